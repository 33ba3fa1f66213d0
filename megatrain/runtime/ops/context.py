"""What an op's handler works with: :class:`OpContext`, the one object every handler takes as ``ctx``.

It names the parts of the executor a handler may touch -- the captured model and its graph, the host store, the
optimizer, the device state, the layer templates, the dropout draws, data parallelism -- and :class:`Copies`, the
issuer's way of moving data between host and device. A handler reaches nothing else of the issuer that runs it, so
the program-order and the stream issuer run the same handlers, and a test can run one with a context of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from megatrain.capture import Captured
from megatrain.capture import documents, packed_attention
from megatrain.capture.tracer import PACKED, Packed
from megatrain.runtime.issue.step import StepState
from megatrain.runtime.ops.compute import WeightRef


class Copies(ABC):
    """How an issuer moves data between host and device and orders those copies: the program-order issuer copies
    synchronously (:class:`InOrderCopies`), the stream issuer on its copy streams with events
    (:class:`~megatrain.runtime.issue.stream_copies.StreamCopies`)."""

    non_blocking: bool  # host <-> device copies that do not make the host wait

    @abstractmethod
    def input_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """An input tensor (a LOAD_IN's) on the compute device."""

    @abstractmethod
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A checkpoint's offload (SAVE_ACT): its host copy."""

    @abstractmethod
    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A checkpoint's reload (LOAD_ACT): its device copy."""

    @abstractmethod
    def keep_alive(self, t: torch.Tensor) -> None:
        """``t``, made on another stream, is read on the current one."""

    @abstractmethod
    def losses_to_host(self, st: StepState) -> None:
        """After the step's last LOSS (or EVAL): its loss sums on their way to the host."""

    @abstractmethod
    def loss_values(self, st: StepState) -> list[float]:
        """Each micro-batch's loss sum, as floats (waits for them)."""

    @abstractmethod
    def guard_to_host(self, st: StepState) -> None:
        """The step's guard, just formed: sets ``st.fetch``, how the host reads it."""

    @abstractmethod
    def before_row(self, layer: int, row: int, st: StepState | None) -> None:
        """Before a LOAD_OPT of step ``st`` copies ``row`` of ``layer``'s host block: wait for what writes it."""

    @abstractmethod
    def row_stored(self, layer: int, row: int) -> None:
        """After ``row`` of ``layer``'s host block is written (row OPT_STATE_ROWS: the bf16 shadow)."""

    @abstractmethod
    def release_host_acts(self, st: StepState) -> None:
        """The step's offloaded checkpoints not reloaded (none, unless the step stopped part way) go."""


class InOrderCopies(Copies):
    """Every copy synchronous, in program order: nothing to wait for, nothing to keep alive."""

    non_blocking = False

    def __init__(self, device: torch.device):
        self.device = device

    def input_to_device(self, t: torch.Tensor) -> torch.Tensor:
        # from pinned memory on a GPU, so the host does not wait for the copy (a copy from pageable memory does)
        if self.device.type != "cuda" or t.device.type != "cpu":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", copy=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device)

    def keep_alive(self, t: torch.Tensor) -> None:
        pass  # one stream: nothing is read on another

    def losses_to_host(self, st: StepState) -> None:
        pass  # read at the step's end, in program order

    def loss_values(self, st: StepState) -> list[float]:
        return [float(t) for t in st.loss_sums]

    def guard_to_host(self, st: StepState) -> None:
        st.fetch = lambda: st.guard.detach().cpu()

    def before_row(self, layer: int, row: int, st: StepState | None) -> None:
        pass  # the store before it has run

    def row_stored(self, layer: int, row: int) -> None:
        pass  # no later op waits on an event

    def release_host_acts(self, st: StepState) -> None:
        st.host_act.clear()


@dataclass(eq=False)
class OpContext:
    """The parts of an executor its handlers use (see the module's docstring). ``dp``: the data-parallel ranks a step
    sums gradients and losses over (:mod:`megatrain.runtime.issue.data_parallel`), None alone. ``bwd_weights``: while
    the BWD of a layer whose forward saved its activations runs, the weight slot its saved weights are views of."""

    captured: Captured
    store: object  # runtime.memory.store.HostStore
    optimizer: object  # runtime.optim.HostAdamW
    dev: object  # runtime.memory.device.DeviceState
    runner: object  # runtime.layers.templates.LayerRunner
    rng: object  # runtime.layers.rng.StepRng
    copies: Copies
    device: torch.device
    dtype: torch.dtype
    head_loss: object | None  # capture's HeadLossSpec: the head runs as the fused linear + cross-entropy kernel
    param_spans: dict  # owner layer -> [(parameter name, offset, elements)] of its parameters that take a gradient
    dp: object | None = None
    bwd_weights: torch.Tensor | None = None

    @property
    def graph(self):
        return self.captured.graph

    def packed_mask(self, position_ids: torch.Tensor) -> Packed:
        """The mask marker of a micro-batch of packed rows: with the documents' offsets, on the device, where the
        model's attention reads them there (capture.packed_attention), else the mask builders work them out; and
        with the documents' layout where the blocks' recurrences run them apart (capture.documents)."""
        put = self.copies.input_to_device
        docs = documents.buckets(position_ids).to(put) if self.captured.docs_apart else None
        if not (self.captured.varlen and self.device.type == "cuda"):
            return PACKED if docs is None else Packed(docs=docs)
        cu, longest = packed_attention.doc_offsets(position_ids)
        return Packed(put(cu), longest, docs=docs)

    def unpack(self, packed):
        """The saved-tensor unpack hook of a saved forward (see ops.compute.WeightRef)."""
        return packed.view_of(self.bwd_weights) if isinstance(packed, WeightRef) else packed
