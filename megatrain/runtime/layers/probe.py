"""How many bytes a layer's forward keeps for its backward on this device, measured by running it once."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from megatrain.runtime.layers.kernel_rewrite import keep_less


def saved_bytes(ctx, layer: int, seq_len: int, lean: bool = False) -> int:
    """Bytes that ``layer``'s forward saves for its backward on ``ctx``'s device with its templates (kernels or not,
    whatever attention the model uses), for one sequence of ``seq_len`` tokens: activations only, not the weights
    (views of the slot), the layer's input (its checkpoint, counted apart) or the side inputs every layer shares;
    ``lean``: keeping less (``ScheduleConfig.saved_lean``). Runs the embedding and the layer once on random tokens,
    with weights copied from the host store into temporary buffers; the random generators are left as they were (a
    seeded run draws the same whether it measures or not)."""
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        return _measure(ctx, layer, seq_len, lean)


def _embedded(ctx, seq_len: int, first: torch.Tensor, generator=None):
    """The embedding layer's output and side inputs for one sequence of ``seq_len`` random tokens, with the
    embedding's weights ``first``."""
    device = ctx.device
    ids = torch.randint(0, ctx.captured.vocab_size, (1, seq_len), generator=generator, device=device)
    mask = None if ctx.captured.mask_optional else torch.ones_like(ids)
    with torch.no_grad():
        return ctx.runner.run(0, first, (ids, mask, torch.arange(seq_len, device=device)[None]))


def inputs_of(ctx, layer: int, h: torch.Tensor, side: dict, weights) -> tuple[torch.Tensor, dict]:
    """``layer``'s input and side inputs, from ``h`` (the embedding's output) and ``side`` (its side inputs): for
    most models those; where a layer before it hands on more than the hidden state (capture's carries, the
    micro-batch's shared object, a block cut in two: capture.split_blocks) the layers before it run first, each with
    ``weights(owner)``."""
    segs = ctx.captured.segments
    if not any(seg.carries or getattr(seg.template, "width_factor", 1) != 1 for seg in segs[:layer]) and \
            not ctx.captured.shared_state:
        return h, side
    with torch.no_grad():
        for i in range(1, layer):
            h = ctx.runner.run(i, weights(ctx.graph.owner(i)), h, side)
    return h, side


def _measure(ctx, layer: int, seq_len: int, lean: bool) -> int:
    graph, device = ctx.graph, ctx.device
    h, side = _embedded(ctx, seq_len, ctx.store.master(graph.owner(0)).to(device, ctx.dtype))
    h, side = inputs_of(ctx, layer, h, side, lambda o: ctx.store.master(o).to(device, ctx.dtype))
    flat = ctx.store.master(graph.owner(layer)).to(device, ctx.dtype)
    x = h.detach().requires_grad_()
    skip = {flat.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    skip |= {v.untyped_storage().data_ptr() for v in tree_leaves(side) if isinstance(v, torch.Tensor)}
    kept: dict[int, int] = {}
    held: list[torch.Tensor] = []  # what was saved, alive until the forward ends (no storage counted twice)

    def pack(t: torch.Tensor) -> int:
        # the pointer, not the tensor: a graph that saves a node's own output through a hook that returns the
        # tensor holds itself (node -> output -> node), which no collector frees, and with it the weights' views
        # (on the H200: a 7B block's 0.44 GiB of weights for each probe, 1.74 GiB held on the device by a 24 GiB
        # plan's four probes). Nothing differentiates the probe's forward.
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        held.append(t.detach())
        return ptr

    def unpack(_ptr: int):
        raise RuntimeError("the saved-bytes probe's forward is not differentiated")

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack), keep_less(lean):
        out = ctx.runner.run(layer, flat, x, side, grad_views=[])
    del out
    held.clear()
    return sum(kept.values())


def unread_outputs_hold(ctx, layer: int, seq_len: int = 8) -> bool:
    """Whether ``layer``'s backward gives the same gradients when its recompute skips the products of the linears
    the runner lists for it (``LayerRunner.unread``): the layer run on random tokens with random weights, its
    gradients (input and weights) taken once in full and once with those products left as NaN. They hold when
    every gradient is finite and equal to the full run's within rounding: a gradient that read a skipped output
    would be NaN. The random generators are left as they were, and the linears marked as they were."""
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        return _unread_hold(ctx, layer, seq_len)


def _unread_hold(ctx, layer: int, seq_len: int) -> bool:
    from megatrain.runtime.layers.grad_sink import outputs_unread

    graph, device, runner = ctx.graph, ctx.device, ctx.runner
    gen = torch.Generator(device=device).manual_seed(0)

    def weights(owner: int) -> torch.Tensor:
        n = ctx.store.master(owner).numel()
        return (torch.randn(n, generator=gen, device=device) * 0.02).to(ctx.dtype)

    h, side = _embedded(ctx, seq_len, weights(graph.owner(0)), gen)
    h, side = inputs_of(ctx, layer, h, side, weights)
    flat = weights(graph.owner(layer))
    dy = torch.randn(h.shape, generator=gen, device=device).to(h.dtype)

    def grads(skip: bool) -> list:
        torch.manual_seed(0)
        x = h.detach().requires_grad_()
        views: list = []
        with torch.enable_grad(), outputs_unread(skip, fill=float("nan")):
            out = runner.run(layer, flat, x, side, grad_views=views)
            return list(torch.autograd.grad(out, [x, *(v for *_, v in views)], dy, allow_unused=True))

    marked = [m.unread for m in runner.unread(layer)]
    runner.mark_unread(layer)
    try:
        full, skipped = grads(False), grads(True)
    finally:
        for mod, was in zip(runner.unread(layer), marked):
            mod.unread = was
    for a, b in zip(full, skipped):
        if (a is None) != (b is None):
            return False
        if a is not None and not (torch.isfinite(b).all() and torch.allclose(a.float(), b.float(), rtol=1e-2,
                                                                                 atol=1e-4)):
            return False
    return True
