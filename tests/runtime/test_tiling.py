"""Blocks' MLPs over tiles of the tokens (ScheduleConfig.seq_tile): the same training as untiled (fp32, CPU), and the
planner's memory and FLOPs for it."""

import dataclasses

import pytest
import torch

from megatrain.ir import Op, OpKind, ScheduleConfig, Stream
from megatrain.planner.cost import matmul_and_attention_flops, workspace_nbytes
from megatrain.planner.graph import preset
from megatrain.runtime.layers import tiling

from .models import DROPOUT_FIELDS, compile_cpu, hf_model, record_grads, with_dropout
from .test_parity import OPT, batches

NO_CLIP = dataclasses.replace(OPT, max_grad_norm=None)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_tiled_mlps_train_as_untiled(family, monkeypatch):
    """Two micro-batches of 3 x 12 tokens, the MLPs over tiles of 5 tokens (tiles cross rows; the last is 1):
    the gradients of the first step equal the untiled ones to fp32 rounding (the tiles' weight gradients are summed
    in another order), and so do 3 steps' losses with clipping; every recomputed forward and backward ran tiled,
    each tile formed once, in the backward (the MLP's output is read by nothing but the block's residual sum: the
    recompute leaves it unformed).
    Llama's and Qwen2's post-attention norms run in the tiles with the MLP; Phi-3's MLP (fused gate and up) alone."""
    data = batches(n_steps=3)
    runs = {}
    for tile in (0, 5):
        sm = compile_cpu(hf_model(family), optim=OPT, n_mb=2, seq_tile=tile)
        calls, tiles, checkpointed = [], [], []
        forward, rebound = tiling.TiledMLP.forward, tiling._rebound
        monkeypatch.setattr(tiling.TiledMLP, "forward",
                            lambda self, x: calls.append((self.tile, torch.is_grad_enabled())) or forward(self, x))
        monkeypatch.setattr(tiling, "_rebound", lambda m, b, x: tiles.append(x.shape[1]) or rebound(m, b, x))
        checkpoint = tiling.checkpoint
        monkeypatch.setattr(tiling, "checkpoint", lambda fn, x, **kw: checkpointed.append(1) or checkpoint(fn, x, **kw))
        grads = record_grads(sm)
        losses = [sm.train_step(*data[0]).loss]
        first = dict(grads)
        losses += [sm.train_step(*b).loss for b in data[1:]]
        monkeypatch.undo()
        assert sm.schedule_for(*data[0][0].shape).config.seq_tile == tile
        blocks = sum(seg.kind == "block" for seg in sm.captured.segments)
        # steps x micro-batches x blocks x (the forward, the backward's recompute), each run over the tiles
        assert sorted(calls) == sorted([(tile, False), (tile, True)] * 3 * 2 * blocks)
        # 36 tokens a micro-batch; Phi-3's MLP, whose last projection is not left out (its fused gate and up), is
        # formed in the recompute under torch's checkpoint and again in the backward
        once = ([5] * 7 + [1]) * 3 * 2 * blocks if tile else []
        assert tiles == once if family != "phi3" else sorted(tiles) == sorted(once * 2)
        assert len(checkpointed) == (len(once) if family == "phi3" else 0)
        runs[tile] = losses, first, sm.state_dict()
        joined = {isinstance(m, torch.nn.Identity) for seg in sm.captured.segments if seg.kind == "block"
                  for m in [getattr(seg.template, "post_attention_layernorm", None)]}
        assert joined == {family != "phi3"}
    (l0, g0, w0), (l1, g1, w1) = runs[0], runs[5]
    assert l1 == pytest.approx(l0, rel=1e-6)
    assert set(g0) == set(g1)
    for n, a in g0.items():  # measured: 3e-7 of the largest element at most
        assert float((g1[n] - a).abs().max()) <= 1e-5 * float(a.abs().max()) + 1e-9, n
    for n, a in w0.items():
        assert float((w1[n] - a).abs().max()) <= 1e-5, n


