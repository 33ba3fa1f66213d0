"""Attention with sinks (GPT-OSS) on the flash path: the kernel's output scaled by the sink's share, and its backward
given the scaled gradient and output, equal HF's eager attention with the sink column (fp64, CPU). The aten flash
kernel runs on CUDA alone; here a pure-torch kernel with its semantics stands in for it (its backward reads ``out``
only for each row's dot(dout, out), as the flash kernel's does). tests/gpu/test_sink_attention.py runs the real one."""

import sys

import pytest
import torch

from megatrain.capture import packed_attention
from megatrain.capture.tracer import Packed

from .models import hf_model
from .test_moe_parity import moe_model


def _scores(q, k, cu, scale, left):
    """(Hq, n, n) scaled scores of (n, H, D) rows and the boolean mask of what each query sees: its document, up to
    itself, the last ``left`` + 1 of those where given."""
    n, hq, _ = q.shape
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    doc = torch.searchsorted(cu.long(), torch.arange(n), right=True)
    i = torch.arange(n)
    seen = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    if left is not None:
        seen &= i[None, :] >= i[:, None] - left
    return s.masked_fill(~seen, float("-inf")), k


def _forward(q, k, v, cu, max_len, scale, left, right):
    s, _ = _scores(q, k, cu, scale, left)
    lse = torch.logsumexp(s, -1)  # (Hq, n)
    vv = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
    return out, lse, None, None


def _backward(dout, q, k, v, out, lse, cu, max_len, rng, unused, scale, left, right):
    s, kk = _scores(q, k, cu, scale, left)
    p = torch.exp(s - lse[..., None])
    g = q.shape[1] // k.shape[1]
    vv = v.repeat_interleave(g, dim=1)
    dp = torch.einsum("qhd,khd->hqk", dout, vv)
    d = (dout * out).sum(-1).t()  # (Hq, n): the only use of out
    ds = p * (dp - d[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    fold = lambda t: t.view(t.shape[0], k.shape[1], g, -1).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("window", [None, 3])
def test_flash_with_sinks_equals_eager_attention_with_the_sink_column(window, monkeypatch):
    monkeypatch.setattr(packed_attention, "kernel_forward", _forward)
    monkeypatch.setattr(packed_attention, "kernel_backward", _backward)
    model = moe_model("gpt_oss").double()
    attn = model.model.layers[0].self_attn
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    g = torch.Generator().manual_seed(0)
    b, t, hq, hkv, d = 2, 7, attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(hq, generator=g, dtype=torch.float64))
    q0 = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    dy = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64)
    mask = packed_attention.causal_mask(t, window, "cpu")
    additive = torch.zeros(t, t, dtype=torch.float64).masked_fill_(~mask, float("-inf"))[None, None]

    def run(fn):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        attn.sinks.grad = None
        out = fn(q, k, v)
        out.backward(dy)
        return [out.detach(), q.grad, k.grad, v.grad, attn.sinks.grad.clone()]

    want = run(lambda q, k, v: eager(attn, q, k, v, additive, scaling=attn.scaling)[0])
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
    got = run(lambda q, k, v: packed_attention._flash(q, k, v, cu, t, attn.scaling, window, attn.sinks))
    for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert torch.allclose(a, w, rtol=1e-9, atol=1e-11), (name, float((a - w).abs().max()))


def test_sink_families_are_switched_and_their_causal_masks_left_to_the_attention():
    """A GPT-OSS model is switched to the sinks attention packed rows or not, and its mask builder returns None for
    a causal mask without padding (the attention applies it); another family keeps its builder."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model = moe_model("gpt_oss")
    assert packed_attention.enable(model) and model.config._attn_implementation == f"{packed_attention.NAME}_sinks"
    builder = ALL_MASK_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    kw = dict(batch_size=1, q_length=4, kv_length=4, dtype=torch.float32)
    assert builder(**kw) is None
    padded = builder(**kw, attention_mask=torch.tensor([[1, 1, 1, 0]], dtype=torch.bool))
    assert padded is not None and padded.shape[-2:] == (4, 4)
    llama = hf_model("llama")
    assert packed_attention.enable(llama) and llama.config._attn_implementation == f"{packed_attention.NAME}_eager"


def test_packed_rows_with_a_sliding_window_keep_their_documents_and_window():
    """The mask the CPU path builds from offsets with a window: what HF's sliding builder makes from the positions."""
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    m = packed_attention.block_mask(Packed(cu, 7), 2, window=3)[:, 0]
    i = torch.arange(8)
    for r in range(2):
        doc = torch.searchsorted(cu.long(), r * 8 + i, right=True)
        want = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
        assert torch.equal(m[r], want)


