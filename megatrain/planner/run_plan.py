"""The plan of a run, whole: what ``compile()`` executes, made in one place from one request (PlanOptions). A
training plan is the search's choice built as the one step every step runs, its set-up (what the steps find on the
device, loaded once), and the pairs a run issues back to back with what the second carries over from the first,
each verified; an evaluation plan is forwards and the loss for a batch shape."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatrain.ir import Schedule, ScheduleConfig
from megatrain.planner.carried import Carried, carried_deps, join
from megatrain.planner.cost import gemm_workspace_nbytes
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.passes import build_schedule, setup_schedule
from megatrain.planner.request import PlanOptions
from megatrain.planner.search import MAX_MB_TOKENS, SEQ_TILES, plan
from megatrain.planner.verify import verify


@dataclass(frozen=True)
class RunPlan:
    setup: Schedule | None  # what the steps keep on the device, loaded before the first (None: nothing)
    step: Schedule  # the schedule every step runs
    pairs: tuple[tuple[Schedule, Schedule, Carried], ...]  # (first, second, what the second carries from the first)
    margin_taken: str | None  # where a faster plan was refused for the host margin alone: in words


def plan_run(graph: LayerGraph, spec: HardwareSpec, batch_size: int, seq_len: int, options: PlanOptions, *,
             clip: bool, on_gpu: bool) -> RunPlan:
    """The training plan for steps of ``batch_size`` sequences of ``seq_len`` tokens: the search's fastest
    (:func:`megatrain.planner.search.plan`, the one ``megatrain plan`` runs) for ``options``, every schedule of it
    verified, and each pair a run issues back to back (the set-up then a step, a step then the next) verified as one
    schedule with its carried dependencies."""
    if options.n_mb != "auto" and batch_size % options.n_mb:
        raise ValueError(f"batch of {batch_size} sequences cannot be split into {options.n_mb} micro-batches")
    found = plan(graph, spec, batch_size * seq_len, seq_len, clip=clip, n_steps=3,
                 **options.search_kwargs(seq_len, on_gpu))
    step = build_schedule(graph, replace(found.schedule.config, n_steps=1))
    setup = setup_schedule(graph, step)
    for s in (setup, step):
        if s is not None:
            verify(s, graph, spec)
    pairs = []
    for prev in (setup, step) if setup is not None else (step,):
        carried = carried_deps(prev, step, graph)
        verify(join(prev, step, carried), graph)
        pairs.append((prev, step, carried))
    return RunPlan(setup, step, tuple(pairs), found.margin_taken)


def plan_eval(graph: LayerGraph, spec: HardwareSpec, batch_size: int, seq_len: int, options: PlanOptions) -> Schedule:
    """The evaluation schedule for a batch shape, verified: the training plan's micro-batches and weight slots
    (where those are "auto": the fewest micro-batches of at most search.MAX_MB_TOKENS tokens, 2 slots), every
    checkpoint on the device (an evaluation keeps none beyond the next layer), the MLPs over tiles for micro-batches
    longer than a tile (without autograd a tile costs no recompute)."""
    n_mb = options.n_mb
    if n_mb == "auto":  # (one sequence a micro-batch at the most)
        n_mb = next(m for m in range(1, batch_size + 1)
                    if batch_size % m == 0 and (m == batch_size or batch_size // m * seq_len <= MAX_MB_TOKENS))
    if batch_size % n_mb:
        raise ValueError(f"batch of {batch_size} sequences cannot be split into {n_mb} micro-batches")
    slots = {"all": len(graph), "auto": 2}.get(options.weight_slots, options.weight_slots)
    cfg = ScheduleConfig(n_layers=len(graph), n_mb=n_mb, mb_tokens=batch_size // n_mb * seq_len, seq_len=seq_len,
                         weight_slots=slots, wire_bytes_per_param=2 if options.wire == "bf16" else 4, clip=False,
                         budget_bytes=spec.budget_bytes, train=False,
                         gemm_workspace_bytes=gemm_workspace_nbytes(spec, train=False),
                         seq_tile=min(SEQ_TILES) if options.seq_tile == "auto" else options.seq_tile)
    s = build_schedule(graph, cfg)
    verify(s, graph, spec)
    return s
