"""The streaming executor on the GPU: same numbers as the synchronous one, run to run identical."""

import copy
from dataclasses import replace

import pytest
import torch

import megatrain
from megatrain.planner.search import split_sets

from ..runtime.models import hf_model
from ..runtime.test_parity import batches

pytestmark = pytest.mark.gpu


def train(model, streams, data, clip=None, **plan):
    opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=clip)
    sm = megatrain.compile(model, device="cuda", streams=streams, optim=opt, **plan)
    stats = [sm.train_step(*[t.cuda() for t in b]) for b in data]
    return [s.loss for s in stats], [s.grad_norm for s in stats], sm.state_dict()


def small(family):
    return hf_model(family, hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4)


@pytest.mark.parametrize("plan", [dict(n_mb=3, weight_slots=2, host_checkpoints=2),
                                  dict(n_mb=2, weight_slots=3, host_checkpoints=0)])
def test_streams_match_program_order_and_repeat(plan):
    """Without clipping the two executors run the same kernels on the same data: identical results."""
    model = small("qwen2")
    data = batches(n_steps=3)
    ref_losses, _, ref_sd = train(copy.deepcopy(model), False, data, **plan)
    losses, _, sd = train(copy.deepcopy(model), True, data, **plan)
    again, _, sd2 = train(copy.deepcopy(model), True, data, **plan)
    assert losses == again and all(torch.equal(sd[n], sd2[n]) for n in sd)  # deterministic
    assert losses == ref_losses
    assert all(torch.equal(sd[n], ref_sd[n]) for n in sd)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: tied embedding, its parts summed on the GPU
def test_streams_clip_by_the_same_global_norm(family):
    """With clipping the streaming executor takes per-layer gradient norms on the GPU: the same global norm up to
    fp32 summation order. The first step agrees to that rounding; after it the weights differ by the rounding of
    the clip factor and bf16 compute carries that into the next gradients (seen: 1.1e-4 relative at step 2)."""
    model = small(family)
    data = batches(n_steps=3)
    ref_losses, ref_norms, _ = train(copy.deepcopy(model), False, data, clip=0.5, n_mb=3)
    losses, norms, _ = train(copy.deepcopy(model), True, data, clip=0.5, n_mb=3)
    assert norms[0] == pytest.approx(ref_norms[0], rel=1e-5) and min(ref_norms) > 0.5
    assert norms == pytest.approx(ref_norms, rel=2e-3)
    assert losses == pytest.approx(ref_losses, rel=2e-3)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_device_updates_match_host_updates(clip):
    """Every second layer updated on the GPU (LOAD_OPT -> fused AdamW on the compute stream -> STORE_OPT), with
    the streaming executor, against every update on the host in program order. The CUDA and CPU AdamW kernels
    round differently (the same formula, another order of operations): agreement to fp32 rounding per update,
    which bf16 compute then carries into the later steps' losses; and the device path is deterministic."""
    model = small("llama")
    data = batches(n_steps=3)
    ref_losses, ref_norms, ref_sd = train(copy.deepcopy(model), False, data, clip=clip, n_mb=2, gpu_opt_every=0)
    losses, norms, sd = train(copy.deepcopy(model), True, data, clip=clip, n_mb=2, gpu_opt_every=2)
    again, _, sd2 = train(copy.deepcopy(model), True, data, clip=clip, n_mb=2, gpu_opt_every=2)
    assert losses == again and all(torch.equal(sd[n], sd2[n]) for n in sd)
    assert losses == pytest.approx(ref_losses, rel=2e-3)
    if clip:
        assert norms == pytest.approx(ref_norms, rel=2e-3)
    for n, p in ref_sd.items():  # AdamW moves an element by at most about lr (1e-3) per step, whatever rounds
        d = (sd[n] - p).abs()
        assert float(d.max()) <= 2 * 1e-3 * 3 and float(d.mean()) <= 0.1 * 1e-3 * 3, n


