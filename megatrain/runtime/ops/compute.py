"""What each op of a schedule does: one handler per (op kind, stream), used by both issuers.

A handler is ``handler(ctx, op, st)``: ``ctx`` the executor's :class:`~megatrain.runtime.ops.context.OpContext`
(device state, host store, optimizer, templates, and the issuer's :class:`~megatrain.runtime.ops.context.Copies`),
``op`` the op, ``st`` the step's :class:`~megatrain.runtime.issue.step.StepState`. The program-order issuer calls it in program order; the
stream issuer calls it on the op's CUDA stream (a ``cpu`` op on the optimizer worker) once the op's dependencies
are met. Nothing else in the runtime does an op's work. This module holds the loads, copies and compute of weights
and activations; :mod:`megatrain.runtime.ops.update` the gradients' stores and norms, the step's guard (its clip
factor) and the updates; :data:`HANDLERS` maps every (op kind, stream) to its handler.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from megatrain.ir import Op
from megatrain.runtime.layers import router_aux
from megatrain.runtime.layers.grad_sink import GradSink, outputs_unread, sink_to
from megatrain.runtime.layers.kernel_rewrite import keep_less
from megatrain.runtime.issue.step import MicroBatch, StepState
from megatrain.runtime.ops.block_inputs import BlockInputs

IGNORE_INDEX = -100


# ---- inputs, weights and activations --------------------------------------------------------------------------
def load_in(ctx, op: Op, st: StepState) -> None:
    """The micro-batch's inputs to the device: token ids, labels, position ids (0..T-1 in every row where it has
    none), and its mask -- None where :meth:`Executor.run` found no padding and the model allows None, the packed
    documents' marker (with their offsets on the device, where the model's attention reads them) where its rows
    hold several."""
    mb, put = st.mbs[op.mb], ctx.copies.input_to_device
    ids = put(mb.input_ids)
    if mb.position_ids is not None:
        pos, mask = put(mb.position_ids), ctx.packed_mask(mb.position_ids)
    else:
        pos = put(torch.arange(ids.shape[1]).unsqueeze(0)).expand(ids.shape)
        mask = put(mb.attention_mask) if isinstance(mb.attention_mask, torch.Tensor) else mb.attention_mask
    rows = None if mb.rows is None else {k: put(v) for k, v in mb.rows.items()}
    st.mbs[op.mb] = MicroBatch(ids, mask, put(mb.next_labels), pos, rows)


def _host_weights(ctx, layer: int, st: StepState) -> torch.Tensor:
    """The layer's weights in the host store as the schedule sends them: the fp32 master (cast where it lands) or
    the bf16 shadow; both hold the same values in the compute dtype."""
    return ctx.store.shadow(layer) if st.schedule.config.wire_bytes_per_param == 2 else ctx.store.master(layer)


def load_w(ctx, op: Op, st: StepState) -> None:
    """LOAD_W (h2d): the layer's host weights into its weight slot."""
    src = _host_weights(ctx, ctx.graph.owner(op.layer), st)
    ctx.dev.load_cast(ctx.dev.w[op.slot("w")][: src.numel()], src, ctx.copies.non_blocking)


def load_w_kept(ctx, op: Op, st: StepState) -> None:
    """LOAD_W (compute): the weights the layer's device update of the step before, or the set-up's KEEP_W, left on
    the device, into its weight slot (the same values a load from the host would bring)."""
    o = ctx.graph.owner(op.layer)
    src = ctx.dev.kept_weights(o)
    if src is None:
        raise RuntimeError(f"layer {o}'s weights are not on the device, where the step expects them (its plan's "
                           f"set-up has not run since the host store changed)")
    ctx.dev.w[op.slot("w")][: src.numel()].copy_(src)


def keep_w(ctx, op: Op, st: StepState) -> None:
    """KEEP_W (a set-up's): the layer's host weights into the device buffer its device updates keep its new weights
    in, which the steps' compute-stream LOAD_W copies."""
    src = _host_weights(ctx, op.layer, st)
    ctx.dev.load_cast(ctx.dev.kept_buffer(op.layer, src.numel()), src, ctx.copies.non_blocking)
    ctx.dev.keep(op.layer, None, written=True)


def save_act(ctx, op: Op, st: StepState) -> None:
    st.host_act[(op.layer, op.mb)] = ctx.copies.to_host(st.act[op.slot("a")])


