"""Optimizer state kept on the device between steps (``resident_opt``), CPU, fp32.

The same updates as every state crossing to the host each step, bit for bit; the host store is stale while the
state is resident and current after ``state_dict()``; a plan that does not keep a state gets the current one from
the host; new weights loaded from outside win over a resident state.
"""

import contextlib
import dataclasses

import pytest
import torch

from megatrain.ir import OpKind
from megatrain.layout import OPT_SLOT_ROWS

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches


def _train(data, **plan):
    opt = dataclasses.replace(OPT, fused=True, max_grad_norm=plan.pop("clip", OPT.max_grad_norm))
    sm = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2, **plan)
    losses = [sm.train_step(*b).loss for b in data]
    return sm, losses


def _slot_state(sm, layer):
    k, _ = sm.executor.dev.resident[layer]
    n = sm.graph[layer].params
    return sm.executor.dev.o[k][: len(OPT_SLOT_ROWS) * n].view(len(OPT_SLOT_ROWS), n)


@pytest.mark.parametrize("clip", [1.0, None])
def test_resident_states_equal_states_sent_back_every_step(clip):
    data = batches(n_steps=4)
    host, host_losses = _train(data, clip=clip, gpu_opt_every=2, resident_opt=0)
    sm, losses = _train(data, clip=clip, gpu_opt_every=2, resident_opt=2)
    setup, step = sm.setup_for(6, 12), sm.schedule_for(6, 12)
    kept = step.config.resident_opt
    assert kept == step.config.gpu_opt[:2] == (1, 3) and host.schedule_for(6, 12).config.resident_opt == ()
    # the set-up loads the kept states; no step moves them over the bus
    assert {op.layer for op in setup.ops if op.kind is OpKind.LOAD_OPT} == set(kept)
    assert {op.layer for op in step.ops if op.kind in (OpKind.LOAD_OPT, OpKind.STORE_OPT)} \
        == set(step.config.gpu_opt) - set(kept)
    # while resident, the host block holds an older state than the device slot
    for layer in kept:
        for r in range(3):
            assert not torch.equal(sm.store.block(layer)[r], _slot_state(sm, layer)[r])
    assert losses == host_losses
    ran = []  # the write-back runs as a schedule of its own through the ops' handlers
    sm.executor.on_op = lambda op: ran.append(op) or contextlib.nullcontext()
    sd = sm.state_dict()  # writes the resident states back
    sm.executor.on_op = None
    homes = dict((l, k) for l, (k, _) in sm.executor.dev.resident.items())
    assert [(op.kind, op.layer, op.slot("o")) for op in ran] == [(OpKind.STORE_OPT, l, homes[l]) for l in kept]
    assert all(torch.equal(host.state_dict()[n], t) for n, t in sd.items())
    for layer in kept:
        for r, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
            assert torch.equal(sm.store.block(layer)[r], host.store.block(layer)[r]), name


def test_reading_the_weights_mid_run_and_switching_plans_lose_nothing():
    """state_dict() between steps (the states stay resident: the next step continues), then a plan that keeps
    other states and one that keeps none: the host copy each of them reads is current, and the run ends with the
    parameters and losses of a run that keeps nothing."""
    data = batches(n_steps=5)
    host, host_losses = _train(data, gpu_opt_every=1, resident_opt=0)
    opt = dataclasses.replace(OPT, fused=True)
    sm = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2, gpu_opt_every=1, resident_opt="auto")
    ran = []  # the set-ups and steps the executor ran
    run, set_up = sm.executor.run, sm.executor.set_up
    sm.executor.run = lambda s, *a, **k: ran.append(s) or run(s, *a, **k)
    sm.executor.set_up = lambda s, *a, **k: ran.append(s) or set_up(s, *a, **k)
    losses = [sm.train_step(*data[0]).loss]
    mid = {n: t.clone() for n, t in sm.state_dict().items()}
    losses.append(sm.train_step(*data[1]).loss)
    assert ran[0].config.setup and ran[2] is ran[1] and ran[1].config.resident_opt  # reading the weights did not
    # end residency: no set-up again
    losses.append(sm.train_step(*data[2], gpu_opt_every=2).loss)  # other layers, other slots: set up again
    assert ran[3].config.setup and ran[4].config.resident_opt != ran[1].config.resident_opt
    losses.append(sm.train_step(*data[3], resident_opt=0).loss)  # nothing kept: every state from the host
    losses.append(sm.train_step(*data[4]).loss)  # and back to the first plan
    assert not sm.executor.dev.resident or ran[-1].config.resident_opt
    assert losses == host_losses
    ref = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2)
    ref.train_step(*data[0])
    assert all(torch.equal(ref.state_dict()[n], t) for n, t in mid.items())
    assert all(torch.equal(host.state_dict()[n], t) for n, t in sm.state_dict().items())


