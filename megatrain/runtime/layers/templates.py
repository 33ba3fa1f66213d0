"""Binding weightless templates to views of a weight slot, and calling them."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.fx.node import Node, map_aggregate

from megatrain.capture import Captured, Segment
from megatrain.capture.shared_state import FreshPerCall, PerMicroBatch
from megatrain.layout import UNREAD_PROJECTION
from megatrain.runtime.layers import grad_sink, router_aux, tiling
from megatrain.runtime.layers.grad_sink import SinkLinear


def bind(seg: Segment, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Template parameter name -> a view of ``flat`` (the owner layer's weights in a slot). No copies."""
    out = {}
    for ref in seg.params:
        n = 1
        for d in ref.shape:
            n *= d
        out[ref.name] = flat[ref.offset: ref.offset + n].view(ref.shape)
    return out


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Move a template's buffers (rotary tables, scales) to ``device``; its meta parameters stay as they are."""
    for mod in module.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device:
                mod._buffers[name] = buf.to(device)


@contextlib.contextmanager
def _patched(patches):
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


class _Binding:
    """Where each of a segment's parameters lives in its template (submodule, attribute), resolved once, and the
    slice of the flat weight buffer it takes. Binding puts views of the buffer into the template's parameter table
    for one call and puts the weightless originals back after it: what ``torch.func.functional_call`` does, without
    walking the module tree on every call (the per-call cost of a compute op's host side)."""

    def __init__(self, seg: Segment, frozen: frozenset[str] = frozenset()):
        self.entries = []
        self.frozen: set[int] = set()  # offsets of parameters that take no gradient
        for ref in seg.params:
            path, _, attr = ref.name.rpartition(".")
            mod = seg.template.get_submodule(path) if path else seg.template
            if attr not in mod._parameters:
                raise KeyError(f"template {type(seg.template).__name__} has no parameter {ref.name!r}")
            n = 1
            for d in ref.shape:
                n *= d
            self.entries.append((mod, attr, ref.offset, n, tuple(ref.shape)))
            if ref.model_name in frozen:
                self.frozen.add(ref.offset)
        # the template's linears send their weight gradients to the executor's sink (grad_sink.py): where their
        # weight and bias lie in the layer's weights, set while bound for a backward
        where = {(id(mod), attr): off for mod, attr, off, _, _ in self.entries}
        self.sinks = [(mod, (off, where.get((id(mod), "bias")))) for mod, attr, off, _, _ in self.entries
                      if attr == "weight" and isinstance(mod, SinkLinear)
                      and (mod.bias is None or (id(mod), "bias") in where)]
        spans = sorted((off, n) for _, _, off, n, _ in self.entries)
        # the parameters follow each other from offset 0 without gaps or overlaps, up to ``end``
        self.contiguous = all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])) and (not spans or
                                                                                            spans[0][0] == 0)
        self.contiguous &= not self.frozen  # frozen parameters leave their gradient spans unwritten
        self.end = spans[-1][0] + spans[-1][1] if spans else 0

    @contextlib.contextmanager
    def bound(self, flat: torch.Tensor, grad_views: list | None = None):
        """Bind views of ``flat``. With ``grad_views`` (a list) each view is a leaf that requires grad, appended
        with its (offset, numel): gradients can then be taken per parameter and added straight into a gradient
        slot, instead of autograd building each parameter's gradient as a zero-filled block-sized tensor and
        summing them (one block-sized write and add per parameter). Frozen parameters are bound as plain views and
        take no gradient."""
        saved = []
        sinks = self.sinks if grad_views is not None else ()
        try:
            for mod, offsets in sinks:
                mod.offsets = offsets
            for mod, attr, off, n, shape in self.entries:
                saved.append((mod, attr, mod._parameters[attr]))
                view = flat[off: off + n].view(shape)
                if grad_views is not None and off not in self.frozen:
                    view = view.detach().requires_grad_()
                    grad_views.append((off, n, view))
                mod._parameters[attr] = view
            yield
        finally:
            for mod, attr, original in saved:
                mod._parameters[attr] = original
            for mod, _ in sinks:
                mod.offsets = None