@pytest.mark.parametrize("gpu_opt_every,chunk", [(0, None), (2, None), (0, 1 << 17)])
def test_gradient_placements_on_streams_train_bit_for_bit_alike(gpu_opt_every, chunk, monkeypatch):
    """Gradients kept on the GPU until the update pass (their stores issued by the optimizer worker after the
    update that read the host buffer before), or each in a host buffer of its own: the same losses, norms and
    weights, steps overlapping (the norms are taken by the same kernel on the same gradients either way).
    ``chunk``: kept gradients pass through the host in parts of that many elements (each layer several)."""
    import megatrain.planner.cost as cost
    import megatrain.runtime.optim.adamw as optim

    if chunk is not None:
        for mod in (cost, optim):
            monkeypatch.setattr(mod, "HOST_UPDATE_CHUNK", chunk)
    model = small("qwen2")
    data = batches(n_steps=4)
    runs = {}
    for kept in (0, "auto"):
        opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=0.5)
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", streams=True, optim=opt, n_mb=2,
                               gpu_opt_every=gpu_opt_every, grad_kept=kept)
        sm.overlap_steps = True
        stats = [sm.train_step(*[t.cuda() for t in b]) for b in data]
        sm.executor.drain()
        cfg = sm.schedule_for(6, 12).config
        runs[kept] = ([s.loss for s in stats], [s.grad_norm for s in stats], sm.state_dict(), cfg)
    assert runs[0][3].grad_kept == () and len(runs["auto"][3].grad_kept) > 2
    assert runs["auto"][3].host_grad_part == (chunk or cost.HOST_UPDATE_CHUNK)
    assert runs[0][0] == runs["auto"][0] and runs[0][1] == runs["auto"][1]
    assert all(torch.equal(runs[0][2][n], t) for n, t in runs["auto"][2].items())


def test_frozen_parameters_on_device_updates():
    """Frozen parameters (part of block 0, all of block 1) with every second layer updated on the GPU: the Triton
    AdamW runs per span of trainable parameters (with or without weight decay); frozen ones keep their bits, the
    rest agree with all updates on the host as in the test above."""
    model = small("qwen2")
    for p in (*model.model.layers[0].self_attn.q_proj.parameters(), *model.model.layers[1].parameters()):
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches(n_steps=3)
    ref_losses, _, ref_sd = train(copy.deepcopy(model), False, data, clip=0.5, n_mb=2, gpu_opt_every=0)
    losses, _, sd = train(copy.deepcopy(model), True, data, clip=0.5, n_mb=2, gpu_opt_every=2)
    assert losses == pytest.approx(ref_losses, rel=2e-3)
    for n, p in ref_sd.items():
        if n.startswith(("model.layers.0.self_attn.q_proj.", "model.layers.1.")):
            assert torch.equal(sd[n], before[n]) and torch.equal(p, before[n]), n
        else:
            assert float((sd[n] - p).abs().max()) <= 2 * 1e-3 * 3, n


@pytest.mark.parametrize("gpu_opt_every", [0, 2])
def test_bf16_wire_equals_fp32_wire(gpu_opt_every):
    """The bf16 shadow (host-rounded, or GPU-rounded after a device update) against the fp32 master cast on the
    GPU: the same bits land in the weight slots, so the streamed runs are identical."""
    model = small("qwen2")
    data = batches(n_steps=3)
    runs = [train(copy.deepcopy(model), True, data, clip=0.5, n_mb=2, wire=w, gpu_opt_every=gpu_opt_every)
            for w in ("fp32", "bf16")]
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][2][n], runs[1][2][n]) for n in runs[0][2])


@pytest.mark.parametrize("gpu_opt_every", [0, 2])
def test_steps_ordered_by_events_match_a_device_sync_between_steps(gpu_opt_every):
    """sync_between_steps=False: no device-wide sync between steps (a slot's first writer waits for the earlier
    step's last use of it, a device-updated layer's loads for its STORE_OPT); with the steps overlapping, the
    results are those of a device sync between steps, bit for bit."""
    model = small("qwen2")
    data = batches(n_steps=4)
    runs = []
    for sync in (True, False):
        opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=0.5)
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", streams=True, optim=opt, n_mb=2,
                               weight_slots="all", gpu_opt_every=gpu_opt_every)
        sm.overlap_steps = True
        sm.executor.sync_between_steps = sync
        stats = [sm.train_step(*[t.cuda() for t in b]) for b in data]
        sm.executor.drain()
        runs.append(([s.loss for s in stats], {n: t.clone() for n, t in sm.state_dict().items()},
                     [s.grad_norm for s in stats]))
    assert runs[0][0] == runs[1][0] and runs[0][0][0] != runs[0][0][-1]
    assert all(torch.equal(runs[0][1][n], t) for n, t in runs[1][1].items())
    assert runs[0][2] == runs[1][2] and all(n > 0 for n in runs[0][2])  # each step's own norm, though overlapped


