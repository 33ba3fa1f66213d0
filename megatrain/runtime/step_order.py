"""How the stream issuer orders one step's ops after the steps issued before it, without a device-wide sync.

A step's schedule orders its own ops; it cannot say what the step before still does. :class:`StepOrder` keeps, on
CUDA events and worker futures, what a later step's op may have to wait for: each buffer slot's last use (an op that
rewrites the slot waits for it), the rows of each layer's host block an earlier STORE_OPT wrote (a load of that
block waits for them, row by row for a state load), the device update that left a layer's weights on the device
(the next load of them waits for it), the optimizer task that last read a host gradient buffer (the next gradient
store into it waits for it), and the worker's issue of a GPU op on a slot (the next writer waits for that before it
looks at the slot's last use).
"""

from __future__ import annotations

from concurrent.futures import Future

from megatrain.ir import SLOT_POOL, Op, OpKind
from megatrain.planner.cost import OPT_STATE_ROWS

BUFFER_POOLS = ("w", "g", "o", "k")  # pools of buffers allocated once and rewritten every step (activations are
# fresh tensors, which the caching allocator keeps apart across streams)


class StepOrder:
    def __init__(self, owner, kept_weights, waited):
        """``owner(layer)``: the layer holding a layer's weights; ``kept_weights(owner)``: the weights a device
        update left on the device (None: none); ``waited(future)``: wait for a worker task, timed."""
        self.owner, self.kept_weights, self.waited = owner, kept_weights, waited
        # (step, event, (kind, layer)) of each slot's last use; layer -> (step, events) of each row's copy to the
        # host block by its latest STORE_OPT; layer -> (step, event) of its latest device OPT
        self.slot_use: dict[tuple[str, int], tuple[int, object, tuple[OpKind, int]]] = {}
        self.store_opt_done: dict[int, tuple[int, list]] = {}
        self.kept_done: dict[int, tuple[int, object]] = {}
        # host gradient buffer -> (step, the optimizer task that read it last); slot -> the worker's issue of a GPU
        # op that uses it, which the next step's writer waits for before it looks at slot_use
        self.host_buffer_user: dict[int, tuple[int, Future]] = {}
        self.slot_pending: dict[tuple[str, int], Future] = {}

    def cpu_task(self, op: Op, step: int, fut: Future) -> None:
        """A worker task of ``step`` for ``op``: the host gradient buffers it reads."""
        for role, idx in op.slots:
            if role == "h":
                self.host_buffer_user[idx] = (step, fut)

    def worker_issues(self, op: Op, fut: Future) -> None:
        """The worker issues GPU op ``op`` once ``fut`` runs."""
        for role, idx in op.slots:
            if SLOT_POOL[role] in BUFFER_POOLS:
                self.slot_pending[(SLOT_POOL[role], idx)] = fut

    def issued(self, op: Op, step: int, end) -> None:
        """GPU op ``op`` of ``step`` is issued; ``end`` marks its end."""
        for role, idx in op.slots:  # (a host gradient buffer a split update's state load reads: the next step's
            # store into it waits for that load)
            if SLOT_POOL[role] in BUFFER_POOLS or role == "h" and op.kind is OpKind.LOAD_OPT:
                self.slot_use[(SLOT_POOL[role], idx)] = (step, end, (op.kind, op.layer))
        if op.kind is OpKind.OPT:  # on the device: the kept weights are ready when it ends
            self.kept_done[op.layer] = (step, end)

    def host_buffer_readers(self, op: Op, step: int) -> list[Future]:
        """The optimizer task of an earlier step than ``step`` that last read a host gradient buffer ``op`` writes
        (within a step the schedule orders them)."""
        out = []
        for role, idx in op.slots:
            last = self.host_buffer_user.get(idx) if role == "h" and op.kind is OpKind.STORE_G else None
            if last is not None and last[0] < step:
                out.append(last[1])
        return out

    def wait_for_earlier_steps(self, op: Op, stream, step: int, writes, in_worker: bool) -> None:
        """``stream``, about to run ``op`` of ``step`` (``writes``: the slot roles it writes), waits for the earlier
        steps' ops it conflicts with. An op the worker issues does not wait for the worker's pending ops: those
        submitted before it have run (the worker runs its queue in order), and the one found may be itself or a
        later one."""
        for role, idx in op.slots:
            pending = None if in_worker else self.slot_pending.get((SLOT_POOL[role], idx))
            if role in writes and pending is not None and not pending.done():
                self.waited(pending)
            last = self.slot_use.get((SLOT_POOL[role], idx))
            if role in writes and last is not None and last[0] < step:
                if op.kind is OpKind.LOAD_OPT and last[2] == (OpKind.STORE_OPT, op.layer):
                    continue  # its own state's store: each row waits for that row's (wait_for_rows)
                stream.wait_event(last[1])
        if op.kind is OpKind.LOAD_W:
            o = self.owner(op.layer)
            if self.kept_weights(o) is not None:
                done = self.kept_done.get(o)
                if done is not None and done[0] < step:
                    stream.wait_event(done[1])
            else:  # from the host block (or its shadow), which a device update of the step before may still write
                self.wait_for_rows(o, stream, (OPT_STATE_ROWS,), step)

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
