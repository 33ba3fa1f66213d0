"""The kernels inside the templates (CPU: Triton's interpreter) give the same step as plain templates."""

import copy

import pytest
import torch

import megatrain

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches


@pytest.mark.parametrize("family,expect", [
    ("llama", {"rmsnorm", "swiglu", "rope", "linear_cross_entropy"}),
    ("qwen3", {"rmsnorm", "swiglu", "rope", "linear_cross_entropy"}),  # q/k norms too
    ("gemma2", {"rmsnorm", "rope", "linear_cross_entropy"}),  # gelu MLP: no SwiGLU; soft-capped head
])
def test_kernels_match_plain_templates(family, expect):
    model = hf_model(family)
    data = batches(n_steps=1)
    plain = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, kernels=False)
    fused = compile_cpu(model, optim=OPT, n_mb=3, kernels=True)
    assert set(fused.kernels) == expect, fused.kernels
    if family == "gemma2":
        assert "softcap 30.0" in fused.kernels["linear_cross_entropy"][0]
    a, b = plain.train_step(*data[0]), fused.train_step(*data[0])
    assert abs(a.loss - b.loss) <= 1e-5 * a.loss
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    sa, sb = plain.store, fused.store
    for name in sa.captured.model_param_names:
        ga, gb = sa.param_view(name, "grad"), sb.param_view(name, "grad")
        assert float((ga - gb).abs().max()) <= 1e-4 * float(ga.abs().max()) + 1e-9, name
    # the user's model still has its own modules
    assert type(model.model.norm).__name__.endswith("RMSNorm")


def test_kernels_on_the_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        megatrain.compile(hf_model("llama"), device="cpu", kernels=True)


def test_rope_reads_half_of_cos_and_sin_only_where_the_rotary_module_repeats_them():
    from megatrain.planner.capture import capture
    from megatrain.runtime.kernel_rewrite import rotary_halves_equal

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