def test_a_model_left_on_eager_attention_is_named_in_one_line():
    """Where no fused kernel takes a family's attention (Gemma 2's soft-capping, or a model built eager) the capture
    says so in one line (compile() warns with it on a GPU); so does Llama built eager (the flash path takes its
    packed rows alone); built with SDPA it is not named, nor is GPT-OSS, which takes the flash kernel with sinks."""
    from megatrain.capture import capture

    from .models import hf_model

    gemma = capture(hf_model("gemma2")).unfused_attention
    assert gemma is not None and gemma.startswith("gemma2: its attention logits are soft-capped") and "\n" not in gemma
    assert capture(moe_model("gpt_oss")).unfused_attention is None
    llama = capture(hf_model("llama")).unfused_attention
    assert llama is not None and llama.startswith("llama: it was built with eager attention")
    from transformers import AutoModelForCausalLM

    from .models import hf_config

    assert capture(AutoModelForCausalLM.from_config(hf_config("llama"), attn_implementation="sdpa")
                   ).unfused_attention is None


@pytest.mark.parametrize("hkv,window,sinks", [(2, None, False), (1, None, False), (4, 3, True)])
def test_long_micro_batches_run_the_backward_a_group_of_heads_at_a_time(hkv, window, sinks, monkeypatch):
    """At GROUPED_ATTN_TOKENS tokens and more the flash path's backward calls the kernel once per key/value head
    with that head's query heads: the gradients equal those of one call over every head (fp64, the pure-torch
    kernel), and each call holds one group."""
    calls = []

    def spy(dout, q, k, v, *rest):
        calls.append((q.shape[1], k.shape[1]))
        return _backward(dout, q, k, v, *rest)

    monkeypatch.setattr(packed_attention, "kernel_forward", _forward)
    monkeypatch.setattr(packed_attention, "kernel_backward", spy)
    g = torch.Generator().manual_seed(1)
    b, t, hq, d = 2, 6, 4, 8
    q0 = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    s0 = torch.randn(hq, generator=g, dtype=torch.float64) if sinks else None
    dy = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64)
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)

    def run(grouped_from):
        monkeypatch.setattr(packed_attention, "GROUPED_ATTN_TOKENS", grouped_from)
        calls.clear()
        x = [a.clone().requires_grad_() for a in (q0, k0, v0)] + ([s0.clone().requires_grad_()] if sinks else [])
        out = packed_attention._flash(*x[:3], cu, t, 0.3, window, x[3] if sinks else None)
        out.backward(dy)
        return [out.detach()] + [a.grad for a in x], list(calls)

    whole, one_call = run(b * t + 1)
    grouped, per_group = run(b * t)
    assert one_call == [(hq, hkv)]
    assert per_group == ([(hq // hkv, 1)] * hkv if hkv > 1 else [(hq, 1)])
    for a, w in zip(grouped, whole):
        assert torch.allclose(a, w, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_sdpa_a_group_of_heads_at_a_time_equals_one_call_over_every_head(hkv):
    """Long rows of an SDPA model run SDPA once per key/value head with its query heads (sdpa_by_group): the
    output and every gradient equal one call's (fp64 on the CPU), and each call gets one group."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = hf_model("qwen2", num_attention_heads=4, num_key_value_heads=hkv, hidden_size=32).model.layers[0].self_attn
    module = module.double().eval()
    g = torch.Generator().manual_seed(2)
    b, t, hq, d = 2, 7, 4, 8
    q0 = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    dy = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64)
    calls = []

    def spy(mod, q, k, v, mask, **kw):
        calls.append((q.shape[1], k.shape[1], mask))
        return sdpa_attention_forward(mod, q, k, v, mask, **kw)

    kw = dict(dropout=0.0, scaling=0.3, sliding_window=None)

    def run(fn):
        x = [a.clone().requires_grad_() for a in (q0, k0, v0)]
        out = fn(*x)
        out.backward(dy)
        return [out.detach()] + [a.grad for a in x]

    whole = run(lambda q, k, v: sdpa_attention_forward(module, q, k, v, None, **kw)[0])
    grouped = run(lambda q, k, v: packed_attention.sdpa_by_group(spy, module, q, k, v, kw))
    assert calls == [(hq // hkv, 1, None)] * hkv
    for a, w in zip(grouped, whole):
        assert torch.allclose(a, w, rtol=1e-12, atol=1e-13)
