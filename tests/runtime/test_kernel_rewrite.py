"""The kernels inside the templates (CPU: Triton's interpreter) give the same step as plain templates."""

import copy

import pytest

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
