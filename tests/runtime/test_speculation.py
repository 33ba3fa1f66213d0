"""Host updates made before the step's global norm is known (``ScheduleConfig.speculate``): each runs as soon as its
gradient is on the host with a clip factor of 1, and its CHECK after the guard keeps it where the step is not
clipped, or puts the masters back and makes it again with the step's factor where it is, or undoes it where the step
must not update. Masters, moments and step counts bit-identical to the same plan without it, on the program-order
executor and the streaming one (fake CUDA), over steps clipped and not, a step that must not update, and a resume;
whether the update keeps the masters it rewrites (its moments made by the CHECK) or writes its whole update to a
spare block that the CHECK makes the layer's (``speculate_keeps``)."""

import copy
import dataclasses

import pytest
import torch

import megatrain
from megatrain.ir import OpKind
from megatrain.runtime.issue.streams import StreamExecutor
from megatrain.runtime.optim import cpu_adamw

from .fake_cuda import FakeCuda
from .models import compile_cpu, hf_model
from .test_parity import OPT, batches
from .test_nonfinite import same, set_weight, snapshot

pytestmark = pytest.mark.skipif(not cpu_adamw.available(), reason="no C compiler to build the host kernel")

NATIVE = dataclasses.replace(OPT, fused=True, host_kernel="native", total_steps=6)
PLAN = dict(n_mb=2, weight_slots=2)


def _compile(model, speculate, executor, optim=NATIVE, **kw):
    sm = compile_cpu(copy.deepcopy(model), optim=optim, speculate=speculate, **PLAN, **kw)
    if executor == "streams":
        sm.executor = StreamExecutor(sm.captured, sm.store, sm.optimizer, torch.device("cpu"), sm.compute_dtype,
                                     runner=sm.executor.runner, cuda=FakeCuda())
        sm.overlap_steps = True
    return sm


def _norms(model, data):
    """The global gradient norms of ``data``'s steps without clipping's effect on them (a limit none reaches)."""
    sm = _compile(model, 0, "program", dataclasses.replace(NATIVE, max_grad_norm=1e9))
    return [sm.train_step(*b).grad_norm for b in data]


@pytest.mark.parametrize("executor", ["program", "streams"])
@pytest.mark.parametrize("clipped,keeps", [("never", "masters"), ("some", "masters"), ("every", "masters"),
                                           ("some", "state")])  # (some: the spare swapped in, and the redo)
def test_updates_before_the_norm_leave_the_bits_of_updates_after_it(executor, clipped, keeps, monkeypatch):
    model, data = hf_model("qwen2"), batches(n_steps=4)
    norms = sorted(_norms(model, data))
    limit = {"never": 1e9, "some": (norms[1] + norms[2]) / 2, "every": norms[0] / 100}[clipped]
    optim = dataclasses.replace(NATIVE, max_grad_norm=limit)
    ref, sm = _compile(model, 0, executor, optim), _compile(model, 3, executor, optim, speculate_keeps=keeps)
    restored = []
    restore = sm.optimizer.restore_masters
    monkeypatch.setattr(sm.optimizer, "restore_masters", lambda layer: (restored.append(layer), restore(layer)))
    want = [ref.train_step(*b) for b in data]
    got = [sm.train_step(*b) for b in data]
    sched = sm.schedule_for(*data[0][0].shape)
    assert len(sched.config.speculate) == 3 and sum(op.kind is OpKind.CHECK for op in sched.ops) == 3
    # the updates before the guard ran before the step's last gradient store
    last_store = max(op.id for op in sched.ops if op.kind is OpKind.STORE_G)
    assert all(op.id < last_store for op in sched.ops if op.kind is OpKind.OPT and op.layer in sched.config.speculate)
    clips = [o.grad_norm > limit for o in got]
    assert [o.grad_norm for o in got] == [o.grad_norm for o in want]
    assert {"never": not any(clips), "some": 0 < sum(clips) < len(clips), "every": all(clips)}[clipped], clips
    a, b = snapshot(ref), snapshot(sm)  # (the worker's last tasks done)
    assert same(a, b)
    assert len(restored) == 3 * sum(clips)  # each clipped step put every layer of the window back
    assert sched.config.speculate_keeps == keeps
    # the spare blocks: one a layer of the window where the update went there, each the size of the layer's
    assert sorted(sm.store.spares) == (sorted(sched.config.speculate) if keeps == "state" else [])
    assert all(sm.store.spares[l].numel() == sm.store.flat(l).numel() for l in sm.store.spares)
    assert all((m is None) == (keeps == "state") for m, _ in sm.optimizer._kept.values())


