"""plan(): refuse what cannot fit, then search the planner's decisions and keep the fastest schedule that verifies."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable

from megatrain.ir import Op, OpKind, Schedule, ScheduleConfig, Stream
from megatrain.layout import STORE_BYTES_PER_PARAM, fmt_bytes, store_bytes
from megatrain.planner import cost
from megatrain.planner.cost import (
    checkpoint_nbytes,
    device_memory,
    gemm_workspace_nbytes,
    host_floor,
    host_memory,
    slot_nbytes,
    workspace_nbytes,
)
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.passes import build_schedule, relabel_saved
from megatrain.planner.simulate import Bound, Timeline, bound, simulate
from megatrain.planner.verify import check_memory, verify

GiB = 1 << 30
MAX_MB_TOKENS = 16384  # beyond this a larger micro-batch buys no GEMM efficiency, only memory
MB_CHOICES = 4  # micro-batch sizes tried (the largest ones that fit the token limit)
# Share of the device memory a plan leaves free that saved activations may fill ("auto"): the rest stays for the
# caching allocator's rounding and fragmentation, which the byte counts of the cost model do not see
SAVED_FILL = 0.9


class PlanError(ValueError):
    """The request cannot be planned; the message names the limit and the numbers."""


@dataclass
class Plan:
    schedule: Schedule
    timeline: Timeline
    bound: Bound
    graph: LayerGraph
    spec: HardwareSpec
    tokens: int
    tried: list[tuple[ScheduleConfig, str]] = field(default_factory=list)  # every candidate and its outcome
    margin_taken: str | None = None  # where a faster plan was refused for the host margin alone: in words

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.timeline.steady_step_s


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def margin_note(spec: HardwareSpec) -> str:
    """``, of which a plan leaves X free`` where the spec keeps a host margin, else nothing."""
    return f", of which a plan leaves {_gib(spec.host_margin)} free" if spec.host_margin else ""


def _min_device_nbytes(graph: LayerGraph, cfg: ScheduleConfig) -> int:
    """What any schedule with ``cfg`` needs at least: a weight and a gradient slot for the largest layer, the
    other slots for the smallest, one mb's activations in and out, and the largest working set."""
    size = slot_nbytes(graph, cfg)
    smallest = min(graph.weight_params(i) for i in range(len(graph)))
    last = len(graph) - 1  # the head runs the LOSS, the layers before it FWD and BWD
    work = max(workspace_nbytes(graph, cfg, Op(0, k, Stream.COMPUTE, 0, l, 0))
               for l in range(len(graph)) for k in ((OpKind.LOSS,) if l == last else (OpKind.FWD, OpKind.BWD)))
    others = (cfg.weight_slots - 1) * cfg.wire_bytes_per_param + (cfg.grad_slots - 1) * 4
    return size["w"] + size["g"] + smallest * others + 2 * size["a"] + work + cfg.gemm_workspace_bytes


def _check_request(graph: LayerGraph, spec: HardwareSpec, tokens: int, seq_len: int, budget: int) -> None:
    if seq_len <= 0 or tokens <= 0:
        raise PlanError(f"tokens per step ({tokens}) and sequence length ({seq_len}) must be positive")
    if tokens % seq_len:
        raise PlanError(f"tokens per step ({tokens}) must be a multiple of the sequence length ({seq_len})")
    if budget > spec.gpu_bytes:
        raise PlanError(f"GPU budget {_gib(budget)} exceeds the {spec.name}'s {_gib(spec.gpu_bytes)}")
    host = store_bytes(graph)
    if host > spec.host_plan_bytes:
        raise PlanError(
            f"model does not fit host memory: {graph.n_params / 1e9:.2f}B parameters x {STORE_BYTES_PER_PARAM} B "
            f"(fp32 master, exp_avg, exp_avg_sq{_FROZEN_NOTE if any(l.frozen for l in graph.layers) else ''}) = "
            f"{_gib(host)}, the {spec.name} host has {_gib(spec.host_bytes)}{margin_note(spec)}")
    smallest = ScheduleConfig(n_layers=len(graph), n_mb=tokens // seq_len, mb_tokens=seq_len, seq_len=seq_len,
                              weight_slots=1, grad_slots=1, wire_bytes_per_param=2,
                              host_checkpoints=len(graph) - 2, budget_bytes=budget,
                              seq_tile=min((t for t in tile_choices(seq_len) if t), default=0),
                              gemm_workspace_bytes=gemm_workspace_nbytes(spec))
    need = _min_device_nbytes(graph, smallest)
    if need > budget:
        size = slot_nbytes(graph, smallest)
        big = max(range(len(graph)), key=lambda i: graph.weight_params(i))
        raise PlanError(
            f"GPU budget {_gib(budget)} is too small for one layer: the smallest plan (1 weight slot, 1 gradient "
            f"slot, one {seq_len}-token sequence per micro-batch, every checkpoint on host"
            f"{f', MLPs over {smallest.seq_tile}-token tiles' if smallest.seq_tile else ''}) needs {_gib(need)} "
            f"(largest layer '{graph[big].name}': {graph.weight_params(big) / 1e6:.1f}M params = "
            f"{_gib(size['w'])} of bf16 weights + {_gib(size['g'])} of fp32 gradients"
            f"{f', cuBLAS workspaces {_gib(smallest.gemm_workspace_bytes)}' if smallest.gemm_workspace_bytes else ''})")


