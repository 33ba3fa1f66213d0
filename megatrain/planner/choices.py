"""The decisions a candidate plan takes beyond its micro-batches and slots, each a pure function of the layer graph
and a config: MLP tiles for long micro-batches, which layers update on the device and keep their state there, which
keep their gradient there until the update pass, which keep their activations for the backward, and which have
their host update done on the device instead (split updates); and :func:`candidates`, the grid of micro-batches,
slots and placements they are taken on. :func:`megatrain.planner.search.plan` tries them."""

from __future__ import annotations

import itertools
from dataclasses import replace

from megatrain.ir import LayerGraph, Schedule, ScheduleConfig
from megatrain.ir.schedule import MAX_DROP_RUN, droppable, max_dropped
from megatrain.planner import cost
from megatrain.planner.checks import PlanError, handing_on
from megatrain.planner.cost import device_memory
from megatrain.planner.passes import build_schedule, relabel_saved

# Share of the device memory a plan leaves free that saved activations may fill ("auto"): the rest stays for the
# caching allocator's rounding and fragmentation, which the byte counts of the cost model do not see
SAVED_FILL = 0.9

# tile sizes (tokens) the search tries for the blocks' MLPs where a micro-batch is longer: a tiled backward runs the
# MLP's forward once more (4/3 of its untiled cost), so a tiled plan wins only where an untiled one does not fit
SEQ_TILES = (65536, 16384, 4096)
LONG_SEQ = 131072  # sequences from this long get checkpoint placements between all on the device and all on the host


def tile_choices(mb_tokens: int, short: bool = False) -> list[int]:
    """The tile sizes the search tries for micro-batches of ``mb_tokens`` (0: untiled): the :data:`SEQ_TILES`
    shorter than the micro-batch once it holds :data:`LONG_SEQ` tokens or more, or where ``short`` (an untiled
    sequence does not fit the budget, ``limits.smallest_plan``); shorter ones are left untiled."""
    return [0, *(t for t in SEQ_TILES if t < mb_tokens)] if mb_tokens >= LONG_SEQ or short else [0]


GRAD_HOST_BYTES = {"fp32": 4, "bf16": 2}
# Share of the device memory a plan leaves free that gradients kept on the device until the update pass may take
# ("auto"): their slots are allocated once, in a few large blocks, so they need less room for the caching
# allocator than the activations, which fill what they leave (SAVED_FILL)
KEPT_FILL = 0.95


def grad_kept_eligible(graph: LayerGraph, cfg: ScheduleConfig) -> list[int]:
    """Layers whose gradient can stay on the device until the update pass (``ScheduleConfig.grad_kept``): updated
    on the host (before the step's guard: not in ``speculate``), owning their weights and sharing them with none;
    none without clipping (each update then follows its gradient)."""
    if not (cfg.clip and cfg.train):
        return []
    return [l for l in range(len(graph)) if graph[l].tie is None and not graph.tied_to(l) and l not in cfg.gpu_opt
            and l not in cfg.speculate]


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
    able = [l for l in range(cfg.host_checkpoints + 1, len(graph) - 1)
            if graph[l].saved_bytes_per_token > 0 and not cfg.dropped(l)]
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




# elements of one part of a split update's state (ScheduleConfig.opt_part): an optimizer slot of 512 MiB; a part
# loads in ~10 ms on the H200's PCIe, so the update pass's first device update starts that soon after the norm
SPLIT_PART = 1 << 25
# candidates of plan() that get split updates tried (the fastest ones without them)
SPLIT_TRIED = 5


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


MAX_MB_TOKENS = 16384  # beyond this a larger micro-batch buys no GEMM efficiency, only memory
MB_CHOICES = 4  # micro-batch sizes tried (the largest ones that fit the token limit)


