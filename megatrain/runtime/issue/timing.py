"""Timing the ops the streaming executor issues: CUDA events around GPU ops, the host clock around worker tasks, and
the host thread's own time; the last step as a :class:`~megatrain.ir.Timeline`, the simulator's format."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from megatrain.ir import Op, Schedule
from megatrain.runtime.issue.cuda_api import TORCH_CUDA


class OpTimer:
    def __init__(self, compute, cuda=TORCH_CUDA):
        self.compute, self.cuda = compute, cuda
        self.schedule: Schedule | None = None
        self._timing: list = []
        self.host_issue_s: dict[str, float] = {}  # the last step's host time issuing ops, by kind (waits included)
        self.host_wait_s = 0.0  # of which: waiting for optimizer tasks
        self.host_loss_wait_s = 0.0  # after issuing: waiting for the losses

    def begin(self, schedule: Schedule) -> None:
        self.schedule, self._timing = schedule, []
        self.host_issue_s, self.host_wait_s, self.host_loss_wait_s = {}, 0.0, 0.0
        self.t0_event = self.cuda.new_event(timing=True)
        self.t0_event.record(self.compute)
        self.t0_host = time.perf_counter()

    @contextlib.contextmanager
    def issuing(self, op: Op):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.host_issue_s[op.kind.value] = self.host_issue_s.get(op.kind.value, 0.0) + time.perf_counter() - t

    def waited(self, fut: Future) -> None:
        """Wait for an optimizer task, counting the time the host thread spends on it."""
        if not fut.done():
            t = time.perf_counter()
            fut.result()
            self.host_wait_s += time.perf_counter() - t
        fut.result()

    def loss_wait(self, wait) -> None:
        t = time.perf_counter()
        wait()
        self.host_loss_wait_s = time.perf_counter() - t

    def records(self) -> list:
        """Where the current step's timings go (a worker may time an op of this step after the next began)."""
        return self._timing

    @contextlib.contextmanager
    def on_stream(self, op: Op, stream, into: list | None = None):
        """Around a GPU op issued on ``stream``: yields the event that marks its end; its timing goes ``into`` its
        step's records (default: the current step's)."""
        start, end = self.cuda.new_event(timing=True), self.cuda.new_event(timing=True)
        start.record(stream)
        yield end
        end.record(stream)
        (self._timing if into is None else into).append((op, (start, end)))

    def task(self, op: Op, handler, ex, st, deps: list[Future], events: Callable[[], list]):
        """The worker's task for a ``cpu`` op: wait for the ops it depends on (``deps``: worker tasks; ``events()``,
        once they are done: the GPU ops', some of which the worker itself issued), run it, return its host
        times."""

        def run():
            for f in deps:
                f.result()
            for e in events():
                e.synchronize()
            start = time.perf_counter()
            handler(ex, op, st)
            return start, time.perf_counter()

        return run

    def record_task(self, op: Op, fut: Future) -> None:
        self._timing.append((op, fut))

    def mark(self) -> "Marked":
        """The current step's records as they are and will be (its worker tasks and stores may still be timed after
        the next step began), for :meth:`timeline` of this step once later ones ran."""
        return Marked(self.schedule, self._timing, self.t0_event, self.t0_host, dict(self.host_issue_s),
                      self.host_wait_s, self.host_loss_wait_s)

    def timeline(self, marked: "Marked | None" = None):
        """The last step (or the one ``marked``): start and end of every op, seconds from the step's start (waits
        for the worker). The device memory it reserved is the plan's (``planner.cost.device_memory``), not
        recorded here."""
        from megatrain.ir import Timeline

        m = marked or self.mark()
        ops, starts, ends = [], [], []
        for op, t in sorted(m.timing, key=lambda x: x[0].id):
            if isinstance(t, Future):
                a, b = t.result()
                a, b = a - m.t0_host, b - m.t0_host
            else:
                a, b = m.t0_event.elapsed_time(t[0]) / 1e3, m.t0_event.elapsed_time(t[1]) / 1e3
            ops.append(op)
            starts.append(a)
            ends.append(b)
        return Timeline(source="measured", ops=tuple(ops), start_s=starts, end_s=ends, n_steps=1)


@dataclass(frozen=True)
class Marked:
    """One step's records (:meth:`OpTimer.mark`): what its timeline reads, and its host thread's times."""
    schedule: Schedule
    timing: list
    t0_event: object
    t0_host: float
    host_issue_s: dict
    host_wait_s: float
    host_loss_wait_s: float
