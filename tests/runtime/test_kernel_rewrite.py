"""The kernels inside the templates (CPU: Triton's interpreter) give the same step as plain templates."""

import contextlib
import copy
import dataclasses

import pytest
import torch

import megatrain

from .models import compile_cpu, hf_model, record_grads
from .test_parity import OPT, batches


@pytest.mark.parametrize("family,expect", [
    ("llama", {"rmsnorm", "swiglu", "rope", "linear_cross_entropy"}),
    ("qwen3", {"rmsnorm", "swiglu", "rope", "linear_cross_entropy"}),  # q/k norms too
    ("gemma2", {"rmsnorm", "rope", "linear_cross_entropy"}),  # gelu MLP: no SwiGLU; soft-capped head
    # gated delta-net layers: the chunked rule's scan over chunks in the kernels
    ("qwen3_5_text", {"rmsnorm", "swiglu", "rope", "gated_delta_rule", "linear_cross_entropy"}),
    # one tensor rotated a call, apply_rotary_pos_emb(x, cos, sin): transformers' rotation kept
    ("gemma3n_text", {"rmsnorm", "linear_cross_entropy"}),
    ("gemma4_text", {"rmsnorm", "linear_cross_entropy"}),
])
def test_kernels_match_plain_templates(family, expect):
    model = hf_model(family)
    data = batches(n_steps=1)
    plain = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, kernels=False)
    fused = compile_cpu(model, optim=OPT, n_mb=3, kernels=True)
    assert set(fused.kernels) == expect, fused.kernels
    if family == "gemma2":
        assert "softcap 30.0" in fused.kernels["linear_cross_entropy"][0]
    if family == "qwen3_5_text":
        assert fused.kernels["gated_delta_rule"] == ["model.layers.0"]  # (layer 2 shares its template)
    grads = record_grads(plain), record_grads(fused)
    a, b = plain.train_step(*data[0]), fused.train_step(*data[0])
    assert abs(a.loss - b.loss) <= 1e-5 * a.loss
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    assert set(grads[0]) == set(grads[1]) == set(plain.captured.model_param_names)
    for name in plain.captured.model_param_names:
        ga, gb = grads[0][name], grads[1][name]
        assert float((ga - gb).abs().max()) <= 1e-4 * float(ga.abs().max()) + 1e-9, name
    # the user's model still has its own modules
    assert type(model.model.norm).__name__.endswith("RMSNorm")


def test_kernels_on_the_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        megatrain.compile(hf_model("llama"), device="cpu", kernels=True)


def test_rope_reads_half_of_cos_and_sin_only_where_the_rotary_module_repeats_them():
    from megatrain.capture import capture
    from megatrain.runtime.layers.kernel_rewrite import rotary_halves_equal

    model = hf_model("llama")
    captured = capture(model)
    assert rotary_halves_equal(captured)  # HF builds cos/sin as cat(freqs, freqs) at every position
    fused = compile_cpu(model, optim=OPT, n_mb=1, kernels=True)
    assert all(name.endswith("(cos/sin halves equal)") for name in fused.kernels["rope"]), fused.kernels
    rotary = next(m for seg in captured.segments for m in seg.template.modules()
                  if type(m).__name__.endswith("RotaryEmbedding"))
    half = rotary.inv_freq.numel()  # D/2
    original = type(rotary).forward

    def skewed(self, x, position_ids):  # a module whose second half differs from the first
        cos, sin = original(self, x, position_ids)
        return cos, torch.cat([sin[..., :half], -sin[..., half:]], dim=-1)

    type(rotary).forward = skewed
    try:
        assert not rotary_halves_equal(captured)
    finally:
        type(rotary).forward = original


def _saved_bytes(fn, skip):
    """Bytes of the distinct tensors autograd saves in ``fn()`` (those on the storages in ``skip`` left out)."""
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


@pytest.mark.parametrize("bias", [False, True])
def test_a_saved_forward_of_the_kernel_mlp_keeps_gate_and_up_but_not_their_product(bias):
    """Under keep_less (a saved layer's forward) the kernel MLP gives the same output and gradients as the kernel
    MLP without it, and keeps T x intermediate elements less for its backward."""
    from torch import nn

    from megatrain.runtime.layers.kernel_rewrite import KernelSwiGLUMLP, _swiglu_replacement, keep_less

    torch.manual_seed(0)
    H, inter, T = 16, 40, 12
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
    mlp.down_proj, mlp.act_fn = nn.Linear(inter, H, bias=bias), nn.SiLU()
    kern = _swiglu_replacement(mlp)
    assert isinstance(kern, KernelSwiGLUMLP)
    x = torch.randn(2, T, H, requires_grad=True)
    dy = torch.randn(2, T, H)
    params = list(kern.parameters())
    skip = {t.untyped_storage().data_ptr() for t in [x, *params]}
    results = []
    for lean in (False, True):
        with torch.enable_grad(), (keep_less() if lean else contextlib.nullcontext()):
            out, nbytes = _saved_bytes(lambda: kern(x), skip)
        results.append((out, torch.autograd.grad(out, [x, *params], dy), nbytes))
    (out0, g0, n0), (out1, g1, n1) = results
    torch.testing.assert_close(out1, out0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b)
    assert n0 - n1 == 2 * T * inter * 4  # the product: batch of two, fp32 here


@pytest.mark.parametrize("lean", [False, True])
def test_saved_layers_with_kernels_train_as_recomputing_layers_do(lean, monkeypatch):
    """Kernels on, every block saved, kept in full or lean (the MLP's product formed again in the backward, the
    down projection's weight gradient through the sink): the step of every block recomputed. The plan is made
    lean here (the planner would not: everything fits); the measurement sees the product missing."""
    from megatrain.planner import search
    from megatrain.runtime.layers import kernel_rewrite

    choose = search.with_saved_acts
    fused = kernel_rewrite._SwiGLUDownFunction.apply
    calls = []
    monkeypatch.setattr(kernel_rewrite._SwiGLUDownFunction, "apply", lambda *a: (calls.append(1), fused(*a))[1])
    monkeypatch.setattr(search, "with_saved_acts",
                        lambda *a: dataclasses.replace(choose(*a), saved_lean=lean) if choose(*a).saved_acts
                        else choose(*a))
    model = hf_model("qwen2")
    data = batches(n_steps=1)  # the interpreter runs the kernels: one step (its update checked by the weights)
    runs = []
    for saved in (0, 3):
        sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, kernels=True, saved_acts=saved)
        stats = [sm.train_step(*b) for b in data]
        cfg = sm.schedule_for(6, 12).config
        assert cfg.saved_acts == ((1, 2, 3) if saved else ()) and cfg.saved_lean == (lean and bool(saved))
        runs.append((stats, sm.state_dict()))
        # the saved forwards (3 blocks x 3 micro-batches) keep less in a lean plan, no other forward does; and the
        # planner's measurement of the lean bytes once (made for a plan that saves layers)
        assert len(calls) == (1 + (9 if lean else 0) if saved else 0)
        calls.clear()
    (s0, w0), (s1, w1) = runs
    for a, b in zip(s0, s1):
        assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-5, atol=1e-6)
    full, less = (sm.executor.measure_saved_bytes(2, 12, lean=x) for x in (False, True))
    assert full - less == 12 * 96 * 4  # tokens x intermediate_size x fp32
    graph = sm.planning_graph(12)
    assert graph[2].saved_bytes(False) - graph[2].saved_bytes(True) == 96 * 4