class LayerRunner:
    """Calls layer i of a captured model: ``run(i, flat, x, side)`` with weights bound from ``flat``."""

    def __init__(self, captured: Captured, device: torch.device):
        self.captured = captured
        self._routers: dict[int, list[nn.Module]] = {}  # id(template) -> its router modules (router loss)
        # id(template) -> its linears whose product a recomputing backward skips (grad_sink.outputs_unread), where
        # the layer graph counts them so (Layer.unread_flops_per_token); resolved before tiling wraps the MLPs
        self._unread: dict[int, list[SinkLinear]] = {}
        self.unread_checked: set[int] = set()  # id(template) of those the executor's probe has checked
        for seg in captured.segments:
            grad_sink.install(seg.template)
            if captured.graph[seg.index].unread_flops_per_token and id(seg.template) not in self._unread:
                mod = seg.template.get_submodule(UNREAD_PROJECTION)
                if not isinstance(mod, SinkLinear):
                    raise TypeError(f"layer {seg.name}: {UNREAD_PROJECTION} is a {type(mod).__name__}, where the "
                                    f"layer graph counts it as a linear whose product the backward skips")
                self._unread[id(seg.template)] = [mod]
            if captured.router_aux is not None:
                self._routers[id(seg.template)] = router_aux.install(seg.template, captured.router_aux)
        self.bindings = [_Binding(seg, captured.frozen) for seg in captured.segments]
        self._tiled: dict[int, list] = {}  # id(template) -> its MLP wrappers (blocks the planner may tile)
        seen = set()
        for seg in captured.segments:
            if id(seg.template) not in seen:
                seen.add(id(seg.template))
                move_buffers(seg.template, device)
                if captured.graph[seg.index].tile_work_bytes_per_token:  # after the bindings (see tiling.install)
                    self._tiled[id(seg.template)] = tiling.install(seg.template, captured.graph.name)

    def run(self, i: int, flat: torch.Tensor, x, side: dict[str, object] | None = None,
            grad_views: list | None = None, tile: int = 0):
        """Layer 0: ``x`` is (input_ids, attention_mask, position_ids) and the result is (hidden, {side name:
        value}).
        Other layers: ``x`` is the hidden state and the result is the layer's output; ``side``: the side inputs
        the embedding layer returned for this micro-batch (blocks, and norm and head where they read any).
        ``grad_views``: see
        :meth:`_Binding.bound`. ``tile``: tokens per tile of the block's MLP (``ScheduleConfig.seq_tile``; 0:
        untiled)."""
        seg = self.captured.segments[i]
        if tile:
            with tiling.tiles(self._tiled.get(id(seg.template), []), tile):
                return self.run(i, flat, x, side, grad_views)
        if seg.patches:
            with _patched(seg.patches):
                return self._run(seg, flat, x, side, grad_views)
        return self._run(seg, flat, x, side, grad_views)

    def unread(self, i: int) -> list[SinkLinear]:
        """Layer i's linears whose product its recomputing backward may skip (none where the graph counts none);
        skipped once marked (:meth:`mark_unread`)."""
        return self._unread.get(id(self.captured.segments[i].template), [])

    def mark_unread(self, i: int, on: bool = True) -> None:
        """Mark (or unmark) layer i's template's skippable linears: skipped under ``outputs_unread`` only when
        marked (the executor marks them once a probe on its device confirms it: ``probe.unread_outputs_hold``)."""
        for mod in self.unread(i):
            mod.unread = on

    def routers(self, i: int) -> list[nn.Module]:
        """Layer i's router modules whose logits the router loss reads (none without one)."""
        return self._routers.get(id(self.captured.segments[i].template), [])

    def tiles(self, i: int, numel: int) -> bool:
        """Whether layer i's parameters cover the first ``numel`` elements of its weight block exactly once (a
        tied head uses only part of its owner's block)."""
        b = self.bindings[i]
        return b.contiguous and b.end == numel

    def _run(self, seg: Segment, flat: torch.Tensor, x, side, grad_views=None):
        with self.bindings[seg.index].bound(flat, grad_views):
            if seg.kind == "embedding":
                out = seg.template(*x)
                out = out if isinstance(out, tuple) else (out,)
                return out[0], dict(zip(self.captured.side_names, out[1:]))
            if seg.kind == "block":
                args, kwargs = map_aggregate(seg.call_args, lambda a: side[a.name] if isinstance(a, Node) else
                                             a.of(side) if isinstance(a, PerMicroBatch) else
                                             a() if isinstance(a, FreshPerCall) else a)
                out = seg.template(x, *args, **kwargs)
                for item, name in seg.carries:  # for the next block, as a side input of this micro-batch (a
                    # recompute writes the same values again)
                    side[name] = out[item].detach() if isinstance(out[item], torch.Tensor) else out[item]
                return out[0] if seg.tuple_out else out
            return seg.template(x, *(side[n] for n in seg.call_args or ()))
