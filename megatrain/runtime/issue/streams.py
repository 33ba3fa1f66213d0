"""The streaming executor (CUDA): the same schedule and the same op handlers, each op issued on its own stream.

One host thread issues the ops in program order: GPU ops go to the ``compute``, ``h2d`` and ``d2h`` CUDA streams (a
split update's, to a queue of its own beside its stream: ``ir.queue_of``) and record an event; a dependency on a GPU
op is a ``wait_event`` on the issuing stream, so the host never waits for the GPU. ``cpu`` ops (AdamW on a layer's
host block) go to one worker thread, which first waits for the events of the GPU ops they depend on; a GPU op that
depends on a ``cpu`` op makes the host wait for that worker task before issuing it (the next step's weight load), or
hands the op to the worker to issue after it. Steps overlap without a barrier: what one step's schedule cannot say
about the steps before it, the dependencies the planner carries from one step to the next do (verified pairs of
schedules; :class:`~megatrain.runtime.issue.step_order.StepOrder` turns them into waits and fences any other pair), or,
with ``sync_between_steps``, the whole device is synchronized before a step. Every op is timed
(:mod:`megatrain.runtime.issue.timing`). CUDA is reached through ``cuda``
(:mod:`megatrain.runtime.issue.cuda_api`), which the tests replace with a fake that checks the order on the CPU.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from megatrain.ir import Op, OpKind, Schedule, Stream, deferrable_opts, queue_of
from megatrain.runtime.ops import HANDLERS
from megatrain.runtime.ops import update as update_ops
from megatrain.runtime.issue.cuda_api import TORCH_CUDA
from megatrain.runtime.issue.executor import Executor
from megatrain.runtime.optim import lr_at
from megatrain.runtime.issue.step import MicroBatch, StepOutput, StepState
from megatrain.runtime.issue.step_order import Issued, PrevDeps, StepOrder, Successions
from megatrain.runtime.issue.stream_copies import StreamCopies
from megatrain.runtime.issue.timing import OpTimer


class _Step(NamedTuple):
    """Of one step, what issuing its ops uses: what it issued (events, tasks, queues' last events), slots, timings."""
    issued: Issued
    tags: list
    timing: list


def _timed(work, done: threading.Event, times: list) -> None:
    """``work()``, then ``done`` set (whether it raised or not) and its seconds appended to ``times``: a moments
    task of the optimizer worker."""
    t = time.perf_counter()
    try:
        work()
    finally:
        done.set()
    times.append(time.perf_counter() - t)


class StreamExecutor(Executor):
    # Between steps: True waits for the whole device (the previous step's last transfers included) before issuing
    # the next step. False orders only what needs it, on the GPU (StepOrder); the next step's forward then runs
    # under the previous step's STORE_OPT tail (measured on the H200: faster, bit-identical results).
    sync_between_steps = False
    # The ops of split updates (one part of a layer's state each: ScheduleConfig.split_opt) on queues of their own,
    # each first waiting for what its IR stream had issued before it: the next step's weight loads and forward,
    # issued after them, then run beside the update pass instead of behind its loads and updates
    split_queues = True
    # With split_queues: each state load of a split update also waits for the split update issued before it, so
    # the copy engine is idle for the length of that update between two loads. A copy engine keeps serving a queue
    # that always has its next copy ready and starves the other queues of its direction (benchmarks/copy_order.py
    # on the H200: a weight load issued beside a chain of state loads ran only after the whole chain, whatever the
    # stream priorities or the chain's copy sizes), so the next step's weight loads waited for every split state
    # load of the update pass; with the gap they go in between. (The stores have gaps of their own: each follows
    # its part's load and update, which take longer.)
    pace_split = True
    # With clipping and megatrain's host kernel: a host update writes the new masters alone (what the next forward
    # waits for) and its moments are computed after the step's update pass, from the gradient still in the host
    # buffer (:func:`deferrable_opts`), by the worker while the GPU runs the next forward and backward; the first
    # gradient store into that buffer waits for them. The pass behind the backward moves 20 bytes a parameter
    # through the host's DRAM instead of 28; the results are bit-identical (runtime/optim/cpu_adamw.c). A split update
    # whose gradient comes from such a buffer likewise stores its new masters alone (4 bytes a parameter back over
    # PCIe instead of 12); the worker computes its moments there after the step's updates (after the state loads
    # that read the old ones), in the arithmetic of the GPU's kernel, and the next step's state loads of the layer
    # wait for them.
    defer_moments = True

    def __init__(self, captured, store, optimizer, device: torch.device, compute_dtype: torch.dtype, head_loss=None,
                 runner=None, *, cuda=TORCH_CUDA):
        self.cuda, device = cuda, torch.device(device)
        if device.type != "cuda" and not cuda.is_fake:
            raise ValueError("the streaming executor needs a CUDA device")
        with cuda.on_device(device):
            self.queues = {(s, split): cuda.new_stream() for s in (Stream.COMPUTE, Stream.H2D, Stream.D2H)
                           for split in (False, True)}
        self.streams = {s: self.queues[(s, False)] for s in (Stream.COMPUTE, Stream.H2D, Stream.D2H)}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-cpu")
        self.last_opt: dict[int, Future] = {}  # owner layer -> its latest optimizer task (persists across steps)
        self.timer = OpTimer(self.streams[Stream.COMPUTE], cuda)
        self.order = StepOrder(self.timer.waited)
        self.steps_issued = 0
        self.split_moments_due: dict[int, tuple] = {}  # split layer -> (the step that deferred its last update's
        # moments, an event set once they are on the host): the state loads of later steps wait
        self.moments_wait_s = 0.0  # the last step's host thread: seconds waiting for moments before a store
        copies = StreamCopies(cuda, device, self.streams, self.order, self.timer, lambda: self.steps_issued,
                              self._wait_moments)
        super().__init__(captured, store, optimizer, device, compute_dtype, head_loss, runner, copies=copies)
        self.split_opt_end = None  # the end event of the last split update issued (pace_split)
        self._no_update_runs = 0  # of which no optimizer step: evaluations, steps whose loss or norm was not finite
        self._step_base = 0  # steps taken before this executor's first (set_step)
        self._deferrable: dict[int, tuple] = {}  # id(schedule) -> (schedule, its deferrable host OPTs)
        self._deferred: list[Op] = []  # this step's host OPTs issued without their moments, and the first stored
        # part of each split update that stores its masters alone
        self.moments_due: dict[int, threading.Event] = {}  # host gradient buffer -> set once the moments of the
        # update that read it last are done (the next gradient store into it waits)
        self.moments_s: list[float] = []  # the last step's moments tasks: host seconds each

    # ---- step ---------------------------------------------------------------------------------------------
    def run(self, schedule: Schedule, mbs: list[MicroBatch], denom: int, wait_optimizer: bool = True,
            successions: Successions | None = None, write_back: Schedule | None = None,
            objective=None) -> StepOutput:
        self.issued = self.order.begin(schedule, None if self.sync_between_steps else successions,
                                       list(self.queues.values()))
        self.events, self.futures = self.issued.events, self.issued.futures
        self.moments_wait_s = 0.0
        if self.sync_between_steps:
            self.cuda.synchronize(self.device)
        self.timer.begin(schedule)
        with self.cuda.use(self.streams[Stream.COMPUTE]):  # what run() puts on the device between ops
            # issues everything; reading the losses waits for compute
            out = super().run(schedule, mbs, denom, write_back=write_back, objective=objective)
        self.order.end()
        if not out.applied:  # the device updates were issued with this step's count and changed nothing: the host's
            # count goes back (worker tasks skipped theirs; the worker's end_step leaves the schedule's index)
            self._no_update_runs += 1
            for layer in schedule.config.gpu_opt + schedule.config.split_opt:
                self.optimizer.undo_device_step(layer)
        if wait_optimizer:
            self.drain()
        return out

    @property
    def checkpoint_bufs(self):
        return self.copies.checkpoint_bufs

    def deferred_for(self, schedule: Schedule) -> frozenset[int]:
        """The host OPTs of ``schedule`` whose moments this executor leaves for after the update pass, and the
        split updates' STORE_OPTs that store the masters alone."""
        return self._deferral(schedule)[1]

    def _deferral(self, schedule: Schedule) -> tuple:
        """(schedule, :func:`deferrable_opts`, {deferred split layer: (its host gradient buffer, its parts'
        LOAD_OPT ids)}), of ``schedule``; nothing deferred unless this executor defers."""
        if not (self.defer_moments and self.optimizer.native and self.dp is None and schedule.config.clip):
            return schedule, frozenset(), {}
        got = self._deferrable.get(id(schedule))
        if got is None or got[0] is not schedule:
            ids = deferrable_opts(schedule)
            split = {op.layer for op in schedule.ops if op.id in ids and op.kind is OpKind.STORE_OPT}
            loads = {}
            for op in schedule.ops:
                if op.kind is OpKind.LOAD_OPT and op.layer in split:
                    h, parts = loads.get(op.layer, (op.slot("h"), []))
                    loads[op.layer] = (h, parts + [op.id])
            got = self._deferrable[id(schedule)] = (schedule, ids, loads)
        return got

    def set_up(self, setup: Schedule, step: Schedule, write_back: Schedule | None = None) -> None:
        """The plan's set-up on the copy stream; the next step follows it by the dependencies carried from it."""
        self.drain()  # (the write-back of other states waits for everything anyway)
        self.issued = self.order.begin(setup, None, list(self.queues.values()))
        self.events, self.futures = self.issued.events, self.issued.futures
        self.timer.begin(setup)
        with self.cuda.use(self.streams[Stream.COMPUTE]):
            super().set_up(setup, step, write_back)
        self.order.end()

    def drain(self) -> None:  # every queued optimizer task and every stream
        for f in list(self.last_opt.values()):
            f.result()
        self.worker.submit(lambda: None).result()  # and the step's begin / end bookkeeping queued behind them
        self.cuda.synchronize(self.device)
        self.order.drained()

    def set_step(self, steps_done: int) -> None:
        """Go on as if ``steps_done`` steps had been taken (a loaded training state): the learning rate and the
        optimizer's step index follow; the ordering of this executor's own steps does not change."""
        self.drain()
        self.optimizer.step_index = steps_done
        self._step_base = steps_done - self.steps_issued + self._no_update_runs

    def quiesce(self) -> None:
        self.drain()

    def begin_step(self) -> float:
        # the worker runs begin/end in order with the optimizer tasks of the steps before; device updates, issued
        # by this thread, use this step's lr and clip factor directly and do not wait for the worker
        self.worker.submit(self.optimizer.begin_step)
        return lr_at(self.optimizer.cfg, self._step_base + self.steps_issued - self._no_update_runs)

    def end_step(self, st: StepState) -> None:
        # the moments of the updates made without them, behind the step's updates in the worker's order, the last
        # updated first: the backward stores the last layers' gradients first
        times = self.moments_s = []
        split = self._deferral(st.schedule)[2]
        for op in reversed(self._deferred):
            if op.kind is OpKind.STORE_OPT:  # a split update's: the whole layer's moments, once its parts' state
                # loads have read the old ones (events of this step's, which the worker may still issue before)
                h, loads = split[op.layer]
                done = self.moments_due[h] = threading.Event()
                self.split_moments_due[op.layer] = (st, done)
                self.worker.submit(self._split_moments_task, op.layer, h, loads, self.issued.events, st, done, times)
            else:
                self.worker.submit(self._moments_task, op, st, self.moments_due[op.slot("h")], times)
        self._deferred = []
        self.issued.tail = self.worker.submit(lambda: self.optimizer.end_step(applied=st.ok()))
        self.steps_issued += 1

    def end_evaluation(self) -> None:  # a run of its own for the ordering across runs; no optimizer step
        self.steps_issued += 1
        self._no_update_runs += 1

    def _moments_task(self, op: Op, st: StepState, done: threading.Event, times: list) -> None:
        _timed(lambda: update_ops.moments_on_host(self.ctx, op, st), done, times)

    def _split_moments_task(self, layer: int, h: int, loads: list[int], events: dict, st: StepState,
                            done: threading.Event, times: list) -> None:
        def work():
            for i in loads:
                events[i].synchronize()
            update_ops.split_moments_on_host(self.ctx, layer, h, st)

        _timed(work, done, times)

    def _wait_moments(self, layer: int, row: int, st: StepState | None) -> None:
        """Before a state load's moments (rows 1 and 2): wait until the host computed them where an earlier step's
        split update stored its masters alone (on the issuing thread, or in the worker, which ran those tasks
        already: they were queued before anything of a later step's)."""
        due = self.split_moments_due.get(layer) if row in (1, 2) else None
        if due is not None and due[0] is not st and not due[1].is_set():
            t = time.perf_counter()
            due[1].wait()
            self.moments_wait_s += time.perf_counter() - t

    # ---- issuing ------------------------------------------------------------------------------------------
    def issue(self, op: Op, st: StepState) -> None:
        with self.timer.issuing(op):
            self._issue_op(op, st)

    def issued_now(self, op: Op) -> bool:
        return op.id not in self.futures

    def _issue_op(self, op: Op, st: StepState) -> None:
        # dependencies on what the worker runs or issues are futures; on the others, events this thread recorded;
        # on the step before, what it carries over (its tasks as a rule long done)
        later = [d for d in op.deps if d in self.futures]
        prev = self.order.on_prev(op)
        handler = HANDLERS[(op.kind, op.stream)]
        # this step's, as they are now: the worker may issue one of its ops after the next step's run began
        step = _Step(self.issued, self.tags, self.timer.records())
        events = step.issued.events
        if op.kind is OpKind.STORE_OPT and op.id in st.deferred_moments and \
                all(o.layer != op.layer or o.kind is not OpKind.STORE_OPT for o in self._deferred):
            self._deferred.append(op)  # (its layer's first part: the moments are the layer's, after the step)
        if op.stream is Stream.CPU:
            if op.id in st.deferred_moments:
                self._deferred.append(op)
                self.moments_due[op.slot("h")] = threading.Event()
            fut = self.worker.submit(self.timer.task(op, handler, self.ctx, st, [self.futures[d] for d in later]
                                                     + prev.tasks(),
                                                     lambda: [events[d] for d in op.deps if d in events]
                                                     + prev.events(op)))
            self.timer.record_task(op, fut)
            self.futures[op.id] = fut
            if op.kind in (OpKind.OPT, OpKind.CHECK):
                self.last_opt[op.layer] = fut
            return
        if op.kind is OpKind.STORE_G and op.stream is Stream.D2H and op.slot("h") is not None:
            due = self.moments_due.pop(op.slot("h"), None)
            if due is not None and not due.is_set():  # the buffer's last reader's moments (queued in the worker
                # before this step's updates, so a store the worker issues never waits here for a later task)
                t = time.perf_counter()
                due.wait()
                self.moments_wait_s += time.perf_counter() - t
        if later and op.kind not in (OpKind.LOAD_W, OpKind.GUARD):
            # a GPU op that waits for an optimizer task (a gradient store into a host buffer an update still reads):
            # the worker issues it after that task, so this thread goes on issuing (the next step's forward); the
            # guard, which every update waits for, this thread issues once the task is done
            fut = self.futures[op.id] = self.worker.submit(self._issue_gpu, op, st, handler, step, prev, True)
            self.order.worker_issues(op, fut)
            return
        for f in [self.futures[d] for d in later] + prev.tasks():
            self.timer.waited(f)
        self._issue_gpu(op, st, handler, step, prev)

    def _issue_gpu(self, op: Op, st: StepState, handler, step: _Step, prev: PrevDeps, in_worker: bool = False) -> None:
        """Issue a GPU op of step ``step`` on its queue after its dependencies' events (recorded by the issuing
        thread, or by the worker for the ops it issued, which run before it in the worker's order) and those of
        the ops of the step before it follows (``prev``). ``in_worker``: the optimizer worker issues it (the
        worker's pending issues are then its own earlier tasks, done)."""
        if not in_worker:
            self.order.wait_for_pending(op, step.tags[op.id][1])
        stream = self._queue(op)
        for d in op.deps:
            if d in step.issued.events:
                stream.wait_event(step.issued.events[d])
        for ev in prev.events(op):
            stream.wait_event(ev)
        paced = self.pace_split and self.split_queues and queue_of(op) == (Stream.H2D, True)
        if paced and self.split_opt_end is not None:
            stream.wait_event(self.split_opt_end)
        with self.cuda.on_device(self.device), self.cuda.use(stream), \
                self.timer.on_stream(op, stream, step.timing) as end:
            handler(self.ctx, op, st)
        step.issued.events[op.id] = end
        step.issued.last[queue_of(op)] = end
        if self.split_queues and queue_of(op) == (Stream.COMPUTE, True):
            self.split_opt_end = end

    def _queue(self, op: Op):
        """The CUDA stream ``op`` is issued on: its IR stream's, or for a split update's op with ``split_queues``
        a queue of its own that first waits for everything issued on the IR stream so far (the program order the
        schedule's dependencies leave implicit)."""
        q = queue_of(op)
        if not (self.split_queues and q[1]):
            return self.streams[op.stream]
        queue = self.queues[q]
        queue.wait_stream(self.streams[op.stream])
        return queue

    def timeline(self, marked=None):  # the last step (or one OpTimer.mark() marked) as measured: each op's start
        # and end, seconds from the step's start
        self.drain()
        return self.timer.timeline(marked)
