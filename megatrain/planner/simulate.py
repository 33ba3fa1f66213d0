"""Event simulation of a schedule over its streams, and the roofline bound.

Queues run their ops in program order (a stream's own queue, and beside each GPU stream the split updates' queue, as
the stream issuer runs them: ``ir.queue_of``); an op starts when its queue is free and its dependencies and issue
predecessors are done. Compute and cpu ops take the cost model's seconds, transfers move their bytes, all fluid:
alone, a copy direction moves at its own rate; when both directions run, each is slowed so that together they stay
within the duplex rate; queues of one direction (or of the GPU's compute) share it; the host's AdamW slows while
copies run (they share the host's DRAM), and runs the deferred moments (``planner.moments``). A device update's
state moves a row at a time (``layout.OPT_STATE_ROWS``): its LOAD_OPT may start once the STORE_OPT it waits for has
stored the first row, and ends no earlier than that store. The steady step holds to ``planner.floor``'s floor."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatrain.ir import (QUEUES, SLOT_POOL, STREAM_ORDER, Op, OpKind, Queue, Schedule, ScheduleConfig, Stream,
                          Timeline, deferrable_opts, issue_preds, queue_of)
from megatrain.layout import OPT_STATE_ROWS, wire_stage_bytes
from megatrain.planner.cost import (COMPUTE_BYTES, POOLS, device_memory, duration_s, host_memory, saved_nbytes,
                                    slot_sizes, transfer_nbytes, workspace_nbytes)
from megatrain.planner.graph import LayerGraph
from megatrain.planner.floor import step_floor_s
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.moments import plan_moments

RESOURCES = ("compute", "h2d", "d2h", "pcie", "cpu")


@dataclass(frozen=True)
class Bound:
    """Lower bounds on the time of a schedule from its op costs.

    ``busy_s``: seconds each resource must work (pcie: both directions' bytes at the duplex rate);
    ``critical_path_s``: the longest chain through dependencies and stream order.
    """

    busy_s: dict[str, float]
    critical_path_s: float
    n_steps: int
    last_step_busy_s: dict[str, float] | None = None  # the last step's ops alone: a steady step's work
    # from the end of one step's last gradient to the end of the next one's: the work that must run between them on
    # each resource (what follows the first gradient and precedes the next backward: with clipping every update,
    # and the next forward), the busiest one's, plus the next backward; (seconds, that resource); None: one step
    chain: tuple[float, str] | None = None

    @property
    def per_step_busy_s(self) -> dict[str, float]:
        """Each resource's seconds in one steady step: the last step's ops (the first step of a schedule can do
        more, e.g. load weights that later steps find on the device), or the average for a one-step schedule."""
        if self.last_step_busy_s is not None and self.n_steps > 1:
            return self.last_step_busy_s
        return {r: v / self.n_steps for r, v in self.busy_s.items()}

    @property
    def roofline_s(self) -> float:
        """The busiest resource's seconds in a steady step."""
        return max(self.per_step_busy_s.values())

    @property
    def limiter(self) -> str:
        """The resource whose work bounds the step, or "backward+R" where the chain does (R: the resource busiest
        between the backwards)."""
        if self.chain is not None and self.chain[0] > self.roofline_s:
            return f"backward+{self.chain[1]}"
        busy = self.per_step_busy_s
        return max(busy, key=lambda r: busy[r])

    @property
    def step_s(self) -> float:
        """The roofline or the chain between two steps' backwards, the longer."""
        return max(self.roofline_s, self.chain[0] if self.chain is not None else 0.0)

    @property
    def makespan_s(self) -> float:
        return max(max(self.busy_s.values()), self.critical_path_s)


def compute_floor(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec, spare: int) -> float:
    """A floor under the compute of one step of ``cfg``, without its schedule: each micro-batch's forward through
    every layer, the loss, and every backward recomputing its forward but where activations kept in ``spare``
    device bytes would spare that (the most seconds saved per byte first, each layer's counted at its lean size
    and its whole saving, a part of a layer as that part): the search refuses a candidate whose floor is above
    the best step found so far before building it."""
    last = len(graph) - 1
    unsaved, saved = replace(cfg, saved_acts=()), replace(cfg, saved_acts=tuple(range(len(graph))), saved_lean=False)
    total, gains = 0.0, []
    for l in range(len(graph)):
        if l == last:
            total += duration_s(graph, cfg, spec, Op(0, OpKind.LOSS, Stream.COMPUTE, 0, l, 0))
            continue
        fwd, bwd = (Op(0, k, Stream.COMPUTE, 0, l, 0) for k in (OpKind.FWD, OpKind.BWD))
        total += duration_s(graph, unsaved, spec, fwd) * (1 + cfg.dropped(l + 1)) + \
            duration_s(graph, unsaved, spec, bwd)  # (a forward more where the checkpoint above is dropped: REFWD)
        if l > cfg.host_checkpoints and graph[l].saved_bytes_per_token > 0:
            gain = duration_s(graph, unsaved, spec, bwd) - duration_s(graph, saved, spec, bwd)
            gains.append((gain * cfg.n_mb, graph[l].saved_bytes(True) * cfg.mb_tokens * cfg.n_mb))
    total *= cfg.n_mb
    room = max(spare, 0)
    for gain, nbytes in sorted(gains, key=lambda g: -g[0] / max(g[1], 1)):
        part = 1.0 if nbytes <= room else room / nbytes
        total -= gain * part
        room -= nbytes * part
        if room <= 0:
            break
    return total


def same_state(load: Op, dep: Op) -> bool:
    """A LOAD_OPT's dependency on the STORE_OPT of the same layer's state (the step before's), which it may follow
    a row behind (``layout.OPT_STATE_ROWS``)."""
    return (load.kind is OpKind.LOAD_OPT and dep.kind is OpKind.STORE_OPT
            and (dep.layer, dep.mb) == (load.layer, load.mb))


def bound(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec) -> Bound:
    cfg = schedule.config
    busy = dict.fromkeys(RESOURCES, 0.0)
    last = dict.fromkeys(RESOURCES, 0.0)
    nbytes = last_nbytes = 0
    finish: list[float] = []
    begin: list[float] = []
    row = 1.0 / OPT_STATE_ROWS
    durations = []
    issued_after = issue_preds(schedule.ops)
    deferred = deferrable_opts(schedule)
    for op, implicit in zip(schedule.ops, issued_after):
        d = duration_s(graph, cfg, spec, op, deferred)
        durations.append(d)
        busy[op.stream.value] += d
        b = transfer_nbytes(graph, cfg, op, spec, deferred)
        nbytes += b
        if op.step == cfg.n_steps - 1:
            last[op.stream.value] += d
            last_nbytes += b
        rows = [x for x in op.deps if same_state(op, schedule.ops[x])]
        # a state load may start after the first row of the store it waits for (see simulate)
        preds = [begin[x] + row * (finish[x] - begin[x]) if x in rows else finish[x] for x in op.deps]
        preds += [finish[x] for x in implicit]
        begin.append(max(preds, default=0.0))
        finish.append(max([begin[-1] + d] + [finish[x] for x in rows]))
    busy["pcie"] = nbytes / spec.duplex_bytes_per_s
    last["pcie"] = last_nbytes / spec.duplex_bytes_per_s
    moments = plan_moments(schedule, graph, spec, deferred)  # the host's deferred moments
    busy["cpu"] += sum(secs for _, secs, _ in moments.tasks)
    last["cpu"] += moments.seconds(cfg.n_steps - 1)
    return Bound(busy, max(finish, default=0.0), cfg.n_steps, last,
                 _chain(schedule, graph, spec, durations, issued_after, deferred))


def _chain(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec, dur: list[float],
           issued_after: list[tuple[int, ...]], deferred: frozenset[int]) -> tuple[float, str] | None:
    """The shortest, over consecutive steps k, k+1, of: the work on the busiest resource among the ops that follow
    step k's last gradient op (BWD or NORM on the compute stream) and precede step k+1's first BWD, through
    dependencies and issue order, plus the busiest resource's work among the ops from that BWD to step k+1's last
    gradient op that follow the one and precede the other (its compute, or the weight loads it waits for where it
    reloads layers into freed slots). Each resource runs its ops one at a time at their modelled durations, and the
    two sets run in disjoint times, so no step's last gradient can follow the one before sooner.
    With exact clipping every update of step k is in that window (the next forward waits for them): the bound the
    roofline misses where the host update pass, not a resource's total, is what a step waits for. The host's
    updates count the share of the window's copies they lose to them (``spec.cpu_h2d_slowdown``,
    ``cpu_d2h_slowdown``). ``dur``: each op's modelled duration; ``issued_after``: :func:`~megatrain.ir.issue_preds`
    of the ops; ``deferred``: :func:`~megatrain.ir.deferrable_opts` of the schedule."""
    cfg, ops = schedule.config, schedule.ops
    if cfg.n_steps < 2 or not cfg.train:
        return None
    preds = [list(op.deps) + list(implicit) for op, implicit in zip(ops, issued_after)]  # ops are in an order
    # that respects both
    grads = [[op.id for op in ops if op.step == k and op.stream is Stream.COMPUTE
              and op.kind in (OpKind.BWD, OpKind.NORM)] for k in range(cfg.n_steps)]
    if not all(grads):
        return None

    def between(a: int, b: int) -> list[int]:
        """The ops from ``a`` to ``b`` (both included) that follow ``a`` and precede ``b`` through dependencies
        and issue order."""
        after = {a}
        for op in ops[a + 1: b + 1]:
            if any(p in after for p in preds[op.id]):
                after.add(op.id)
        before = {b}
        for i in range(b, a - 1, -1):
            if i in before:
                before.update(preds[i])
        return sorted(after & before)

    def busy_on(ids: list[int]) -> dict[str, float]:
        busy = dict.fromkeys(RESOURCES, 0.0)
        for i in ids:
            busy[ops[i].stream.value] += dur[i]
            busy["pcie"] += transfer_nbytes(graph, cfg, ops[i], spec, deferred) / spec.duplex_bytes_per_s
        return busy

    best, (a, b) = None, (spec.cpu_h2d_slowdown, spec.cpu_d2h_slowdown)  # (both at once: (1 - a)(1 - b) kept)
    for k in range(cfg.n_steps - 1):
        first, nxt = grads[k][-1], min(i for i in grads[k + 1] if ops[i].kind is OpKind.BWD)
        window = [i for i in between(first, nxt) if i not in (first, nxt)]
        busy = busy_on(window)
        h, d = (sum(dur[i] for i in window if ops[i].stream is s) for s in (Stream.H2D, Stream.D2H))
        slowed = a * h + b * d - a * b * min(h, d)  # the host updates' time lost to the window's copies
        if busy["cpu"]:  # each copy in the window slows the host's updates while they overlap, or adds its own
            busy["cpu"] += slowed  # time where they do not (the slowdowns are below 1)
        # the next backward: its compute, or the transfers that must run within it (the weights it loads back
        # once it has freed their slots), whichever is longer
        backward = max(busy_on(between(nxt, grads[k + 1][-1])).values())
        r = max(busy, key=lambda x: busy[x])
        if best is None or busy[r] + backward < best[0]:
            best = (busy[r] + backward, r)
    return best


def _copy_rates(spec: HardwareSpec) -> dict[Stream, float]:
    """Each copy direction's rate alone, bytes per second."""
    return {Stream.H2D: spec.h2d_bytes_per_s, Stream.D2H: spec.d2h_bytes_per_s}


def _rates(spec: HardwareSpec, running: list[Queue]) -> dict[Queue, float]:
    """Each running queue's rate: bytes per second for a transfer, seconds of work per second for the rest. The
    queues of one copy direction share its rate; when both directions run, each is slowed so that together they
    stay within the duplex rate; the compute queues share the GPU; the host's AdamW loses
    ``spec.cpu_h2d_slowdown`` (``cpu_d2h_slowdown``) of its rate per unit of the h2d (d2h) direction's full rate
    in use, where both run of what the other leaves it (as ``megatrain probe`` measured), and while it runs each
    copy direction loses ``spec.h2d_cpu_slowdown`` (``d2h_cpu_slowdown``) of its rate (DRAM shared)."""
    alone = _copy_rates(spec)
    count = {s: sum(1 for q in running if q[0] is s) for s in STREAM_ORDER}
    both = count[Stream.H2D] and count[Stream.D2H]
    scale = min(1.0, spec.duplex_bytes_per_s / (alone[Stream.H2D] + alone[Stream.D2H])) if both else 1.0
    use = {s: scale if count[s] else 0.0 for s in alone}  # each direction's share of its full rate in use
    host = {Stream.H2D: spec.h2d_cpu_slowdown, Stream.D2H: spec.d2h_cpu_slowdown} if count[Stream.CPU] else {}
    out = {}
    for q in running:
        if q[0] in alone:
            out[q] = alone[q[0]] * scale / count[q[0]] * (1.0 - host.get(q[0], 0.0))
        elif q[0] is Stream.CPU:
            out[q] = (1 - spec.cpu_h2d_slowdown * use[Stream.H2D]) * (1 - spec.cpu_d2h_slowdown * use[Stream.D2H])
        else:
            out[q] = 1.0 / count[q[0]]
    return out


class Slower(Exception):
    """:func:`simulate` stopped early: the schedule's steady step is certainly longer than its ``give_up_s``."""


def simulate(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec, *, curve: bool = True,
             give_up_s: float | None = None, steady_only: bool = False) -> Timeline:
    """The schedule's ops timed on ``spec`` (see the module's docstring); ``curve``: with the device memory over
    time (:func:`memory_curve`; without, ``Timeline.memory`` is empty: a search compares steps, not peaks).
    ``give_up_s``: raise :class:`Slower` as soon as the steady step (``Timeline.steady_step_s``, three steps or
    more) is known to exceed it: the first step has ended and the second-to-last is still running that long after.
    ``steady_only`` (three steps or more): stop once the first and the second-to-last steps have ended, which fixes
    the steady step; the timeline then holds the ops ended by then (its makespan is when the second-to-last step
    ended, its ``step_s`` no average over the steps)."""
    cfg = schedule.config
    ops = schedule.ops
    n = len(ops)
    watch = give_up_s is not None and cfg.n_steps >= 3
    steady_only = steady_only and cfg.n_steps >= 3
    if steady_only and curve:
        raise ValueError("a memory curve needs every op's times: simulate(steady_only=True) draws none")
    left = [0] * cfg.n_steps  # ops of each step not yet ended
    for op in ops:
        left[op.step] += 1
    first_end = 0.0  # when the first step ended (once it has)
    queue = [queue_of(op) for op in ops]
    queues: dict[Queue, list[Op]] = {q: [] for q in QUEUES}
    for op, q in zip(ops, queue):
        queues[q].append(op)
    # a split queue's op also waits for what its stream's own queue issued before it (issue_preds)
    across = [tuple(p for p in pp if queue[p] != queue[op.id]) for op, pp in zip(ops, issue_preds(ops, queue))]
    head = dict.fromkeys(QUEUES, 0)
    start = [0.0] * n
    end: list[float | None] = [None] * n
    active: dict[Queue, list] = {}  # queue -> [op, remaining, total]; units: bytes for transfers, seconds else
    alone = _copy_rates(spec)
    row = 1.0 / OPT_STATE_ROWS
    t = 0.0
    finished = 0

    def started_rows(load: Op, d: int) -> bool:  # a LOAD_OPT's dependency on its own layer's store of the step
        # before, whose first row is done (a store of another layer that reads the slot must end first)
        return same_state(load, ops[d]) and any(
            a[0].id == d and a[1] <= (1 - row) * a[2] * (1 + 1e-9) for q, a in active.items() if q[0] is Stream.D2H)

    known: dict[tuple, float] = {}  # an op's units by what they depend on: the steps repeat each other's ops
    deferred = deferrable_opts(schedule)
    moments = plan_moments(schedule, graph, spec, deferred)
    if watch and (floor := step_floor_s(schedule, graph, spec, deferred, moments)) > give_up_s:
        raise Slower(f"steady step at least {floor:.4f} s, a step's work on its busiest resource")
    pending, moments_end = list(range(len(moments.tasks))), {}  # (moments tasks not started; task -> its end)
    blocked: dict[Queue, int] = {}  # queue -> a dependency its next op was last found waiting for
    rates: dict[frozenset, dict[Queue, float]] = {}
    while finished < n:
        progress = True
        while progress:
            progress = False
            for q in QUEUES:
                k, secs, after = moments.tasks[pending[0]] if pending and q[0] is Stream.CPU and q not in active \
                    else (None, 0.0, ())
                if k is not None and all(end[d] is not None for d in after):  # the host's queue runs a moments
                    active[q], progress = [moments.pseudo_op(pending.pop(0)), secs, secs], True  # task (plan_moments)
                    continue
                if q in active or head[q] >= len(queues[q]):
                    continue
                op = queues[q][head[q]]
                g = moments.gate.get(op.id)
                if k is not None and op.step > k or g is not None and g not in moments_end:
                    continue  # (a later step's host op after the pass; a gated op after it ends)
                b = blocked.get(q)
                if b is not None and end[b] is None and op.kind is not OpKind.LOAD_OPT:
                    continue  # still waiting for it (a state load may also go on a store's first row)
                if op.kind is OpKind.LOAD_OPT:
                    b = next((d for d in op.deps if end[d] is None and not started_rows(op, d)), None)
                else:
                    b = next((d for d in op.deps if end[d] is None), None)
                if b is None:
                    b = next((d for d in across[op.id] if end[d] is None), None)
                if b is not None:
                    blocked[q] = b
                    continue
                blocked.pop(q, None)
                head[q] += 1
                start[op.id] = t
                # (what an op's cost reads: not its step)
                key = (op.kind, op.stream, op.layer, op.mb, op.slots, op.id in deferred)
                units = known.get(key)
                if units is None:
                    units = known[key] = transfer_nbytes(graph, cfg, op, spec, deferred) if q[0] in alone else \
                        duration_s(graph, cfg, spec, op, deferred)
                if units <= 0:
                    end[op.id] = t
                    finished += 1
                    left[op.step] -= 1
                else:
                    active[q] = [op, float(units), float(units)]
                progress = True
        if not active:
            if finished < n:
                raise AssertionError("simulation stalled with ops left (dependencies point forward?)")
            break
        waiting = {q for q, a in active.items() if a[1] <= 1e-12 * a[2]}  # a load done before its store
        running = frozenset(q for q in active if q not in waiting)
        rate = rates.get(running)
        if rate is None:  # (a queue's rate depends on which queues run alone: few sets recur all along)
            rate = rates[running] = _rates(spec, list(running))
        # next event: an op ends, or a state store finishes its first row (a load may be waiting for it); a load
        # done before its store waits for the store's end
        dt = min([a[1] / rate[q] for q, a in active.items() if q not in waiting]
                 + [(a[1] - (1 - row) * a[2]) / rate[q] for q, a in active.items()
                    if a[0].kind is OpKind.STORE_OPT and a[1] > (1 - row) * a[2] * (1 + 1e-9)])
        held = False  # a load done before its store is left in active below
        t += dt
        # (the second-to-last step ends at t or later while any of its ops is left, this event's included)
        if watch and not left[0]:
            if not first_end:
                first_end = max(e for op, e in zip(ops, end) if op.step == 0)
            if left[-2] and (t - first_end) / (cfg.n_steps - 2) > give_up_s:
                raise Slower(f"steady step over {give_up_s:.4f} s (stopped at {t:.4f} s)")
        for q in list(active):
            a = active[q]
            if q not in waiting:
                a[1] -= rate[q] * dt
            if a[1] <= 1e-12 * a[2] and a[0].id < 0:  # a moments task
                moments_end[-1 - a[0].id] = t
                del active[q]
            elif a[1] <= 1e-12 * a[2]:
                if a[0].kind is OpKind.LOAD_OPT and any(end[d] is None for d in a[0].deps
                                                        if same_state(a[0], ops[d])):
                    held = True
                    continue
                end[a[0].id] = t
                finished += 1
                left[a[0].step] -= 1
                del active[q]
        for q in list(active) if held else ():  # a load that waited for its store, which ended just now
            a = active[q]
            if a[1] <= 1e-12 * a[2] and all(end[d] is not None for d in a[0].deps):
                end[a[0].id] = t
                finished += 1
                left[a[0].step] -= 1
                del active[q]
        if steady_only and not left[0] and not left[-2]:
            break
    if finished < n:  # (steady_only) the ops ended so far
        kept = [i for i in range(n) if end[i] is not None]
        ops, start, end = [ops[i] for i in kept], [start[i] for i in kept], [end[i] for i in kept]
    end_s = [float(e) for e in end]
    mem = device_memory(graph, schedule)
    return Timeline(
        source="simulated", ops=ops, start_s=start, end_s=end_s,
        memory=memory_curve(schedule, graph, start, end_s) if curve else [],
        reserved_nbytes=mem.total_nbytes, host_nbytes=sum(host_memory(graph, schedule).values()), n_steps=cfg.n_steps,
        floor_s=floor if watch else step_floor_s(schedule, graph, spec, deferred, moments))


def memory_curve(schedule: Schedule, graph: LayerGraph, start: list[float], end: list[float]) -> list[tuple[float, int]]:
    """Device bytes in use over time: the weight, gradient, optimizer and kept-gradient pools throughout, as the
    runtime allocates them before the first op (``DeviceBuffers.fit``: weight slots in the compute dtype, and an
    fp32 wire's staging buffer), each activation slot from the start of the op that fills it to the end of the last
    op that reads that content (activations are tensors of their own), plus each compute op's working set while it
    runs, plus saved activations (see ``ScheduleConfig.saved_acts``) from their forward to their backward, on top of
    cuBLAS's workspaces (``ScheduleConfig.gemm_workspace_bytes``, held throughout)."""
    cfg = schedule.config
    size = slot_sizes(graph, schedule)
    events: list[tuple[float, int]] = []
    holder: dict[tuple[str, int], tuple[float, float]] = {}  # (pool, slot) -> (filled at, last read end)
    starters = {OpKind.LOAD_ACT: ("a",), OpKind.FWD: ("y",), OpKind.REFWD: ("y",)}
    held = sum(sum(size[p]) for p in POOLS if p not in "aw") + sum(size["w"]) * COMPUTE_BYTES // \
        cfg.wire_bytes_per_param + wire_stage_bytes(graph.largest_weights(), cfg.wire_bytes_per_param)
    events += [(0.0, held), (max(end, default=0.0), -held)]
    carry = sum(lay.carry_bytes_per_token for lay in graph.layers)
    for op in schedule.ops:
        fills = set(starters.get(op.kind, ()))
        for role, idx in op.slots:
            key = (SLOT_POOL[role], idx)
            if key[0] != "a":  # the held pools, and host gradient buffers (not device memory)
                continue
            if role in fills:
                if key in holder:  # the old content's last read may overlap the refill: one buffer, counted once
                    a, b = holder[key][0], min(holder[key][1], start[op.id])
                    events += [(a, size[key[0]][key[1]]), (b, -size[key[0]][key[1]])]
                holder[key] = (start[op.id], end[op.id])
            elif key in holder:
                holder[key] = (holder[key][0], max(holder[key][1], end[op.id]))
        w = workspace_nbytes(graph, cfg, op)
        if w:
            events += [(start[op.id], w), (end[op.id], -w)]
        saved = saved_nbytes(graph, cfg, op.layer)  # kept from the layer's forward to the end of its backward
        if saved and op.kind is OpKind.FWD:
            events.append((start[op.id], saved))
        elif saved and op.kind is OpKind.BWD:
            events.append((end[op.id], -saved))
        if carry and op.kind is OpKind.FWD:  # what blocks hand the next: a micro-batch's until its last backward
            events.append((start[op.id], graph[op.layer].carry_bytes_per_token * cfg.mb_tokens))
        elif carry and op.kind is OpKind.BWD and op.layer == 0:
            events.append((end[op.id], -carry * cfg.mb_tokens))
    for (pool, idx), (a, b) in holder.items():
        events += [(a, size[pool][idx]), (b, -size[pool][idx])]
    events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same instant
    cur = cfg.gemm_workspace_bytes
    curve = [(0.0, cur)]
    for t, d in events:
        cur += d
        if curve[-1][0] == t:
            curve[-1] = (t, cur)
        else:
            curve.append((t, cur))
    return curve