def load_act(ctx, op: Op, st: StepState) -> None:
    st.act[op.slot("a")] = ctx.copies.to_device(st.host_act.pop((op.layer, op.mb)))


# ---- compute -------------------------------------------------------------------------------------------------
def fwd(ctx, op: Op, st: StepState) -> None:
    """The layer's forward for one micro-batch, without autograd; a layer in ``saved_acts`` keeps what its backward
    needs instead (:func:`_forward_saved`)."""
    ctx.rng.seed(op.layer, op.mb)
    if op.layer in st.schedule.config.saved_acts:
        return _forward_saved(ctx, op, st)
    logits: list = []
    with torch.no_grad(), _routers(ctx, op, st, logits):
        st.act[op.slot("y")] = _forward(ctx, op, st, keep_side=True)
    if logits:
        router_aux.add(st.aux[op.mb], logits, ctx.captured.router_aux, _aux_mask(st, op.mb))


def refwd(ctx, op: Op, st: StepState) -> None:
    """REFWD: the layer's forward for one micro-batch again, in the backward, to make the checkpoint above it that
    the forward dropped: the same output as the FWD's (the same seed; its router loss was counted there)."""
    ctx.rng.seed(op.layer, op.mb)
    with torch.no_grad():
        st.act[op.slot("y")] = _forward(ctx, op, st, keep_side=False)


def _forward(ctx, op: Op, st: StepState, keep_side: bool) -> torch.Tensor:
    """The layer's output for one micro-batch from its input (the embedding: from the inputs, keeping what the
    blocks read besides their input where ``keep_side``)."""
    if op.layer == 0:
        mb = st.mbs[op.mb]
        h, side = ctx.runner.run(0, ctx.dev.weights(op), (mb.input_ids, mb.attention_mask, mb.position_ids))
        if keep_side:
            st.side[op.mb] = side
        return h
    return ctx.runner.run(op.layer, ctx.dev.weights(op), st.act[op.slot("x")], st.side[op.mb],
                          tile=_tile(ctx, op, st))


def _tile(ctx, op: Op, st: StepState) -> int:
    """Tokens per tile of the layer's MLP in this op (0: untiled)."""
    cfg = st.schedule.config
    return cfg.seq_tile if cfg.tiled(ctx.graph[op.layer], op.layer) else 0


def _routers(ctx, op: Op, st: StepState, logits: list):
    """Where the model has a router loss, collect the router logits of ``op``'s layer run inside into ``logits``."""
    routers = ctx.runner.routers(op.layer) if st.aux is not None else []
    return router_aux.collecting(routers, logits) if routers else contextlib.nullcontext()


def _aux_mask(st: StepState, mb: int) -> torch.Tensor | None:
    """The attention mask HF's router loss weights a micro-batch's rows by (None: no padding, or packed rows)."""
    mask = st.mbs[mb].attention_mask
    return mask if isinstance(mask, torch.Tensor) else None


def _aux_loss(ctx, st: StepState, mb: int) -> torch.Tensor | float:
    """A micro-batch's router loss as its share of the step's loss: ``coef x aux / n_mb`` (0 without one)."""
    if st.aux is None or st.aux[mb].counts is None:
        return 0.0
    spec = ctx.captured.router_aux
    return router_aux.value(st.aux[mb], spec) * (spec.coef / len(st.mbs))


def _aux_outputs(ctx, st: StepState, op: Op, out, dy, probs) -> tuple[list, list]:
    """The outputs a backward differentiates and their gradients: the layer's output against ``dy``, and where
    its routers ran, their probability sums against the router loss's gradient."""
    if probs is None:
        return [out], [dy]
    spec = ctx.captured.router_aux
    return [out, probs], [dy, router_aux.probs_grad(st.aux[op.mb], spec, spec.coef, len(st.mbs))]


def _block_outputs(ctx, st: StepState, op: Op, out, dy, probs, ins: BlockInputs) -> tuple[list, list]:
    """:func:`_aux_outputs` and what the block stored for later blocks (:meth:`BlockInputs.outputs`)."""
    outs, dys = _aux_outputs(ctx, st, op, out, dy, probs)
    more, more_dys = ins.outputs()
    return outs + more, dys + more_dys


