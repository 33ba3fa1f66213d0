"""Mixture-of-experts models on the GPU's streaming executor: the router loss (its sums formed on the compute
stream, its gradient in each backward) and layers frozen whole (no moments), as the synchronous executor runs them."""

import copy

import pytest
import torch

from ..runtime.test_moe_parity import moe_model
from ..runtime.test_parity import batches
from .test_streams import train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_loss_on_streams_matches_program_order(family):
    """Without clipping the two executors run the same kernels on the same data: identical losses and weights,
    the router term in the loss (it differs from the run without it), a saved layer and recomputed ones."""
    model = moe_model(family)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5
    data = batches(n_steps=3)
    plan = dict(n_mb=3, weight_slots=2, saved_acts=1)
    ref_losses, _, ref_sd = train(copy.deepcopy(model), False, data, **plan)
    losses, _, sd = train(copy.deepcopy(model), True, data, **plan)
    assert losses == ref_losses and all(torch.equal(sd[n], ref_sd[n]) for n in sd)
    plain = copy.deepcopy(model)
    plain.config.output_router_logits = False
    plain_losses, _, _ = train(plain, True, data, **plan)
    assert abs(plain_losses[0] - losses[0]) > 1e-3  # the term is there


def test_layers_frozen_whole_keep_no_moments_on_the_gpu():
    """The embedding and one block frozen, device updates searched: neither is updated nor holds moments, and the
    streaming executor trains as the synchronous one."""
    model = moe_model("qwen3_moe")
    for p in (*model.model.embed_tokens.parameters(), *model.model.layers[1].parameters()):
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches(n_steps=2)
    ref_losses, _, ref_sd = train(copy.deepcopy(model), False, data, n_mb=2, gpu_opt_every="auto")
    losses, _, sd = train(copy.deepcopy(model), True, data, n_mb=2, gpu_opt_every="auto")
    assert losses == ref_losses and all(torch.equal(sd[n], ref_sd[n]) for n in sd)
    for n in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert torch.equal(sd[n].cpu(), before[n]), n
