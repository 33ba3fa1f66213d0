"""fp32 weights bound for weight slots of the compute dtype cross into the device through one planned staging
buffer, a part at a time (``DeviceState.load_cast``), instead of through an fp32 temporary of the whole layer that
torch's ``copy_`` would take from the caching allocator."""

import torch

from megatrain.ir import ScheduleConfig
from megatrain.planner.graph import preset
from megatrain.planner.passes import build_schedule
from megatrain.runtime.memory.device import DeviceState


def _state(dtype=torch.bfloat16, graph=None) -> DeviceState:
    def quiesce():
        raise AssertionError("nothing to wait for: no buffer is replaced")

    return DeviceState(graph=graph, store=None, device=torch.device("cpu"), dtype=dtype, quiesce=quiesce)


def test_parts_through_the_stage_land_as_a_direct_cast_would():
    """A layer 7.5 stages long (the last part short) and values that round both ways, halfway cases and non-finite
    ones: the slot holds exactly the bf16 a direct cast gives."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(60, generator=g) * torch.logspace(-30, 30, 60)
    src[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1 + 2 ** -8])  # the last: a tie, to even
    dst = torch.full((64,), 7.0, dtype=torch.bfloat16)
    dev = _state()
    dev.stage = torch.empty(8)
    dev.load_cast(dst[:60], src, non_blocking=False)
    want = src.to(torch.bfloat16)
    assert torch.equal(dst[:60].view(torch.int16), want.view(torch.int16))
    assert torch.equal(dst[60:], torch.full((4,), 7.0, dtype=torch.bfloat16))  # nothing past the layer written


def test_no_stage_where_nothing_is_cast_on_the_way():
    """On the CPU (slots of the host's dtype), and for a bf16 wire on any device, loads copy directly; fitting a
    schedule then waits for nothing (the stream issuer's record of the step before must survive it)."""
    graph = preset("qwen2.5-0.5b")
    for wire in (2, 4):
        cfg = ScheduleConfig(n_layers=len(graph), n_mb=1, mb_tokens=1024, seq_len=1024, weight_slots=2,
                             wire_bytes_per_param=wire)
        for dtype in (torch.float32, torch.bfloat16):
            dev = _state(dtype, graph)
            dev._fit_stage(build_schedule(graph, cfg))
            assert dev.stage is None
    src, dst = torch.randn(5), torch.empty(5, dtype=torch.bfloat16)
    _state().load_cast(dst, src, non_blocking=False)  # no stage: torch's copy
    assert torch.equal(dst, src.to(torch.bfloat16))
