"""The handlers of a schedule's gradient and update ops (see :mod:`megatrain.runtime.ops`, whose ``HANDLERS``
table maps op kinds to them): gradients to the host or into an optimizer slot, their norms, the step's clip factor
and update guard, and the updates on the host and on the device with their state's loads and stores."""

from __future__ import annotations

import torch

from megatrain.ir import Op
from megatrain.layout import OPT_STATE_ROWS
from megatrain.runtime.issue.step import StepState


# ---- gradients -------------------------------------------------------------------------------------------------
def _add_part(ctx, op: Op, st: StepState, src: torch.Tensor, into: torch.Tensor) -> bool:
    """Put ``op``'s gradient ``src`` into ``into``, where its owner's gradient is gathered: written by the first
    part, added by the next (a tied gradient has a part per layer that reads the weights, the owner's own last).
    True once the gradient is complete."""
    o = ctx.graph.owner(op.layer)
    done = st.tied_parts.get(o, 0)
    if done:
        into.add_(src)
    else:
        into.copy_(src)
    st.tied_parts[o] = done + 1
    return done + 1 == 1 + len(ctx.graph.tied_to(o))


def _take_norms(ctx, st: StepState, owner: int, grad: torch.Tensor) -> None:
    """With clipping: the L2 norm of each of ``owner``'s parameters' gradients in ``grad`` (its whole gradient), as
    torch.nn.utils.clip_grad_norm_ takes them (one foreach kernel where the device has one)."""
    spans = ctx.param_spans[owner]
    if not st.clip or not spans:
        return
    views = [grad[off: off + n] for _, off, n in spans]
    norms = torch._foreach_norm(views) if grad.is_cuda else [torch.linalg.vector_norm(v) for v in views]
    st.param_norms.update(zip((name for name, _, _ in spans), norms))


def _complete(ctx, st: StepState, owner: int, grad: torch.Tensor) -> None:
    """``owner``'s gradient is complete in ``grad`` (every micro-batch's, every tied part's): summed over the
    data-parallel ranks where there are several (in place), then its norms taken."""
    if ctx.dp is not None:
        ctx.dp.sum_(grad)
    _take_norms(ctx, st, owner, grad)


def store_g_to_host(ctx, op: Op, st: StepState) -> None:
    """The layer's gradient (summed over the micro-batches in its slot) to its host gradient buffer, in the buffer's
    dtype (rounded on the device where that is bf16), its norms taken first unless a NORM took them; a tied
    gradient's parts are summed on the device first, and the sum goes to the host once."""
    o = ctx.graph.owner(op.layer)
    n = ctx.graph.weight_params(o)
    if op.slot("k") is not None:  # kept on the device until now: norms taken, in the buffer's dtype already; the
        # whole gradient or one part of it
        lo, hi = st.schedule.config.part_span(op, n)
        ctx.store.grads.view(op.slot("h"), hi - lo).copy_(ctx.dev.k[op.slot("k")][lo:hi], non_blocking=ctx.copies.non_blocking)
        return
    dst = ctx.store.grads.view(op.slot("h"), n) if op.slot("h") is not None else None
    src = ctx.dev.g[op.slot("g")][:n]
    if ctx.graph.tied_to(o):
        buf = ctx.dev.tied_sum(o, n)
        if not _add_part(ctx, op, st, src, buf):
            return
        src = buf
    _complete(ctx, st, o, src)
    dst.copy_(src if dst.dtype == src.dtype else src.to(dst.dtype), non_blocking=ctx.copies.non_blocking)


def norm(ctx, op: Op, st: StepState) -> None:
    """NORM: the norms of a complete gradient, which then moves to its kept-gradient slot (rounded to the slot's
    dtype), where it waits for the update pass; its gradient slot is free after."""
    n = ctx.graph.weight_params(op.layer)
    src = ctx.dev.g[op.slot("g")][:n]
    _complete(ctx, st, op.layer, src)
    ctx.dev.k[op.slot("k")][:n].copy_(src)


