"""Mixture-of-experts blocks on the GPU compute their experts through grouped GEMMs (transformers' grouped_mm
implementation, torch's grouped matmul): in bf16 against the same experts looping over themselves in fp32, for the
same routing (top-k indices and weights given to both); and capture.grouped_experts, which the captured model
runs instead, likewise."""

import copy
import functools

import pytest
import torch

from megatrain.capture import grouped_experts

from ..runtime.test_moe_parity import moe_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["transformers", "megatrain"])
@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral", "gpt_oss"])
def test_grouped_experts_in_bf16_match_a_loop_over_experts(family, impl):
    model = moe_model(family)
    experts = model.model.layers[-1].mlp.experts.cuda()
    assert experts.config._experts_implementation == "grouped_mm"
    ref = copy.deepcopy(experts).float()  # its own copy of the config
    ref.config._experts_implementation = "eager"
    experts = experts.to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    n_tok, k = 1024, model.config.num_experts_per_tok
    n_exp = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    x = torch.randn(n_tok, model.config.hidden_size, device="cuda", generator=g)
    index = torch.rand(n_tok, n_exp, device="cuda", generator=g).topk(k, dim=-1).indices
    weights = torch.rand(n_tok, k, device="cuda", generator=g).softmax(-1)
    xb = x.to(torch.bfloat16).requires_grad_()
    xf = xb.detach().float().requires_grad_()
    run = experts if impl == "transformers" else functools.partial(grouped_experts.forward, experts)
    out, out_ref = run(xb, index, weights.to(torch.bfloat16)), ref(xf, index, weights)
    dy = torch.randn(out_ref.shape, device="cuda", generator=g)
    out.float().backward(dy)
    out_ref.backward(dy)
    assert float((out.float() - out_ref).abs().max()) <= 2e-2 * float(out_ref.abs().max())
    assert float((xb.grad.float() - xf.grad).abs().max()) <= 3e-2 * float(xf.grad.abs().max())
    for (n, p), (_, q) in zip(experts.named_parameters(), ref.named_parameters()):
        # an expert bias's gradient sums its rows in bf16 in both implementations (GPT-OSS on the H200: 4.0% of
        # the largest, either one)
        tol = 5e-2 if n.endswith("_bias") else 3e-2
        assert float((p.grad.float() - q.grad).abs().max()) <= tol * float(q.grad.abs().max()), n
