"""The streaming executor (CUDA): the same schedule, each op issued on its own stream.

One host thread issues the ops in program order: GPU ops go to the ``compute``, ``h2d`` and ``d2h`` CUDA streams and
record an event; a dependency on a GPU op is a ``wait_event`` on the issuing stream, so the host never waits for the
GPU. ``cpu`` ops (AdamW on a layer's host block) go to one worker thread, which first waits for the events of the
GPU ops they depend on; a GPU op that depends on a ``cpu`` op (the next step's weight load) makes the host wait for
that worker task before issuing it. Across ``run`` calls, a layer's first load of a step waits for the layer's
optimizer task of the previous step, so steps overlap without a barrier: only the ops that rewrite a slot or load a
layer's host copy wait, on the GPU, for the earlier step's ops they conflict with (or, with ``sync_between_steps``,
the whole device is synchronized before a step).

Every op is timed with CUDA events (GPU) or the host clock (cpu ops); :meth:`StreamExecutor.timeline` returns the
last step as a measured :class:`~megatrain.planner.simulate.Timeline`, comparable with the simulation.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from megatrain.ir import SLOT_POOL, Op, OpKind, Schedule, Stream
from megatrain.runtime.executor import OPT_STATE_ROWS, Executor, MicroBatch, StepOutput


BUFFER_POOLS = ("w", "g", "o")  # pools of buffers allocated once and rewritten every step (activations are fresh
# tensors, which the caching allocator keeps apart across streams)


@dataclass
class _StepState:
    """Per step: the per-gradient norms taken on the GPU before each store; made at the first OPT, on the device,
    the global norm (with clipping) and the step's loss, their copy in pinned memory with the event that marks the
    copy done, and the factor device updates scale the gradient by (the clip factor, 1 without clipping, NaN where
    the loss or the norm is not finite: the update then changes nothing); the parts of each tied gradient summed
    so far."""
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    coef: torch.Tensor | None = None
    guard_host: torch.Tensor | None = None  # pinned: (global norm or 0, the step's summed loss)
    guard_copied: torch.cuda.Event | None = None
    clip: bool = False
    tied_parts: dict[int, int] = field(default_factory=dict)

    def norm(self) -> float | None:
        """The global gradient norm (waits for its copy to the host); None without clipping."""
        self.guard_copied.synchronize()
        return float(self.guard_host[0]) if self.clip else None

    def ok(self) -> bool:
        """Whether the step's updates may run: its loss and global norm finite (waits for their copy)."""
        self.guard_copied.synchronize()
        return bool(torch.isfinite(self.guard_host).all())