def store_g_to_slot(ctx, op: Op, st: StepState) -> None:
    """A device update's gradient into the gradient row of its optimizer slot (a tied gradient's parts summed
    there)."""
    src = ctx.dev.g[op.slot("g")][: ctx.graph.weight_params(op.layer)]
    row = ctx.dev.opt_block(op)[3]
    if _add_part(ctx, op, st, src, row):
        _complete(ctx, st, ctx.graph.owner(op.layer), row)


def guard(ctx, op: Op, st: StepState) -> None:
    """The step's GUARD: :func:`form_guard`, and its copy to the host (the issuer's)."""
    form_guard(ctx, st)
    ctx.copies.guard_to_host(st)


def form_guard(ctx, st: StepState) -> None:
    """The step's GUARD, before its first OPT (every LOSS has run; with clipping every gradient's norm is taken): on
    the device, the global gradient norm (the per-parameter norms in the model's order, as
    torch.nn.utils.clip_grad_norm_ takes it), the step's loss, and the factor device updates scale the gradient by:
    the clip factor (1 without clipping), NaN where the norm or the loss is not finite, which makes a device update
    change nothing."""
    dev = ctx.device
    # without clipping the guard runs right after the last LOSS, before the backward's norms: it reads none
    norms = [st.param_norms[n] for n in ctx.captured.model_param_names if n in st.param_norms] if st.clip else []
    if st.clip and len(norms) != sum(len(spans) for spans in ctx.param_spans.values()):
        missing = sorted(n for spans in ctx.param_spans.values() for n, _, _ in spans if n not in st.param_norms)
        raise AssertionError(f"the global norm lacks the gradient norms of {len(missing)} parameters, e.g. "
                             f"{missing[:3]}: no op took them before the step's GUARD")
    for n in norms:
        ctx.copies.keep_alive(n)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=dev)
    loss = torch.stack([torch.as_tensor(t, device=dev).float().reshape(()) for t in st.loss_sums]).sum()
    if ctx.dp is not None:  # every rank's micro-batches: the ranks decide alike whether the step updates
        ctx.dp.sum_(loss)
    coef = ctx.optimizer.clip_factor(total) if st.clip else torch.ones((), device=dev)
    ok = torch.isfinite(total) & torch.isfinite(loss)
    st.coef = torch.where(ok, coef, float("nan"))
    st.guard = torch.stack([total, loss, st.coef])


# ---- updates ---------------------------------------------------------------------------------------------------
def opt_on_host(ctx, op: Op, st: StepState) -> None:
    """AdamW on the layer's host block (the optimizer worker's task on a GPU), unless the step must not update. A
    layer of ``speculate``: before the step's guard, with a clip factor of 1, the masters alone after keeping them,
    or (``speculate_keeps`` "state") the whole update into the layer's spare block (its CHECK finishes or undoes
    it: :func:`check`)."""
    cfg = st.schedule.config
    if op.layer in cfg.speculate:
        if not ctx.optimizer.native or ctx.dp is not None:
            raise AssertionError("an update before the step's guard needs megatrain's host kernel (it writes the "
                                 "masters alone, or to a spare block) and one process")
        state = cfg.speculate_keeps == "state"
        ctx.optimizer.keep_masters(op.layer, cfg.speculate, masters=not state)
        ctx.optimizer.step_layer(op.layer, _host_grad(ctx, op), moments=state, absent=st.absent.get(op.layer),
                                 spare=state)
        return
    if not st.ok():
        return
    lo, hi = st.schedule.config.part_span(op, ctx.graph.weight_params(op.layer))
    if ctx.dp is not None and not ctx.dp.owns(op.layer):  # its owner rank updates the shared store
        ctx.optimizer.count_step(op.layer, span=(lo, hi))
        return
    ctx.optimizer.step_layer(op.layer, ctx.store.grads.view(op.slot("h"), hi - lo), coef=st.coef_value(), span=(lo, hi),
                            moments=op.id not in st.deferred_moments, absent=st.absent.get(op.layer))


