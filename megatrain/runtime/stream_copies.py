"""The copies the stream issuer's handlers and steps make, each on the stream that keeps it off the critical path.

A mixin of :class:`~megatrain.runtime.streams.StreamExecutor`: it uses ``self.cuda`` (a
:class:`~megatrain.runtime.cuda_api.TorchCuda` or a fake), ``self.streams``, ``self.device``, ``self.order`` (its
:class:`~megatrain.runtime.step_order.StepOrder`), ``self.steps_issued``, ``self.timer`` and ``self.host_keep``.
"""

from __future__ import annotations

import torch

from megatrain.ir import Stream
from megatrain.runtime.step import StepState


class StreamCopies:
    loss_host: torch.Tensor | None = None  # pinned: the step's loss sums, copied right after its last LOSS
    loss_copied = None  # the event that marks that copy done

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

    def _loss_values(self, st: StepState) -> list[float]:
        self.timer.loss_wait(self.loss_copied.synchronize)
        return self.loss_host.tolist()

    def guard_to_host(self, st: StepState) -> None:
        """The step's guard, just formed on the compute stream, to pinned memory on the ``d2h`` stream: device
        updates read the factor on the device, host updates and the step's result wait for the copy."""
        host = self.cuda.pinned(3, st.guard.dtype)
        copied = self._to_pinned(st.guard, host, self.cuda.current_stream())
        st.fetch = lambda: (copied.synchronize(), host)[1]

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.cuda.record_stream(t, self.cuda.current_stream())
        host = self.cuda.pinned(t.shape, t.dtype)
        host.copy_(t, non_blocking=True)
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.host_keep.append(host)
        t = host.to(self.device, non_blocking=True)
        self.cuda.record_stream(t, self.streams[Stream.COMPUTE])
        return t

    def keep_alive(self, t: torch.Tensor) -> None:
        self.cuda.record_stream(t, self.cuda.current_stream())

    def before_row(self, layer: int, row: int) -> None:  # each row after the same row's store by the step before:
        # the load of a large layer's state starts while the rest of it is still being stored
        self.order.wait_for_rows(layer, self.cuda.current_stream(), (row,), self.steps_issued)

    def _row_stored(self, layer: int, row: int) -> None:
        done = self.cuda.new_event()
        done.record()
        self.order.row_stored(layer, row, self.steps_issued, done)
