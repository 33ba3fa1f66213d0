"""Tracing a causal LM with ``torch.fx``: decoder blocks as leaves, static tensor metadata, errors that say where.

The forward of ``(input_ids, attention_mask, position_ids) -> logits`` is traced with the decoder blocks (and
rotary-embedding and RMSNorm modules) as leaf calls, and HF's attention-mask builders
(``transformers.masking_utils.create_*mask``) as leaf functions evaluated at run time, once per micro-batch.

Code around the blocks often branches on what a tensor *is* rather than what it holds: ``attention_mask.ndim < 4``
(GPT-2), ``causal_mask.ndim == 4`` and ``causal_mask.dtype == torch.bool`` (Falcon with ALiBi), ``*alibi.shape[1:]``.
A plain fx trace cannot answer these. Here every traced value carries an example of itself on the meta device (the
inputs as a (2, 8) batch, parameters in the compute dtype the runtime binds them in), propagated op by op; a value's
rank, dtype and the length of a shape tuple -- the same for every batch -- are answered from that example, so such
branches are decided at capture time. Sizes stay symbolic (the graph serves every batch shape), and a branch on
tensor contents or sizes is refused, naming the module and the source line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import operator
import os
import re
import sys
import traceback
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.node import map_aggregate

from megatrain.capture.shared_state import FreshPerCall, PerMicroBatch, kv_sharing


class CaptureError(ValueError):
    """The model has a structure capture does not understand; the message says what, where, and what to do."""


# example batches the metadata is propagated with: their sizes never reach the graph (only ranks, dtypes and sizes
# that are the same for both do)
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 8
EXAMPLES = ((EXAMPLE_BATCH, EXAMPLE_SEQ), (3, 7))
# HF's builder of the padding mask that recurrent mixers (delta nets, Mamba) take (transformers.masking_utils)
RECURRENT_MASK_BUILDER = "create_recurrent_attention_mask"


def leaf_function(fn):
    """A stand-in for ``fn`` that records one fx call node (like ``torch.fx.wrap``), binding arguments that fx cannot
    represent (config objects) into the recorded callable."""

    @functools.wraps(fn)
    def stand_in(*args, **kwargs):
        flat = [*args, *kwargs.values()]
        proxy = next((a for a in flat if isinstance(a, torch.fx.Proxy)), None)
        if proxy is None:
            return fn(*args, **kwargs)
        const = {k: v for k, v in kwargs.items() if not _fx_arg(v)}
        dyn = {k: v for k, v in kwargs.items() if k not in const}

        def bound(*a, **k):
            packed = k.get("attention_mask")
            if isinstance(packed, Packed):  # documents packed into each row, told apart by position ids
                if packed.cu is not None and fn.__name__ in ("create_causal_mask", "create_sliding_window_causal_mask"):
                    return packed  # for the attention to read the documents' offsets from (and its window)
                if packed.docs is not None and fn.__name__ == RECURRENT_MASK_BUILDER:
                    return packed  # for the blocks' recurrences to run the documents apart (capture.documents)
                # restarting at each: HF's mask builders keep them apart where no mask is given
                k = {**k, "attention_mask": None}
            elif "position_ids" in k and "attention_mask" in k and k["attention_mask"] is None:
                # the runtime passes no mask only for a micro-batch without padding (see Captured.mask_optional),
                # whose positions run 0..T-1 in every row: HF's mask builders would read them back from the device
                # to look for packed sequences, and they use them for nothing else
                k = {**k, "position_ids": None}
            return fn(*a, **const, **k)

        bound.__name__ = bound.__qualname__ = fn.__name__
        bound.__module__ = __name__
        bound.const = const  # (rebind_config)
        return proxy.tracer.create_proxy("call_function", bound, args, dyn)

    return stand_in


def rebind_config(target, config) -> None:
    """Make a recorded call of :func:`leaf_function` (a mask builder) read ``config`` where it read the traced
    model's: the capture's own copy, whose attention implementation it switched (capture.packed_attention)."""
    const = getattr(target, "const", None)
    if const is not None and "config" in const:
        const["config"] = config


def is_mask_builder(target) -> bool:
    """Whether an fx call target is an HF mask builder recorded by :func:`leaf_function`."""
    name = getattr(target, "__name__", "")
    return getattr(target, "__module__", None) == __name__ and name.startswith("create_") and name.endswith("mask")


def _fx_arg(v) -> bool:
    if isinstance(v, (torch.fx.Proxy, torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)):
        return True
    if isinstance(v, (tuple, list)):
        return all(_fx_arg(x) for x in v)
    return False


_UNKNOWN = object()


@dataclasses.dataclass(eq=False, repr=False)
class Packed:
    """Passed for the attention mask of a micro-batch whose rows hold several documents each (with position ids that
    restart at each document): the mask builders then make each document attend to itself alone. With ``cu`` (the
    documents' offsets in the rows laid end to end, on the device; ``max_len`` the longest), the causal-mask builder
    returns the marker itself, for an attention that reads the offsets (runtime.packed_attention)."""

    cu: torch.Tensor | None = None
    max_len: int = 0
    docs: Any = None  # the documents' layout for the blocks' recurrences where they take it (capture.documents)

    def __repr__(self) -> str:
        return "PACKED"


PACKED = Packed()


class MetaProxy(torch.fx.Proxy):
    """A traced value with an example of itself (``example``: a meta tensor, a shape, a number; or unknown).
    Rank, dtype and the length of a tuple are static, so they are answered from the example; everything else
    (sizes, devices, values) stays a node of the graph."""

    example: Any = _UNKNOWN
    example2: Any = _UNKNOWN  # the same over the second example batch (EXAMPLES)
    static: bool = False  # a number or size the same for every batch (see Tracer.to_bool)

    def _tensor(self) -> torch.Tensor | None:
        return self.example if isinstance(self.example, torch.Tensor) else None

    @property
    def ndim(self):
        t = self._tensor()
        return t.ndim if t is not None else self.__getattr__("ndim")

    @property
    def dtype(self):
        t = self._tensor()
        return t.dtype if t is not None else self.__getattr__("dtype")

    def dim(self):
        t = self._tensor()
        return t.dim() if t is not None else self.__getattr__("dim")()

    def is_floating_point(self):
        t = self._tensor()
        return t.is_floating_point() if t is not None else self.__getattr__("is_floating_point")()

    def __len__(self):
        if isinstance(self.example, (tuple, list)):  # a shape or a tuple of values: its length is a rank
            return len(self.example)
        return super().__len__()

    def __getattr__(self, k: str) -> "MetaAttribute":
        return MetaAttribute(self, k)


class MetaAttribute(MetaProxy, torch.fx.proxy.Attribute):
    """``proxy.attr`` (``x.shape``, ``x.dtype`` where unknown, a method about to be called), with its example."""

    def __init__(self, root: MetaProxy, attr: str):
        torch.fx.proxy.Attribute.__init__(self, root, attr)
        for name in ("example", "example2"):
            try:
                ex = getattr(root, name)
                setattr(self, name, getattr(ex, attr) if ex is not _UNKNOWN else _UNKNOWN)
            except Exception:  # noqa: BLE001 - an attribute the example lacks: unknown
                setattr(self, name, _UNKNOWN)
        self.static = _same(self.example, self.example2) and root.static


class Tracer(torch.fx.Tracer):
    """Blocks, rotary embeddings and RMSNorms as leaves; every value with a meta example (see the module doc)."""

    def __init__(self, blocks: set[int], meta_root: nn.Module, dtype: torch.dtype, kv_shared: bool = False):
        super().__init__()
        self.blocks = blocks
        self.kv_shared = kv_shared  # some blocks reuse keys and values earlier blocks computed (refused)
        self.block_names: set[str] = set()  # the blocks' call targets (trace sets them)
        self.blocks_keep_shape = True  # every block run on the examples returned a tensor shaped as its input
        self.meta_shared: dict = {}
        self.meta_root = meta_root  # the traced root over a model whose parameters and buffers are meta tensors
        self.dtype = dtype

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self.blocks or type(m).__name__.endswith(("RotaryEmbedding", "Norm", "Norm1P")):
            return True
        return super().is_leaf_module(m, qualname)

    def proxy(self, node: torch.fx.Node) -> MetaProxy:
        return MetaProxy(node, self)

    def create_arg(self, a):
        """The key/value sharing object handed to every block (Gemma 3n, Gemma 4): where blocks reuse keys and
        values others stored there, one per micro-batch (:class:`PerMicroBatch`); else a new one each call (the
        last block of each attention type only stores its own there, for assistant models to read)."""
        if kv_sharing(a):
            return PerMicroBatch(type(a)) if self.kv_shared else FreshPerCall(type(a))
        return super().create_arg(a)

    def create_proxy(self, kind, target, args, kwargs, *rest, **kw):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        if isinstance(proxy, MetaProxy):
            proxy.example = proxy.node.meta["example"] = self._example(kind, target, args, kwargs, 0)
            proxy.example2 = self._example(kind, target, args, kwargs, 1)
            inputs = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.fx.Proxy)]
            # a size read off a shape, the same for both example batches, is one no batch changes (e.g. the 4 of
            # Qwen3.5's (4, b, T) position ids); what is computed from static values alone is static too
            size = target in (operator.getitem, "size") and bool(inputs) and isinstance(
                getattr(inputs[0], "example", None), torch.Size)
            # and two traced sizes or shapes found equal (or unequal) for both example batches are so for every
            # batch (Gemma 3n compares two shapes built from the same batch)
            pair = target in (operator.eq, operator.ne) and len(inputs) == 2 == len(args) and all(
                _plain(getattr(v, "example", None)) for v in inputs)
            proxy.static = _same(proxy.example, proxy.example2) and (
                size or pair or all(getattr(v, "static", False) for v in inputs))
        return proxy

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        """A branch on a static value (:attr:`MetaProxy.static`: a size no batch changes, compared with a
        constant) is decided at capture time; any other is refused (torch.fx's error, described by
        :func:`describe_failure`)."""
        if getattr(obj, "static", False):
            return bool(obj.example)
        return super().to_bool(obj)

    def iter(self, obj):
        if isinstance(obj, MetaProxy) and isinstance(obj.example, (tuple, list)):  # `*x.shape[1:]`
            return iter([obj[i] for i in range(len(obj.example))])
        return super().iter(obj)

    def _example(self, kind: str, target, args, kwargs, which: int = 0):
        """The op run on the examples of its inputs (meta tensors) of example batch ``which`` (:data:`EXAMPLES`),
        or unknown where any input is unknown or the op cannot run on meta tensors (it reads values)."""
        if kind == "placeholder":
            return torch.zeros(*EXAMPLES[which], dtype=torch.long, device="meta")
        if kind == "get_attr":
            try:
                return self.meta_root.get_parameter(target)
            except AttributeError:
                try:
                    return self.meta_root.get_buffer(target)
                except AttributeError:
                    return _UNKNOWN
        unknown = []
        a, k = map_aggregate((args, kwargs), lambda v: _example_of(v, unknown, which))
        if kind == "call_module" and target in self.block_names:
            return self._block_example(target, a, k, unknown, which)
        if unknown:
            return _UNKNOWN
        try:
            with _unpatched(), torch.no_grad():  # modules called as modules, not recorded
                if kind == "call_function":
                    return target(*a, **k)
                if kind == "call_method":
                    return getattr(a[0], target)(*a[1:], **k)
                if kind == "call_module":
                    return self.meta_root.get_submodule(target)(*a, **k)
        except Exception:  # noqa: BLE001 - an op that reads values (or needs a real device): its example is unknown
            return _UNKNOWN
        return _UNKNOWN


    def _block_example(self, target: str, a, k, unknown: list, which: int):
        """A block's output on the examples; where an input other than the hidden state is unknown (a mask a leaf
        builder made), the hidden state's shape again, if every block run on known inputs gave back a tensor of its
        input's shape (a block of a chain maps the hidden state to one like it)."""
        h = a[0] if a else None
        if not unknown:
            # one shared object of meta examples per example batch for the block calls (the model's stays empty)
            a, k = map_aggregate((a, k), lambda v: self.meta_shared.setdefault(which, type(v)()) if kv_sharing(v)
                                 else v)
            try:
                with _unpatched(), torch.no_grad():
                    out = self.meta_root.get_submodule(target)(*a, **k)
            except Exception:  # noqa: BLE001 - as in _example
                out = _UNKNOWN
            self.blocks_keep_shape &= isinstance(out, torch.Tensor) and isinstance(h, torch.Tensor) and \
                out.shape == h.shape
            return out
        if self.blocks_keep_shape and isinstance(h, torch.Tensor):
            return torch.empty_like(h)
        return _UNKNOWN