def candidates(graph: LayerGraph, tokens: int, seq_len: int, budget: int, *, clip: bool, n_steps: int,
               n_mb: int | None = None, weight_slots: int | str | None = None, wire_bytes: int | None = None,
               host_checkpoints: int | None = None, gpu_opt_every: int | None = 0,
               resident_opt: int | None = None, grad_slots: int | None = None,
               grad_host_dtype: str = "fp32", seq_tile: int | None = None) -> list[ScheduleConfig]:
    """Every combination of decisions the search tries; a fixed value pins a decision. ``gpu_opt_every``: every
    k-th layer that owns its weights is updated on the device (0: none, the default until measured on the
    GPU; None: search none, every 4th, 3rd, 2nd, each also with the first such layer). ``resident_opt``: how many
    of the device updates keep their state on the device (see :func:`resident_sets`; None: search).
    ``grad_host_dtype``: "bf16" lets gradients go to the host in bf16 (each candidate also so; a plan with fp32
    gradients is preferred wherever one fits). ``seq_tile``: tokens per tile of the blocks' MLPs (0: untiled; None:
    untiled and, for micro-batches of :data:`LONG_SEQ` tokens or more, each of :data:`SEQ_TILES`).
    ``grad_slots``: gradient slots (None: 2, and 1 as well for sequences of :data:`LONG_SEQ` tokens, where a
    layer's backward takes seconds and a second slot hides little but costs the largest layer's fp32 gradient)."""
    n_seqs = tokens // seq_len
    if n_mb is not None:
        if n_mb <= 0 or n_seqs % n_mb:
            raise PlanError(f"{n_mb} micro-batches cannot split {n_seqs} sequences evenly")
        mbs = [n_mb]
    else:
        fit = [m for m in range(1, n_seqs + 1) if n_seqs % m == 0 and tokens // m <= max(MAX_MB_TOKENS, seq_len)]
        mbs = fit[:MB_CHOICES]
    if weight_slots == "all":
        weight_slots = len(graph)
    slots = [weight_slots] if weight_slots else [2, 3, len(graph)]  # len(graph): each layer loaded once a step
    wires = [wire_bytes] if wire_bytes else [2, 4]
    # checkpoints all on the device or all on the host; for long sequences (a checkpoint of GiBs a layer, which
    # neither memory may hold for every layer) also split between them after every block
    split = range(0, len(graph) - 1) if seq_len >= LONG_SEQ else ()
    offload = [host_checkpoints] if host_checkpoints is not None else sorted({0, len(graph) - 2, *split})
    if any(h < 0 or h > len(graph) - 2 for h in offload):
        raise PlanError(f"offloaded checkpoints must be between 0 and {len(graph) - 2} (layers 1..L-2)")
    if gpu_opt_every is not None and gpu_opt_every < 0:
        raise PlanError(f"gpu_opt_every must be >= 0 (0: every update on the host), got {gpu_opt_every}")
    check_resident(gpu_opt_every, resident_opt)
    device_sets = [(g, r) for g in device_update_sets(graph, gpu_opt_every)
                   for r in resident_sets(g, "auto" if resident_opt is None else resident_opt, clip)]
    if grad_host_dtype not in GRAD_HOST_BYTES:
        raise PlanError(f"grad_host_dtype must be 'fp32' or 'bf16', got {grad_host_dtype!r}")
    grads = [4] if grad_host_dtype == "fp32" else [4, 2]
    if seq_tile is not None and (not isinstance(seq_tile, int) or isinstance(seq_tile, bool) or seq_tile < 0):
        raise PlanError(f"seq_tile must be a number of tokens >= 0 (0: untiled), got {seq_tile!r}")

    def tiles(m: int) -> list[int]:  # searched for long micro-batches only: shorter ones fit untiled
        if seq_tile is not None:
            return [seq_tile]
        return tile_choices(tokens // m)

    if grad_slots is not None and (not isinstance(grad_slots, int) or isinstance(grad_slots, bool) or grad_slots < 1):
        raise PlanError(f"grad_slots must be an integer >= 1, got {grad_slots!r}")
    gslots = [grad_slots] if grad_slots is not None else [2, 1] if seq_len >= LONG_SEQ else [2]
    return [
        ScheduleConfig(n_layers=len(graph), n_steps=n_steps, n_mb=m, mb_tokens=tokens // m, seq_len=seq_len,
                       weight_slots=k, grad_slots=gs, wire_bytes_per_param=w, host_checkpoints=h, clip=clip,
                       budget_bytes=budget, gpu_opt=g, resident_opt=r, grad_host_bytes=b, seq_tile=t)
        for m, k, w, h, (g, r), b, gs in itertools.product(mbs, slots, wires, offload, device_sets, grads, gslots)
        for t in tiles(m)
    ]


# tile sizes (tokens) the search tries for the blocks' MLPs where a micro-batch is longer: a tiled backward runs the
# MLP's forward once more (4/3 of its untiled cost), so a tiled plan wins only where an untiled one does not fit
SEQ_TILES = (65536, 16384)
LONG_SEQ = 131072  # sequences from this long get checkpoint placements between all on the device and all on the host


def tile_choices(mb_tokens: int) -> list[int]:
    """The tile sizes the search tries for micro-batches of ``mb_tokens`` (0: untiled): the :data:`SEQ_TILES`
    shorter than the micro-batch once it holds :data:`LONG_SEQ` tokens or more; shorter ones fit untiled."""
    return [0, *(t for t in SEQ_TILES if t < mb_tokens)] if mb_tokens >= LONG_SEQ else [0]


GRAD_HOST_BYTES = {"fp32": 4, "bf16": 2}
_FROZEN_NOTE = "; 4 B in frozen layers"
# Share of the device memory a plan leaves free that gradients kept on the device until the update pass may take
# ("auto"): their slots are allocated once, in a few large blocks, so they need less room for the caching
# allocator than the activations, which fill what they leave (SAVED_FILL)
KEPT_FILL = 0.95


def grad_kept_eligible(graph: LayerGraph, cfg: ScheduleConfig) -> list[int]:
    """Layers whose gradient can stay on the device until the update pass (``ScheduleConfig.grad_kept``): updated
    on the host, owning their weights and sharing them with none; none without clipping (each update then follows
    its gradient)."""
    if not (cfg.clip and cfg.train):
        return []
    return [l for l in range(len(graph)) if graph[l].tie is None and not graph.tied_to(l) and l not in cfg.gpu_opt]


MAX_PARTS = 64  # parts a kept gradient passes through the host in, at most (ops per layer stay few)


def kept_config(graph: LayerGraph, cfg: ScheduleConfig, kept: tuple[int, ...]) -> ScheduleConfig:
    """``cfg`` with gradients ``kept`` on the device until the update pass, each passing through the host buffers
    in parts of :data:`cost.HOST_UPDATE_CHUNK` elements, or a multiple of it that cuts the largest into at most
    :data:`MAX_PARTS` (so a host buffer is one part, not the largest layer)."""
    if not kept:
        return replace(cfg, grad_kept=(), host_grad_part=0)
    chunk = cost.HOST_UPDATE_CHUNK
    largest = max(graph.weight_params(l) for l in kept)
    return replace(cfg, grad_kept=tuple(kept), host_grad_part=chunk * max(1, -(-largest // (chunk * MAX_PARTS))))


def with_grad_kept(graph: LayerGraph, cfg: ScheduleConfig, choice: int | str,
                   base: Schedule | None = None) -> ScheduleConfig:
    """``cfg`` with the layers whose gradient stays on the device until the update pass: the first ``choice`` of
    :func:`grad_kept_eligible`, or for "auto" as many as :data:`KEPT_FILL` of the device memory the plan without
    them leaves free holds, past any too large for what is left -- a gradient kept there is 4 bytes per parameter
    of host memory the plan does not need (the host buffers of kept gradients take turns). The layers whose
    update is split to the device come first, then the others in layer order: a split update's kept gradient
    never crosses the bus (4 bytes per parameter less each way, the h2d ones in the update pass), where a host
    update's only moves its trip from the backward into the update pass. Host memory is what bounds the model a
    machine can train, so kept gradients come before saved activations, which take what they leave. ``base``: the
    schedule of ``cfg`` without kept gradients and saved activations, where the caller has it."""
    able = grad_kept_eligible(graph, cfg)
    able = [l for l in able if l in cfg.split_opt] + [l for l in able if l not in cfg.split_opt]
    if choice != "auto":
        if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
            raise PlanError(f"grad_kept must be 'auto' or a count of layers >= 0, got {choice!r}")
        return kept_config(graph, cfg, tuple(sorted(able[:choice])))
    if not able:
        return cfg
    if base is None:
        base = build_schedule(graph, unsaved(kept_config(graph, cfg, ())))
    spare = (cfg.budget_bytes - device_memory(graph, base).total_nbytes) * KEPT_FILL
    out = []
    for l in able:
        need = graph.weight_params(l) * cfg.grad_host_bytes  # its kept-gradient slot
        if need > spare:  # a layer too large for what is left (an embedding): the next ones may still fit
            continue
        spare -= need
        out.append(l)
    return kept_config(graph, cfg, tuple(sorted(out)))


def check_resident(gpu_opt_every: int | str | None, resident_opt: int | str | None) -> None:
    """Refuse a count of kept states where no layer is updated on the device (None or "auto": search)."""
    if gpu_opt_every == 0 and resident_opt not in (None, "auto", 0):
        raise PlanError(f"resident_opt={resident_opt} keeps the state of layers updated on the GPU there, but "
                        f"gpu_opt_every=0 updates every layer on the host: set gpu_opt_every too")


def resident_sets(gpu_opt: tuple[int, ...], choice: int | str, clip: bool) -> list[tuple[int, ...]]:
    """Sets of device-updated layers whose master weights and moments stay on the device between steps
    (``ScheduleConfig.resident_opt``): the first ``choice`` of ``gpu_opt`` (all of them where there are fewer), or
    for "auto" all of them with clipping, else none, the first half and all. Each saves the layer's state its trip
    over the bus both ways every step; with clipping that costs no device memory (every device update holds a
    slot of its own from the forward, where its state loads, to the end of the step anyway: the simulated peak is
    the same), without, a slot per resident layer where two would be shared."""
    if choice == "auto":
        return [gpu_opt] if clip else sorted({(), gpu_opt[: len(gpu_opt) // 2], gpu_opt})
    if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
        raise PlanError(f"resident_opt must be a count >= 0 of device-updated layers or 'auto', got {choice!r}")
    return [gpu_opt[:choice]]


def device_update_sets(graph: LayerGraph, every: int | None) -> list[tuple[int, ...]]:
    """Sets of layers to update on the device: every ``every``-th layer that owns its weights (a tied head goes with
    its owner) (0: none), or for None the candidates a search tries — none, every 4th, 3rd, 2nd, each also with the
    first such layer (with clipping the next step's forward waits on that one's update first), all of them, and
    the first 2, 4, 6, ... of them (with clipping the next forward then runs through layers whose weights are
    already on the device while the host updates the later ones: the fastest set when not every layer's state
    fits, e.g. the first 20 of 31 for Qwen2.5-7B at 32,768 tokens on the H200)."""
    eligible = [l for l in range(len(graph)) if graph[l].tie is None and len(graph.tied_to(l)) <= 1
                and not graph[l].frozen]  # (a frozen layer has nothing to update, and no moments to stream)
    if every is not None:
        return [tuple(eligible[every - 1::every]) if every else ()]
    sets = {()}
    for k in (4, 3, 2, 1):
        each = tuple(eligible[k - 1::k])
        sets |= {each, tuple(sorted({*each, *eligible[:1]}))}
    sets |= {tuple(eligible[:m]) for m in range(2, len(eligible), 2)}
    return sorted(sets)


def unsaved(cfg: ScheduleConfig) -> ScheduleConfig:
    """``cfg`` with no saved activations: the config whose schedule has the same ops as ``cfg``'s (see
    :func:`~megatrain.planner.passes.relabel_saved`) and the device memory before any are kept."""
    return replace(cfg, saved_acts=(), saved_lean=False)


def saved_act_layers(graph: LayerGraph, cfg: ScheduleConfig, choice: int | str,
                     base: Schedule | None = None) -> tuple[int, ...]:
    """The layers whose forward keeps its activations for the backward (``ScheduleConfig.saved_acts``): the last
    ``choice`` layers that can, or for "auto" as many as fit in :data:`SAVED_FILL` of the device memory the plan
    without them leaves free. From the last layer back: its activations live the shortest (its backward comes
    first), and every layer saved is one recompute less, whichever it is. A layer whose checkpoint goes to the
    host cannot: what it saves holds its input on the device anyway. ``base``: the schedule of
    :func:`unsaved` ``(cfg)`` where the caller has it (built here otherwise)."""
    able = [l for l in range(cfg.host_checkpoints + 1, len(graph) - 1) if graph[l].saved_bytes_per_token > 0]
    if choice != "auto":
        if not isinstance(choice, int) or isinstance(choice, bool) or not 0 <= choice <= len(able):
            raise PlanError(f"saved_acts must be 'auto' or a count of layers from 0 to {len(able)} (the layers "
                            f"whose activations can be kept, with {cfg.host_checkpoints} checkpoints on the host), "
                            f"got {choice!r}")
        return tuple(able[len(able) - choice:]) if choice else ()
    if base is None:
        base = build_schedule(graph, unsaved(cfg))
    spare = (cfg.budget_bytes - device_memory(graph, relabel_saved(base, unsaved(cfg))).total_nbytes) * SAVED_FILL
    out = []
    for l in reversed(able):
        need = graph[l].saved_bytes(cfg.saved_lean) * cfg.mb_tokens * cfg.n_mb
        if need > spare:
            break
        spare -= need
        out.append(l)
    return tuple(sorted(out))


def with_saved_acts(graph: LayerGraph, cfg: ScheduleConfig, choice: int | str,
                    base: Schedule | None = None) -> ScheduleConfig:
    """``cfg`` with its saved layers (:func:`saved_act_layers`) and whether they keep less
    (``ScheduleConfig.saved_lean``). Lean costs an elementwise pass per saved layer and buys memory, so it is
    chosen only where the memory buys something: for "auto" when it keeps more layers than keeping everything
    would, for a count when keeping everything in that many layers does not fit the budget. ``base``: the schedule
    of :func:`unsaved` ``(cfg)`` where the caller has it (built here otherwise, once)."""
    if base is None and choice == "auto":  # built once for both fillings below (a count needs it only to check fit)
        base = build_schedule(graph, unsaved(cfg))
    full = replace(cfg, saved_lean=False)
    full = replace(full, saved_acts=saved_act_layers(graph, full, choice, base))
    if choice == 0 or all(lay.saved_bytes(True) == lay.saved_bytes_per_token for lay in graph.layers):
        return full
    lean = replace(cfg, saved_lean=True)
    lean = replace(lean, saved_acts=saved_act_layers(graph, lean, choice, base))
    if choice == "auto":
        return lean if len(lean.saved_acts) > len(full.saved_acts) else full
    full_schedule = build_schedule(graph, full) if base is None else relabel_saved(base, full)
    fits = device_memory(graph, full_schedule).total_nbytes <= cfg.budget_bytes
    return full if fits else lean


def choose_grad_kept(graph: LayerGraph, cfg: ScheduleConfig, choice: int | str) -> Schedule:
    """The schedule of ``cfg`` (without saved activations) with its kept gradients chosen by
    :func:`with_grad_kept`; for "auto", its estimate checked against the device budget with the slots the
    allocator gives them, and halved until it fits."""
    base = build_schedule(graph, unsaved(kept_config(graph, cfg, ())))
    kept = with_grad_kept(graph, cfg, choice, base).grad_kept
    while kept:
        with_kept = build_schedule(graph, unsaved(kept_config(graph, cfg, kept)))
        if choice != "auto" or device_memory(graph, with_kept).total_nbytes <= cfg.budget_bytes:
            return with_kept
        kept = kept[: len(kept) // 2]
    return base


def _try(graph: LayerGraph, spec: HardwareSpec, budget: int, saved_acts: int | str, grad_kept: int | str,
         cfg: ScheduleConfig) -> tuple[ScheduleConfig, str, tuple | None, tuple | None]:
    """One candidate of :func:`plan`: its config with the kept gradients and saved activations chosen, the outcome,
    its rank (None where it cannot run), and for a candidate refused only because it would take some of the host
    margin (``HardwareSpec.host_margin``), the rank it would have had (else None). Checks what is cheap first,
    builds the schedule (once, twice with kept gradients), checks it against the device budget and the host
    memory, and simulates it. Module level, so that worker processes can run it."""
    limit = spec.host_plan_bytes
    host = sum(host_floor(graph, cfg).values())
    if host > spec.host_bytes:
        return cfg, f"host memory {_gib(host)} > {_gib(limit)} {FLOOR_NOTE}", None, None
    need = _min_device_nbytes(graph, cfg)
    if need > budget:
        return cfg, f"device memory >= {_gib(need)} > budget {_gib(budget)}", None, None
    try:  # a count of kept gradients or saved layers this candidate cannot take
        base = choose_grad_kept(graph, cfg, grad_kept)  # its ops, for every choice of saved activations
        cfg = base.config
        host = sum(host_memory(graph, base).values())
        if host > spec.host_bytes:
            return cfg, f"host memory {_gib(host)} > {_gib(limit)}", None, None
        cfg = with_saved_acts(graph, cfg, saved_acts, base)
    except (PlanError, ValueError) as e:
        return cfg, str(e), None, None
    s = relabel_saved(base, cfg)
    try:
        check_memory(s, graph, spec)
    except ValueError as e:
        return cfg, str(e), None, None
    tl = simulate(s, graph, spec)
    # fp32 gradients wherever a plan with them fits (bf16 ones only where asked for and needed)
    key = (cfg.grad_host_bytes != 4, round(tl.steady_step_s, 6), tl.makespan_s, tl.reserved_nbytes, cfg.n_mb,
           cfg.weight_slots, host)
    if host > limit:
        return cfg, (f"host memory {_gib(host)} > {_gib(limit)} (of {_gib(spec.host_bytes)}, "
                     f"{_gib(spec.host_margin)} left free; {tl.step_s:.4f} s/step)"), None, key
    return cfg, f"{tl.step_s:.4f} s/step", key, None


# Plans whose simulated steady step is within this share of the fastest one's count as equally fast; among them the
# one needing the least host memory is taken (host memory is what bounds the model a machine trains, and a plan
# that leaves it free leaves room for the rest of the process)
HOST_LEAN_SLACK = 0.01


def rank(keys: list[tuple | None]) -> list[int]:
    """Indices of the runnable candidates (their :func:`_try` key not None), best first: the fastest by simulated
    steady-state step, except that among those within :data:`HOST_LEAN_SLACK` of it (with the same gradient dtype
    on the host) the one needing the least host memory comes first."""
    able = [(key, i) for i, key in enumerate(keys) if key is not None]
    if not able:
        return []
    best = min(able)[0]

    def order(item):
        key, i = item
        near = key[0] == best[0] and key[1] <= best[1] * (1 + HOST_LEAN_SLACK)
        return (not near, key[-1] if near else 0, key, i)

    return [i for _, i in sorted(able, key=order)]


# elements of one part of a split update's state (ScheduleConfig.opt_part): an optimizer slot of 512 MiB; a part
# loads in ~10 ms on the H200's PCIe, so the update pass's first device update starts that soon after the norm
SPLIT_PART = 1 << 25
# candidates of plan() that get split updates tried (the fastest ones without them)
SPLIT_TRIED = 3


def split_eligible(graph: LayerGraph, cfg: ScheduleConfig) -> list[int]:
    """Layers a split update can take (``ScheduleConfig.split_opt``): updated on the host, owning their weights and
    sharing them with none, with parameters to train; none without clipping."""
    return [l for l in grad_kept_eligible(graph, cfg) if not graph[l].frozen]


def split_sets(graph: LayerGraph, cfg: ScheduleConfig, choice: int | str) -> list[tuple[int, ...]]:
    """Sets of layers whose update is split to the device: ``choice`` of :func:`split_eligible` spread evenly over
    them (the next forward then finds every few layers one the device updated), or for "auto" a quarter, a third,
    half, two thirds and three quarters of them (the host and the PCIe link share the update pass; which share is
    fastest depends on their rates and what else the link carries; :func:`plan` then tries the counts next to the
    fastest of these)."""
    able = split_eligible(graph, cfg)
    if choice != "auto":
        if not isinstance(choice, int) or isinstance(choice, bool) or choice < 0:
            raise PlanError(f"split_opt must be 'auto' or a count of layers >= 0, got {choice!r}")
        if choice > len(able):
            raise PlanError(f"split_opt={choice}: only {len(able)} layers can have their update split to the device "
                            f"(updated on the host, owning their weights, untied, trained, with clipping)")
        counts = [choice]
    else:
        counts = sorted({round(len(able) * f) for f in (1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4)} - {0})
    return [spread(able, n) for n in counts]


def spread(able: list[int], n: int) -> tuple[int, ...]:
    """``n`` of the layers ``able`` spread evenly over them."""
    return tuple(able[int((i + 0.5) * len(able) / n)] for i in range(n))


def with_split(graph: LayerGraph, cfg: ScheduleConfig, layers: tuple[int, ...], part: int | None) -> ScheduleConfig:
    """``cfg`` with the updates of ``layers`` split to the device, their state streamed in parts of ``part``
    elements (None: :data:`SPLIT_PART`)."""
    return replace(cfg, split_opt=layers, opt_part=(SPLIT_PART if part is None else part) if layers else 0)


def _refine_split(graph: LayerGraph, outcomes: list, split: list[tuple[ScheduleConfig, tuple[int, ...]]],
                  opt_part: int | None, run: Callable[[list[ScheduleConfig]], list]) -> list:
    """The outcomes of split counts next to the fastest one :func:`plan` tried (``split``: the candidate and split set
    of each of its last ``len(split)`` outcomes), one layer more and one fewer at a time while that is faster:
    the share of the update pass the host and the link each take best lies anywhere between the shares
    :func:`split_sets` tries (on a host with a slower AdamW one or two split layers more simulate 2-3% faster
    on the 7B shape at 24 GiB)."""
    first = len(outcomes) - len(split)
    at = {first + i: (c, len(layers)) for i, (c, layers) in enumerate(split)}  # outcome index -> (candidate, count)
    found: list = []
    while True:
        order = rank([o[2] for o in outcomes + found])
        if not order or order[0] not in at:  # the fastest plan splits nothing (or is not one of these)
            return found
        c, n = at[order[0]]
        able = split_eligible(graph, c)
        more = [k for k in (n - 1, n + 1) if 1 <= k <= len(able) and (c, k) not in at.values()]
        if not more:
            return found
        at.update({len(outcomes) + len(found) + i: (c, k) for i, k in enumerate(more)})
        found += run([with_split(graph, c, spread(able, k), opt_part) for k in more])


def plan(graph: LayerGraph, spec: HardwareSpec, tokens: int, seq_len: int, *, budget_bytes: int | None = None,
         clip: bool = True, n_steps: int = 3, saved_acts: int | str = "auto", grad_kept: int | str = "auto",
         split_opt: int | str = 0, opt_part: int | None = None, workers: int = 1,
         progress: Callable[[int, int], None] | None = None, **fixed) -> Plan:
    """The fastest schedule (by simulated steady-state step time, the leanest on host memory among those within
    :data:`HOST_LEAN_SLACK` of it, then time over ``n_steps`` steps, then the order of :func:`candidates`) among :func:`candidates` that verifies and fits the device budget and the host,
    each with the saved activations ``saved_acts`` chooses (see :func:`saved_act_layers`). Raises
    :class:`PlanError` before building anything when nothing can fit.

    Each candidate is built once, checked against the memory budget and simulated (:func:`_try`); the full
    verification then runs on the fastest, and on the next where one fails it. ``workers`` > 1 spreads the
    candidates over that many processes (the answer is the same); ``progress(done, total)`` is called as they
    finish."""
    budget = spec.budget_bytes if budget_bytes is None else int(budget_bytes)
    _check_request(graph, spec, tokens, seq_len, budget)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise PlanError(f"workers must be a positive integer, got {workers!r}")
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise PlanError(f"steps to simulate must be a positive integer, got {n_steps!r}")
    gemm = gemm_workspace_nbytes(spec)
    configs = [replace(c, gemm_workspace_bytes=gemm)
               for c in candidates(graph, tokens, seq_len, budget, clip=clip, n_steps=n_steps, **fixed)]
    if saved_acts != "auto" and configs:  # a count no plan can keep, even with every checkpoint on the device
        saved_act_layers(graph, replace(configs[0], host_checkpoints=0), saved_acts)
    if grad_kept != "auto" and (not isinstance(grad_kept, int) or isinstance(grad_kept, bool) or grad_kept < 0):
        raise PlanError(f"grad_kept must be 'auto' or a count of layers >= 0, got {grad_kept!r}")
    if opt_part is not None and (not isinstance(opt_part, int) or isinstance(opt_part, bool) or opt_part < 1):
        raise PlanError(f"opt_part must be a number of elements >= 1, got {opt_part!r}")
    if split_opt not in (0, "auto") and configs:  # a fixed count: every candidate splits that many
        if not clip:
            raise PlanError(f"split_opt={split_opt} splits the update pass after the backward, which needs "
                            f"clipping (without it each update follows its gradient)")
        able = []
        for c in configs:  # (a candidate whose device updates leave fewer layers to split is left out)
            try:
                able.append(with_split(graph, c, split_sets(graph, c, split_opt)[0], opt_part))
            except PlanError as e:
                refused = e
        if not able:
            raise refused
        configs = able
    job = functools.partial(_try, graph, spec, budget, saved_acts, grad_kept)
    outcomes = []
    with contextlib.ExitStack() as stack:
        run = map  # in the order of the configs either way
        if workers > 1 and len(configs) > 1:
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(configs))))
            run = lambda f, cs: pool.map(f, cs, chunksize=max(1, len(cs) // (8 * workers)))  # noqa: E731
        for out in run(job, configs):
            outcomes.append(out)
            if progress is not None:
                progress(len(outcomes), len(configs))
        if split_opt == "auto" and clip:  # the fastest few again, a share of their host updates split to the device
            best = [configs[i] for i in rank([o[2] for o in outcomes])[:SPLIT_TRIED]]
            split = [(c, layers) for c in best for layers in split_sets(graph, c, "auto")]
            outcomes += run(job, [with_split(graph, c, layers, opt_part) for c, layers in split])
            outcomes += _refine_split(graph, outcomes, split, opt_part, lambda cs: list(run(job, cs)))
    tried: list[tuple[ScheduleConfig, str]] = [(o[0], o[1]) for o in outcomes]
    for i in rank([o[2] for o in outcomes]):
        cfg = outcomes[i][0]
        s = build_schedule(graph, cfg)
        try:
            verify(s, graph, spec)
        except ValueError as e:
            tried[i] = (cfg, str(e))
            continue
        tl = simulate(s, graph, spec)
        return Plan(s, tl, bound(s, graph, spec), graph, spec, tokens, tried, _margin_taken(outcomes, tl, spec))
    raise PlanError(no_fit_message([why for _, why in tried], spec, budget=budget,
                                   bf16_tried=fixed.get("grad_host_dtype", "fp32") == "bf16"))


def _margin_taken(outcomes: list, chosen: Timeline, spec: HardwareSpec) -> str | None:
    """Where the fastest candidate was refused only for the host margin and is faster than the plan chosen: one
    sentence saying so (None otherwise)."""
    over = [o[3] for o in outcomes if o[3] is not None and not o[3][0]]  # (fp32 host gradients, as preferred)
    if not over:
        return None
    fastest = min(over)
    if fastest[1] >= chosen.steady_step_s * (1 - 1e-6):
        return None
    return (f"the fastest plan ({fastest[1]:.3f} s/step) needs {_gib(fastest[-1])} of host memory, more than the "
            f"{_gib(spec.host_plan_bytes)} a plan may take ({_gib(spec.host_margin)} of the "
            f"{_gib(spec.host_bytes)} left free for what no plan counts): the fastest that leaves it is taken, "
            f"{chosen.steady_step_s:.3f} s/step")


# what a candidate's host check says where what it holds whatever its gradients (store, shadow, checkpoints, the
# process's own) is more than the host has: host gradients in bf16 would not make it fit
FLOOR_NOTE = "before any gradient buffer"


def no_fit_message(reasons: list[str], spec: HardwareSpec, *, bf16_tried: bool, budget: int | None = None) -> str:
    """Why no candidate fits, in one line: of the candidates that need more host memory than there is, the least
    any needs (and that bf16 host gradients need less, where they were not allowed and some candidate's gradient
    buffers were part of what did not fit); of those that need more device memory than the budget, the least any
    needs; then every other distinct reason."""
    host, device, other = [], [], set()
    grads_over = False  # some candidate over the host with its gradient buffers counted
    for why in reasons:
        if m := re.match(r"host memory ([\d.]+) GiB > ", why):
            host.append(float(m.group(1)))
            grads_over = grads_over or not why.endswith(FLOOR_NOTE)
        elif m := re.match(r"device memory >= ([\d.]+) GiB > |schedule rule 'memory' broken: needs ([\d.]+) GiB on "
                           r"the device", why):
            device.append(float(m.group(1) or m.group(2)))
        else:
            other.add(why)
    parts = []
    if host:
        if not grads_over:
            hint = (" before any gradient buffer: the store, the bf16 shadow where the weights travel in bf16, the "
                    "checkpoints it puts on the host and the process's own")
        elif not bf16_tried:
            hint = "; gradients on the host in bf16 (grad_host_dtype='bf16') need less"
        else:
            hint = ""
        parts.append(f"host memory {min(host):.2f} GiB > {_gib(spec.host_plan_bytes)} (the least any of {len(host)} "
                     f"candidate plans needs{hint}; the host has {_gib(spec.host_bytes)}{margin_note(spec)})")
    if device:
        budget = spec.budget_bytes if budget is None else budget
        parts.append(f"device memory {min(device):.2f} GiB > budget {_gib(budget)} (the least any of "
                     f"{len(device)} {'other ' if host else ''}candidate plans needs)")
    return "no plan fits: " + "; ".join(parts + sorted(other))


def largest_on_host(graph: LayerGraph, schedule: Schedule, host_bytes: int) -> str:
    """The largest model of ``graph``'s family (more or fewer blocks of the same shape) whose host memory fits
    ``host_bytes`` with this plan's placements, in words: each block more at the store's 12 bytes per parameter,
    the bf16 shadow where the wire carries it, and with clipping a host gradient buffer of its own (more blocks
    than the device holds gradients for send theirs to the host during the backward); the other layers and the
    turn-taking buffers as planned."""
    cfg = schedule.config
    blocks = [l for l in range(len(graph)) if graph[l].kind == "block" and graph[l].tie is None]
    if not blocks:
        return "no blocks to repeat"
    per_block = graph[blocks[-1]].params
    per_param = STORE_BYTES_PER_PARAM + (2 if cfg.wire_bytes_per_param == 2 else 0) + (
        cfg.grad_host_bytes if cfg.clip else 0)
    block_bytes = per_block * per_param
    offloads = cfg.host_checkpoints >= len(graph) - 2  # every checkpoint on the host: a block more, one more
    if offloads:
        block_bytes += checkpoint_nbytes(graph, cfg, blocks[-1]) * cfg.n_mb
    room = host_bytes - sum(host_memory(graph, schedule).values())
    extra = math.floor(room / block_bytes) if room >= 0 else -math.ceil(-room / block_bytes)
    n = max(0, len(blocks) + extra)
    total = graph.n_params + (n - len(blocks)) * per_block
    return (f"{n} blocks ({total / 1e9:.1f}B params) of this shape fit {fmt_bytes(host_bytes)} of host memory with "
            f"this plan's placements (each block more: {per_param} bytes per parameter on the host"
            + (", and its checkpoints" if offloads else "") + ")")
