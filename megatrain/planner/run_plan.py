"""The plan of a run, whole: what ``compile()`` executes, made in one place from one request (PlanOptions). A
training plan is the search's choice built as the one step every step runs, its set-up (what the steps find on the
device, loaded once), and the pairs a run issues back to back with what the second carries over from the first,
each verified; an evaluation plan is forwards and the loss for a batch shape."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from megatrain.ir import Schedule, ScheduleConfig, resident_slots
from megatrain.planner.carried import Carried, carried_deps, join
from megatrain.planner.cost import gemm_workspace_nbytes, host_memory
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.passes import build_schedule, setup_schedule, write_back_schedule
from megatrain.planner.request import PlanOptions
from megatrain.planner.choices import SEQ_TILES
from megatrain.planner.choices import MAX_MB_TOKENS
from megatrain.planner.search import plan
from megatrain.planner.verify import verify


@dataclass(frozen=True)
class RunPlan:
    setup: Schedule | None  # what the steps keep on the device, loaded before the first (None: nothing)
    step: Schedule  # the schedule every step runs
    pairs: tuple[tuple[Schedule, Schedule, Carried], ...]  # (first, second, what the second carries from the first)
    margin_taken: str | None  # where a faster plan was refused for the host margin alone: in words
    key: str = ""  # the request's (plan_key)
    from_cache: bool = False  # taken from a plan file (no search ran)
    # what takes the optimizer states the steps keep on the device (resident_opt) back to the host store before it
    # is read or saved, or before another plan runs (None: the steps keep none)
    write_back: Schedule | None = None
    speculation_left: str | None = None  # where the search left a window of updates before the norm out: in words

    def to_json(self) -> str:
        """What a plan file holds: the request's key and the step's config (all a later run needs to build the
        same plan without searching)."""
        return json.dumps({"key": self.key, "config": self.step.config.to_dict(), "margin_taken": self.margin_taken,
                           "speculation_left": self.speculation_left})


@functools.cache
def _code_digest() -> str:
    """A digest of the code that decides plans (the planner, the IR, the layout): a plan file made by other code
    is not taken."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*root.joinpath("planner").glob("*.py"), *root.joinpath("ir").glob("*.py"), root / "layout.py"]):
        h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return h.hexdigest()


def plan_key(graph: LayerGraph, spec: HardwareSpec, batch_size: int, seq_len: int, options: PlanOptions, *,
             clip: bool, on_gpu: bool) -> str:
    """What decides a training plan, as a digest: the layer graph, the hardware spec but its host memory (which
    the machine reports anew each time; a plan file's plan is checked against it instead), the batch shape,
    clipping, the search's arguments and the code's digest."""
    hw = {k: v for k, v in spec.to_dict().items() if k not in ("host_bytes", "host_margin_bytes")}
    what = {"graph": [graph.name, [dataclasses.asdict(lay) for lay in graph.layers]], "spec": hw,
            "batch": [batch_size, seq_len], "clip": clip, "search": options.search_kwargs(seq_len, on_gpu),
            "code": _code_digest()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()


def plan_run(graph: LayerGraph, spec: HardwareSpec, batch_size: int, seq_len: int, options: PlanOptions, *,
             clip: bool, on_gpu: bool, known: tuple[str, ...] = ()) -> RunPlan:
    """The training plan for steps of ``batch_size`` sequences of ``seq_len`` tokens: the search's fastest
    (:func:`megatrain.planner.search.plan`, the one ``megatrain plan`` runs) for ``options``, every schedule of it
    verified, and each pair a run issues back to back (the set-up then a step, a step then the next) verified as one
    schedule with its carried dependencies. ``known``: plan files' texts (:meth:`RunPlan.to_json`, an earlier run's):
    the plan of the one whose key is this request's is taken without a search where it fits this host's memory
    now; otherwise the search runs."""
    if options.n_mb != "auto" and batch_size % options.n_mb:
        raise ValueError(f"batch of {batch_size} sequences cannot be split into {options.n_mb} micro-batches")
    key = plan_key(graph, spec, batch_size, seq_len, options, clip=clip, on_gpu=on_gpu)
    for text in known:
        step = _known_step(text, key, graph, spec)
        if step is not None:
            d = json.loads(text)
            return _run_plan(graph, spec, step, d.get("margin_taken"), key, True, d.get("speculation_left"))
    found = plan(graph, spec, batch_size * seq_len, seq_len, clip=clip, n_steps=3,
                 **options.search_kwargs(seq_len, on_gpu))
    step = build_schedule(graph, replace(found.schedule.config, n_steps=1))
    return _run_plan(graph, spec, step, found.margin_taken, key, False, found.speculation_left)


def _known_step(known: str, key: str, graph: LayerGraph, spec: HardwareSpec) -> Schedule | None:
    """The step of a plan file's plan where it is this request's and fits the host now, else None."""
    try:
        d = json.loads(known)
        if d.get("key") != key:
            return None
        step = build_schedule(graph, replace(ScheduleConfig.from_dict(d["config"]), n_steps=1))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return step if sum(host_memory(graph, step).values()) <= spec.host_plan_bytes else None


def _run_plan(graph: LayerGraph, spec: HardwareSpec, step: Schedule, margin_taken: str | None, key: str,
              from_cache: bool, speculation_left: str | None = None) -> RunPlan:
    setup = setup_schedule(graph, step)
    for s in (setup, step):
        if s is not None:
            verify(s, graph, spec)
    pairs = []
    for prev in (setup, step) if setup is not None else (step,):
        carried = carried_deps(prev, step, graph)
        verify(join(prev, step, carried), graph)
        pairs.append((prev, step, carried))
    homes = resident_slots(step, graph.owner)
    write_back = write_back_schedule(graph, homes) if homes else None
    if write_back is not None:
        verify(write_back, graph)
    return RunPlan(setup, step, tuple(pairs), margin_taken, key, from_cache, write_back, speculation_left)


def plan_eval(graph: LayerGraph, spec: HardwareSpec, batch_size: int, seq_len: int, options: PlanOptions) -> Schedule:
    """The evaluation schedule for a batch shape, verified: the training plan's micro-batches and weight slots
    (where those are "auto": the fewest micro-batches of at most choices.MAX_MB_TOKENS tokens, 2 slots), every
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
