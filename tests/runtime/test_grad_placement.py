"""Where gradients wait for their update -- a host buffer of their own, the device until the update pass (then a
host buffer in turn), fp32 or bf16 -- changes the host memory a plan needs, never the numbers (fp32): each placement
trains bit for bit like the others, and the host buffers the runtime allocates are the ones the plan counts."""

import copy
import dataclasses

import pytest
import torch

from megatrain.layout import HOST_UPDATE_CHUNK
from megatrain.planner.cost import host_memory
from megatrain.planner.hardware import PRESETS
from megatrain.planner.choices import grad_kept_eligible

from .models import TinyGPT, compile_cpu, hf_model, record_grads
from .test_parity import OPT, batches, check, reference_train


def _model(family):
    if family == "tinygpt-tied":
        torch.manual_seed(0)
        return TinyGPT(tied=True)
    return hf_model(family)


def _data(family, n_steps=3):
    data = batches(n_steps=n_steps)
    return [(ids, torch.ones_like(ids), labels) for ids, _, labels in data] if family == "tinygpt-tied" else data


def _train(model, data, **plan):
    sm = compile_cpu(model, optim=OPT, n_mb=3, **plan)
    stats = [sm.train_step(*b) for b in data]
    return sm, stats


@pytest.mark.parametrize("family", ["llama", "qwen2", "tinygpt-tied"])
@pytest.mark.parametrize("gpu_opt_every", [0, 2])
def test_every_gradient_placement_trains_bit_for_bit_alike(family, gpu_opt_every):
    """Every host-updated gradient in a host buffer of its own (grad_kept=0), two kept on the device until the
    update pass, and all that can be (auto): the same losses, gradient norms (clipping active) and weights."""
    data = _data(family)
    runs = {}
    for kept in (0, 2, "auto"):
        sm, stats = _train(_model(family), data, gpu_opt_every=gpu_opt_every, grad_kept=kept)
        runs[kept] = (sm, [s.loss for s in stats], [s.grad_norm for s in stats], sm.state_dict())
    placements = {k: sm.schedule_for(6, 12).config.grad_kept for k, (sm, *_) in runs.items()}
    cfg = runs["auto"][0].schedule_for(6, 12).config
    assert placements[0] == () and len(placements[2]) == 2, placements
    assert placements["auto"] == tuple(grad_kept_eligible(runs["auto"][0].graph, cfg)), placements  # all fit
    base = runs[0]
    assert max(base[2]) > OPT.max_grad_norm  # clipping was active
    for kept, (sm, losses, norms, sd) in runs.items():
        assert losses == base[1] and norms == base[2], kept
        assert all(torch.equal(sd[n], base[3][n]) for n in sd), kept
        plan = sm.schedule_for(6, 12)
        assert sm.store.grads.nbytes == host_memory(sm.graph, plan)["gradients"], kept  # what the plan counts
    # gradients kept on the device take turns in two host buffers instead of one each
    if len(placements["auto"]) > 2:
        assert runs["auto"][0].store.grads.nbytes < runs[0][0].store.grads.nbytes


def test_placements_match_plain_pytorch():
    """The fully kept plan (the CPU's default) against plain PyTorch training, as the parity tests do."""
    model = hf_model("qwen2")
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm, stats = _train(model, data, grad_kept="auto")
    assert sm.schedule_for(6, 12).config.grad_kept
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def _host_between(model, data, kept):
    """A cpu spec whose host is one byte short of the plan with fp32 gradients (``kept`` on the device, the others
    in host buffers of their own), which the plan with bf16 ones fits (half the buffers, and a chunk to read one
    back into fp32)."""
    probe = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, grad_kept=kept)
    fp32 = sum(host_memory(probe.graph, probe.schedule_for(*data[0][0].shape)).values())
    return dataclasses.replace(PRESETS["cpu"], name="small-host", host_bytes=fp32 - 1, host_margin_bytes=0)