def test_the_planner_counts_one_tile_of_the_mlp_and_its_forward_once_more_unless_the_recompute_skips_it():
    g = preset("qwen2.5-7b")
    lay = g[1]
    # gate, up, their product and the post-attention norm's output (Qwen2's norm runs in the MLP's tiles)
    assert lay.tile_work_bytes_per_token == (3 * 18944 + 3584) * 2 and lay.tile_flops_per_token == 6.0 * 3584 * 18944
    t, tile = 524288, 16384
    base = ScheduleConfig(n_layers=len(g), mb_tokens=t, seq_len=t)
    tiled = dataclasses.replace(base, seq_tile=tile)
    bwd, fwd = Op(0, OpKind.BWD, Stream.COMPUTE, 0, 1, 0), Op(0, OpKind.FWD, Stream.COMPUTE, 0, 1, 0)
    untiled_work = lay.work_bytes_per_token * t
    one_tile = untiled_work - lay.tile_work_bytes_per_token * (t - tile)
    assert workspace_nbytes(g, base, fwd) == untiled_work and workspace_nbytes(g, tiled, fwd) == one_tile
    # and the attention kernel's own buffers in the backward: at 524,288 tokens one key/value head's group at a time
    # (its fp32 query-gradient accumulator, key/value gradients expanded to its 7 query heads, its query gradient:
    # 10 bytes x 896; its key and value gradients: 2 x 2 bytes x 128), below GROUPED_ATTN_TOKENS all 28 heads' (the
    # accumulator and the expanded key/value gradients: 8 bytes x 3,584); and the input's gradient (2 bytes x 3,584)
    assert workspace_nbytes(g, tiled, bwd) == 2 * one_tile + (10 * 896 + 4 * 128) * t + 2 * 3584 * t
    short = dataclasses.replace(base, mb_tokens=8192, seq_len=8192)
    assert workspace_nbytes(g, short, bwd) == 2 * lay.work_bytes_per_token * 8192 + (8 + 2) * 3584 * 8192
    mm0, attn0 = matmul_and_attention_flops(g, base, bwd)
    mm1, attn1 = matmul_and_attention_flops(g, tiled, bwd)
    # the recompute leaves out the down projection (Layer.unread_flops_per_token) and, tiled, the MLP's tiles, which
    # its backward forms once: the same FLOPs; without the skip a tiled backward forms its tiles once more
    assert attn1 == attn0 and mm1 == mm0 and lay.unread_flops_per_token == 2.0 * 3584 * 18944
    from megatrain.planner.graph import full_recompute

    full = full_recompute(g)
    mm2, _ = matmul_and_attention_flops(full, base, bwd)
    mm3, _ = matmul_and_attention_flops(full, tiled, bwd)
    assert mm2 - mm0 == pytest.approx(lay.unread_flops_per_token * t)
    assert mm3 - mm2 == pytest.approx(lay.tile_flops_per_token * t)
    saved = dataclasses.replace(tiled, saved_acts=(1,))  # a layer that keeps its activations is not tiled
    assert workspace_nbytes(g, saved, fwd) == untiled_work
    assert workspace_nbytes(g, tiled, Op(0, OpKind.FWD, Stream.COMPUTE, 0, 0, 0)) == g[0].work_bytes_per_token * t


def test_mixture_of_experts_blocks_are_not_tiled():
    from .test_moe_parity import moe_model

    sm = compile_cpu(moe_model("qwen3_moe"), optim=OPT, n_mb=1)
    assert all(lay.tile_work_bytes_per_token == 0 for lay in sm.graph.layers)


def test_qwen_7b_at_524k_tokens_fits_one_h200_only_with_tiles():
    """The docs' plan (docs/planner.md, long sequences) with its other decisions pinned: tiles, a split of the
    checkpoints between device and host and one gradient slot make it fit the H200 and its 125 GiB host with fp32
    host gradients and every checkpoint kept; untiled, nothing does, not even with bf16 host gradients."""
    from megatrain.planner.hardware import PRESETS
    from megatrain.planner.search import PlanError, plan

    g, spec = preset("qwen2.5-7b"), PRESETS["h200"]
    fixed = dict(n_mb=1, weight_slots=2, wire_bytes=4, gpu_opt_every=0, resident_opt=0)
    p = plan(g, spec, 524288, 524288, **fixed)
    cfg = p.schedule.config
    assert cfg.seq_tile == 4096 and 0 < cfg.host_checkpoints < len(g) - 2 and cfg.grad_slots == 1
    assert cfg.grad_host_bytes == 4 and cfg.dropped_checkpoints == 0
    assert p.timeline.host_nbytes <= 122.5 * 2**30 and p.timeline.reserved_nbytes <= spec.budget_bytes
    with pytest.raises(PlanError, match="no plan fits"):
        plan(g, spec, 524288, 524288, seq_tile=0, grad_host_dtype="bf16", **fixed)


def test_an_evaluation_runs_its_mlps_over_tiles_with_the_same_loss(monkeypatch):
    """Evaluations tile long micro-batches whatever the training plan does (no recompute without autograd): the
    loss of a fixed tile equals the untiled one, and the planned tile runs."""
    data = batches(n_steps=1)[0]
    losses = {}
    for tile in (0, 5):
        sm = compile_cpu(hf_model("qwen2"), optim=OPT, n_mb=2, seq_tile=tile)
        seen = []
        forward = tiling.TiledMLP.forward
        monkeypatch.setattr(tiling.TiledMLP, "forward", lambda self, x: seen.append(self.tile) or forward(self, x))
        losses[tile] = sm.evaluate(*data).loss
        monkeypatch.undo()
        assert seen and set(seen) == {tile}
    assert losses[5] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("family,tiled", [("llama", True), ("qwen2", True), ("gpt2", True), ("bloom", False)])
def test_an_mlp_is_tiled_only_where_its_forward_takes_the_hidden_states_alone(family, tiled):
    """Bloom's MLP takes the residual as well: the planner counts no tiles for it and the runtime wraps nothing (a
    wrapper taking one argument failed its first step); the other families' MLPs are tiled as before."""
    from megatrain.capture.blocks import mlp_tileable

    model = hf_model(family, **(with_dropout(family, 0.0) if family in DROPOUT_FIELDS else {}))
    blocks = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    assert blocks and all(mlp_tileable(m) == tiled for m in blocks)
    sm = compile_cpu(model, n_mb=1)
    works = [lay.tile_work_bytes_per_token for lay in sm.captured.graph if lay.kind == "block"]
    assert works and all(bool(w) == tiled for w in works)
    sm.train_step(*batches(n_steps=1)[0])
