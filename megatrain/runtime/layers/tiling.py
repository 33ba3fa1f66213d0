"""A block's MLP over tiles of the tokens (``ScheduleConfig.seq_tile``).

At long sequences the MLP's intermediate dominates a layer's working set: for one 524,288-token sequence of a
Qwen2.5-7B shape, gate, up and their product are 3 x 524,288 x 18,944 bf16 values, 60 GB, where everything else
the layer holds is a fraction of that. The MLP is token-wise, so it can run over the tokens a tile at a time: without
autograd (a forward op) each tile's intermediate is freed before the next; with autograd (a backward op's recompute)
each tile runs under torch's non-reentrant checkpoint, which keeps its input alone and recomputes the tile ahead of
its backward. The intermediate then exists for one tile at a time, at the price of one more forward of the MLP in a
backward (the planner charges it: ``Layer.tile_flops_per_token``). Results equal the untiled MLP's up to the order
in which the tiles' weight gradients are summed.

Where the MLP's output is read by nothing but the block's residual sum (its last projection marked ``unread``, as
the executor's probe confirms: ``grad_sink.outputs_unread``), a backward's recompute does not form the tiles at all:
the MLP's output stands uninitialized in the block's output, which only its gradient is taken against, and each tile
runs for the first time in the backward, without its last projection's product (:class:`_TilesInBackward`). The
tiled backward then costs the untiled one's FLOPs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatrain.capture.blocks import mlp_tileable
from megatrain.layout import NORM_WITH_MLP
from megatrain.runtime.layers.grad_sink import SinkLinear, outputs_unread, unread_on


class TiledMLP(nn.Module):
    """Runs ``inner`` (a block's MLP, after ``norm`` where given) over tiles of ``tile`` tokens (the rows' tokens
    laid end to end) while ``tile`` is set; as ``inner(norm(x))`` otherwise."""

    def __init__(self, inner: nn.Module, norm: nn.Module | None = None):
        super().__init__()
        self.inner = nn.Sequential(norm, inner) if norm is not None else inner
        self.tile = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.tile
        if not n or x.shape[:-1].numel() <= n:
            return self.inner(x)
        if torch.is_grad_enabled():
            # the backward runs after the executor has unbound the template's weights: each tile binds them again
            binding = _binding(self.inner)
            run = functools.partial(_rebound, self.inner, binding)
            if self.output_unread():
                params = [v for _, _, v in binding if isinstance(v, torch.Tensor) and v.requires_grad]
                return _TilesInBackward.apply(run, n, x, *params)
            # the tile's input is kept, its intermediate recomputed in the backward (the random state with it)
            with outputs_unread(False):
                outs = [checkpoint(run, p, use_reentrant=False) for p in _parts(x, n)]
        else:
            outs = [self.inner(p) for p in _parts(x, n)]
        return torch.cat(outs, dim=1).view(*x.shape[:-1], -1)

    def output_unread(self) -> bool:
        """Whether this forward is a backward's recompute whose MLP output nothing reads but the block's residual sum
        (its last projection marked ``unread``, under ``outputs_unread``), with no dropout to replay."""
        mods = list(self.inner.modules())
        return unread_on() and any(isinstance(m, SinkLinear) and m.unread for m in mods) and \
            not any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in mods)


def _parts(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``x``'s tokens laid end to end, in tiles of ``n``."""
    return x.reshape(1, -1, x.shape[-1]).split(n, dim=1)


class _TilesInBackward(torch.autograd.Function):
    """The MLP over tiles of ``n`` tokens where its output is not read (:meth:`TiledMLP.output_unread`): the forward
    keeps ``x`` and returns an uninitialized tensor of its shape; the backward runs each tile's forward (its last
    projection's product skipped) and backward, and returns the input's gradient and those of the bound parameters
    ``params`` that autograd routes (the linears' weights go to the gradient sink in effect, as in any backward)."""

    @staticmethod
    def forward(ctx, run, n: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.n, ctx.params = run, n, params  # (the tensors the tiles' forward binds, as bound)
        ctx.save_for_backward(x)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,), params = ctx.saved_tensors, ctx.params
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # each tile's gradient copied in (not two)
        dps = [None] * len(params)
        # (autograd may run this on its own device thread, where the issuing thread's setting is not seen)
        with torch.enable_grad(), outputs_unread(True):
            for p, g, into in zip(_parts(x, ctx.n), _parts(dy, ctx.n), _parts(dx, ctx.n)):
                p = p.detach().requires_grad_()
                got = torch.autograd.grad(ctx.run(p), [p, *params], g, allow_unused=True)
                into.copy_(got[0])
                dps = [a if b is None else b if a is None else a + b for a, b in zip(dps, got[1:])]
        return None, None, dx, *dps


def _binding(module: nn.Module) -> list[tuple[dict, str, object]]:
    """What the executor has bound in ``module`` now, as (where, key, value): its parameters (views of the layer's
    weights, in each module's ``_parameters``) and the linears' gradient-sink offsets (in their ``__dict__``)."""
    out = [(m._parameters, a, t) for m in module.modules() for a, t in m._parameters.items() if t is not None]
    return out + [(m.__dict__, "offsets", m.offsets) for m in module.modules() if isinstance(m, SinkLinear)]


def _rebound(module: nn.Module, binding, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with ``binding`` in place (the state :func:`_binding` saw), what was there put back after."""
    saved = [(where, key, where.get(key)) for where, key, _ in binding]
    for where, key, value in binding:
        where[key] = value
    try:
        return module(x)
    finally:
        for where, key, value in reversed(saved):
            where[key] = value


def norm_joins(template: nn.Module, model_type: str | None) -> bool:
    """Whether the block's post-attention norm runs in the MLP's tiles (:data:`NORM_WITH_MLP`)."""
    return model_type in NORM_WITH_MLP and isinstance(getattr(template, "post_attention_layernorm", None), nn.Module)


def install(template: nn.Module, model_type: str | None = None) -> list[TiledMLP]:
    """Wrap the block template's ``mlp`` (with its post-attention norm, :func:`norm_joins`; the norm's place then
    holds an identity) in a :class:`TiledMLP`, after its parameters are bound by reference: the wrapping changes no
    module that holds them. Returns the wrappers (none where there is no ``mlp`` or its forward takes more than the
    hidden states: ``capture.blocks.mlp_tileable``)."""
    mlp = getattr(template, "mlp", None)
    if not isinstance(mlp, nn.Module) or not (isinstance(mlp, TiledMLP) or mlp_tileable(mlp)):
        return []
    if not isinstance(mlp, TiledMLP):
        norm = None
        if norm_joins(template, model_type):
            norm, template.post_attention_layernorm = template.post_attention_layernorm, nn.Identity()
        template.mlp = TiledMLP(mlp, norm)
    return [template.mlp]


@contextlib.contextmanager
def tiles(wrappers: list[TiledMLP], n: int):
    """The wrappers run over tiles of ``n`` tokens inside (0: untiled)."""
    for w in wrappers:
        w.tile = n
    try:
        yield
    finally:
        for w in wrappers:
            w.tile = 0