def _host_grad(ctx, op: Op) -> torch.Tensor:
    """The whole gradient of ``op``'s layer in its host buffer."""
    return ctx.store.grads.view(op.slot("h"), ctx.graph.weight_params(op.layer))


def check(ctx, op: Op, st: StepState) -> None:
    """CHECK of an update made before the step's guard (:func:`opt_on_host`) with a factor of 1: where the step's
    clip factor is 1 the masters stand (or the spare block becomes the layer's); else they go back, with the step
    count, and (unless the step must not update) the update is made again with the factor (in the layer's block,
    untouched, where the update went to the spare). Then, where it kept the masters, the moments with the step's
    factor (left for after the update pass where the executor defers them: ``st.deferred_moments``). The same bits
    as one update after the guard."""
    opt, absent = ctx.optimizer, st.absent.get(op.layer)
    coef = st.coef_value() if st.ok() else None
    state = st.schedule.config.speculate_keeps == "state"
    if coef == 1.0 and state:
        ctx.store.take_spare(op.layer)
    if coef != 1.0:
        opt.restore_masters(op.layer)
        st.redone.append(op.layer)
        if coef is None:
            return
        opt.step_layer(op.layer, _host_grad(ctx, op), coef=coef, moments=state, absent=absent)
    if not state and op.id not in st.deferred_moments:
        opt.step_moments(op.layer, _host_grad(ctx, op), coef=coef, absent=absent)


def moments_on_host(ctx, op: Op, st: StepState) -> None:
    """The moments of the host update ``op`` made without them (``st.deferred_moments``), from the gradient still in
    its host buffer."""
    if not st.ok():
        return
    lo, hi = st.schedule.config.part_span(op, ctx.graph.weight_params(op.layer))
    ctx.optimizer.step_moments(op.layer, ctx.store.grads.view(op.slot("h"), hi - lo), coef=st.coef_value(),
                              span=(lo, hi), absent=st.absent.get(op.layer))


def split_moments_on_host(ctx, layer: int, h: int, st: StepState) -> None:
    """The moments of the split update of ``layer`` whose parts stored the masters alone (``st.deferred_moments``),
    from the gradient still in its host buffer ``h``: the same arithmetic as the update on the device made them
    with (kernels.adamw), so they are the bits it dropped."""
    if not st.ok():
        return
    ctx.optimizer.step_moments(layer, ctx.store.grads.view(h, ctx.graph.weight_params(layer)), coef=st.coef_value(),
                              device=True, absent=st.absent.get(layer))


def opt_on_device(ctx, op: Op, st: StepState) -> None:
    """AdamW on the layer's optimizer slot, its new weights kept on the device in the compute dtype (written by the
    update where it can). The factor on the device stops a step that must not update (the Triton kernel); torch's
    AdamW, which would apply it, is not called for such a step (the host decides). One part of a split update:
    :func:`_update_part`."""
    if op.mb is not None:
        return _update_part(ctx, op, st)
    block = ctx.dev.opt_block(op)
    if _skips(ctx, block, st):
        ctx.dev.keep(op.layer, block[0])
        return
    written = ctx.optimizer.step_layer_on(op.layer, block, lr=st.lr, coef=st.coef,
                                         out=ctx.dev.kept_buffer(op.layer, block.shape[1]),
                                         absent=st.absent.get(op.layer))
    ctx.dev.keep(op.layer, block[0], written)


def _skips(ctx, block: torch.Tensor, st: StepState) -> bool:
    """Whether a device update is not called for a step that must not update: only where the fused GPU kernel,
    which reads the factor on the device, would not stop it itself."""
    return not (block.is_cuda and ctx.optimizer.cfg.fused) and not st.ok()


