"""Packed rows for blocks that carry something from token to token besides attention: the gated delta nets of
Qwen3-Next, Qwen3.5 and OLMo-hybrid, and the short convolutions and scans of the Mamba hybrids.

Attention keeps packed documents apart with its mask; a recurrence's state and a causal convolution would run from
one document into the next. Here each such mixer module of a block template runs its documents as rows of their own:
the micro-batch's documents, sorted by length, go in buckets whose longest is at most :data:`GROWTH` times the
shortest, each bucket one call of the mixer's own forward over a (documents, longest, hidden) batch right-padded
with zeros, and the outputs are gathered back to where the documents sit in the packed rows. Right padding is exact
for a causal mixer (no document token reads a later position), and a padded position's output is never read back,
so its gradient is zero. The layout (:class:`Buckets`) is made once per micro-batch on the host from the position
ids and travels in the :class:`~megatrain.capture.tracer.Packed` marker, which HF's recurrent-mask builder passes on
to the mixers (capture.tracer) in place of the padding mask they take; a mixer called without it runs as it is.

Families are taken as their packed parity test shows them to train exactly (:data:`FAMILIES`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from megatrain.capture.blocks import delta_nets, find_blocks, mixes_tokens
from megatrain.capture.packed_attention import doc_offsets
from megatrain.capture.tracer import RECURRENT_MASK_BUILDER, CaptureError, Packed

# the model types whose blocks' mixers take HF's recurrent mask, where packed rows have been checked to train as the
# documents one per row (tests/runtime/test_packing.py)
FAMILIES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h", "zamba2"})
GROWTH = 1.25  # a bucket's longest document over its shortest, at most: the padding a bucket costs


@dataclass(eq=False)
class Buckets:
    """Where a micro-batch's documents run: per bucket, the rows laid end to end (plus one zero row at index
    ``tokens``) gathered into (documents, longest) by ``src``; ``where`` gives, for each token of the rows, its
    position in the buckets' outputs laid end to end."""

    src: list[torch.Tensor]  # per bucket: (n x longest,) indices into the rows laid end to end plus the zero row
    shapes: list[tuple[int, int]]  # per bucket: (documents, longest)
    where: torch.Tensor  # (tokens,)
    tokens: int
    whole: bool = False  # every row is one document: the mixer runs on the rows as they are

    def to(self, put) -> "Buckets":
        """The same layout with its index tensors passed through ``put`` (to the device)."""
        return Buckets([put(s) for s in self.src], self.shapes, put(self.where), self.tokens, self.whole)

    def run(self, mixer, x: torch.Tensor):
        """``mixer`` (hidden (n, L, H) -> (n, L, H')) over the documents of ``x`` (b, T, H) one per row; the
        outputs back as (b, T, H')."""
        if self.whole:
            return mixer(x)
        b, t, h = x.shape
        flat = torch.cat([x.reshape(b * t, h), x.new_zeros(1, h)])
        outs = []
        for src, (n, longest) in zip(self.src, self.shapes):
            y = mixer(flat.index_select(0, src).view(n, longest, h))
            if not isinstance(y, torch.Tensor) or y.shape[:2] != (n, longest):
                raise TypeError(f"{type(mixer).__name__}: a mixer run over packed documents must return its hidden "
                                f"states as one (batch, seq, hidden) tensor, got {type(y).__name__}")
            outs.append(y.reshape(n * longest, -1))
        return torch.cat(outs).index_select(0, self.where).view(b, t, -1)


