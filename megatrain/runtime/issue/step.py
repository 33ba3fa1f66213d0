"""What one step's ops share: its inputs, the activations in flight, the gradient norms and the update guard."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatrain.ir import Schedule


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (b, T) int64
    attention_mask: torch.Tensor  # (b, T) int64, 1 = real token
    next_labels: torch.Tensor  # (b, T) int64: the label each position predicts (the next token), or -100
    position_ids: torch.Tensor | None = None  # (b, T) int64 restarting at 0 at each document packed into a row;
    # None: 0..T-1 in every row
    rows: dict[str, torch.Tensor] | None = None  # per-row values a step's objective reads (megatrain.objectives)


@dataclass
class StepOutput:
    loss: float  # summed over micro-batches, normalized by the step's valid tokens
    mb_loss_sums: list[float]  # un-normalized cross-entropy sum per micro-batch
    grad_norm: float | None  # global gradient norm before clipping (None without clipping)
    lr: float
    applied: bool = True  # False: the loss or the gradient norm was not finite and no update was applied
    # per mb, on the host: the objective's statistics (a training step with one), or an evaluation's log-probability
    # sum of each row's labels
    stats: list[torch.Tensor] | None = None


@dataclass
class StepState:
    """One step's data, passed to every op handler (:mod:`megatrain.runtime.ops`). Activation slots are the keys of
    ``act`` (the schedule's activation slot indices: tensors are made fresh, the caching allocator recycles them)."""

    schedule: Schedule
    # on the device; each one's attention mask is None where it has no padding and the model allows None, PACKED
    # (capture.tracer) where its rows hold several documents, kept apart by their position ids
    mbs: list[MicroBatch]
    denom: int  # valid (label != -100) tokens of the whole step
    lr: float
    clip: bool  # the step's updates are scaled by the clip factor of the global gradient norm
    act: dict[int, torch.Tensor] = field(default_factory=dict)  # activation slot -> tensor
    host_act: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, mb) -> host checkpoint
    side: dict[int, dict] = field(default_factory=dict)  # mb -> the side inputs the embedding layer returned
    # mb -> the gradients the blocks' backward gave the side inputs computed from parameters (Captured.grad_sides),
    # summed; the embedding's backward differentiates against them
    side_grads: dict[int, dict] = field(default_factory=dict)
    saved: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (layer, mb) -> a saved forward's autograd
    loss_sums: list = field(default_factory=list)  # per mb: its cross-entropy sum (a device tensor once computed)
    # what the head minimizes instead of the cross-entropy (megatrain.objectives.Objective; None: the cross-entropy),
    # and per mb what its LOSS (or an evaluation's EVAL) reports besides the loss (StepOutput.stats)
    objective: Callable | None = None
    stats: list = field(default_factory=list)
    param_norms: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter -> its gradient's L2 norm
    tied_parts: dict[int, int] = field(default_factory=dict)  # owner -> parts of its tied gradient summed so far
    # owner -> offsets of its parameters no backward of the step gave a gradient (every micro-batch's, every tied
    # part's): their updates leave them alone, as torch.optim.AdamW leaves a parameter whose .grad is None
    absent: dict[int, frozenset[int]] = field(default_factory=dict)
    # per mb, where the model has a router loss: its routers' sums over the layers run so far
    # (runtime.layers.router_aux)
    aux: list | None = None
    # its host OPTs that write the masters alone, their moments computed after the update pass (the streaming
    # executor's defer_moments); decided when the step is issued, so a task the worker runs late sees its own step's
    deferred_moments: frozenset[int] = frozenset()
    # layers whose update made before the guard (ScheduleConfig.speculate) its CHECK undid: the step was clipped,
    # or must not update
    redone: list[int] = field(default_factory=list)
    # made by the step's GUARD op (ops.update.form_guard), on the device: the factor updates scale the gradient by (the
    # clip factor, or 1; NaN where the loss or the norm is not finite), and (global norm or 0, the step's loss,
    # factor)
    guard: torch.Tensor | None = None
    coef: torch.Tensor | None = None
    fetch: Callable[[], torch.Tensor] | None = None  # the guard's values on the host (the issuer's copy), once
    _host: torch.Tensor | None = None

    def guard_values(self) -> torch.Tensor:
        if self._host is None:
            self._host = self.fetch()
        return self._host

    def ok(self) -> bool:
        """Whether the step's updates may run: its loss and global norm finite (waits for them on the host)."""
        return self.guard is None or bool(torch.isfinite(self.guard_values()).all())

    def coef_value(self) -> float:
        """The clip factor on the host."""
        return float(self.guard_values()[2])

    def norm(self) -> float | None:
        """The global gradient norm before clipping (None without clipping)."""
        return float(self.guard_values()[0]) if self.clip and self.guard is not None else None