@pytest.mark.parametrize("kept", [0, 2])
def test_bf16_host_gradients_are_the_fp32_sums_rounded_once(kept):
    """Allowed and needed (the host holds no plan with fp32 gradients), gradients go to the host in bf16: each
    the fp32 sum over the micro-batches rounded to nearest once, whether it waited on the device (the first two
    layers' with kept=2) or not, and one AdamW step moves every weight within the bound that rounding allows.

    The bound: a first AdamW step moves an element by lr * g / (|g| + eps) (m and v bias-corrected); a gradient
    rounded to bf16 (8 bits of precision) is g (1 + d) with |d| <= 2^-8, and d/dg [g / (|g| + eps)] =
    eps / (|g| + eps)^2, so the step moves by at most lr * 2^-8 * max(eps |g| / (|g| + eps)^2) (1 + 2^-8)^2 =
    lr * 2^-10 * 1.008 more or less, and each result is rounded to fp32 (half an ulp of the weight each); weight
    decay and the clip factor (from the fp32 norms) are the same in both."""
    from megatrain.planner.search import PlanError

    model = hf_model("llama")
    data = batches(n_steps=1)
    spec = _host_between(model, data, kept)
    fp32 = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, grad_kept=kept)
    low = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, grad_kept=kept, grad_host_dtype="bf16",
                      hardware=spec)
    with pytest.raises(PlanError, match="no plan fits: host memory"):
        compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, grad_kept=kept, hardware=spec).train_step(*data[0])
    grads = record_grads(fp32), record_grads(low)
    a, b = fp32.train_step(*data[0]), low.train_step(*data[0])
    assert low.schedule_for(6, 12).config.grad_host_bytes == 2 and fp32.schedule_for(6, 12).config.grad_host_bytes == 4
    assert a.loss == b.loss and a.grad_norm == b.grad_norm  # the same forward, backward and fp32 norms
    assert set(grads[1]) == set(fp32.captured.model_param_names)
    for n, g in grads[0].items():
        assert torch.equal(grads[1][n], g.to(torch.bfloat16).float()), n
    eps32 = torch.finfo(torch.float32).eps
    moved = 0
    for n in grads[0]:
        w, ref = low.state_dict()[n], fp32.state_dict()[n]
        over = (w - ref).abs() - (OPT.lr * 2.0 ** -10 * 1.008 + eps32 * ref.abs())
        assert float(over.max()) <= 0, (n, float(over.max()))
        moved += int((w != ref).sum())
    assert moved > 0  # the rounding did reach some weights (the bound is not met by doing nothing different)
    assert low.store.grads.nbytes == host_memory(low.graph, low.schedule_for(6, 12))["gradients"]


def test_bf16_gradients_of_a_layer_larger_than_a_chunk_are_read_back_a_chunk_at_a_time(monkeypatch):
    """A host update reads a bf16 gradient back into fp32 HOST_UPDATE_CHUNK elements at a time: with a chunk
    smaller than the layers, the same weights as a whole-layer read-back."""
    import megatrain.runtime.optim.adamw as optim
    import megatrain.runtime.memory.store as store

    model = hf_model("llama")
    data = batches(n_steps=2)
    spec = _host_between(model, data, 0)
    runs = []
    for chunk in (HOST_UPDATE_CHUNK, 1000):
        monkeypatch.setattr(optim, "HOST_UPDATE_CHUNK", chunk)
        monkeypatch.setattr(store, "HOST_UPDATE_CHUNK", chunk)
        sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, grad_kept=0, grad_host_dtype="bf16",
                         hardware=spec)
        losses = [sm.train_step(*b).loss for b in data]
        assert sm.schedule_for(6, 12).config.grad_host_bytes == 2
        runs.append((losses, sm.state_dict(), max(len(c) for c in sm.optimizer.chunks.values())))
    assert runs[1][2] > runs[0][2]  # the small chunk did cut the layers
    assert runs[0][0] == runs[1][0] and all(torch.equal(runs[0][1][n], t) for n, t in runs[1][1].items())


