"""What a plan request can fit and what is said where it cannot: the request checked before any search (the device
memory one layer needs, the host memory the store needs), the one line of a refusal naming the limit, and how many
blocks of a shape a host holds with a plan's placements."""

from __future__ import annotations

import math
import re
from dataclasses import replace

from megatrain.ir import LayerGraph, Op, OpKind, Schedule, ScheduleConfig, Stream, Timeline
from megatrain.layout import STORE_BYTES_PER_PARAM, fmt_bytes, store_bytes
from megatrain.planner.checks import NoFit, PlanError
from megatrain.planner.choices import tile_choices
from megatrain.planner.cost import (COMPUTE_BYTES, OPT_SLOT_BYTES, checkpoint_nbytes, gemm_workspace_nbytes,
                                    host_memory, slot_nbytes, workspace_nbytes)
from megatrain.planner.hardware import HardwareSpec

GiB = 1 << 30
_FROZEN_NOTE = "; 4 B in frozen layers"

def gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def margin_note(spec: HardwareSpec) -> str:
    """``, of which a plan leaves X free`` where the spec keeps a host margin, else nothing."""
    return f", of which a plan leaves {gib(spec.host_margin)} free" if spec.host_margin else ""


def min_device_nbytes(graph: LayerGraph, cfg: ScheduleConfig) -> int:
    """What any schedule with ``cfg`` needs at least: a weight and a gradient slot for the largest layer, the
    other slots for the smallest (with a slot for every layer, each layer's weights at once, held from its forward
    to its backward), one mb's activations in and out or, where more, the checkpoints the device keeps at the end of
    the forward (every micro-batch's, of each block whose checkpoint is not on the host), the largest working set,
    the new weights every device update keeps, and an optimizer slot of its own for each layer whose state stays
    on the device (or the largest optimizer slot, where that is more). Cheap: no schedule is built, so the search
    refuses with it first."""
    size = slot_nbytes(graph, cfg)
    kept = sum(graph[l].params for l in cfg.gpu_opt) * COMPUTE_BYTES
    opt = max(sum(graph[l].params for l in cfg.resident_opt) * OPT_SLOT_BYTES, size["o"])
    smallest = min(graph.weight_params(i) for i in range(len(graph)))
    last = len(graph) - 1  # the head runs the LOSS, the layers before it FWD and BWD
    work = max(workspace_nbytes(graph, cfg, Op(0, k, Stream.COMPUTE, 0, l, 0))
               for l in range(len(graph)) for k in ((OpKind.LOSS,) if l == last else (OpKind.FWD, OpKind.BWD)))
    owners = len({graph.owner(l) for l in range(len(graph))})  # (a tied head loads its owner's weights)
    others = (min(cfg.weight_slots, owners) - 1) * cfg.wire_bytes_per_param + (cfg.grad_slots - 1) * 4
    weights = size["w"] + smallest * others
    if cfg.weight_slots >= owners:  # (the device-updated layers' weights: counted as kept)
        weights = max(weights, sum(graph.weight_params(o) for o in {graph.owner(l) for l in range(len(graph))}
                                   if o not in cfg.gpu_opt) * cfg.wire_bytes_per_param)
    acts = 2 if len(graph) > 2 else 1  # a micro-batch's activations in and out (the head reads the embedding's alone)
    acts = max(acts, sum(not cfg.dropped(l) for l in range(cfg.host_checkpoints + 1, len(graph) - 1)) * cfg.n_mb)
    return weights + size["g"] + acts * size["a"] + work + cfg.gemm_workspace_bytes + kept + opt


