"""GPT-OSS's attention with sinks on torch's flash kernel (capture.packed_attention) against HF's eager attention
in fp32: outputs and the gradients of queries, keys, values and sinks, full and sliding-window layers, rows dense and
packed (tests/runtime/test_sink_attention.py checks the same algebra exactly on the CPU)."""

import sys

import pytest
import torch

from megatrain.capture import packed_attention
from megatrain.capture.tracer import Packed

from ..planner.test_moe import FAMILIES, TINY
from ..runtime.models import VOCAB

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window,packed", [(None, False), (128, False), (128, True), (None, True)])
def test_sinks_on_the_flash_kernel_equal_eager_attention(window, packed):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, t, d = 2, 16, 2, 512, 64
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_oss", **{**TINY, "vocab_size": VOCAB, **FAMILIES["gpt_oss"], "head_dim": d,
                                             "num_attention_heads": hq, "num_key_value_heads": hkv})
    attn = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").model.layers[0].self_attn.cuda()
    attn.sinks = torch.nn.Parameter(torch.randn(hq, device="cuda", generator=g))
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    q, k, v = (torch.randn(b, n, t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for n in (hq, hkv, hkv))
    scale = d ** -0.5
    if packed:
        pos = torch.cat([torch.arange(n) for n in (100, 300, 112, 512)]).view(b, t)
        cu, longest = packed_attention.doc_offsets(pos)
        mask = Packed(cu.cuda(), longest)
        allowed = packed_attention.block_mask(mask, b, window)
    else:
        mask = None
        allowed = packed_attention.causal_mask(t, window, "cuda")[None, None].expand(b, 1, t, t)
    out, _ = packed_attention.attention("eager", attn, q, k, v, mask, dropout=0.0, scaling=scale,
                                        sliding_window=window, s_aux=attn.sinks)
    dy = torch.randn(out.shape, device="cuda", generator=g)
    grads = torch.autograd.grad(out.float(), (q, k, v, attn.sinks), dy)
    additive = torch.zeros(allowed.shape, device="cuda").masked_fill_(~allowed, torch.finfo(torch.float32).min)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    attn.float()
    ref, _ = eager(attn, qf, kf, vf, additive, scaling=scale)
    refs = torch.autograd.grad(ref, (qf, kf, vf, attn.sinks), dy)
    assert out.shape == ref.shape == (b, t, hq, d)
    assert float((out.float() - ref).abs().max()) < 2e-2
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        assert float((a.float() - r).abs().max()) <= 3e-2 * float(r.abs().max()), name
