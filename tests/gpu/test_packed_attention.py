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