def _update_part(ctx, op: Op, st: StepState) -> None:
    """AdamW on one part of a split update (``ScheduleConfig.split_opt``) in its optimizer slot; a gradient kept on
    the device joins the part's state here (read back into fp32). Its new weights go to the host with its state
    (STORE_OPT)."""
    block, lo, hi = _part(ctx, op, st)
    if not _owned(ctx, op):  # its owner rank updates the shared store; this one counts the step (once, at part 0)
        if lo == 0 and st.ok():
            ctx.optimizer.count_step(op.layer)
        return
    if op.slot("k") is not None:
        block[3].copy_(ctx.dev.k[op.slot("k")][lo:hi])
    if _skips(ctx, block, st):
        return
    ctx.optimizer.step_layer_on(op.layer, block, lr=st.lr, coef=st.coef, span=(lo, hi), absent=st.absent.get(op.layer))


def _owned(ctx, op: Op) -> bool:
    """Whether this process runs ``op``, one part of a split update: with data parallel only the layer's owner rank
    does (the ranks share one host store, and another rank's store of a part may land before this one's load)."""
    return ctx.dp is None or ctx.dp.owns(op.layer)


def _part(ctx, op: Op, st: StepState) -> tuple[torch.Tensor, int, int]:
    """(its block in the optimizer slot, lo, hi): the elements [lo, hi) of its layer one part of a split update
    handles."""
    lo, hi = st.schedule.config.part_span(op, ctx.graph.weight_params(op.layer))
    return ctx.dev.part_block(op, hi - lo), lo, hi


def load_opt(ctx, op: Op, st: StepState) -> None:
    """Master weights and moments into the optimizer slot, a row at a time (``Copies.before_row``: the issuer's wait
    for that row's store by an earlier step); the gradient row is filled by the layer's STORE_G. One part of a split
    update: the part's rows, and its gradient from the layer's host buffer (unless kept on the device)."""
    if op.mb is None:
        block, lo = ctx.dev.opt_block(op), 0
    elif _owned(ctx, op):
        block, lo, _ = _part(ctx, op, st)
    else:
        return
    for r, (host, row) in enumerate(ctx.store.row_pairs(op.layer, block, lo)):
        ctx.copies.before_row(op.layer, r, st)
        row.copy_(host, non_blocking=ctx.copies.non_blocking)
    if op.slot("h") is not None:
        grads = ctx.store.grads.view(op.slot("h"), ctx.graph.weight_params(op.layer))[lo: lo + block.shape[1]]
        block[3].copy_(grads, non_blocking=ctx.copies.non_blocking)


def store_opt(ctx, op: Op, st: StepState) -> None:
    """Updated master weights and moments back to the host block (and the bf16 shadow, where there is one)."""
    if op.mb is None:
        return store_state(ctx, op.layer, ctx.dev.opt_block(op))
    if _owned(ctx, op):
        block, lo, hi = _part(ctx, op, st)
        store_state(ctx, op.layer, block, span=(lo, hi), moments=op.id not in st.deferred_moments)


def store_state(ctx, layer: int, block: torch.Tensor, span: tuple[int, int] | None = None,
                moments: bool = True) -> None:
    """Master weights and moments of ``block`` (an optimizer slot's) to the layer's host block, and the bf16 shadow,
    where there is one, refreshed from them. ``span``: the elements (lo, hi) of the layer ``block`` holds (one part
    of a split update; None: all). ``moments=False``: the master weights alone (the host computes the moments: a
    split update's, deferred)."""
    lo, hi = span if span is not None else (0, block.shape[1])
    copies = ctx.copies
    for r, (host, row) in enumerate(ctx.store.row_pairs(layer, block, lo)):
        if moments or r == 0:
            host.copy_(row, non_blocking=copies.non_blocking)
        copies.row_stored(layer, r)
    if ctx.store.shadows is not None:  # kept current whichever wire this schedule uses; rounded where the update
        # ran, to nearest even as the host would
        ctx.store.shadow(layer)[lo:hi].copy_(block[0].to(torch.bfloat16), non_blocking=copies.non_blocking)
    copies.row_stored(layer, OPT_STATE_ROWS)
