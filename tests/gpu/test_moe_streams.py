"""Mixture-of-experts models on the GPU's streaming executor: the router loss (its sums formed on the compute
stream, its gradient in each backward) and frozen layers (no moments for what is frozen), as the synchronous executor runs them."""

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


def test_frozen_layers_keep_no_moments_on_the_gpu():
    """The embedding and one block frozen, and block 0's attention projections (a layer frozen in part, whose
    moments cover what trains alone), device updates searched: nothing frozen is updated, and the streaming
    executor trains as the synchronous one."""
    model = moe_model("qwen3_moe")
    attn = model.model.layers[0].self_attn
    for p in (*model.model.embed_tokens.parameters(), *model.model.layers[1].parameters(), attn.q_proj.weight,
              attn.o_proj.weight):
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = batches(n_steps=2)
    ref_losses, _, ref_sd = train(copy.deepcopy(model), False, data, n_mb=2, gpu_opt_every="auto")
    losses, _, sd = train(copy.deepcopy(model), True, data, n_mb=2, gpu_opt_every="auto")
    assert losses == ref_losses and all(torch.equal(sd[n], ref_sd[n]) for n in sd)
    for n in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert torch.equal(sd[n].cpu(), before[n]), n
    assert not torch.equal(sd["model.layers.0.self_attn.k_proj.weight"].cpu(),
                           before["model.layers.0.self_attn.k_proj.weight"])