def _forward_saved(ctx, op: Op, st: StepState) -> None:
    """The forward of a layer in ``saved_acts``: with autograd on, keeping what its backward needs. The weights it
    saves are views of this weight slot, which other layers overwrite before the backward: they are saved as their
    place in the layer's weights and found again in the slot the BWD reads (:class:`WeightRef`); activations stay
    as they are (on the device, until the BWD)."""
    flat = ctx.dev.weights(op)
    x = st.act[op.slot("x")].detach().requires_grad_()
    views: list = []
    logits: list = []
    ins = BlockInputs(ctx, st, op.mb)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(WeightRef.packer(flat), ctx.unpack), \
            keep_less(st.schedule.config.saved_lean), _routers(ctx, op, st, logits):
        out = ctx.runner.run(op.layer, flat, x, ins.side, grad_views=views)
        probs = router_aux.layer_probs(logits, _aux_mask(st, op.mb)) if logits else None
    ins.commit()
    if logits:
        router_aux.add(st.aux[op.mb], logits, ctx.captured.router_aux, _aux_mask(st, op.mb))
    st.saved[(op.layer, op.mb)] = (out, x, views, probs, ins)
    st.act[op.slot("y")] = out.detach()


def loss(ctx, op: Op, st: StepState) -> None:
    """Forward and backward of the head and the loss for one micro-batch: the loss sum, the head's gradient into its
    gradient slot, the gradient of its input in place of the input."""
    ctx.rng.seed(op.layer, op.mb)
    if st.objective is not None:
        return _objective_loss(ctx, op, st)
    if ctx.head_loss is not None:
        return _fused_loss(ctx, op, st)
    x = st.act[op.slot("x")].detach().requires_grad_()
    views: list = []
    with torch.enable_grad():
        logits = ctx.runner.run(op.layer, ctx.dev.weights(op), x, st.side[op.mb], grad_views=views)
        labels = st.mbs[op.mb].next_labels
        loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        sink = _grad_sink(ctx, op)
        dx, *dws = _grads(sink, loss_sum / st.denom, [x, *(v for *_, v in views)])
    st.loss_sums[op.mb] = loss_sum.detach() + st.denom * _aux_loss(ctx, st, op.mb)
    _accumulate(ctx, st, op, sink, views, dws)
    st.act[op.slot("x")] = dx


