"""Packed rows on the GPU attend through torch's variable-length flash attention over their documents' offsets
(capture.packed_attention): the same outputs and gradients as the block-diagonal masks HF builds, within bf16."""

import copy

import pytest
import torch

import megatrain
from megatrain.capture import packed_attention
from megatrain.capture.tracer import PACKED, Packed

from ..runtime.models import hf_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("orig,hkv", [("sdpa", 2), ("eager", 8)])
def test_flash_over_offsets_equals_the_masked_attention(orig, hkv):
    """One layer's attention on random bf16 inputs (grouped and plain heads): the flash path against ``orig`` with
    the block-diagonal mask, outputs and input gradients."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, t, d = 2, 8, 512, 64
    pos = torch.cat([torch.arange(n) for n in (100, 300, 112, 512)]).view(b, t)
    cu, longest = packed_attention.doc_offsets(pos)
    packed = Packed(cu.cuda(), longest)
    q, k, v = (torch.randn(b, n, t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for n in (h, hkv, hkv))
    module = hf_model("qwen2", num_attention_heads=h, num_key_value_heads=hkv, hidden_size=h * d) \
        .model.layers[0].self_attn.cuda()
    module.eval()
    out, _ = packed_attention.attention(orig, module, q, k, v, packed, dropout=0.0, scaling=d ** -0.5)
    with torch.no_grad():
        ref, _ = packed_attention.attention(orig, module, q.float(), k.float(), v.float(), packed, dropout=0.0,
                                            scaling=d ** -0.5)  # fp32: the masked path
    assert out.shape == (b, t, h, d)
    assert float((out.float() - ref).abs().max()) < 2e-2
    dy = torch.randn(out.shape, device="cuda", generator=g)
    grads = torch.autograd.grad(out.float(), (q, k, v), dy)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, _ = packed_attention.attention(orig, module, qf, kf, vf, packed, dropout=0.0, scaling=d ** -0.5)
    refs = torch.autograd.grad(ref, (qf, kf, vf), dy)
    for a, r in zip(grads, refs):
        assert float((a.float() - r).abs().max()) <= 3e-2 * float(r.abs().max())


def test_a_packed_step_through_offsets_trains_as_through_hf_masks():
    """A 2-layer Qwen2 on packed rows, 2 steps: flash over the offsets (which the runtime gives on the GPU) against
    the mask builders' masks (the marker without offsets): losses and weights agree within bf16, and the flash path
    ran in every block."""
    model = hf_model("qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=512)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (4, 256), generator=g)
    pos = torch.cat([torch.arange(n) for n in (40, 150, 66, 256, 10, 90, 156, 128, 128)]).view(4, 256)
    calls = []
    flash = packed_attention._flash
    results = []
    for offsets in (True, False):
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", n_mb=2, weight_slots=2,
                               optim=megatrain.OptimConfig(lr=1e-4))
        assert sm.captured.varlen
        if not offsets:
            sm.executor.ctx.packed_mask = lambda position_ids: PACKED
        packed_attention._flash = lambda *a: calls.append(offsets) or flash(*a)
        try:
            losses = [sm.train_step(ids, position_ids=pos).loss for _ in range(2)]
        finally:
            packed_attention._flash = flash
        results.append((losses, {n: t.clone() for n, t in sm.state_dict().items()}))
    assert calls.count(True) >= 2 * 2 * 2 and False not in calls  # 2 blocks x 2 micro-batches, forward + recompute
    (l1, w1), (l2, w2) = results
    assert l1 == pytest.approx(l2, rel=2e-2)
    for n, a in w1.items():
        assert float((a - w2[n]).abs().max()) <= 4e-4, n  # two Adam steps of at most ~lr each, either way


def test_long_rows_run_a_group_of_heads_at_a_time_through_sdpa_or_the_flash_kernel(monkeypatch):
    """A row of GROUPED_ATTN_TOKENS tokens or more without a mask runs its attention a key/value head's group at a
    time: an SDPA model through SDPA (sdpa_by_group, holding less than one SDPA call), another through the flash
    kernel with its backward a group at a time; outputs and gradients as one SDPA call's within bf16, and the flash
    kernel's grouped backward gives the gradients of its one call over every head and holds less by what the
    planner counts (Layer.attn_bwd_bytes: 8 x q_dim bytes a token against one group's)."""
    from megatrain.planner.graph import attn_group_bytes

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, t, d = 1, 28, 4, 32768, 128
    q, k, v = (torch.randn(b, n, t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for n in (hq, hkv, hkv))
    dy = torch.randn(b, t, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    module = hf_model("qwen2", num_attention_heads=hq, num_key_value_heads=hkv, hidden_size=hq * d) \
        .model.layers[0].self_attn.cuda()
    module.eval()
    taken = []
    flash, by_group = packed_attention._flash, packed_attention.sdpa_by_group
    monkeypatch.setattr(packed_attention, "_flash", lambda *a, **kw: taken.append("flash") or flash(*a, **kw))
    monkeypatch.setattr(packed_attention, "sdpa_by_group",
                        lambda *a, **kw: taken.append("sdpa") or by_group(*a, **kw))

    def run(grouped_from, orig="sdpa"):
        monkeypatch.setattr(packed_attention, "GROUPED_ATTN_TOKENS", grouped_from)
        taken.clear()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, _ = packed_attention.attention(orig, module, q, k, v, None, dropout=0.0, scaling=d ** -0.5)
        grads = torch.autograd.grad(out, (q, k, v), dy)
        torch.cuda.synchronize()
        return out, grads, torch.cuda.max_memory_allocated() - base

    ref, ref_grads, peak_ref = run(1 << 40)  # one SDPA call (causal, grouped heads)
    assert not taken
    for orig in ("sdpa", "eager"):
        out, grads, peak = run(t, orig)
        assert taken == [{"sdpa": "sdpa", "eager": "flash"}[orig]] and out.shape == (b, t, hq, d)
        assert float((out.float() - ref.float()).abs().max()) < 2e-2
        for name, a, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert float((a.float() - r.float()).abs().max()) <= 2e-2 * float(r.float().abs().max()), name
        if orig == "sdpa":
            assert peak < peak_ref, (peak, peak_ref)
    peak_grouped = peak
    # the same kernel over every head at once, on the flash path
    monkeypatch.setattr(packed_attention, "GROUPED_ATTN_TOKENS", 1 << 40)
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    one = torch.autograd.grad(flash(q2, k2, v2, cu, t, d ** -0.5), (q2, k2, v2), dy)
    torch.cuda.synchronize()
    peak_one = torch.cuda.max_memory_allocated() - base
    for name, a, r in zip(("dq", "dk", "dv"), grads, one):
        assert float((a.float() - r.float()).abs().max()) <= 1e-3 * float(r.float().abs().max()), name
    planned = (8 * hq * d - attn_group_bytes(hq * d, hkv * d, hq, 2)) * t
    assert peak_one - peak_grouped >= 0.8 * planned, (peak_one, peak_grouped, planned)


def test_packed_rows_of_a_hybrid_train_as_its_documents_one_per_row():
    """Qwen3-Next (gated delta nets through the delta rule's kernels, gated attention, experts) on packed rows on the
    GPU in fp32, 3 steps at lr 1e-2: each mixer runs the documents apart (capture.documents), and the losses are
    those of the same documents one per row, right-padded, within 1e-4; the packed rows without the layout (the
    documents' states and convolutions running into each other) are off by more than 3e-4 (about 1e-3 on the CPU),
    so the comparison sees a leak."""
    model = hf_model("qwen3_next", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=512)
    g = torch.Generator().manual_seed(1)
    lengths = ((40, 150, 66), (200, 56), (10, 90, 156), (128, 128))
    docs = [[torch.randint(3, 512, (n,), generator=g) for n in row] for row in lengths]
    packed = torch.stack([torch.cat(row) for row in docs])
    pos = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    flat = [d for row in docs for d in row]
    rows = torch.zeros(len(flat), 256, dtype=torch.long)
    mask = torch.zeros_like(rows)
    for i, d in enumerate(flat):
        rows[i, : len(d)], mask[i, : len(d)] = d, 1

    def losses(ids, m, p, leak=False):
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", compute_dtype=torch.float32, n_mb=2,
                               weight_slots=2, optim=megatrain.OptimConfig(lr=1e-2))
        assert sm.captured.docs_apart and "gated_delta_rule" in sm.kernels
        if leak:
            sm.executor.ctx.packed_mask = lambda position_ids: PACKED
        return torch.tensor([sm.train_step(ids, m, position_ids=p).loss for _ in range(3)], dtype=torch.float64)

    one_per_row = losses(rows, mask, None)
    apart, leaking = losses(packed, None, pos), losses(packed, None, pos, leak=True)
    assert float(((apart - one_per_row) / one_per_row).abs().max()) <= 1e-4, (apart, one_per_row)
    assert float(((leaking - one_per_row) / one_per_row).abs().max()) >= 3e-4, (leaking, one_per_row)
