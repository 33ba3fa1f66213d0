"""How many parameters each slot of a schedule holds at most: what the runtime allocates and the cost model counts
(at each pool's bytes per parameter, planner.cost.slot_sizes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatrain.ir.op import SLOT_POOL, Op
from megatrain.ir.schedule import Schedule, ScheduleConfig

if TYPE_CHECKING:
    from megatrain.ir.graph import LayerGraph

POOLS = ("w", "g", "a", "o", "k")  # device slot pools
HOST_POOLS = ("h",)  # host gradient buffers

_last_slot_params: tuple = (None, None, None)  # (ops, graph, result) of the last call: see slot_params


def slot_params(graph: LayerGraph, schedule: Schedule) -> dict[str, list[int]]:
    """Parameters each weight, gradient and optimizer slot holds at most, by slot index: the largest layer the
    schedule puts in it (an embedding's slot need not size every other one). For activation slots (``a``), the
    number of slots, each 0 here. Depends on the ops alone, which the plan search shares between the configs it
    tries on one candidate (``passes.relabel_saved``): the last result is kept for the same ops."""
    global _last_slot_params
    ops, g, out = _last_slot_params
    if ops is schedule.ops and g is graph:
        return {p: list(v) for p, v in out.items()}
    out = _slot_params(graph, schedule)
    _last_slot_params = (schedule.ops, graph, out)
    return {p: list(v) for p, v in out.items()}


def _slot_params(graph: LayerGraph, schedule: Schedule) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {p: [] for p in POOLS + HOST_POOLS}
    for op in schedule.ops:
        for role, idx in op.slots:
            pool = SLOT_POOL[role]
            sizes = out[pool]
            if len(sizes) <= idx:
                sizes.extend([0] * (idx + 1 - len(sizes)))
            if pool != "a":
                n = op_params(graph, schedule.config, op) if pool in ("h", "o") else graph.weight_params(op.layer)
                sizes[idx] = max(sizes[idx], n)
    return out


def op_params(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> int:
    """Parameters whose gradient or update ``op`` handles: its layer's weights, or one part of them
    (``ScheduleConfig.host_grad_part``)."""
    lo, hi = cfg.part_span(op, graph.weight_params(op.layer))
    return hi - lo