def _objective_loss(ctx, op: Op, st: StepState) -> None:
    """The head under a step's objective (megatrain.objectives) for one micro-batch, its logits formed a chunk of
    ``LOSS_CHUNK_TOKENS`` tokens at a time, twice: each position's log-probability of its label first (no graph),
    the objective on them and its gradient with respect to each (small: a number per position), then each chunk's
    head again with its graph and the backward of those gradients times its log-probabilities. The same gradients as
    one pass over the whole logits (the head works on each position alone); no more logits at once than a chunk's."""
    x = st.act[op.slot("x")].detach()
    mb, flat = st.mbs[op.mb], ctx.dev.weights(op)
    labels, chunks = mb.next_labels, _head_chunks(x)
    with torch.no_grad():
        logps = torch.cat([token_logps(ctx.runner.run(op.layer, flat, x[:, a:b], st.side[op.mb]), labels[:, a:b])
                           for a, b in chunks], 1)
    logps.requires_grad_()
    with torch.enable_grad():  # (its statistics are sums over the micro-batch's rows, as the loss is)
        loss_sum, stats = st.objective(logps, labels != IGNORE_INDEX, mb.rows or {})
        (weight,) = torch.autograd.grad(loss_sum / st.denom, logps)
    sink, dx = _grad_sink(ctx, op), torch.empty_like(x)  # (one sink: a span written by a chunk, the next adds)
    for a, b in chunks:
        part, views = x[:, a:b].requires_grad_(), []
        with torch.enable_grad():
            logits = ctx.runner.run(op.layer, flat, part, st.side[op.mb], grad_views=views)
            out = (weight[:, a:b] * token_logps(logits, labels[:, a:b])).sum()
            dpart, *dws = _grads(sink, out, [part, *(v for *_, v in views)])
        _accumulate(ctx, st, op, sink, views, dws)
        dx[:, a:b] = dpart
    st.loss_sums[op.mb] = loss_sum.detach() + st.denom * _aux_loss(ctx, st, op.mb)
    st.stats[op.mb] = stats.detach()
    st.act[op.slot("x")] = dx


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of its label (b, T; 0 where the label is ignored), in fp32."""
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(labels.shape)


def _head_chunks(x: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) positions of the chunks a head's logits are formed over: ``LOSS_CHUNK_TOKENS`` tokens of
    the micro-batch ``x`` (b, T, H) at a time."""
    from megatrain.layout import LOSS_CHUNK_TOKENS

    step = max(1, LOSS_CHUNK_TOKENS // x.shape[0])
    return [(a, min(a + step, x.shape[1])) for a in range(0, x.shape[1], step)]


def loss_out(ctx, op: Op, st: StepState) -> None:
    """After the step's last LOSS (or EVAL): every micro-batch's loss sum on its way to the host (the issuer's
    copy; program order reads them at the step's end)."""
    ctx.copies.losses_to_host(st)


def eval_loss(ctx, op: Op, st: StepState) -> None:
    """An evaluation's head and loss for one micro-batch: the loss sum, and each row's log-probability sum of its
    labels (``StepOutput.stats``), the logits formed a chunk of ``LOSS_CHUNK_TOKENS`` tokens at a time (no more of
    them exist at once than the plan counts)."""
    x = st.act[op.slot("x")]
    labels = st.mbs[op.mb].next_labels
    flat = ctx.dev.weights(op)
    rows = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    with torch.no_grad():
        for a, b in _head_chunks(x):
            logits = ctx.runner.run(op.layer, flat, x[:, a:b], st.side[op.mb])
            rows += token_logps(logits, labels[:, a:b]).sum(1)
    st.stats[op.mb] = rows
    st.loss_sums[op.mb] = -rows.sum() + st.denom * _aux_loss(ctx, st, op.mb)


def _fused_loss(ctx, op: Op, st: StepState) -> None:
    from megatrain.kernels.linear_ce import linear_cross_entropy_forward
    from megatrain.runtime.layers.templates import bind

    seg = ctx.captured.segments[op.layer]
    spec = ctx.head_loss
    ref = next(r for r in seg.params if r.name == spec.weight_name)
    weight = bind(seg, ctx.dev.weights(op))[spec.weight_name]  # (V, H)
    g = ctx.dev.g[op.slot("g")]
    if op.mb == 0:
        g[: ctx.graph.weight_params(op.layer)].zero_()
    grad_w = g[ref.offset: ref.offset + weight.numel()].view(weight.shape)
    x = st.act[op.slot("x")]
    loss_sum, dh, _ = linear_cross_entropy_forward(x.reshape(-1, x.shape[-1]), weight,
                                                   st.mbs[op.mb].next_labels.reshape(-1), st.denom,
                                                   grad_weight=grad_w, softcap=spec.softcap)
    st.loss_sums[op.mb] = loss_sum * st.denom + st.denom * _aux_loss(ctx, st, op.mb)
    st.act[op.slot("x")] = dh.view_as(x)


def bwd(ctx, op: Op, st: StepState) -> None:
    """The layer's backward for one micro-batch (its forward run again from the checkpoint first, unless it kept its
    activations): weight gradients accumulated in the gradient slot, the input's gradient in place of the input."""
    ctx.rng.seed(op.layer, op.mb)
    sink = _grad_sink(ctx, op)
    if op.layer in st.schedule.config.saved_acts:
        out, x, views, probs, ins = st.saved.pop((op.layer, op.mb))
        ctx.bwd_weights = ctx.dev.weights(op)
        try:
            outs, dys = _block_outputs(ctx, st, op, out, st.act[op.slot("dy")], probs, ins)
            dx, *dws = _grads(sink, outs, [x, *ins.inputs, *(v for *_, v in views)], dys)
        finally:
            ctx.bwd_weights = None
        st.act[op.slot("x")] = dx
        dws = ins.take(dws)
        _accumulate(ctx, st, op, sink, views, dws)
        return
    flat = ctx.dev.weights(op)
    dy = st.act[op.slot("dy")]
    views: list = []
    with torch.enable_grad():
        if op.layer == 0:
            mb = st.mbs[op.mb]
            h, side = ctx.runner.run(0, flat, (mb.input_ids, mb.attention_mask, mb.position_ids), grad_views=views)
            back = {n: g for n, g in st.side_grads.pop(op.mb, {}).items() if isinstance(n, str)}  # the side
            # inputs' gradients the blocks gave back
            outs, dys = [h, *(side[n] for n in back)], [dy, *back.values()]
            dws = _grads(sink, outs, [v for *_, v in views], dys) if views else ()  # none: all frozen
        else:
            x = st.act[op.slot("x")].detach().requires_grad_()
            logits: list = []
            tile = _tile(ctx, op, st)
            ins = BlockInputs(ctx, st, op.mb)
            # the recompute skips the products nothing but the layer's output reads (the output is then not its
            # value: only differentiated against dy); tiled, such an MLP forms each tile in its backward alone
            with _routers(ctx, op, st, logits), outputs_unread():
                out = ctx.runner.run(op.layer, flat, x, ins.side, grad_views=views, tile=tile)
            probs = router_aux.layer_probs(logits, _aux_mask(st, op.mb)) if logits else None
            outs, dys = _block_outputs(ctx, st, op, out, dy, probs, ins)
            dx, *dws = _grads(sink, outs, [x, *ins.inputs, *(v for *_, v in views)], dys)
            dws = ins.take(dws)
            st.act[op.slot("x")] = dx
    _accumulate(ctx, st, op, sink, views, dws)
    if op.layer == 0:
        st.side.pop(op.mb, None)


def _grad_sink(ctx, op: Op) -> GradSink:
    """Where the backward of ``op`` puts its parameter gradients: the fp32 gradient slot, which the first
    micro-batch writes instead of adding to (cleared first where the layer's parameters do not tile it)."""
    g = ctx.dev.g[op.slot("g")]
    first = op.mb == 0
    numel = ctx.graph.weight_params(op.layer)
    if first and not ctx.runner.tiles(op.layer, numel):  # gaps, shared or unused spans: clear, then add
        g[:numel].zero_()
        first = False
    return GradSink(g, accumulate=not first)


def _grads(sink: GradSink, out, inputs: list, dy=None) -> tuple:
    """``autograd.grad`` of ``out`` (against ``dy``) for ``inputs``, the templates' linears sending their weight
    gradients to ``sink``; None for an input the output does not depend on (or whose gradient went there)."""
    with sink_to(sink):
        return torch.autograd.grad(out, inputs, dy, allow_unused=True)


_SAID_ABSENT_DP: list[int] = []  # the warning below is given once a process


def _accumulate(ctx, st: StepState, op: Op, sink: GradSink, views: list, grads) -> None:
    """The gradients autograd returned (compute dtype) into the sink's slot, next to those its linears wrote; the
    parameters that got none are noted (``StepState.absent``: those no micro-batch and no tied part gives one are
    left alone by the step's update). With data parallelism every parameter counts as having one: another rank's
    micro-batches may have given it one, and the ranks do not exchange which (a warning says so, once)."""
    for (off, n, _), dw in zip(views, grads):
        sink.put(off, n, dw)
    if ctx.dp is not None:
        if sink.absent and not _SAID_ABSENT_DP:
            _SAID_ABSENT_DP.append(op.layer)
            warnings.warn(f"layer {op.layer}: {len(sink.absent)} parameters got no gradient from a micro-batch on this "
                          f"rank; with data parallelism they are updated as with a zero gradient (weight decay and "
                          f"moments applied), where torch.optim.AdamW would leave a parameter without one alone",
                          stacklevel=2)
        return
    owner = ctx.graph.owner(op.layer)
    before = st.absent.get(owner)
    st.absent[owner] = frozenset(sink.absent) if before is None else before & sink.absent


class WeightRef:
    """A weight tensor autograd saved in a forward (see :func:`_forward_saved`): where it lies in the layer's flat
    weights (element offset, shape, strides), to be viewed again in whichever slot holds them later."""

    __slots__ = ("offset", "shape", "stride")

    def __init__(self, offset: int, shape: tuple, stride: tuple):
        self.offset, self.shape, self.stride = offset, shape, stride

    @staticmethod
    def packer(flat: torch.Tensor):
        """A pack hook: tensors on ``flat``'s storage become references into it, others are kept as they are."""
        ptr, base = flat.untyped_storage().data_ptr(), flat.storage_offset()

        def pack(t: torch.Tensor):
            if t.device == flat.device and t.untyped_storage().data_ptr() == ptr:
                return WeightRef(t.storage_offset() - base, tuple(t.shape), t.stride())
            return t

        return pack

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.stride, flat.storage_offset() + self.offset)