def check_request(graph: LayerGraph, spec: HardwareSpec, tokens: int, seq_len: int, budget: int) -> None:
    if seq_len <= 0 or tokens <= 0:
        raise PlanError(f"tokens per step ({tokens}) and sequence length ({seq_len}) must be positive")
    if tokens % seq_len:
        raise PlanError(f"tokens per step ({tokens}) must be a multiple of the sequence length ({seq_len})")
    if budget > spec.gpu_bytes:
        raise PlanError(f"GPU budget {gib(budget)} exceeds the {spec.name}'s {gib(spec.gpu_bytes)}")
    host = store_bytes(graph)
    if host > spec.host_plan_bytes:
        raise PlanError(
            f"model does not fit host memory: {graph.n_params / 1e9:.2f}B parameters x {STORE_BYTES_PER_PARAM} B "
            f"(fp32 master, exp_avg, exp_avg_sq{_FROZEN_NOTE if any(l.frozen for l in graph.layers) else ''}) = "
            f"{gib(host)}, the {spec.name} host has {gib(spec.host_bytes)}{margin_note(spec)}")
    smallest = smallest_plan(graph, spec, tokens // seq_len, seq_len, budget)
    need = min_device_nbytes(graph, smallest)
    if need <= budget:
        return
    size = slot_nbytes(graph, smallest)
    big = max(range(len(graph)), key=lambda i: graph.weight_params(i))
    what = (f"the smallest plan (1 weight slot, 1 gradient slot, one {seq_len:,}-token sequence per micro-batch, "
            f"every checkpoint on host{f', MLPs over {smallest.seq_tile}-token tiles' if smallest.seq_tile else ''})")
    layer = (f"largest layer '{graph[big].name}': {graph.weight_params(big) / 1e6:.1f}M params = {gib(size['w'])} of "
             f"bf16 weights + {gib(size['g'])} of fp32 gradients"
             f"{f', cuBLAS workspaces {gib(smallest.gemm_workspace_bytes)}' if smallest.gemm_workspace_bytes else ''}")
    fixed = size["w"] + size["g"] + smallest.gemm_workspace_bytes
    longest = longest_seq(lambda s: min_device_nbytes(graph, smallest_plan(graph, spec, 1, s, budget)) <= budget,
                          seq_len)
    if fixed > budget or not longest:
        raise PlanError(f"GPU budget {gib(budget)} is too small for one layer: {what} needs {gib(need)} ({layer})")
    raise NoFit(f"GPU budget {gib(budget)} is too small for one {seq_len:,}-token sequence: {what} needs "
                f"{gib(need)}, {gib(need - fixed)} of it the sequence's activations and working set ({layer}); "
                f"no sequence longer than {longest:,} tokens fits it", longest=longest, device=True)


def smallest_plan(graph: LayerGraph, spec: HardwareSpec, n_seqs: int, seq_len: int, budget: int) -> ScheduleConfig:
    """The config of the least device memory for ``n_seqs`` sequences of ``seq_len`` tokens a step: one weight and
    one gradient slot, bf16 on the wire, every checkpoint on the host, and the shortest MLP tile the search tries
    (:func:`~megatrain.planner.choices.tile_choices`): for a sequence shorter than ``LONG_SEQ`` only where one
    untiled does not fit ``budget``, which is where the search tries tiles for it."""
    cfg = ScheduleConfig(n_layers=len(graph), n_mb=n_seqs, mb_tokens=seq_len, seq_len=seq_len,
                         weight_slots=1, grad_slots=1, wire_bytes_per_param=2,
                         host_checkpoints=len(graph) - 2, budget_bytes=budget, seq_tile=0,
                         gemm_workspace_bytes=gemm_workspace_nbytes(spec))
    short = min_device_nbytes(graph, cfg) > budget
    return replace(cfg, seq_tile=min((t for t in tile_choices(seq_len, short) if t), default=0))


# sequence lengths suggested instead of one that does not fit: multiples of this many tokens where that long
SEQ_STEP = 1024


def longest_seq(fits, seq_len: int, below: int | None = None) -> int:
    """The longest multiple of :data:`SEQ_STEP` tokens shorter than ``seq_len`` (and than ``below``, a length known
    not to fit) for which ``fits(tokens)`` holds, by bisection (what a plan needs grows with the sequence); 0 where
    none does."""
    hi = -(-min(seq_len, below or seq_len) // SEQ_STEP)  # in steps: not fits(hi * SEQ_STEP)
    if hi <= 1 or not fits(SEQ_STEP):
        return 0
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * SEQ_STEP):
            lo = mid
        else:
            hi = mid
    return lo * SEQ_STEP


def margin_refusal(outcomes: list, chosen: Timeline, spec: HardwareSpec) -> str | None:
    """Where the fastest candidate was refused only for the host margin and is faster than the plan chosen: one
    sentence saying so (None otherwise)."""
    over = [o[3] for o in outcomes if o[3] is not None and not o[3][0]]  # (fp32 host gradients, as preferred)
    if not over:
        return None
    fastest = min(over)
    if fastest[1] >= chosen.steady_step_s * (1 - 1e-6):
        return None
    return (f"the fastest plan ({fastest[1]:.3f} s/step) needs {gib(fastest[-1])} of host memory, more than the "
            f"{gib(spec.host_plan_bytes)} a plan may take ({gib(spec.host_margin)} of the "
            f"{gib(spec.host_bytes)} left free for what no plan counts): the fastest that leaves it is taken, "
            f"{chosen.steady_step_s:.3f} s/step")


# what a candidate's host check says where what it holds whatever its gradients (store, shadow, checkpoints, the
# process's own) is more than the host has: host gradients in bf16 would not make it fit
FLOOR_NOTE = "before any gradient buffer"


def no_fit_error(reasons: list[str], spec: HardwareSpec, *, bf16_tried: bool, budget: int | None = None) -> NoFit:
    """Why no candidate fits, in one line: of the candidates that need more host memory than there is, the least
    any needs (and that bf16 host gradients need less, where they were not allowed and some candidate's gradient
    buffers were part of what did not fit); of those that need more device memory than the budget, the least any
    needs; then every other distinct reason. The error to raise (``device``: some candidate was over the budget)."""
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
        parts.append(f"host memory {min(host):.2f} GiB > {gib(spec.host_plan_bytes)} (the least any of {len(host)} "
                     f"candidate plans needs{hint}; the host has {gib(spec.host_bytes)}{margin_note(spec)})")
    if device:
        budget = spec.budget_bytes if budget is None else budget
        parts.append(f"device memory {min(device):.2f} GiB > budget {gib(budget)} (the least any of "
                     f"{len(device)} {'other ' if host else ''}candidate plans needs)")
    return NoFit("no plan fits: " + "; ".join(parts + sorted(other)), device=bool(device))


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