def candidates(graph: LayerGraph, tokens: int, seq_len: int, budget: int, *, clip: bool, n_steps: int,
               n_mb: int | None = None, weight_slots: int | str | None = None, wire_bytes: int | None = None,
               host_checkpoints: int | None = None, gpu_opt_every: int | None = 0,
               resident_opt: int | None = None, grad_slots: int | None = None,
               grad_host_dtype: str = "fp32", seq_tile: int | None = None,
               short_tiles: bool = False, dropped_checkpoints: int | None = None,
               dropping: bool = False) -> list[ScheduleConfig]:
    """Every combination of decisions the search tries; a fixed value pins a decision. ``gpu_opt_every``: every
    k-th layer that owns its weights is updated on the device (0: none, the default until measured on the
    GPU; None: search none, every 4th, 3rd, 2nd, each also with the first such layer). ``resident_opt``: how many
    of the device updates keep their state on the device (see :func:`resident_sets`; None: search).
    ``grad_host_dtype``: "bf16" lets gradients go to the host in bf16 (each candidate also so; a plan with fp32
    gradients is preferred wherever one fits). ``seq_tile``: tokens per tile of the blocks' MLPs (0: untiled; None:
    untiled and, for micro-batches of :data:`LONG_SEQ` tokens or more, each of :data:`SEQ_TILES` shorter than the
    micro-batch). ``grad_slots``: gradient slots (None: 2, and 1 as well for sequences of :data:`LONG_SEQ`
    tokens, where a layer's backward takes seconds and a second slot hides little but costs the largest layer's
    fp32 gradient). ``short_tiles``: shorter sequences get what those long ones do (tiles, checkpoints split
    between host and device, one gradient slot), for a budget that cannot hold one untiled
    (``limits.smallest_plan``). ``dropped_checkpoints``: checkpoints the forward drops and the backward makes
    again (``ScheduleConfig.dropped_checkpoints``; None: none, or where ``dropping``, each of
    :func:`drop_choices`: the search's round for sequences of :data:`LONG_SEQ` tokens or more that no plan keeping
    every checkpoint fits)."""
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
    long = seq_len >= LONG_SEQ or short_tiles  # (the regime of long sequences: see short_tiles)
    split = range(0, len(graph) - 1) if long else ()
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

    def tiles(m: int) -> list[int]:  # searched for long micro-batches, or where an untiled one cannot fit
        if seq_tile is not None:
            return [seq_tile]
        return tile_choices(tokens // m, short_tiles)

    if grad_slots is not None and (not isinstance(grad_slots, int) or isinstance(grad_slots, bool) or grad_slots < 1):
        raise PlanError(f"grad_slots must be an integer >= 1, got {grad_slots!r}")
    gslots = [grad_slots] if grad_slots is not None else [2, 1] if long else [2]
    drops = [dropped_checkpoints] if dropped_checkpoints is not None else drop_choices(graph) if dropping else [0]
    return [
        ScheduleConfig(n_layers=len(graph), n_steps=n_steps, n_mb=m, mb_tokens=tokens // m, seq_len=seq_len,
                       weight_slots=k, grad_slots=gs, wire_bytes_per_param=w, host_checkpoints=h, clip=clip,
                       budget_bytes=budget, gpu_opt=g, resident_opt=r, grad_host_bytes=b, seq_tile=t,
                       dropped_checkpoints=d)
        for m, k, w, h, (g, r), b, gs, d in itertools.product(mbs, slots, wires, offload, device_sets, grads, gslots,
                                                               drops)
        for t in tiles(m)
    ]


def drop_choices(graph: LayerGraph) -> list[int]:
    """The counts of dropped checkpoints the search tries where no plan keeping them all fits: a quarter, half,
    three quarters and all of every other one, and all that runs of 2 and 3 between kept ones drop
    (``ScheduleConfig.dropped``); none where blocks hand the next more than their output
    (``checks.check_dropped``)."""
    if handing_on(graph):
        return []
    n = droppable(len(graph))
    top = max_dropped(n, 1)
    return sorted({top * k // 4 for k in (1, 2, 3, 4)} | {max_dropped(n, r) for r in range(2, MAX_DROP_RUN + 1)}
                  - {0})
