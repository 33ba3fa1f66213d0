"""Fused linear + cross-entropy: loss and gradients of sum(CE(hidden @ weight.T, labels)) / denom, in chunks of
rows so the (T, V) logits never exist whole. Gradients are computed in the forward pass (the loss is the end of
the graph); backward only scales them by the incoming gradient."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one logits chunk (1 GiB in bf16). Larger chunks mean fewer passes over the weight gradient (each
# chunk reads and writes it once: at V=152064, H=3584 that is 2.2 GB a chunk in bf16); smaller ones less memory.
LOGITS_PER_CHUNK = 1 << 29


@triton.jit
def _softcap(z, cap):
    # cap * tanh(z / cap), with tanh from exp (portable across Triton versions)
    e = tl.exp(-2.0 * tl.abs(z / cap))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(z < 0, -t, t)


@triton.jit
def _ce_grad_kernel(LOGITS, LABELS, LOSS, stride, V, ignore_index, scale, cap,
                    SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    # One row: online max / sum-exp over V, then overwrite the row with scale * (softmax - onehot), chained
    # through cap * tanh(z / cap) when SOFTCAP (Gemma 2's final logit soft-capping).
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = _softcap(x, cap)
        x = tl.where(cols < V, x, -float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    safe = tl.where(valid, label, 0)
    x_label = tl.load(ptr + safe).to(tl.float32)
    if SOFTCAP:
        x_label = _softcap(x_label, cap)
    tl.store(LOSS + row, tl.where(valid, lse - x_label, 0.0))
    g_scale = tl.where(valid, scale, 0.0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cmask = cols < V
        z = tl.load(ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        x = z
        if SOFTCAP:
            x = _softcap(z, cap)
        g = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * g_scale
        if SOFTCAP:  # d/dz cap * tanh(z / cap) = 1 - tanh^2
            t = x / cap
            g = g * (1.0 - t * t)
        tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=cmask)


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, with fp32 output straight from the GEMM where torch supports it (CUDA, 16-bit inputs)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):
            pass
    acc.add_(a @ b)


def linear_cross_entropy_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, denom: float,
                                 ignore_index: int = -100, grad_weight: torch.Tensor | None = None,
                                 softcap: float | None = None):
    """(loss, d hidden, d weight). hidden (T, H), weight (V, H), labels (T,).

    ``grad_weight``: a (V, H) buffer to accumulate into and return (the runtime passes its fp32 gradient slot);
    by default a new one of the weight's dtype, accumulated chunk by chunk by the GEMM (fp32 inside each GEMM).
    ``softcap``: logits become softcap * tanh(logits / softcap) before the softmax (Gemma 2)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)} do not fit (T, H), (V, H), (T,)")
    T, _ = hidden.shape
    V = weight.shape[0]
    labels = labels.contiguous()
    chunk = max(1, min(T, LOGITS_PER_CHUNK // V))
    dh = torch.empty_like(hidden)
    dw = grad_weight if grad_weight is not None else torch.zeros_like(weight)
    losses = torch.empty(T, dtype=torch.float32, device=hidden.device)
    block = min(4096, triton.next_power_of_2(V))
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        h = hidden[start:end]
        logits = h @ weight.t()  # (c, V), becomes the gradient of the logits in place
        _ce_grad_kernel[(end - start,)](logits, labels[start:end], losses[start:end], logits.stride(0), V,
                                        ignore_index, 1.0 / denom, float(softcap or 1.0), SOFTCAP=softcap is not None,
                                        BLOCK=block, num_warps=8)
        torch.mm(logits, weight, out=dh[start:end])
        _add_matmul(dw, logits.t(), h)
        del logits  # before the next chunk's is formed: one chunk at a time (the plan counts one)
    return losses.sum() / denom, dh, dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, denom: float, ignore_index: int = -100, softcap: float | None = None):
        loss, dh, dw = linear_cross_entropy_forward(hidden, weight, labels, denom, ignore_index, softcap=softcap)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        return dh * grad_loss.to(dh.dtype), dw * grad_loss.to(dw.dtype), None, None, None, None


def linear_cross_entropy(hidden, weight, labels, denom: float, ignore_index: int = -100,
                         softcap: float | None = None) -> torch.Tensor:
    return LinearCrossEntropyFunction.apply(hidden, weight, labels, denom, ignore_index, softcap)
