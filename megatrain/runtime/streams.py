"""The streaming executor (CUDA): the same schedule and the same op handlers, each op issued on its own stream.

One host thread issues the ops in program order: GPU ops go to the ``compute``, ``h2d`` and ``d2h`` CUDA streams and
record an event; a dependency on a GPU op is a ``wait_event`` on the issuing stream, so the host never waits for the
GPU. ``cpu`` ops (AdamW on a layer's host block) go to one worker thread, which first waits for the events of the
GPU ops they depend on; a GPU op that depends on a ``cpu`` op (the next step's weight load) makes the host wait for
that worker task before issuing it. Across ``run`` calls, a layer's first load of a step waits for the layer's
optimizer task of the previous step, so steps overlap without a barrier: only the ops that rewrite a slot or load a
layer's host copy wait, on the GPU, for the earlier step's ops they conflict with (or, with ``sync_between_steps``,
the whole device is synchronized before a step). Every op is timed (:mod:`megatrain.runtime.timing`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from megatrain.ir import SLOT_POOL, Op, OpKind, Schedule, Stream, split_part
from megatrain.planner.cost import OPT_STATE_ROWS
from megatrain.runtime import ops
from megatrain.runtime.executor import Executor
from megatrain.runtime.optim import lr_at
from megatrain.runtime.step import MicroBatch, StepOutput, StepState
from megatrain.runtime.timing import OpTimer

BUFFER_POOLS = ("w", "g", "o", "k")  # pools of buffers allocated once and rewritten every step (activations are
# fresh tensors, which the caching allocator keeps apart across streams)


class _Step(NamedTuple):
    """What issuing an op of one step uses of that step: its ops' end events, slot contents, index among the steps
    issued, and where its timings go."""

    events: dict
    tags: list
    step: int
    timing: list


class StreamExecutor(Executor):
    non_blocking = True
    # Between steps: True waits for the whole device (the previous step's last transfers included) before issuing
    # the next step. False orders only what needs it, on the GPU: an op that writes a slot waits for the previous
    # step's last use of that slot, and a load of a layer updated on the device waits for the STORE_OPT that wrote
    # its host copy; the next step's forward then runs under the previous step's STORE_OPT tail (measured on the
    # H200 with the planner's ordering of device updates: faster, bit-identical results; docs/benchmarks.md).
    sync_between_steps = False
    # The ops of split updates (one part of a layer's state each: ScheduleConfig.split_opt) on queues of their own,
    # each first waiting for what its IR stream had issued before it: the next step's weight loads and forward,
    # issued after them, then run beside the update pass instead of behind its loads and updates
    split_queues = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise ValueError("the streaming executor needs a CUDA device")
        with torch.cuda.device(self.device):
            self.streams = {s: torch.cuda.Stream() for s in (Stream.COMPUTE, Stream.H2D, Stream.D2H)}
            self.split_streams = {s: torch.cuda.Stream() for s in (Stream.COMPUTE, Stream.H2D, Stream.D2H)}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-cpu")
        self.last_opt: dict[int, Future] = {}  # owner layer -> its latest optimizer task (persists across steps)
        self.timer = OpTimer(self.graph, self.streams[Stream.COMPUTE])
        self.steps_issued = 0
        self._no_update_runs = 0  # of which no optimizer step: evaluations, steps whose loss or norm was not finite
        self._step_base = 0  # steps taken before this executor's first (set_step)
        # across steps (sync_between_steps False): (step, event, (kind, layer)) of each slot's last use; layer ->
        # (step, events) of each row's copy to the host block by its latest STORE_OPT; layer -> (step, event) of
        # its latest device OPT; pinned buffers of the step before, which its copies may still read
        self.slot_use: dict[tuple[str, int], tuple[int, torch.cuda.Event, tuple[OpKind, int]]] = {}
        self.store_opt_done: dict[int, tuple[int, list[torch.cuda.Event]]] = {}
        self.kept_done: dict[int, tuple[int, torch.cuda.Event]] = {}
        # host gradient buffer -> (step, the optimizer task that read it last); slot -> the worker's issue of a GPU
        # op that uses it, which the next step's writer waits for before it looks at slot_use
        self.host_buffer_user: dict[int, tuple[int, Future]] = {}
        self.slot_pending: dict[tuple[str, int], Future] = {}
        self.host_keep: list[torch.Tensor] = []
        self.loss_host: torch.Tensor | None = None  # pinned: the step's loss sums, copied right after its last LOSS
        self.loss_copied: torch.cuda.Event | None = None

    # ---- step ---------------------------------------------------------------------------------------------
    def run(self, schedule: Schedule, mbs: list[MicroBatch], denom: int, wait_optimizer: bool = True) -> StepOutput:
        self.events: dict[int, torch.cuda.Event] = {}
        self.futures: dict[int, Future] = {}
        self.prev_host_keep = self.host_keep  # the step before may still be copying from these (no device sync)
        self.host_keep = []  # pinned host buffers in flight, kept alive for the step
        if self.sync_between_steps:
            torch.cuda.synchronize(self.device)
        self.timer.begin(schedule)
        with torch.cuda.stream(self.streams[Stream.COMPUTE]):  # inputs are moved on the compute stream
            out = super().run(schedule, mbs, denom)  # issues everything; reading the losses waits for compute
        if not out.applied:  # the device updates were issued with this step's count and changed nothing: the host's
            # count goes back (worker tasks skipped theirs; the worker's end_step leaves the schedule's index)
            self._no_update_runs += 1
            for layer in schedule.config.gpu_opt + schedule.config.split_opt:
                self.optimizer.set_steps(layer, self.optimizer.steps(layer) - 1)
        if wait_optimizer:
            self.drain()
        return out

    def drain(self) -> None:
        """Wait for every queued optimizer task and every stream."""
        for f in list(self.last_opt.values()):
            f.result()
        self.worker.submit(lambda: None).result()  # and the step's begin / end bookkeeping queued behind them
        torch.cuda.synchronize(self.device)

    def set_step(self, steps_done: int) -> None:
        """Go on as if ``steps_done`` steps had been taken (a loaded training state): the learning rate and the
        optimizer's step index follow; the ordering of this executor's own steps does not change."""
        self.drain()
        self.optimizer.step_index = steps_done
        self._step_base = steps_done - self.steps_issued + self._no_update_runs

    def _quiesce(self) -> None:
        self.drain()

    def _begin_step(self) -> float:
        # the worker runs begin/end in order with the optimizer tasks of the steps before; device updates, issued
        # by this thread, use this step's lr and clip factor directly and do not wait for the worker
        self.worker.submit(self.optimizer.begin_step)
        return lr_at(self.optimizer.cfg, self._step_base + self.steps_issued - self._no_update_runs)

    def _end_step(self, st: StepState) -> None:
        self.worker.submit(lambda: self.optimizer.end_step(applied=st.ok()))
        self.steps_issued += 1

    def _end_evaluation(self) -> None:  # a run of its own for the ordering across runs; no optimizer step
        self.steps_issued += 1
        self._no_update_runs += 1

    # ---- copies the handlers and the step make -----------------------------------------------------------
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """An input on the device, copied from pinned memory on the ``h2d`` stream, which the compute stream waits
        for. A host-to-device copy queues behind the copies already waiting on the copy engine: on the compute
        stream it waited for the step's first optimizer-state loads (0.3 s measured on the H200); issued here,
        before them, it goes first."""
        if t.device.type != "cpu":
            return t.to(self.device)
        h2d, compute = self.streams[Stream.H2D], self.streams[Stream.COMPUTE]
        with torch.cuda.stream(h2d):
            out = t.pin_memory().to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        out.record_stream(compute)
        compute.wait_event(copied)
        return out

    def _to_pinned(self, src: torch.Tensor, dst: torch.Tensor, made_on: torch.cuda.Stream) -> torch.cuda.Event:
        """Copy ``src`` (made on ``made_on``) into pinned ``dst`` on the ``d2h`` stream; the event marks it done."""
        d2h = self.streams[Stream.D2H]
        d2h.wait_stream(made_on)
        src.record_stream(d2h)
        with torch.cuda.stream(d2h):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    def _copy_losses(self, st: StepState) -> None:
        """Right after the step's last LOSS: its loss sums to pinned host memory, on the ``d2h`` stream, so reading
        them at the step's end waits for this copy alone (on the compute stream it would queue behind the step
        before's optimizer-state stores, up to a third of a step on the H200)."""
        n = len(st.loss_sums)
        if self.loss_host is None or self.loss_host.numel() != n:
            self.loss_host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        sums = torch.stack([t.float().reshape(()) for t in st.loss_sums])  # every LOSS has run: all tensors
        self.loss_copied = self._to_pinned(sums, self.loss_host, torch.cuda.current_stream())

    def _loss_values(self, st: StepState) -> list[float]:
        self.timer.loss_wait(self.loss_copied.synchronize)
        return self.loss_host.tolist()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        t.record_stream(torch.cuda.current_stream())
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.host_keep.append(host)
        t = host.to(self.device, non_blocking=True)
        t.record_stream(self.streams[Stream.COMPUTE])
        return t

    def keep_alive(self, t: torch.Tensor) -> None:
        t.record_stream(torch.cuda.current_stream())

    def before_row(self, layer: int, row: int) -> None:  # each row after the same row's store by the step before:
        # the load of a large layer's state starts while the rest of it is still being stored
        self._wait_for_rows(layer, torch.cuda.current_stream(), (row,))

    def _row_stored(self, layer: int, row: int) -> None:
        done = torch.cuda.Event()
        done.record()
        rows = [] if row == 0 else self.store_opt_done[layer][1]
        self.store_opt_done[layer] = (self.steps_issued, rows + [done])

    # ---- issuing ------------------------------------------------------------------------------------------
    def _issue(self, op: Op, st: StepState) -> None:
        with self.timer.issuing(op):
            self._issue_op(op, st)

    def _issue_op(self, op: Op, st: StepState) -> None:
        # dependencies on ops the worker runs (optimizer tasks, and GPU ops it issues) are futures; on the others,
        # events (recorded when this thread issued them)
        later = [d for d in op.deps if d in self.futures]
        if op.kind is OpKind.LOAD_W and self.graph.owner(op.layer) in self.last_opt:  # the previous step's update
            self.timer.waited(self.last_opt[self.graph.owner(op.layer)])
        if op.kind is OpKind.OPT and st.guard is None:
            self._guard(st, op.deps)
        handler = ops.HANDLERS[(op.kind, op.stream)]
        earlier = self._host_buffer_readers(op)  # an earlier step's update that may still read a host buffer
        # this step's, as they are now: the worker may issue one of its ops after the next step's run began
        ctx = _Step(self.events, self.tags, self.steps_issued, self.timer.records())
        events = ctx.events
        if op.stream is Stream.CPU:
            fut = self.worker.submit(self.timer.task(op, handler, self, st, [self.futures[d] for d in later] + earlier,
                                                     lambda: [events[d] for d in op.deps if d in events]))
            self.timer.record_task(op, fut)
            self.futures[op.id] = fut
            for role, idx in op.slots:
                if role == "h":
                    self.host_buffer_user[idx] = (self.steps_issued, fut)
            if op.kind is OpKind.OPT:
                self.last_opt[op.layer] = fut
            return
        if later and op.kind is not OpKind.LOAD_W:
            # a GPU op that waits for an optimizer task (a gradient store into a host buffer an update still reads):
            # the worker issues it after that task, so this thread goes on issuing (the next step's forward)
            fut = self.worker.submit(self._issue_gpu, op, st, handler, ctx, True)
            self.futures[op.id] = fut
            for role, idx in op.slots:
                if SLOT_POOL[role] in BUFFER_POOLS:
                    self.slot_pending[(SLOT_POOL[role], idx)] = fut
            return
        for f in [self.futures[d] for d in later] + earlier:
            self.timer.waited(f)
        self._issue_gpu(op, st, handler, ctx)

    def _issue_gpu(self, op: Op, st: StepState, handler, ctx: "_Step", in_worker: bool = False) -> None:
        """Issue a GPU op of step ``ctx`` on its stream after its dependencies' events (recorded by the issuing
        thread, or by the worker for the ops it issued, which run before it in the worker's order). ``in_worker``:
        the optimizer worker issues it."""
        stream = self._queue(op)
        for d in op.deps:
            if d in ctx.events:
                stream.wait_event(ctx.events[d])
        if not self.sync_between_steps:
            self._wait_for_earlier_steps(op, stream, ctx, in_worker)
        with torch.cuda.device(self.device), torch.cuda.stream(stream), \
                self.timer.on_stream(op, stream, ctx.timing) as end:
            handler(self, op, st)
            if op.kind in (OpKind.LOSS, OpKind.EVAL) and op.mb == len(st.loss_sums) - 1:
                self._copy_losses(st)
        ctx.events[op.id] = end
        if not self.sync_between_steps:
            for role, idx in op.slots:  # (a host gradient buffer a split update's state load reads: the next
                # step's store into it waits for that load)
                if SLOT_POOL[role] in BUFFER_POOLS or role == "h" and op.kind is OpKind.LOAD_OPT:
                    self.slot_use[(SLOT_POOL[role], idx)] = (ctx.step, end, (op.kind, op.layer))
            if op.kind is OpKind.OPT:  # on the device: the kept weights are ready when it ends
                self.kept_done[op.layer] = (ctx.step, end)

    def _queue(self, op: Op) -> torch.cuda.Stream:
        """The CUDA stream ``op`` is issued on: its IR stream's, or for a split update's op with ``split_queues``
        a queue of its own that first waits for everything issued on the IR stream so far (the program order the
        schedule's dependencies leave implicit)."""
        if not (self.split_queues and split_part(op)):
            return self.streams[op.stream]
        queue = self.split_streams[op.stream]
        queue.wait_stream(self.streams[op.stream])
        return queue

    def _host_buffer_readers(self, op: Op) -> list[Future]:
        """The optimizer task of an earlier step that last read a host gradient buffer ``op`` writes (within a
        step the schedule orders them)."""
        out = []
        for role, idx in op.slots:
            last = self.host_buffer_user.get(idx) if role == "h" and op.kind is OpKind.STORE_G else None
            if last is not None and last[0] < self.steps_issued:
                out.append(last[1])
        return out

    def _guard(self, st: StepState, store_deps: tuple[int, ...]) -> None:
        """The step's guard (:func:`ops.guard`) on the compute stream once ``store_deps`` (which end the gradient
        stores and norms on each stream) are done, and its copy to pinned memory on the ``d2h`` stream: device
        updates read the factor on the device, host updates and the step's result wait for the copy."""
        compute = self.streams[Stream.COMPUTE]
        for d in store_deps:
            if d in self.futures:  # an optimizer task or a GPU op the worker issues (none before the first OPT)
                self.timer.waited(self.futures[d])
            if d in self.events:
                compute.wait_event(self.events[d])
        with torch.cuda.stream(compute):
            ops.guard(self, st)
        host = torch.empty(3, dtype=torch.float32, pin_memory=True)
        copied = self._to_pinned(st.guard, host, compute)
        st.fetch = lambda: (copied.synchronize(), host)[1]

    def _wait_for_earlier_steps(self, op: Op, stream: torch.cuda.Stream, ctx: "_Step", in_worker: bool) -> None:
        """What the schedule of one step cannot say: a slot this op writes may still be read by an earlier step's
        op, and a layer's host copy this op loads may still be being written by an earlier step's STORE_OPT. An op
        the worker issues does not wait for the worker's pending ops: those submitted before it have run (the
        worker runs its queue in order), and the one found may be itself or a later one."""
        writes = ctx.tags[op.id][1]
        for role, idx in op.slots:
            pending = None if in_worker else self.slot_pending.get((SLOT_POOL[role], idx))
            if role in writes and pending is not None and not pending.done():
                self.timer.waited(pending)
            last = self.slot_use.get((SLOT_POOL[role], idx))
            if role in writes and last is not None and last[0] < ctx.step:
                if op.kind is OpKind.LOAD_OPT and last[2] == (OpKind.STORE_OPT, op.layer):
                    continue  # its own state's store: each row waits for that row's (before_row)
                stream.wait_event(last[1])
        if op.kind is OpKind.LOAD_W:
            o = self.graph.owner(op.layer)
            if self.dev.kept_weights(o) is not None:
                done = self.kept_done.get(o)
                if done is not None and done[0] < ctx.step:
                    stream.wait_event(done[1])
            else:  # from the host block (or its shadow), which a device update of the step before may still write
                self._wait_for_rows(o, stream, (OPT_STATE_ROWS,))

    def _wait_for_rows(self, layer: int, stream: torch.cuda.Stream, rows) -> None:
        """``stream`` waits for the copies of ``rows`` of ``layer``'s host block by an earlier step's STORE_OPT."""
        done = self.store_opt_done.get(layer)
        if done is not None and done[0] < self.steps_issued:
            for r in rows:
                stream.wait_event(done[1][r])

    def timeline(self):
        """The last step as measured: start and end of every op, seconds from the step's start."""
        self.drain()
        return self.timer.timeline()
