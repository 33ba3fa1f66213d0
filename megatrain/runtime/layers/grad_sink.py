"""Weight gradients written by their GEMM straight into the layer's fp32 gradient slot.

Left to autograd, a linear layer's weight gradient ``dy^T x`` is a new tensor in the compute dtype, which the
executor then converts and adds into the fp32 gradient slot: per micro-batch a parameter-sized bf16 write, a read
of it and an fp32 read-modify-write, with each micro-batch's gradient rounded to bf16 before the sum. In the
templates' linears (:class:`SinkLinear`) the backward instead computes it as one GEMM whose output is the slot
itself (fp32 output; beta 0 for the first write, 1 to add), and the bias gradient as an fp32 sum added there.
Autograd then returns no gradient for those parameters; the executor's :class:`GradSink` knows which spans were
written and treats the rest as before.

The sink in effect is a process-wide setting (:func:`sink_to`): the executor sets it around each ``autograd.grad``
it calls. Autograd may run a CUDA backward on its own device thread, so a thread-local would not be seen there.
Outside any sink a :class:`SinkLinear` is an ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

_current: list = [None]  # the GradSink of the backward running now, if any


@contextlib.contextmanager
def sink_to(sink: "GradSink"):
    """Send the weight gradients of template linears to ``sink`` while the block runs (a backward)."""
    if _current[0] is not None:
        raise RuntimeError("a gradient sink is already in effect: backward passes of two layers cannot overlap")
    _current[0] = sink
    try:
        yield sink
    finally:
        _current[0] = None


class GradSink:
    """Where one backward's parameter gradients go: ``g``, the layer's fp32 gradient slot (a parameter at element
    offset ``o`` of the layer's weights has its gradient at ``g[o:]``). ``accumulate``: the slot already holds
    gradients of earlier micro-batches (else each span is written by the first gradient that reaches it and
    cleared if none does)."""

    def __init__(self, g: torch.Tensor, accumulate: bool):
        self.g, self.accumulate = g, accumulate
        self.written: set[int] = set()
        self.absent: set[int] = set()  # offsets of parameters that got no gradient in this backward

    def _span(self, offset: int, shape) -> tuple[torch.Tensor, bool]:
        dst = self.g[offset: offset + math.prod(shape)].view(shape)
        add = self.accumulate or offset in self.written
        self.written.add(offset)
        return dst, add

    def matmul(self, offset: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """The span at ``offset`` (shape of ``a @ b``) gets ``a @ b`` added, or written if nothing is there yet."""
        dst, add = self._span(offset, (a.shape[0], b.shape[1]))
        if a.dtype == dst.dtype:
            if add:
                dst.addmm_(a, b)
            else:
                torch.mm(a, b, out=dst)
        elif a.is_cuda:  # 16-bit inputs, fp32 out of the GEMM (mm/addmm with out_dtype: CUDA only)
            if add:
                torch.addmm(dst, a, b, out_dtype=dst.dtype, out=dst)
            else:
                torch.mm(a, b, out_dtype=dst.dtype, out=dst)
        else:  # 16-bit compute on the CPU: product in the compute dtype, then converted
            p = a @ b
            dst.add_(p) if add else dst.copy_(p)

    def sum_rows(self, offset: int, t: torch.Tensor) -> None:
        """The span at ``offset`` gets the sum of ``t``'s rows (2-D), taken in fp32."""
        dst, add = self._span(offset, t.shape[1:])
        s = t.sum(0, dtype=dst.dtype)
        dst.add_(s) if add else dst.copy_(s)

    def put(self, offset: int, numel: int, grad: torch.Tensor | None) -> None:
        """A gradient autograd returned for the span (None: the output did not depend on it, or it went to the
        sink already)."""
        if grad is None and offset not in self.written:
            self.absent.add(offset)
        dst, add = self._span(offset, (numel,))
        if grad is None:
            if not add:
                dst.zero_()
        elif add:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))