@pytest.mark.parametrize("family,grad_host_dtype", [("qwen2", "fp32"), ("llama", "bf16")])
def test_kept_gradients_pass_through_the_host_in_parts(monkeypatch, family, grad_host_dtype):
    """Gradients kept on the device go to the host and are updated a part (HOST_UPDATE_CHUNK elements) at a time,
    each part its own STORE_G and OPT: the host buffers are two parts instead of two of the largest layers, and
    the weights are bit for bit those of whole-layer updates (fp32 gradients), and of whole-layer bf16 ones."""
    import megatrain.planner.cost as cost
    import megatrain.runtime.optim.adamw as optim
    import megatrain.runtime.memory.store as store
    from megatrain.ir import OpKind

    model, data = hf_model(family), batches(n_steps=2)
    runs = []
    for chunk in (HOST_UPDATE_CHUNK, 3000):
        for mod in (cost, optim, store):
            monkeypatch.setattr(mod, "HOST_UPDATE_CHUNK", chunk)
        # bf16: two gradients kept, the others in host buffers of their own, on a host one byte short of the plan
        # with fp32 ones, which makes it use bf16
        kept = 2 if grad_host_dtype == "bf16" else "auto"
        spec = {"hardware": _host_between(model, data, kept)} if grad_host_dtype == "bf16" else {}
        sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, grad_kept=kept, grad_host_dtype=grad_host_dtype,
                         **spec)
        stats = [sm.train_step(*b) for b in data]
        plan = sm.schedule_for(6, 12)
        assert plan.config.grad_host_bytes == (2 if grad_host_dtype == "bf16" else 4)
        parts = [op for op in plan.ops if op.kind in (OpKind.STORE_G, OpKind.OPT) and op.mb is not None]
        runs.append(([s.loss for s in stats], [s.grad_norm for s in stats], sm.state_dict(), parts,
                     sm.store.grads.nbytes))
        assert plan.config.grad_kept and sm.store.grads.nbytes == host_memory(sm.graph, plan)["gradients"]
    (losses, norms, sd, whole, big), (p_losses, p_norms, p_sd, parts, small) = runs
    assert {op.mb for op in whole} == {0} and max(op.mb for op in parts) >= 2  # one part each; more than two
    assert {op.layer for op in parts} == set(sm.schedule_for(6, 12).config.grad_kept)
    assert small < big
    assert p_losses == losses and p_norms == norms and max(norms) > OPT.max_grad_norm
    assert all(torch.equal(p_sd[n], sd[n]) for n in sd)


def test_without_clipping_gradients_pass_through_two_host_buffers():
    """No clipping: each update follows its gradient, which passes through two host buffers in turn (12 bytes
    per parameter and two layers' gradients on the host), and training matches plain PyTorch."""
    no_clip = dataclasses.replace(OPT, max_grad_norm=None)
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, _ = reference_train(ref, data, n_mb=3, opt_cfg=no_clip)
    sm = compile_cpu(model, optim=no_clip, n_mb=3)
    losses = [sm.train_step(*b).loss for b in data]
    plan = sm.schedule_for(6, 12)
    assert plan.config.grad_kept == () and len({op.slot("h") for op in plan.ops if op.slot("h") is not None}) == 2
    biggest = max(sm.graph.weight_params(i) for i in range(len(sm.graph)))
    assert sm.store.grads.nbytes <= 2 * biggest * 4
    check(sm, ref, losses, ref_losses)


def test_host_buffers_a_later_plan_needs_are_checked_before_they_are_allocated(monkeypatch):
    import megatrain.api as api

    sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=3)  # every gradient kept on the device: two host buffers
    ids, mask, labels = batches(n_steps=1)[0]
    sm.train_step(ids, mask, labels)
    have = sm.store.grads.nbytes
    monkeypatch.setattr(api, "available_host_bytes", lambda: 1000)
    sm.measure_host = True  # as compile() sets it where it measured the machine
    sm.train_step(ids, mask, labels)  # the same plan: its buffers are there
    with pytest.raises(ValueError, match=r"host memory: the plan for 6 x 12-token sequences needs .* more of host "
                                         r"gradient buffers, and this machine has 1000 B available"):
        sm.train_step(ids, mask, labels, grad_kept=0)  # a buffer for every gradient
    assert sm.store.grads.nbytes == have  # nothing was allocated