def test_weights_loaded_from_outside_replace_the_masters_of_a_resident_state():
    """New weights put into the store replace the masters, as they do when every state is on the host: the
    resident moments are written back first and kept, the resident masters are not written over the new ones, and
    training goes on exactly as a run that keeps nothing."""
    data = batches(n_steps=3)
    sm, _ = _train(data[:1], gpu_opt_every=1)
    host, _ = _train(data[:1], gpu_opt_every=1, resident_opt=0)
    assert sm.executor.dev.resident and not host.executor.dev.resident
    new = {n: t.clone() * 0.5 for n, t in host.state_dict().items()}
    for m in (sm, host):
        m.store.load_state(new)
    assert not sm.executor.dev.resident
    assert all(torch.equal(new[n], t) for n, t in sm.state_dict().items())  # nothing written over them
    for layer in sm.schedule_for(6, 12).config.gpu_opt:  # the moments of the step before survive
        assert torch.equal(sm.store.block(layer)[1:3], host.store.block(layer)[1:3])
        assert sm.store.block(layer)[1].abs().sum() > 0
    assert [sm.train_step(*b).loss for b in data[1:]] == [host.train_step(*b).loss for b in data[1:]]
    assert all(torch.equal(host.state_dict()[n], t) for n, t in sm.state_dict().items())


def test_a_step_without_its_set_up_is_refused():
    sm = compile_cpu(hf_model("qwen2"), optim=dataclasses.replace(OPT, fused=True), n_mb=2, gpu_opt_every=1)
    cont = sm.schedule_for(6, 12)
    assert cont.config.resident_opt
    ids, mask, labels = batches(n_steps=1)[0]
    from megatrain.runtime.issue.executor import MicroBatch

    nxt = torch.full_like(labels, -100)
    nxt[:, :-1] = labels[:, 1:]
    mbs = [MicroBatch(ids[i * 3:(i + 1) * 3], mask[i * 3:(i + 1) * 3], nxt[i * 3:(i + 1) * 3]) for i in range(2)]
    denom = int((nxt != -100).sum())
    with pytest.raises(ValueError, match=r"keeps the optimizer state of layers \[.*\] on the device, and no "
                                          r"write-back"):
        sm.executor.run(cont, mbs, denom)
    with pytest.raises(ValueError, match=r"expects the state of layers \[.*\] on the device.*run the plan's set-up"):
        sm.executor.run(cont, mbs, denom, write_back=sm.run_plan(cont).write_back)


def test_keeping_states_without_device_updates_is_refused():
    with pytest.raises(ValueError, match=r"resident_opt=2 keeps the state.*gpu_opt_every=0 updates every layer on "
                                         r"the host"):
        compile_cpu(hf_model("qwen2"), resident_opt=2)
    with pytest.raises(ValueError, match="resident_opt must be an integer >= 0"):
        compile_cpu(hf_model("qwen2"), gpu_opt_every=1, resident_opt=-1)