class StreamExecutor(Executor):
    non_blocking = True
    # Between steps: True waits for the whole device (the previous step's last transfers included) before issuing
    # the next step. False orders only what needs it, on the GPU: an op that writes a slot waits for the previous
    # step's last use of that slot, and a load of a layer updated on the device waits for the STORE_OPT that wrote
    # its host copy; the next step's forward then runs under the previous step's STORE_OPT tail (measured on the
    # H200 with the planner's ordering of device updates: faster, bit-identical results; docs/benchmarks.md).
    sync_between_steps = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.device.type != "cuda":
            raise ValueError("the streaming executor needs a CUDA device")
        with torch.cuda.device(self.device):
            self.streams = {Stream.COMPUTE: torch.cuda.Stream(), Stream.H2D: torch.cuda.Stream(),
                            Stream.D2H: torch.cuda.Stream()}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-cpu")
        self.last_opt: dict[int, Future] = {}  # owner layer -> its latest optimizer task (persists across steps)
        self.tied_sum: dict[int, torch.Tensor] = {}  # owner -> device buffer summing a tied gradient's parts
        # owner -> how many gradient parts a step stores for it (its own and each tied layer's), where more than one
        self.tied = {o: 1 + len(self.graph.tied_to(o)) for o in range(len(self.graph)) if self.graph.tied_to(o)}
        self._timing: list = []
        self.steps_issued = 0
        self._skipped = 0  # of which not applied (a loss or gradient norm that was not finite)
        self._step_base = 0  # steps taken before this executor's first (set_step)
        # across steps (sync_between_steps False): (step, event) of each slot's last use and of each layer's
        # latest device OPT and STORE_OPT; pinned buffers of the step before, which its copies may still read
        self.slot_use: dict[tuple[str, int], tuple[int, torch.cuda.Event, tuple[OpKind, int]]] = {}  # and the op
        # layer -> (step, events): each row's copy to the host block by its latest STORE_OPT, then the whole op's
        self.store_opt_done: dict[int, tuple[int, list[torch.cuda.Event]]] = {}
        self.kept_done: dict[int, tuple[int, torch.cuda.Event]] = {}  # layer -> its device update's OPT
        self.host_keep: list[torch.Tensor] = []
        self.loss_host: torch.Tensor | None = None  # pinned: the step's loss sums, copied right after its last LOSS
        self.loss_copied: torch.cuda.Event | None = None

    # ---- step ---------------------------------------------------------------------------------------------
    def run(self, schedule: Schedule, mbs: list[MicroBatch], denom: int, wait_optimizer: bool = True) -> StepOutput:
        self.schedule = schedule
        self.events: dict[int, torch.cuda.Event] = {}
        self.futures: dict[int, Future] = {}
        self.prev_host_keep = self.host_keep  # the step before may still be copying from these (no device sync)
        self.host_keep: list[torch.Tensor] = []  # pinned host buffers in flight, kept alive for the step
        # what this step's optimizer ops share; worker tasks hold their own step's (the next step may be issuing)
        self.st = _StepState()
        self._timing = []
        self.host_issue_s: dict[str, float] = {}  # this step's host time issuing ops, by kind (waits included)
        self.host_wait_s = 0.0  # of which: waiting for optimizer tasks
        self.host_loss_wait_s = 0.0  # after issuing: waiting for the losses
        if self.sync_between_steps:
            torch.cuda.synchronize(self.device)
        self.t0_event = torch.cuda.Event(enable_timing=True)
        self.t0_event.record(self.streams[Stream.COMPUTE])
        self.t0_host = time.perf_counter()
        with torch.cuda.stream(self.streams[Stream.COMPUTE]):  # inputs are moved on the compute stream
            out = super().run(schedule, mbs, denom)  # issues everything; reading the losses waits for compute
        applied = self.st.ok()
        if not applied:  # the device updates were issued with this step's count and changed nothing: the host's
            # count goes back (worker tasks skipped theirs; the worker's end_step leaves the schedule's index)
            self._skipped += 1
            for layer in schedule.config.gpu_opt:
                if layer in self.optimizer.opts:
                    self.optimizer.opts[layer].state[self.optimizer.params[layer]]["step"].sub_(1)
        if wait_optimizer:
            self.drain()
        return StepOutput(out.loss, out.mb_loss_sums, self.st.norm(), out.lr, applied)

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
        self._step_base = steps_done - self.steps_issued + self._skipped

    def _quiesce(self) -> None:
        self.drain()

    def _begin_step(self) -> float:
        from megatrain.runtime.optim import lr_at

        # the worker runs begin/end in order with the optimizer tasks of the steps before; device updates, issued
        # by this thread, use this step's lr and clip factor directly and do not wait for the worker
        self.worker.submit(self.optimizer.begin_step)
        self.step_lr = lr_at(self.optimizer.cfg, self._step_base + self.steps_issued - self._skipped)
        return self.step_lr

    def _end_step(self) -> None:
        self.worker.submit(lambda st=self.st: self.optimizer.end_step(applied=st.ok()))
        self.steps_issued += 1

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

    def _copy_losses(self) -> None:
        """Right after the step's last LOSS: its loss sums to pinned host memory, on the ``d2h`` stream, so reading
        them at the step's end waits for this copy alone. A device-to-host copy queues behind the copies issued
        before it on the copy engine (the step before's optimizer-state stores, up to a third of a step on the
        H200); on the compute stream it would hold the backward back until they end."""
        n = len(self.loss_sums)
        if self.loss_host is None or self.loss_host.numel() != n:
            self.loss_host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        sums = torch.stack([t.float().reshape(()) for t in self.loss_sums])  # every LOSS has run: all tensors
        self.loss_copied = self._to_pinned(sums, self.loss_host, torch.cuda.current_stream())

    def _to_pinned(self, src: torch.Tensor, dst: torch.Tensor, made_on: torch.cuda.Stream) -> torch.cuda.Event:
        """Copy ``src`` (made on ``made_on``) into pinned ``dst`` on the ``d2h`` stream; the event marks the copy
        done."""
        d2h = self.streams[Stream.D2H]
        d2h.wait_stream(made_on)
        src.record_stream(d2h)
        with torch.cuda.stream(d2h):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    def _loss_values(self) -> list[float]:
        if self.loss_copied is None:
            return super()._loss_values()
        t = time.perf_counter()
        self.loss_copied.synchronize()
        self.host_loss_wait_s = time.perf_counter() - t
        self.loss_copied = None
        return self.loss_host.tolist()

    # ---- issuing ------------------------------------------------------------------------------------------
    def _issue(self, op: Op) -> None:
        t_issue = time.perf_counter()
        try:
            self._issue_op(op)
        finally:  # host time per op kind, and how much of it went to waiting for the optimizer worker
            self.host_issue_s[op.kind.value] = self.host_issue_s.get(op.kind.value, 0.0) + (
                time.perf_counter() - t_issue)

    def _wait(self, fut: Future) -> None:
        if not fut.done():
            t = time.perf_counter()
            fut.result()
            self.host_wait_s += time.perf_counter() - t
        else:
            fut.result()

    def _issue_op(self, op: Op) -> None:
        ops = self.schedule.ops
        gpu_deps = [d for d in op.deps if ops[d].stream is not Stream.CPU]
        cpu_deps = [d for d in op.deps if ops[d].stream is Stream.CPU]
        if op.kind is OpKind.LOAD_W:  # the previous step's update of these weights must be done
            prev = self.last_opt.get(self.graph.owner(op.layer))
            if prev is not None:
                self._wait(prev)
        if op.kind is OpKind.OPT and self.st.coef is None:
            self._guard(gpu_deps)
        if op.stream is Stream.CPU:
            if op.kind is OpKind.OPT:  # the host master changes: a copy kept on the device would be stale
                self.kept.pop(op.layer, None)
            events = [self.events[d] for d in gpu_deps]
            deps = [self.futures[d] for d in cpu_deps]

            def task(op=op, events=events, deps=deps, st=self.st):
                for f in deps:
                    f.result()
                for e in events:
                    e.synchronize()
                start = time.perf_counter()
                self._execute(op, st)
                return start, time.perf_counter()

            fut = self.worker.submit(task)
            self.futures[op.id] = fut
            if op.kind is OpKind.OPT:
                self.last_opt[op.layer] = fut
            self._timing.append((op, fut))
            return
        for d in cpu_deps:
            self._wait(self.futures[d])
        stream = self.streams[op.stream]
        for d in gpu_deps:
            stream.wait_event(self.events[d])
        if not self.sync_between_steps:
            self._wait_for_earlier_steps(op, stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            self._execute(op)
            end.record(stream)
            if op.kind is OpKind.LOSS and op.mb == len(self.loss_sums) - 1:
                self._copy_losses()
        self.events[op.id] = end
        self._timing.append((op, (start, end)))
        if not self.sync_between_steps:
            for role, idx in op.slots:
                if SLOT_POOL[role] in BUFFER_POOLS:
                    self.slot_use[(SLOT_POOL[role], idx)] = (self.steps_issued, end, (op.kind, op.layer))
            if op.kind is OpKind.OPT:  # on the device: the kept weights are ready when it ends
                self.kept_done[op.layer] = (self.steps_issued, end)

    def _wait_for_earlier_steps(self, op: Op, stream: torch.cuda.Stream) -> None:
        """What the schedule of one step cannot say: a slot this op writes may still be read by an earlier step's
        op, and a layer's host copy this op loads may still be being written by an earlier step's STORE_OPT."""
        writes = self.tags[op.id][1]
        for role, idx in op.slots:
            last = self.slot_use.get((SLOT_POOL[role], idx))
            if role in writes and last is not None and last[0] < self.steps_issued:
                if op.kind is OpKind.LOAD_OPT and last[2] == (OpKind.STORE_OPT, op.layer):
                    continue  # its own state's store: each row waits for that row's (see _execute)
                stream.wait_event(last[1])
        if op.kind is OpKind.LOAD_W:
            o = self.graph.owner(op.layer)
            if self.kept_weights(o) is not None:
                done = self.kept_done.get(o)
                if done is not None and done[0] < self.steps_issued:
                    stream.wait_event(done[1])
            else:  # from the host block (or its shadow), which a device update of the step before may still be
                # writing
                self._wait_for_rows(o, stream, (OPT_STATE_ROWS,))

    def _wait_for_rows(self, layer: int, stream: torch.cuda.Stream, rows) -> None:
        """``stream`` waits for the copies of ``rows`` of ``layer``'s host block by an earlier step's STORE_OPT."""
        done = self.store_opt_done.get(layer)
        if done is not None and done[0] < self.steps_issued:
            for r in rows:
                stream.wait_event(done[1][r])

    # ---- ops whose data crosses streams or the PCIe bus ------------------------------------------------------
    def _execute(self, op: Op, st: "_StepState | None" = None) -> None:
        st = st or self.st
        k, l = op.kind, op.layer
        if k is OpKind.SAVE_ACT:
            t = self.act[op.slot("a")]
            t.record_stream(self.streams[Stream.D2H])
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self.host_act[(l, op.mb)] = host
        elif k is OpKind.LOAD_ACT:
            host = self.host_act.pop((l, op.mb))
            self.host_keep.append(host)
            t = host.to(self.device, non_blocking=True)
            t.record_stream(self.streams[Stream.COMPUTE])
            self.act[op.slot("a")] = t
        elif k is OpKind.LOAD_OPT:  # row by row, each after the same row's store by the step before: the load
            # of a large layer's state starts while the rest of it is still being stored
            stream = torch.cuda.current_stream()
            self._load_opt(op, before_row=lambda r: self._wait_for_rows(l, stream, (r,)))
        elif k is OpKind.STORE_OPT:
            rows: list[torch.cuda.Event] = []

            def stored(r: int) -> None:
                rows.append(torch.cuda.Event())
                rows[-1].record()

            self._store_opt(op, after_row=stored)
            stored(OPT_STATE_ROWS)  # and the bf16 shadow, where there is one
            self.store_opt_done[l] = (self.steps_issued, rows)
        elif k is OpKind.STORE_G and op.stream is Stream.COMPUTE:  # a device update's gradient: stays on the GPU
            src = self.g[op.slot("g")][: self.graph.weight_params(l)]
            row = self._opt_block(op)[3]
            self._put_part(row, src, l)
            if self.optimizer.cfg.max_grad_norm is not None and self.graph.owner(l) == l:  # complete: its norm
                st.grad_norms.append(torch.linalg.vector_norm(row))
        elif k is OpKind.STORE_G:
            o = self.graph.owner(l)
            src = self.g[op.slot("g")][: self.store.grad(o).numel()]
            clip = self.optimizer.cfg.max_grad_norm is not None
            if o in self.tied:  # tied weights: the parts are summed on the GPU, the sum goes to the host once
                buf = self.tied_sum.get(o)
                if buf is None:
                    buf = self.tied_sum[o] = torch.empty(src.numel(), dtype=torch.float32, device=self.device)
                if o not in st.tied_parts:
                    buf.copy_(src)
                    st.tied_parts[o] = 1
                    return
                buf.add_(src)
                st.tied_parts[o] += 1
                if st.tied_parts[o] < self.tied[o]:
                    return
                src = buf
            if clip:
                st.grad_norms.append(torch.linalg.vector_norm(src))
            self.store.grad(o).copy_(src, non_blocking=True)
            self.stored.add(o)
        elif k is OpKind.OPT and op.stream is Stream.COMPUTE:  # issued by this thread on the compute stream,
            # after its LOAD_OPT; the factor on the device stops a step that must not update (the fused kernel)
            if not self.optimizer.cfg.fused and not st.ok():  # torch's AdamW would apply it: the host decides
                self._keep(l, self._opt_block(op)[0])
                return
            self._update_on_device(op, lr=self.step_lr, coef=st.coef)
        elif k is OpKind.OPT:  # a worker task: the optimizer is at this step (begin_step ran before it)
            if not st.ok():  # the loss or the norm is not finite: no update
                return
            if st.clip:
                self.optimizer.set_grad_norm(st.norm())
            self.optimizer.step_layer(l)
        else:
            super()._execute(op)

    def _guard(self, store_deps: list[int]) -> None:
        """At the step's first OPT (every LOSS has run; with clipping every gradient is stored, and ``store_deps``,
        the ops it waits for, end the stores on each stream): on the compute stream, the global norm from the
        per-gradient norms, the step's loss, and the factor device updates scale the gradient by (the clip factor,
        or 1; NaN where either is not finite); their copy to pinned memory on the ``d2h`` stream. The host thread
        does not wait: device updates read the factor on the device, host updates and the step's result wait for
        the copy."""
        st, compute = self.st, self.streams[Stream.COMPUTE]
        st.clip = self.optimizer.cfg.max_grad_norm is not None
        for d in store_deps:
            compute.wait_event(self.events[d])
        with torch.cuda.stream(compute):
            for n in st.grad_norms:  # made on the stream of their store
                n.record_stream(compute)
            zero = torch.zeros((), device=self.device)
            total = (torch.linalg.vector_norm(torch.stack(st.grad_norms)) if st.clip and st.grad_norms else zero)
            loss = torch.stack([t.float().reshape(()) for t in self.loss_sums]).sum()
            guard = torch.stack([total.float(), loss])
            coef = self.optimizer.clip_factor(total) if st.clip else torch.ones((), dtype=torch.float64,
                                                                                  device=self.device)
            st.coef = torch.where(torch.isfinite(guard).all(), coef, float("nan"))
        st.guard_host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        st.guard_copied = self._to_pinned(guard, st.guard_host, compute)

    # ---- measurement --------------------------------------------------------------------------------------
    def timeline(self):
        """The last step as measured: start and end of every op, seconds from the step's start."""
        from megatrain.planner.cost import device_memory
        from megatrain.planner.simulate import Timeline

        self.drain()
        ops, starts, ends = [], [], []
        for op, t in sorted(self._timing, key=lambda x: x[0].id):
            if isinstance(t, Future):
                a, b = t.result()
                a, b = a - self.t0_host, b - self.t0_host
            else:
                a, b = self.t0_event.elapsed_time(t[0]) / 1e3, self.t0_event.elapsed_time(t[1]) / 1e3
            ops.append(op)
            starts.append(a)
            ends.append(b)
        return Timeline(source="measured", ops=tuple(ops), start_s=starts, end_s=ends,
                        reserved_nbytes=device_memory(self.graph, self.schedule).total_nbytes, n_steps=1)