@pytest.mark.parametrize("clip", [None, 0.5])
def test_states_kept_on_the_device_equal_states_sent_back(clip):
    """resident_opt: every device update's master weights and moments stay on the GPU between steps, the same
    kernels on the same numbers as sending them to the host and back each step: identical losses and weights,
    read mid-run (written back while they stay on the GPU) and at the end, with the steps overlapping."""
    model = small("qwen2")
    data = batches(n_steps=4)
    runs = []
    for resident in (0, 99):  # none; all of them
        opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=clip)
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", streams=True, optim=opt, n_mb=2,
                               weight_slots="all", gpu_opt_every=1, resident_opt=resident)
        sm.overlap_steps = True
        losses = [sm.train_step(*[t.cuda() for t in b]).loss for b in data[:2]]
        mid = {n: t.clone() for n, t in sm.state_dict().items()}
        losses += [sm.train_step(*[t.cuda() for t in b]).loss for b in data[2:]]
        cont = sm.schedule_for(6, 12)
        runs.append((losses, mid, {n: t.clone() for n, t in sm.state_dict().items()}, cont))
    assert not runs[0][3].config.resident_opt and runs[1][3].config.resident_opt == runs[1][3].config.gpu_opt
    assert not any(op.kind.value in ("LOAD_OPT", "STORE_OPT") for op in runs[1][3].ops)
    assert runs[0][0] == runs[1][0] and runs[0][0][0] != runs[0][0][-1]
    for i in (1, 2):
        assert all(torch.equal(runs[0][i][n], t) for n, t in runs[1][i].items())


@pytest.mark.parametrize("kept", [0, "auto"])
def test_split_updates_equal_device_updates_of_the_same_layers(kept):
    """Updates split to the GPU after the backward (state streamed in parts, gradient from a host buffer or kept on
    the GPU) run the same fused AdamW as whole-layer device updates of the same layers: bit for bit the same
    weights; against every update on the host, agreement to AdamW's rounding as above; deterministic."""
    model = small("llama")
    data = batches(n_steps=3)
    whole = megatrain.compile(copy.deepcopy(model), device="cuda", n_mb=2, gpu_opt_every=2, split_opt=0)
    cfg = whole.schedule_for(*data[0][0].shape).config
    layers = cfg.gpu_opt
    assert split_sets(whole.graph, replace(cfg, gpu_opt=()), len(layers)) == [layers]  # the same layers
    del whole
    runs = {}
    for name, plan in {"device": dict(gpu_opt_every=2, split_opt=0, resident_opt=0),
                       "split": dict(gpu_opt_every=0, split_opt=len(layers), opt_part=1 << 16, grad_kept=kept),
                       "host": dict(gpu_opt_every=0, split_opt=0)}.items():
        runs[name] = train(copy.deepcopy(model), True, data, clip=0.5, n_mb=2, **plan)
    again = train(copy.deepcopy(model), True, data, clip=0.5, n_mb=2, gpu_opt_every=0, split_opt=len(layers),
                  opt_part=1 << 16, grad_kept=kept)
    losses, norms, sd = runs["split"]
    assert losses == again[0] and all(torch.equal(sd[n], again[2][n]) for n in sd)
    assert losses == runs["device"][0] and norms == runs["device"][1]
    assert all(torch.equal(sd[n], runs["device"][2][n]) for n in sd)
    assert losses == pytest.approx(runs["host"][0], rel=2e-3) and min(norms) > 0.5
    for n, p in runs["host"][2].items():
        d = (sd[n] - p).abs()
        assert float(d.max()) <= 2 * 1e-3 * 3 and float(d.mean()) <= 0.1 * 1e-3 * 3, n


