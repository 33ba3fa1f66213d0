"""A device budget the user sets (``device_budget_gib``): the plan fills no more (peak allocated), and torch's
caching allocator is capped to it plus the spec's reserve, so a run on the H200 behaves as on a card of that size."""

import copy
import gc

import pytest
import torch

import megatrain

from ..runtime.models import hf_model
from ..runtime.test_parity import batches

pytestmark = pytest.mark.gpu
GiB = 1 << 30


def test_a_device_budget_is_never_exceeded_where_the_card_would_be_used():
    model = hf_model("qwen2", hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                     num_key_value_heads=4, num_hidden_layers=8)
    data = batches(n_steps=2)
    peaks, losses = {}, {}
    try:
        for budget in (1.0, None):  # the capped run first: the cap counts what the process holds already
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.reset_peak_memory_stats()
            sm = megatrain.compile(copy.deepcopy(model), n_mb=2, weight_slots=2, device_budget_gib=budget)
            losses[budget] = [sm.train_step(*b).loss for b in data]
            sm.wait()
            peaks[budget] = torch.cuda.max_memory_allocated()
            del sm
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert peaks[None] > GiB  # the full card's plan keeps state and activations there
    assert peaks[1.0] <= GiB, peaks
    assert losses[1.0] == pytest.approx(losses[None], rel=1e-3)