# while tracing, torch.fx patches nn.Module.__call__ to record calls; the examples are computed with it undone
_unpatched = getattr(torch.fx._symbolic_trace, "_maybe_revert_all_patches", contextlib.nullcontext)


def _same(a, b) -> bool:
    """Whether two examples are one plain value (a number, a bool, a size or a tuple of them) in both."""
    return type(a) is type(b) and _plain(a) and _plain(b) and a == b


def _plain(v) -> bool:
    return isinstance(v, (bool, int, float)) or isinstance(v, (tuple, torch.Size)) and all(_plain(x) for x in v)


def _example_of(v, unknown: list, which: int = 0):
    if isinstance(v, MetaProxy):
        ex = v.example2 if which else v.example
        if ex is _UNKNOWN:
            unknown.append(v)
        return ex
    if isinstance(v, torch.fx.Proxy):
        unknown.append(v)
    return v


def meta_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` on the meta device: floating-point parameters in ``dtype`` (what the runtime binds),
    buffers as they are (the runtime moves them without casting)."""
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype,
                                            device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in model.buffers()})
    return __import__("copy").deepcopy(model, memo)


def takes_positions(model: nn.Module, hf: bool) -> bool:
    """Whether ``model`` is an HF model whose forward takes position ids."""
    return hf and "position_ids" in inspect.signature(model.forward).parameters


class Root(nn.Module):
    """What is traced: ``(input_ids, attention_mask, position_ids) -> logits``; the position ids reach an HF model
    whose forward takes them (``positions``), nothing else."""

    def __init__(self, model: nn.Module, hf: bool):
        super().__init__()
        self.m = model
        self.hf = hf
        self.positions = takes_positions(model, hf)

    def forward(self, input_ids, attention_mask, position_ids):
        if self.positions:
            return self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits
        if self.hf:
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return self.m(input_ids)


def trace(model: nn.Module, blocks: nn.ModuleList, blocks_name: str, hf: bool,
          dtype: torch.dtype) -> torch.fx.GraphModule:
    """The traced root with ``blocks`` as leaves; a :class:`CaptureError` naming the construct and the line where
    tracing fails."""
    patched = []
    targets = {}
    try:
        mask_mod = importlib.import_module("transformers.masking_utils") if hf else None
    except ImportError:
        mask_mod = None
    if mask_mod is not None:
        for n in dir(mask_mod):
            f = getattr(mask_mod, n)
            if n.startswith("create_") and n.endswith("mask") and callable(f):
                targets[f] = leaf_function(f)
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    root = Root(model, hf)
    cfg = getattr(model, "config", None)
    kv_shared = bool(getattr(getattr(cfg, "get_text_config", lambda: cfg)(), "num_kv_shared_layers", 0))
    tracer = Tracer({id(b) for b in blocks}, Root(meta_model(model, dtype), hf), dtype, kv_shared)
    tracer.block_names = {f"m.{blocks_name}.{i}" for i in range(len(blocks))}
    # Gemma 4 slices the KV-shared blocks' inputs to the positions whose logits generation keeps; a training forward
    # keeps them all (logits_to_keep 0), where the slicing returns its inputs as they are (its branch on the length
    # is one the trace cannot take)
    sliced = [m for m in model.modules() if hasattr(m, "_maybe_slice_kv_shared_inputs")]
    try:
        for mod in modules:
            for n, v in list(vars(mod).items()):
                if callable(v) and v in targets:
                    patched.append((mod, n, v))
                    setattr(mod, n, targets[v])
        for m in sliced:
            m._maybe_slice_kv_shared_inputs = lambda h, per_layer, positions, masks, *a, **k: (h, per_layer,
                                                                                             positions, masks)
        try:
            graph = tracer.trace(root)
        except Exception as e:  # noqa: BLE001 - any tracing failure is reported as what capture did not understand
            raise CaptureError(describe_failure(model, blocks_name, e)) from None
        return torch.fx.GraphModule(root, graph)
    finally:
        for mod, n, v in patched:
            setattr(mod, n, v)
        for m in sliced:
            m.__dict__.pop("_maybe_slice_kv_shared_inputs", None)


# --------------------------------------------------------------------------------------------------------------
_WHAT = (  # torch.fx's message -> what the model's code did, in the words of this project
    ("cannot be used as inputs to control flow",
     "an `if`, `while`, `and`/`or` or `assert` decides on a tensor's values or sizes, which are only known when a "
     "batch runs"),
    ("cannot be iterated", "a loop or an unpacking runs over a tensor or over a traced value of unknown length"),
    ("'len' is not supported", "len() of a tensor, whose size is only known when a batch runs"),
    ("object is not subscriptable", "indexes a traced value that is not a tensor"),
)
_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.rpartition(".")[0]]))


def describe_failure(model: nn.Module, blocks_name: str, e: BaseException) -> str:
    """One message for a failed trace: the construct, the module and source line it is in, what to do."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = next((w for key, w in _WHAT if key in msg), None)
    kind = re.search(r"argument of type: <class '([\w.]+)'>", msg)
    if kind is not None:
        what = f"a value of type {kind.group(1).rpartition('.')[2]} is passed along, neither a tensor nor a plain value"
    if what is None:
        what = f"{type(e).__name__} while tracing ({msg[:200]})"
    names = {id(m): n for n, m in model.named_modules()}
    where, module = None, None
    for frame, line in traceback.walk_tb(e.__traceback__):
        path = frame.f_code.co_filename
        if path.startswith(_SKIP_DIRS) or path.startswith("<"):
            continue
        where = (path, line)
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module = f"'{names[id(owner)]}' ({type(owner).__name__})" if names[id(owner)] else \
                f"{type(owner).__name__}.forward"
    loc = ""
    if where is not None:
        import linecache

        code = linecache.getline(where[0], where[1]).strip()
        loc = f" in {module or 'the forward'} at {os.path.basename(where[0])}:{where[1]}" + (f": `{code}`" if code
                                                                                             else "")
    head = (f"{type(model).__name__}: capture cannot trace the forward around the decoder blocks "
            f"('{blocks_name}'){loc}: {what}.")
    if kind is not None:  # (no branch to avoid: what the blocks are given)
        return f"{head} Blocks may take tensors and plain values only, each block's own or shared by every block"
    return (f"{head} Only the code outside the blocks is traced (each block runs as it "
            f"is): pass compile(blocks='path.to.ModuleList') if these are not the decoder blocks; for an HF model, "
            f"another attn_implementation may take a path without the branch; otherwise compute that value without "
            f"branching on it")