@pytest.mark.parametrize("defer", [True, False])
def test_split_updates_train_bit_for_bit_like_host_updates(defer):
    """The GPU's AdamW kernel computes the host kernel's arithmetic: updates split to the GPU leave, bit for bit,
    the masters, moments and step counts of every update on the host (each parameter of this model a multiple of
    16 elements, so the host kernel computes every element itself), with the split updates' moments computed on
    the host after the update pass (their parts storing the masters alone) or stored from the GPU."""
    from megatrain.runtime.optim import cpu_adamw

    if not cpu_adamw.available():
        pytest.skip("no C compiler to build the host kernel")
    model = small("llama")
    assert all(p.numel() % 16 == 0 for p in model.parameters())
    data = batches(n_steps=3)
    runs = {}
    for name, plan in {"host": dict(split_opt=0), "split": dict(split_opt=3, opt_part=1 << 14, grad_kept=0)}.items():
        opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=0.5)
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", streams=True, optim=opt, n_mb=2,
                               gpu_opt_every=0, **plan)
        sm.executor.defer_moments = defer
        stats = [sm.train_step(*[t.cuda() for t in b]) for b in data]
        sm.wait()
        cfg = sm.schedule_for(*data[0][0].shape).config
        runs[name] = ([s.loss for s in stats], [s.grad_norm for s in stats],
                      {l: sm.store.block(l)[:3].clone() for l in sm.store.owners()},
                      {l: sm.optimizer.steps(l) for l in sm.store.owners()}, cfg, sm.executor.deferred_moments)
    losses, norms, blocks, steps, cfg, deferred = runs["split"]
    assert len(cfg.split_opt) == 3 and not cfg.grad_kept and min(norms) > 0.5
    assert bool(deferred) == defer
    assert losses == runs["host"][0] and norms == runs["host"][1] and steps == runs["host"][3]
    for layer, block in runs["host"][2].items():
        assert torch.equal(block, blocks[layer]), f"layer {layer}: {int((block != blocks[layer]).sum())} differ"


def test_host_checkpoints_wait_in_one_steps_pinned_buffers():
    """Offloaded checkpoints on the GPU: one step's exact-size pinned buffers, reused by the steps after, and the
    run identical to program order (the issuer's order on the fake CUDA: tests/runtime/test_stream_issuer.py)."""
    plan = dict(n_mb=3, weight_slots=2, host_checkpoints=2)
    model = small("qwen2")
    data = batches(n_steps=3)
    ref_losses, _, ref_sd = train(copy.deepcopy(model), False, data, **plan)
    opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=None)  # as train() makes it
    sm = megatrain.compile(copy.deepcopy(model), device="cuda", streams=True, optim=opt, **plan)
    losses = [sm.train_step(*[t.cuda() for t in b]).loss for b in data]
    sm.wait()
    bufs = [h for free in sm.executor.checkpoint_bufs.free.values() for h, _ in free]
    assert len(bufs) == plan["n_mb"] * plan["host_checkpoints"]
    assert all(h.is_pinned() for h in bufs)
    assert losses == ref_losses
    sd = sm.state_dict()
    assert all(torch.equal(sd[n], ref_sd[n]) for n in sd)


@pytest.mark.parametrize("host_checkpoints", [0, 3])
def test_dropped_checkpoints_train_bit_for_bit_as_kept_ones(host_checkpoints):
    """The checkpoints of blocks 2 and 4 dropped after the forward and made again by a REFWD in the backward, on
    the streams with clipping: losses, norms and weights equal to the plan that keeps them, bit for bit."""
    model = hf_model("qwen2", hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
                     num_hidden_layers=4)
    data = batches(n_steps=3)
    plan = dict(n_mb=2, weight_slots=2, host_checkpoints=host_checkpoints)
    kept = train(copy.deepcopy(model), True, data, clip=0.5, dropped_checkpoints=0, **plan)
    dropped = train(copy.deepcopy(model), True, data, clip=0.5, dropped_checkpoints=2, **plan)
    assert dropped[0] == kept[0] and dropped[1] == kept[1]
    assert all(torch.equal(dropped[2][n], kept[2][n]) for n in kept[2])
