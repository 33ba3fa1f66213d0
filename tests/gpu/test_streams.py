"""The streaming executor on the GPU: same numbers as the synchronous one, run to run identical."""

import copy

import pytest
import torch

import megatrain

from ..runtime.models import hf_model
from ..runtime.test_parity import batches

pytestmark = pytest.mark.gpu


def train(model, streams, data, **plan):
    sm = megatrain.compile(model, device="cuda", streams=streams, optim=megatrain.OptimConfig(lr=1e-3), **plan)
    losses = [sm.train_step(*[t.cuda() for t in b]).loss for b in data]
    return losses, sm.state_dict()


@pytest.mark.parametrize("plan", [dict(n_mb=3, weight_slots=2, host_checkpoints=2),
                                  dict(n_mb=2, weight_slots=3, host_checkpoints=0)])
def test_streams_match_program_order_and_repeat(plan):
    model = hf_model("qwen2", hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4)
    data = batches(n_steps=3)
    ref_losses, ref_sd = train(copy.deepcopy(model), False, data, **plan)
    losses, sd = train(copy.deepcopy(model), True, data, **plan)
    again, sd2 = train(copy.deepcopy(model), True, data, **plan)
    assert losses == again and all(torch.equal(sd[n], sd2[n]) for n in sd)  # deterministic
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for n in ref_sd:
        torch.testing.assert_close(sd[n], ref_sd[n], rtol=1e-6, atol=1e-7)
