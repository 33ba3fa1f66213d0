"""How the stream issuer orders a step after the steps issued before it, without a device-wide sync.

Within a step the schedule's dependencies order its ops. Across two steps issued back to back, the dependencies the
planner carries from one to the next (:func:`megatrain.planner.carried.carried_deps`, verified with the two steps
joined into one schedule) do: :class:`StepOrder` keeps what the step before left -- its ops' end events, its worker
tasks, the last event on each queue, the row events of its optimizer-state stores -- and turns each carried
dependency into a wait: on the event of the op it names; on the host for an optimizer task, or for the worker's
issue of a GPU op; row by row for a state load after the same layer's store (each row once that row is stored).
A step that follows one it has no verified dependencies on (an evaluation, another plan's step) is fenced: every
queue waits for every queue's last event of that step, and the host for its worker tasks. Every step also fences
the step before the one before it, so no wait reaches further back (free in steady state: each layer's weight load
of the step in between waited for that step's update of the layer).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

from megatrain.ir import SLOT_POOL, Op, OpKind, Schedule
from megatrain.ir import OUTLIVING_POOLS, Carried

Successions = dict[tuple[int, int], tuple[Schedule, Schedule, Carried]]  # (id(prev), id(next)) -> verified pair


@dataclass
class Issued:
    """Of one step, what the waits of a later step use."""
    schedule: Schedule
    events: dict = field(default_factory=dict)  # op id -> its end event (a GPU op the worker issues: once issued)
    futures: dict = field(default_factory=dict)  # op id -> the worker's task (a cpu op, or a GPU op it issues)
    last: dict = field(default_factory=dict)  # queue -> the last end event recorded on it
    tail: Future | None = None  # the step's last worker task (its end-of-step bookkeeping)


class PrevDeps(NamedTuple):
    """The ops of the step before (``step``, by id) that an op of the current step follows."""
    step: Issued | None
    ids: tuple[int, ...]

    def tasks(self) -> list[Future]:
        """Their worker tasks (optimizer tasks, GPU ops the worker issued)."""
        return [self.step.futures[d] for d in self.ids if d in self.step.futures]

    def events(self, op: Op) -> list:
        """Their end events (those issued by now: the worker's, once its task ran), but for a state load's own
        layer's stores, which it follows row by row (:meth:`StepOrder.wait_for_rows`)."""
        out = []
        for d in self.ids:
            dep = self.step.schedule.ops[d]
            if op.kind is OpKind.LOAD_OPT and dep.kind is OpKind.STORE_OPT and dep.layer == op.layer:
                continue
            ev = self.step.events.get(d)
            if ev is not None:
                out.append(ev)
        return out


class StepOrder:
    def __init__(self, waited):
        """``waited(future)``: wait on the host for a worker task, timed."""
        self.waited = waited
        self.prev: Issued | None = None  # the step issued last, and the one before it
        self.older: Issued | None = None
        self.carried: Carried | None = None  # the current step's dependencies on ``prev`` (None: fenced, or none)
        self.current: Issued | None = None
        self.store_opt_done: dict[int, tuple[int, list]] = {}  # layer -> (step, row events) of its latest STORE_OPT
        # buffer slot -> the worker's issue of a GPU op that uses it: an op issued after it that rewrites the slot
        # waits for that issue (the worker issues in its own time; the queue's order is the order of issue)
        self.slot_pending: dict[tuple[str, int], Future] = {}

    def begin(self, schedule: Schedule, successions: Successions | None, queues) -> Issued:
        """Before ``schedule``'s ops are issued on ``queues``: fence the step before last, and the step before
        unless the pair is a verified succession (then its carried dependencies apply op by op)."""
        if self.older is not None:
            self._fence(self.older, queues)
        pair = None
        if self.prev is not None and successions is not None:
            pair = successions.get((id(self.prev.schedule), id(schedule)))
            if pair is not None and not (pair[0] is self.prev.schedule and pair[1] is schedule):
                pair = None
        if self.prev is not None and pair is None:
            self._fence(self.prev, queues)
        self.carried = pair[2] if pair is not None else None
        self.current = Issued(schedule)
        return self.current

    def end(self) -> None:
        """The current step is issued (its worker tasks and worker-issued ops may still be pending)."""
        self.older, self.prev, self.current = self.prev, self.current, None

    def drained(self) -> None:
        """Every step's work is done: nothing to wait for, the current step's carried dependencies on the step before
        included (a drain while a step is issued: a buffer replaced before its ops, ``DeviceState.fit``)."""
        self.prev = self.older = None
        self.carried = None

    def _fence(self, step: Issued, queues) -> None:
        if step.tail is not None:  # first: the worker's issues of that step's GPU ops come before its tail
            self.waited(step.tail)
        events = list(step.last.values())
        for q in queues:
            for ev in events:
                q.wait_event(ev)

    # ---- the current step's ops ------------------------------------------------------------------------------
    def on_prev(self, op: Op) -> "PrevDeps":
        """What ``op`` of the current step follows of the step before."""
        if self.carried is None or not self.carried[op.id]:
            return PrevDeps(None, ())
        return PrevDeps(self.prev, self.carried[op.id])

    def worker_issues(self, op: Op, fut: Future) -> None:
        """The worker issues GPU op ``op`` once ``fut`` runs."""
        for role, idx in op.slots:
            if SLOT_POOL[role] in OUTLIVING_POOLS:
                self.slot_pending[(SLOT_POOL[role], idx)] = fut

    def wait_for_pending(self, op: Op, writes) -> None:
        """Before this thread issues ``op`` (``writes``: the slot roles it writes): the worker's issue of the ops
        that use a slot it rewrites."""
        for role, idx in op.slots:
            pending = self.slot_pending.get((SLOT_POOL[role], idx)) if role in writes else None
            if pending is not None and not pending.done():
                self.waited(pending)

    def wait_for_rows(self, layer: int, stream, rows, step: int) -> None:
        """``stream`` waits for the copies of ``rows`` of ``layer``'s host block by a STORE_OPT of a step before
        ``step``."""
        done = self.store_opt_done.get(layer)
        if done is not None and done[0] < step:
            for r in rows:
                stream.wait_event(done[1][r])

    def row_stored(self, layer: int, row: int, step: int, done) -> None:
        """Row ``row`` of ``layer``'s host block is written by ``step`` when ``done`` (an event) fires."""
        rows = [] if row == 0 else self.store_opt_done[layer][1]
        self.store_opt_done[layer] = (step, rows + [done])
