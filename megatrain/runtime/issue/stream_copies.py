"""The copies the stream issuer's handlers and steps make, each on the stream that keeps it off the critical path.

:class:`StreamCopies` is the :class:`~megatrain.runtime.ops.context.Copies` of
:class:`~megatrain.runtime.issue.streams.StreamExecutor`; it owns the pinned buffers of offloaded checkpoints
(:class:`CheckpointBuffers`) and of the step's losses.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from megatrain.ir import Stream
from megatrain.runtime.issue.step import StepState
from megatrain.runtime.ops.context import Copies


class StreamCopies(Copies):
    """``cuda``: a :class:`~megatrain.runtime.issue.cuda_api.TorchCuda` or a fake; ``streams``: the IR streams' CUDA
    streams; ``order``: the executor's :class:`~megatrain.runtime.issue.step_order.StepOrder`; ``timer``: its
    :class:`~megatrain.runtime.issue.timing.OpTimer`; ``steps_issued()``: the steps it issued so far;
    ``wait_moments(layer, row, st)``: before a state load's row, the wait for moments the host still computes."""

    non_blocking = True

    def __init__(self, cuda, device: torch.device, streams: dict, order, timer, steps_issued: Callable[[], int],
                 wait_moments: Callable[[int, int, StepState | None], None]):
        self.cuda, self.device, self.streams, self.order, self.timer = cuda, device, streams, order, timer
        self.steps_issued, self.wait_moments = steps_issued, wait_moments
        self.checkpoint_bufs = CheckpointBuffers(cuda)  # the host buffers of offloaded checkpoints, reused
        self.loss_host: torch.Tensor | None = None  # pinned: the step's loss sums, copied right after its last LOSS
        self.loss_copied = None  # the event that marks that copy done

    def input_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """An input on the device, copied from pinned memory on the stream its LOAD_IN runs on (``h2d``, where the
        schedule issues it first in its step: on the compute stream it waited for the step's first optimizer-state
        loads, 0.3 s measured on the H200); the compute stream that reads it waits for the op's event."""
        if t.device.type != "cpu":
            return t.to(self.device)
        out = self.cuda.pin(t).to(self.device, non_blocking=True)
        self.cuda.record_stream(out, self.streams[Stream.COMPUTE])
        return out

    def _to_pinned(self, src: torch.Tensor, dst: torch.Tensor, made_on):
        """Copy ``src`` (made on ``made_on``) into pinned ``dst`` on the ``d2h`` stream; the event marks it done."""
        d2h = self.streams[Stream.D2H]
        d2h.wait_stream(made_on)
        self.cuda.record_stream(src, d2h)
        with self.cuda.use(d2h):
            dst.copy_(src, non_blocking=True)
            done = self.cuda.new_event()
            done.record()
        return done

    def losses_to_host(self, st: StepState) -> None:
        """The step's LOSS_OUT (on the ``d2h`` stream, right after its last LOSS): its loss sums to pinned host
        memory, so reading them at the step's end waits for this copy alone (on the compute stream it would queue behind the step
        before's optimizer-state stores, up to a third of a step on the H200)."""
        n = len(st.loss_sums)
        if self.loss_host is None or self.loss_host.numel() != n:
            self.loss_host = self.cuda.pinned(n, torch.float32)
        sums = torch.stack([t.float().reshape(()) for t in st.loss_sums])  # every LOSS has run: all tensors
        self.loss_copied = self._to_pinned(sums, self.loss_host, self.cuda.current_stream())

    def loss_values(self, st: StepState) -> list[float]:
        self.timer.loss_wait(self.loss_copied.synchronize)
        return self.loss_host.tolist()

    def guard_to_host(self, st: StepState) -> None:
        """The step's guard, just formed on the compute stream, to pinned memory on the ``d2h`` stream: device
        updates read the factor on the device, host updates and the step's result wait for the copy."""
        host = self.cuda.pinned(3, st.guard.dtype)
        copied = self._to_pinned(st.guard, host, self.cuda.current_stream())
        st.fetch = lambda: (copied.synchronize(), host)[1]

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A checkpoint's offload (SAVE_ACT) on the current stream, into a host buffer of :attr:`checkpoint_bufs`."""
        self.cuda.record_stream(t, self.cuda.current_stream())
        host = self.checkpoint_bufs.take(t.shape, t.dtype)
        host.copy_(t, non_blocking=True)
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A checkpoint's reload (LOAD_ACT) on the current stream; its host buffer goes back to
        :attr:`checkpoint_bufs` for a later offload, which waits on the device for this copy to have read it."""
        t = host.to(self.device, non_blocking=True)
        self.cuda.record_stream(t, self.streams[Stream.COMPUTE])
        read = self.cuda.new_event()
        read.record()
        self.checkpoint_bufs.give_back(host, read)
        return t

    def release_host_acts(self, st: StepState) -> None:
        if st.host_act:  # a step stopped part way: the copies into these buffers end before they go
            self.cuda.synchronize(self.device)
            st.host_act.clear()

    def keep_alive(self, t: torch.Tensor) -> None:
        self.cuda.record_stream(t, self.cuda.current_stream())

    def before_row(self, layer: int, row: int, st: StepState | None) -> None:
        # each row after the same row's store by the step before: the load of a large layer's state starts while
        # the rest of it is still being stored
        self.wait_moments(layer, row, st)
        self.order.wait_for_rows(layer, self.cuda.current_stream(), (row,), self.steps_issued())

    def row_stored(self, layer: int, row: int) -> None:
        done = self.cuda.new_event()
        done.record()
        self.order.row_stored(layer, row, self.steps_issued(), done)


class CheckpointBuffers:
    """The pinned host buffers offloaded checkpoints wait in, each exactly a checkpoint's size (not the CUDA host
    caching allocator's power-of-two blocks) and reused from step to step: a reload gives its buffer back with the
    event of its copy, and the offload that takes it next has its stream wait for that event, so the host holds
    one step's checkpoints (what the planner's host accounting, ``cost.host_floor``, charges) and never blocks on
    a copy. Buffers of a shape no longer offloaded go when a new shape needs its first (the host waits for their
    last reads then, once per change of shape)."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.free: dict[tuple, list] = {}  # (shape, dtype) -> [(buffer, the event after its last read)]
        self.lock = threading.Lock()  # offloads and reloads are issued by the host thread and the worker

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self.lock:
            free = self.free.get(key)
            if free:
                host, read = free.pop()
                self.cuda.current_stream().wait_event(read)
                return host
            stale = [k for k, bufs in self.free.items() if k != key and bufs]
            dropped = [self.free.pop(k) for k in stale]
        for bufs in dropped:  # no longer used: let them go (unpinned when the last reference does)
            for _, read in bufs:
                read.synchronize()
        return self.cuda.pinned_exact(key[0], dtype)

    def give_back(self, host: torch.Tensor, read) -> None:
        with self.lock:
            self.free.setdefault((tuple(host.shape), host.dtype), []).append((host, read))
