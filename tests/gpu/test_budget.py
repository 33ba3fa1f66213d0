"""A device budget the user sets (``device_budget_gib``): the plan fills no more (peak allocated), and torch's
caching allocator is capped to it plus the spec's reserve, so a run on the H200 behaves as on a card of that size."""

import copy
import dataclasses
import gc

import pytest
import torch

import megatrain

from ..runtime.models import hf_model
from ..runtime.test_parity import batches

pytestmark = pytest.mark.gpu
GiB = 1 << 30


def test_a_device_budget_is_never_exceeded_where_the_card_would_be_used():
    """A 1 GiB budget on a spec whose reserve is 256 MiB: the allocator is capped at 1.25 GiB, which the full
    card's plan of this model passes; the capped run keeps within the cap (it would fail with an out-of-memory
    error otherwise), its plan within the budget, and trains as the uncapped one does."""
    from megatrain.planner.cost import device_memory
    from megatrain.planner.hardware import PRESETS

    spec = dataclasses.replace(PRESETS["h200"], gpu_reserved_bytes=GiB // 4)
    model = hf_model("qwen2", hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                     num_key_value_heads=4, num_hidden_layers=16)
    data = batches(n_steps=2)
    peaks, losses, planned = {}, {}, {}
    try:
        for budget in (1.0, None):  # the capped run first: the cap counts what the process holds already
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.reset_peak_memory_stats()
            sm = megatrain.compile(copy.deepcopy(model), n_mb=2, weight_slots=2, device_budget_gib=budget,
                                   hardware=spec)
            losses[budget] = [sm.train_step(*b).loss for b in data]
            sm.wait()
            peaks[budget] = torch.cuda.max_memory_allocated()
            s = sm.schedule_for(*data[0][0].shape)
            planned[budget] = device_memory(sm.graph_for(s), s).total_nbytes
            del sm
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    cap = GiB + spec.gpu_reserved_bytes
    assert peaks[None] > cap, peaks  # the full card's plan keeps state and activations there
    assert planned[1.0] <= GiB < planned[None], planned
    assert peaks[1.0] <= cap, (peaks, planned)
    assert losses[1.0] == pytest.approx(losses[None], rel=1e-3)
