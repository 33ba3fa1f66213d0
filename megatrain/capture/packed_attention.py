"""Attention over packed rows at the fused kernel's speed.

A row packed from several documents must attend within each document alone. HF's mask builders do that from the
position ids: they build a (b, 1, T, T) block-diagonal mask, which sends SDPA to its masked kernel, and first read a
value back from the device to see whether the rows are packed at all (a stall of the issuing thread for every
micro-batch). Where the model's attention goes through HF's attention interface, the captured model is switched to
``NAME_sdpa`` or ``NAME_eager``: the model's own attention for every mask HF builds and, for a micro-batch of packed
rows on the GPU, torch's flash attention over the documents (its variable-length form, the aten kernels that
``torch.nn.attention.varlen`` wraps), their offsets computed once per micro-batch on the host (:func:`doc_offsets`).
The embedding layer's causal-mask builder then returns the :class:`~megatrain.capture.tracer.Packed` marker that
carries them instead of building a mask (capture.tracer)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch

from megatrain.capture.tracer import Packed

NAME = "megatrain_packed"

# families whose attention modules call HF's attention interface with (module, q, k, v, mask, dropout=, scaling=,
# sliding_window=, ...) and take no score modifiers (soft-capping, sinks) the flash kernel lacks
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "olmo2",
                      "granite"})


def _flash_available() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(torch.ops.aten, "_flash_attention_backward")


def enable(model: torch.nn.Module) -> bool:
    """Switch ``model`` (the captured model's own copy) from SDPA or eager attention to the same with offsets for
    packed rows (``NAME_sdpa`` / ``NAME_eager``) where its family and torch allow; whether it was switched."""
    cfg = model.config
    orig = cfg._attn_implementation
    if (getattr(cfg, "model_type", None) not in FAMILIES or orig not in ("sdpa", "eager") or not _flash_available()
            or getattr(cfg, "attn_logit_softcapping", None) is not None):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"{NAME}_{orig}"
    AttentionInterface.register(name, functools.partial(attention, orig))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[orig])
    cfg._attn_implementation = name
    return True


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
    (b, Hkv, T, D); returns the output as (b, T, Hq, D) and ``orig``'s weights (none for packed rows). ``orig`` for
    every mask but a :class:`Packed` marker with offsets."""
    if orig == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as delegate
    else:  # each modeling file has its own eager attention
        delegate = sys.modules[type(module).__module__].eager_attention_forward
    if not isinstance(attention_mask, Packed):
        return delegate(module, query, key, value, attention_mask, **kwargs)
    if attention_mask.cu is None:
        raise ValueError("packed rows reached the attention without their document offsets")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(f"{NAME}: a layer with a sliding window or soft-capping was given packed rows; its mask "
                         "builder should have built their mask")
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and kwargs.get("dropout", 0.0) == 0.0:
        return _flash(query, key, value, attention_mask, kwargs.get("scaling")), None
    # elsewhere (the CPU, fp32 on the GPU, dropout): ``orig`` with the block-diagonal causal mask of the offsets, as
    # HF's builder for ``orig`` makes it (boolean for SDPA, additive for eager)
    mask = block_mask(attention_mask, query.shape[0])
    if orig == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    return delegate(module, query, key, value, mask, **kwargs)


def block_mask(packed: Packed, b: int) -> torch.Tensor:
    """The (b, 1, T, T) boolean mask of packed rows: each position sees the positions up to itself in its document."""
    cu = packed.cu.long()
    n = int(cu[-1])
    t = n // b
    doc = torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True).view(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=cu.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


class _FlashOverDocuments(torch.autograd.Function):
    """Causal flash attention over the documents of rows laid end to end: (n, Hq, D) queries, (n, Hkv, D) keys and
    values (grouped heads as they are), ``cu`` the documents' offsets. torch's own aten flash kernels, called
    directly: the issuing thread pays one autograd node per call, where the library's variable-length wrapper adds
    a Python dispatch layer each way (a host cost per layer and micro-batch that a host-bound step pays in full)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float | None):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        with _deterministic():
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng, unused,
                scale=ctx.scale)
        return dq, dk, dv, None, None, None


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


def _flash(query, key, value, packed: Packed, scale):
    b, hq, t, d = query.shape
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    return _FlashOverDocuments.apply(q, k, v, packed.cu, packed.max_len, scale).view(b, t, hq, d)
