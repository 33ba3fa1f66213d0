"""The least a steady step takes: one step's work on its busiest resource.

A schedule simulated over a few steps shows its steady step as the time between step ends; where one resource
carries more work a step than that time (the host's updates and the deferred moments' pass falling behind from step
to step), three steps are too few to show the backlog, and the step ends come closer together than the steady
state can keep them. Each resource must do a step's work every step: the compute stream its ops, each copy
direction its bytes at its rate alone, both directions their bytes within the duplex rate, the host its updates and
the step's moments tasks (``planner.moments``). The largest of these, of a middle step, is a floor under the steady
step that the simulator's holds to (``Timeline.floor_s``).
"""

from __future__ import annotations

from megatrain.ir import OpKind, Schedule, Stream
from megatrain.planner.cost import duration_s, transfer_nbytes
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.moments import Moments

# ops whose ``mb`` is a part of a layer's elements (the last part shorter), not a micro-batch
PARTS = (OpKind.STORE_G, OpKind.OPT, OpKind.LOAD_OPT, OpKind.STORE_OPT)


def step_floor_s(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec, deferred: frozenset[int],
                 moments: Moments) -> float:
    """The work of the middle step of ``schedule`` (three steps or more; else 0) on its busiest resource
    (``deferred``: ``ir.deferrable_opts`` of the schedule; ``moments``: its moments tasks)."""
    cfg = schedule.config
    if cfg.n_steps < 3:
        return 0.0
    k = cfg.n_steps // 2
    work = dict.fromkeys([*Stream, "pcie"], 0.0)
    known: dict[tuple, tuple[float, float]] = {}  # (an op's seconds and PCIe seconds by what they depend on: a
    # micro-batch's compute and copies are every micro-batch's; a part's are its own)
    for op in schedule.ops:
        if op.step != k:
            continue
        key = (op.kind, op.stream, op.layer, op.mb if op.kind in PARTS else None, op.id in deferred)
        secs = known.get(key)
        if secs is None:
            copy = op.stream in (Stream.H2D, Stream.D2H)
            secs = known[key] = (duration_s(graph, cfg, spec, op, deferred), transfer_nbytes(
                graph, cfg, op, spec, deferred) / spec.duplex_bytes_per_s if copy else 0.0)
        work[op.stream] += secs[0]
        work["pcie"] += secs[1]
    work[Stream.CPU] += moments.seconds(k)
    return max(work.values())