def buckets(position_ids: torch.Tensor) -> Buckets:
    """The layout of (b, T) packed rows' documents (host position ids; a document starts at each row and wherever
    a position is not the one before plus one, as ``packed_attention.doc_offsets`` has it)."""
    cu, _ = doc_offsets(position_ids)
    tokens = int(cu[-1])
    starts, lengths = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()
    if len(starts) == position_ids.shape[0]:  # a document a row
        return Buckets([], [], torch.empty(0, dtype=torch.long), tokens, whole=True)
    order = sorted(range(len(starts)), key=lambda d: -lengths[d])
    src, shapes, where = [], [], torch.empty(tokens, dtype=torch.long)
    i, done = 0, 0
    while i < len(order):
        longest = lengths[order[i]]
        j = i
        while j < len(order) and lengths[order[j]] * GROWTH >= longest:
            j += 1
        index = torch.full((j - i, longest), tokens, dtype=torch.long)
        for row, d in enumerate(order[i:j]):
            span = torch.arange(starts[d], starts[d] + lengths[d])
            index[row, : lengths[d]] = span
            where[span] = done + row * longest + torch.arange(lengths[d])
        src.append(index.flatten())
        shapes.append((j - i, longest))
        done += (j - i) * longest
        i = j
    return Buckets(src, shapes, where, tokens)


class _DocumentsApart:
    """Mixed into a template's mixer module (its class becomes a subclass of this and its own, under the same
    name): a call that is given the :class:`Packed` marker with a layout runs the documents one per row."""

    def forward(self, *args, **kwargs):
        marker = next((a for a in (*args, *kwargs.values()) if isinstance(a, Packed) and a.docs is not None), None)
        own = super().forward
        if marker is None:
            return own(*args, **kwargs)
        args = tuple(None if a is marker else a for a in args)
        kwargs = {k: None if v is marker else v for k, v in kwargs.items()}
        if "hidden_states" in kwargs:
            x = kwargs.pop("hidden_states")
            return marker.docs.run(lambda h: own(*args, hidden_states=h, **kwargs), x)
        return marker.docs.run(lambda h: own(h, *args[1:], **kwargs), args[0])


_subclasses: dict[type, type] = {}


def _keep_apart(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, _DocumentsApart):
        return
    if cls not in _subclasses:
        _subclasses[cls] = type(cls.__name__, (_DocumentsApart, cls), {"__module__": cls.__module__,
                                                                     "__qualname__": cls.__qualname__})
    module.__class__ = _subclasses[cls]


def mixers(block: nn.Module) -> list[nn.Module]:
    """The modules of ``block`` that carry something from token to token: its gated delta nets, and the module
    holding each other ``nn.Conv1d`` (a Mamba mixer, a short convolution)."""
    nets = delta_nets(block)
    inside = {id(m) for n in nets for m in n.modules()}
    found = list(nets)
    for m in block.modules():
        if id(m) not in inside and any(isinstance(c, nn.Conv1d) for c in m.children()) and m not in found:
            found.append(m)
    return found


def can_keep_apart(model: nn.Module) -> bool:
    """Whether packed rows of ``model`` keep their documents apart in its blocks: none of its blocks mixes tokens
    besides attention, or its family's mixers run documents one per row here (:data:`FAMILIES`)."""
    try:
        blocks = find_blocks(model)[1]
    except CaptureError:
        return True  # (the capture says why it cannot take the model)
    return not any(mixes_tokens(b) for b in blocks) or _family(model) in FAMILIES


def keep_apart(model: nn.Module, segments: list, graph: torch.fx.Graph) -> tuple[bool, bool]:
    """Make the mixers of the block templates of the captured ``segments`` run packed documents one per row where
    ``model``'s family allows (:func:`can_keep_apart`) and its embedding layer's ``graph`` builds the recurrent mask
    (which carries the layout to them). Returns (whether packed rows keep their documents apart in every block,
    whether any mixer was changed: the runtime then gives packed micro-batches their layout)."""
    mixing = [s.template for s in segments if s.kind == "block" and mixes_tokens(s.template)]
    if not mixing:
        return True, False
    if _family(model) not in FAMILIES or not any(
            n.op == "call_function" and getattr(n.target, "__name__", "") == RECURRENT_MASK_BUILDER
            for n in graph.nodes):
        return False, False
    for t in mixing:
        for m in mixers(t):
            _keep_apart(m)
    return True, True


def _family(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)