def param_grads(ctx, dy: torch.Tensor, x: torch.Tensor, weight_index: int, offsets, has_bias: bool):
    """The backward of ``y = x @ weight^T + bias`` for the weight and bias, inputs ``weight_index`` and the one
    after it of an autograd Function: sent to the sink in effect (returns None, None) when there is one and the
    parameters were bound for it (``offsets``: where weight and bias lie in the layer's weights), else returned."""
    need_w, need_b = ctx.needs_input_grad[weight_index], has_bias and ctx.needs_input_grad[weight_index + 1]
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    sink = _current[0]
    if sink is None or offsets is None:  # outside the executor: an ordinary linear's gradients
        return dy2.t() @ x2 if need_w else None, dy2.sum(0) if need_b else None
    w_off, b_off = offsets
    if need_w:
        sink.matmul(w_off, dy2.t(), x2)
    if need_b:
        sink.sum_rows(b_off, dy2)
    return None, None


class _SinkLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, offsets):
        ctx.save_for_backward(x, weight)
        ctx.offsets, ctx.has_bias = offsets, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        return dx, *param_grads(ctx, dy, x, 1, ctx.offsets, ctx.has_bias), None


class _UnreadLinearFunction(_SinkLinearFunction):
    """A linear whose output no gradient reads (see :func:`outputs_unread`): its backward is the linear's, its
    forward saves the inputs and returns an uninitialized tensor of the output's shape instead of forming the
    product (filled with the value :func:`outputs_unread` was given, if any)."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets):
        ctx.save_for_backward(x, weight)
        ctx.offsets, ctx.has_bias = offsets, bias is not None
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        fill = getattr(_unread, "fill", None)
        return out if fill is None else out.fill_(fill)


# outputs_unread in effect (``on``) and the value the skipped outputs are filled with (``fill``), for the thread
# that runs the forward: a recompute's forward runs on the thread that issues the BWD, and no other thread's
# forward (another model's, a step issued elsewhere) may see it
_unread = threading.local()


@contextlib.contextmanager
def outputs_unread(on: bool = True, fill: float | None = None):
    """While a backward's recompute of its layer's forward runs: the template linears marked ``unread`` (the last
    projection before a block's residual sum, whose result only that sum and the layer's output read) keep what
    their backward needs and skip their product. The layer's output is then not its value -- nothing reads it:
    the backward differentiates it against the incoming gradient, which needs the graph and the saved inputs
    alone. Which linears qualify is decided at capture by the block's form and checked on the device by
    :func:`megatrain.runtime.layers.probe.unread_outputs_hold`. ``fill``: a value to fill the skipped outputs with (the
    probe's NaN), none by default."""
    before = getattr(_unread, "on", False), getattr(_unread, "fill", None)
    _unread.on, _unread.fill = on, fill
    try:
        yield
    finally:
        _unread.on, _unread.fill = before


def unread_on() -> bool:
    """Whether :func:`outputs_unread` is in effect on this thread."""
    return getattr(_unread, "on", False)


class SinkLinear(nn.Linear):
    """``nn.Linear`` in a template. While the executor binds its parameters for a backward (``offsets`` set:
    where weight and bias lie in the layer's weights), its backward sends their gradients to the sink. One marked
    ``unread`` skips its product under :func:`outputs_unread`."""

    offsets: tuple[int, int | None] | None = None
    unread = False

    def forward(self, x):
        if self.unread and torch.is_grad_enabled() and getattr(_unread, "on", False):
            return _UnreadLinearFunction.apply(x, self.weight, self.bias, self.offsets)
        if self.offsets is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            return _SinkLinearFunction.apply(x, self.weight, self.bias, self.offsets)
        return F.linear(x, self.weight, self.bias)


def install(module: nn.Module) -> int:
    """Make every ``nn.Linear`` (exactly that class) under ``module`` a :class:`SinkLinear` sharing its
    parameters (a template's are weightless). Returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = SinkLinear.__new__(SinkLinear)
                new.__dict__.update(child.__dict__)
                setattr(parent, name, new)
                count += 1
    return count