@pytest.mark.parametrize("keeps", ["masters", "state"])
@pytest.mark.parametrize("executor", ["program", "streams"])
def test_a_step_that_must_not_update_undoes_the_updates_made_before_its_norm(executor, keeps):
    """An inf weight makes the loss not finite: the updates already made go back, nothing is applied, and the
    run goes on as the same plan without updates before the norm does."""
    model, data = hf_model("qwen2"), batches(n_steps=5)
    runs = []
    for speculate in (0, 3):
        sm = _compile(model, speculate, executor, nonfinite="skip", speculate_keeps=keeps)
        for b in data[:2]:
            sm.train_step(*b)
        kept = set_weight(sm, "lm_head.weight", 5, float("inf"))
        out = sm.train_step(*data[2])
        assert out.skipped
        set_weight(sm, "lm_head.weight", 5, kept)
        for b in data[3:]:
            sm.train_step(*b)
        runs.append(snapshot(sm))
    assert same(*runs)


@pytest.mark.parametrize("keeps", ["masters", "state"])
def test_a_run_resumed_between_steps_goes_on_bit_for_bit(tmp_path, keeps):
    model, data = hf_model("qwen2"), batches(n_steps=4)
    optim = dataclasses.replace(NATIVE, max_grad_norm=(lambda n: (n[1] + n[2]) / 2)(sorted(_norms(model, data))))
    whole = _compile(model, 3, "streams", optim, speculate_keeps=keeps)
    for b in data:
        whole.train_step(*b)
    first = _compile(model, 3, "streams", optim, speculate_keeps=keeps)
    for b in data[:2]:
        first.train_step(*b)
    first.save_state(tmp_path / "state")
    second = megatrain.compile(hf_model("qwen2"), device="cpu", optim=optim, state=tmp_path / "state",
                               speculate=3, speculate_keeps=keeps, saved_acts=0, **PLAN)
    for b in data[2:]:
        second.train_step(*b)
    assert same(snapshot(whole), snapshot(second))


def test_a_count_where_the_host_kernel_is_torchs_is_refused_and_auto_is_none():
    with pytest.raises(ValueError, match="speculate=2: updates before the step's global norm write the masters"):
        compile_cpu(hf_model("qwen2"), optim=dataclasses.replace(NATIVE, host_kernel="torch"), speculate=2)
    sm = compile_cpu(hf_model("qwen2"), optim=dataclasses.replace(NATIVE, host_kernel="torch"), speculate="auto")
    assert sm.plan_options.speculate == 0


def test_a_plan_with_another_window_lets_the_masters_kept_for_the_last_one_go():
    """The host bytes of the kept masters are the running plan's: a step of a plan with a smaller window drops the
    copies of the layers it does not keep."""
    model, data = hf_model("qwen2"), batches(n_steps=2)
    sm = _compile(model, 3, "program")
    sm.train_step(*data[0])
    assert sorted(sm.optimizer._kept) == sorted(sm.schedule_for(*data[0][0].shape).config.speculate)
    sm.train_step(*data[1], speculate=1)
    one = sm.schedule_for(*data[1][0].shape, speculate=1).config.speculate
    assert len(one) == 1 and sorted(sm.optimizer._kept) == list(one)


def test_a_plan_with_another_window_lets_the_spare_blocks_of_the_last_one_go():
    model, data = hf_model("qwen2"), batches(n_steps=3)
    sm = _compile(model, 3, "program", speculate_keeps="state")
    sm.train_step(*data[0])
    assert len(sm.store.spares) == 3
    sm.train_step(*data[1], speculate=1)
    assert list(sm.store.spares) == list(sm.schedule_for(*data[1][0].shape, speculate=1).config.speculate)
    sm.train_step(*data[2], speculate_keeps="masters")  # the masters kept again: no spare is needed
    assert not sm.store.spares
