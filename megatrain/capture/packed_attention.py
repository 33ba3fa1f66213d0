"""Attention over packed rows at the fused kernel's speed.

A row packed from several documents must attend within each document alone. HF's mask builders do that from the
position ids: they build a (b, 1, T, T) block-diagonal mask, which sends SDPA to its masked kernel, and first read a
value back from the device to see whether the rows are packed at all (a stall of the issuing thread for every
micro-batch). Where the model's attention goes through HF's attention interface, the captured model is switched to
``NAME_sdpa`` or ``NAME_eager``: the model's own attention for every mask HF builds and, for a micro-batch of packed
rows on the GPU, torch's flash attention over the documents (its variable-length form, the aten kernels that
``torch.nn.attention.varlen`` wraps), their offsets computed once per micro-batch on the host (:func:`doc_offsets`).
The embedding layer's causal-mask builders then return the :class:`~megatrain.capture.tracer.Packed` marker that
carries them instead of building a mask (capture.tracer); a sliding window goes to the kernel as its window. A
family with attention sinks (GPT-OSS), which HF runs through its eager attention alone, is switched whether its rows
are packed or not (``NAME_sinks``): the flash kernel with the sinks folded into its output (:class:`_FlashOverDocuments`).
Micro-batches of ``ir.graph.GROUPED_ATTN_TOKENS`` tokens or more run their attention one key/value head's group of
query heads at a time, so that the kernel's own buffers are a group's (a long sequence's step holds less on the
device; ``Layer.attn_bwd_bytes``): through SDPA, a group per call, where the model's attention is SDPA's, with no
window, sinks or mask (:func:`sdpa_by_group`); else the flash kernel, its backward a group per call."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch

from megatrain.capture.tracer import Packed
from megatrain.ir.graph import GROUPED_ATTN_TOKENS

NAME = "megatrain_packed"

# families whose attention modules call HF's attention interface with (module, q, k, v, mask, dropout=, scaling=,
# sliding_window=, ...) and take no score modifiers (soft-capping) the flash kernel lacks
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "olmo2",
                      "granite"})
# families with learned per-head sink logits (``s_aux``), a softmax denominator term with no value: HF runs them
# through their eager attention alone, which holds the (heads, T, T) scores; here every causal or sliding-window
# mask without padding goes to the flash kernel, its output scaled by the sink's share (see _FlashOverDocuments)
SINK_FAMILIES = frozenset({"gpt_oss"})


def attention_for(config) -> str:
    """The attention implementation to build an HF model of ``config`` with before capture: SDPA, or eager for a
    family with sinks (HF refuses SDPA there; the capture switches it to the flash kernel)."""
    return "eager" if getattr(config, "model_type", None) in SINK_FAMILIES else "sdpa"


def takes_flash(config) -> bool:
    """Whether a model of ``config``'s family is switched to the flash path (:func:`enable`, where torch has the
    kernel): the families it serves, without soft-capped logits."""
    family = getattr(config, "model_type", None)
    return (family in FAMILIES or family in SINK_FAMILIES) and getattr(config, "attn_logit_softcapping", None) is None


def unfused(model: torch.nn.Module) -> str | None:
    """Where ``model`` (the capture's copy, after :func:`enable`) runs HF's eager attention, which holds each layer's
    (heads, T, T) scores: one line naming the family, why, and what to set; None where SDPA's or the flash kernel
    runs it."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) not in ("eager", f"{NAME}_eager"):
        return None  # (NAME_eager: eager for every mask but packed rows' offsets)
    family = getattr(cfg, "model_type", type(model).__name__)
    why = ("its attention logits are soft-capped, which no fused kernel here takes"
           if getattr(cfg, "attn_logit_softcapping", None) is not None else "it was built with eager attention")
    return (f"{family}: {why}, so each layer's attention holds a (heads, T, T) matrix of scores on the GPU "
            f"(memory and time grow with T squared); build the model with attn_implementation='sdpa' where its "
            f"family allows it, or keep sequences short")


def _flash_available() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(torch.ops.aten, "_flash_attention_backward")


def enable(model: torch.nn.Module) -> bool:
    """Switch ``model`` (the captured model's own copy) from SDPA or eager attention to the same with offsets for
    packed rows (``NAME_sdpa`` / ``NAME_eager``; ``NAME_sinks`` for a family with attention sinks) where its family
    and torch allow; whether it was switched."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):  # not an HF model
        return False
    orig, family = cfg._attn_implementation, getattr(cfg, "model_type", None)
    sinks = family in SINK_FAMILIES and orig == "eager"
    if (not (family in FAMILIES or sinks) or orig not in ("sdpa", "eager") or not _flash_available()
            or not takes_flash(cfg)):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"{NAME}_sinks" if sinks else f"{NAME}_{orig}"
    AttentionInterface.register(name, functools.partial(attention, orig))
    builder = ALL_MASK_ATTENTION_FUNCTIONS[orig]
    AttentionMaskInterface.register(name, functools.partial(_causal_as_none, builder) if sinks else builder)
    cfg._attn_implementation = name
    return True


def _causal_as_none(builder, *args, allow_is_causal_skip: bool = True, attention_mask=None, **kwargs):
    """A mask builder that returns None for a causal (or sliding-window causal) mask without padding, which the
    attention then applies itself (as SDPA's builder does for a causal mask), and ``builder``'s mask otherwise (HF
    turns the skip off for packed rows it has to mask apart)."""
    if allow_is_causal_skip and (attention_mask is None or bool(attention_mask.all())):  # (as SDPA's builder reads)
        return None
    return builder(*args, attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def doc_offsets(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """For (b, T) position ids of packed rows (on the host): where each document starts in the rows laid end to end
    (int32, ``n_docs + 1`` values, the last b x T), and the longest document. A document starts at each row's start
    and wherever a position is not the one before plus one (HF's rule for packed sequences)."""
    b, t = position_ids.shape
    starts = torch.ones(b, t, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    first = starts.flatten().nonzero().flatten()
    cu = torch.cat([first, torch.tensor([b * t])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def attention(orig: str, module, query, key, value, attention_mask, **kwargs):
    """HF's attention interface over ``orig`` ("sdpa" or "eager"): ``query`` (b, Hq, T, D), ``key``/``value``
    (b, Hkv, T, D); returns the output as (b, T, Hq, D) and ``orig``'s weights (none from the flash kernel).
    ``orig`` for every mask but a :class:`Packed` marker with offsets and, in a family with sinks (``s_aux``), no
    mask (causal, no padding); on the GPU in half precision without dropout those go to the flash kernel. There,
    micro-batches of :data:`GROUPED_ATTN_TOKENS` tokens or more without a mask run a key/value head's group of query
    heads at a time: through SDPA where ``orig`` is SDPA and no window or sinks apply (:func:`sdpa_by_group`), else
    through the flash kernel (:func:`_backward`)."""
    if orig == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as delegate
    else:  # each modeling file has its own eager attention
        delegate = sys.modules[type(module).__module__].eager_attention_forward
    sinks, window = kwargs.get("s_aux"), kwargs.get("sliding_window")
    packed = isinstance(attention_mask, Packed)
    b, t = query.shape[0], query.shape[2]
    flash = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and kwargs.get("dropout", 0.0) == 0.0
    if flash and orig == "sdpa" and not packed and attention_mask is None and sinks is None and window is None \
            and b * t >= GROUPED_ATTN_TOKENS:
        return sdpa_by_group(delegate, module, query, key, value, kwargs), None
    # (long rows without padding take the flash path too: its backward runs a group of heads at a time)
    if not packed and not ((sinks is not None or flash and b * t >= GROUPED_ATTN_TOKENS) and attention_mask is None):
        return delegate(module, query, key, value, attention_mask, **kwargs)
    if packed and attention_mask.cu is None:
        raise ValueError("packed rows reached the attention without their document offsets")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{NAME}: a layer with soft-capping was given packed rows; its mask builder should have "
                         "built their mask")
    if flash:
        cu, longest = ((attention_mask.cu, attention_mask.max_len) if packed else
                       (torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=query.device), t))
        return _flash(query, key, value, cu, longest, kwargs.get("scaling"), window, sinks), None
    # elsewhere (the CPU, fp32 on the GPU, dropout): ``orig`` with the mask HF's builder for ``orig`` would make
    # (boolean for SDPA, additive for eager)
    if packed:
        mask = block_mask(attention_mask, b, window)
    else:
        mask = causal_mask(t, window, query.device)[None, None].expand(b, 1, t, t)
    if orig == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    return delegate(module, query, key, value, mask, **kwargs)


def sdpa_by_group(delegate, module, query, key, value, kwargs) -> torch.Tensor:
    """HF's SDPA attention (``delegate``, causal, no mask) one key/value head's group of query heads at a time: the
    backward's buffers are then a group's (``Layer.attn_bwd_bytes``), and the kernel SDPA picks is its own (cuDNN's
    on Hopper: 510-580 TFLOP/s at 131,072 and 262,144 tokens on an H100, where the flash kernel reaches 320, and
    9.4 GiB at most for a 262,144-token Qwen2.5-7B attention's forward and backward against its 10.7;
    docs/benchmarks.md, "Long sequences"). The heads are independent: the output is the whole call's, (b, T, Hq, D)."""
    r = query.shape[1] // key.shape[1]
    outs = [delegate(module, query[:, g * r:(g + 1) * r], key[:, g:g + 1], value[:, g:g + 1], None, **kwargs)[0]
            for g in range(key.shape[1])]
    return torch.cat(outs, dim=2)


def causal_mask(t: int, window: int | None, device) -> torch.Tensor:
    """(t, t) boolean: each position sees itself and the positions before it, the last ``window`` (itself
    included) where a sliding window is given (HF's ``sliding_window_overlay``)."""
    i = torch.arange(t, device=device)
    seen = i[None, :] <= i[:, None]
    return seen if window is None else seen & (i[None, :] > i[:, None] - window)


def block_mask(packed: Packed, b: int, window: int | None = None) -> torch.Tensor:
    """The (b, 1, T, T) boolean mask of packed rows: each position sees the positions up to itself in its document
    (the last ``window`` of them, where given)."""
    cu = packed.cu.long()
    n = int(cu[-1])
    t = n // b
    doc = torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True).view(b, t)
    return (causal_mask(t, window, cu.device) & (doc[:, :, None] == doc[:, None, :]))[:, None]


class _FlashOverDocuments(torch.autograd.Function):
    """Causal flash attention over the documents of rows laid end to end: (n, Hq, D) queries, (n, Hkv, D) keys and
    values (grouped heads as they are), ``cu`` the documents' offsets, ``window`` the keys each query sees (itself
    included; None: all before it). torch's own aten flash kernels, called directly: the issuing thread pays one
    autograd node per call, where the library's variable-length wrapper adds a Python dispatch layer each way (a
    host cost per layer and micro-batch that a host-bound step pays in full).

    ``sinks`` (Hq logits, or None): a softmax term per head with no value. With the kernel's output O and its
    log-sum-exp L of the real scores, the output is O * s with s = sigmoid(L - sink). In the backward the kernel
    is given dO * s for the output's gradient and O * s for the output it computes each row's dot(dO, O) from:
    that dot then equals the one of the softmax that includes the sink, so the scores' gradients are exact; the
    sink's own gradient is -sum over rows of (1 - s) dot(dOut, Out)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, max_len: int, scale: float | None, window: int | None):
        left, right = (None, None) if window is None else (window - 1, 0)
        out, lse, rng, unused = kernel_forward(q, k, v, cu, max_len, scale, left, right)
        if sinks is not None:
            _check_lse(lse, q.shape[0])
            out = _sink_ops(q)[0](out.contiguous(), lse, sinks)  # (the kernel's out follows q's strides)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused, sinks)
        ctx.max_len, ctx.scale, ctx.window = max_len, scale, (left, right)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused, sinks = ctx.saved_tensors
        dout, dsinks = dout.contiguous(), None
        if sinks is not None:
            dout, rows = _sink_ops(q)[1](dout, out, lse, sinks)
            dsinks = -rows.sum(0).to(sinks.dtype)
        # (deterministic, the kernel keeps one fp32 query-gradient accumulator per share of the SMs a (sequence,
        # head) pair gets: 33 GiB for one 524,288-token sequence on an H100, whatever the heads; so a micro-batch of
        # GROUPED_ATTN_TOKENS tokens or more sums its query gradients in the order the blocks finish)
        long = q.shape[0] >= GROUPED_ATTN_TOKENS
        with contextlib.nullcontext() if long else _deterministic():
            dq, dk, dv = _backward(dout, q, k, v, out, lse, cu, ctx.max_len, rng, unused, ctx.scale, ctx.window)
        return dq, dk, dv, dsinks, None, None, None, None


def _backward(dout, q, k, v, out, lse, cu, max_len: int, rng, unused, scale, window):
    """The kernel's backward over all heads at once, or, for :data:`GROUPED_ATTN_TOKENS` tokens or more, one key/
    value head's group of query heads at a time: the kernel then holds its fp32 query-gradient accumulator and its
    key/value gradients expanded to the query heads for one group, not for the layer (``Layer.attn_bwd_bytes``).
    The heads are independent, so each group's gradients are those of the whole call."""
    n, hq, hk = q.shape[0], q.shape[1], k.shape[1]
    if n < GROUPED_ATTN_TOKENS or hk == 1:
        return kernel_backward(dout, q, k, v, out, lse, cu, max_len, rng, unused, scale, *window)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    r = hq // hk
    for g in range(hk):
        h, j = slice(g * r, (g + 1) * r), slice(g, g + 1)
        dq[:, h], dk[:, j], dv[:, j] = kernel_backward(dout[:, h], q[:, h], k[:, j], v[:, j], out[:, h], lse[h], cu,
                                                       max_len, rng, unused, scale, *window)
    return dq, dk, dv


def kernel_forward(q, k, v, cu, max_len: int, scale, left, right):
    """torch's causal flash kernel over documents: (output, log-sum-exp (Hq, n), rng state, unused)."""
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, window_size_left=left,
        window_size_right=right)
    return out, lse, rng, unused


def kernel_backward(dout, q, k, v, out, lse, cu, max_len: int, rng, unused, scale, left, right):
    """Its backward: (dq, dk, dv). ``out`` serves only for each row's dot(dout, out)."""
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng, unused, scale=scale,
        window_size_left=left, window_size_right=right)


def _check_lse(lse: torch.Tensor, n: int) -> None:
    if lse.dim() != 2 or lse.shape[1] != n:
        raise RuntimeError(f"the flash kernel's log-sum-exp has shape {tuple(lse.shape)}, not (heads, {n}) as the "
                           "attention with sinks reads it")


def _sink_ops(q: torch.Tensor):
    """(scale, its backward): the Triton kernels on a GPU, their pure-torch definitions elsewhere."""
    if q.is_cuda:
        from megatrain.kernels import sink_scale as kernels
        return kernels.sink_scale, kernels.sink_scale_backward
    from megatrain.kernels import reference
    return reference.sink_scale, reference.sink_scale_backward


_DETERMINISM = threading.Lock()


@contextlib.contextmanager
def _deterministic():
    """torch's deterministic algorithms for the duration of one call: the flash kernel's backward otherwise sums
    each query block's gradient over key blocks in whatever order they finish (atomic adds), so two runs of the same
    steps on the same GPU differed from the second step on (Qwen2.5-1.5B's shape, packed chat rows, H100), and a run
    resumed from a saved state could not equal the run it continued. Uninitialized memory is left as it is (the
    kernel writes every element it returns)."""
    if torch.are_deterministic_algorithms_enabled():
        yield
        return
    with _DETERMINISM:
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)
            torch.utils.deterministic.fill_uninitialized_memory = fill


def _flash(query, key, value, cu: torch.Tensor, max_len: int, scale, window: int | None = None, sinks=None):
    b, hq, t, d = query.shape
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    return _FlashOverDocuments.apply(q, k, v, sinks, cu, max_len, scale, window).view(b, t, hq, d)
