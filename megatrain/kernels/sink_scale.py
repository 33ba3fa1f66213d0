"""Attention sinks around a flash kernel (GPT-OSS): the kernel's output of the real scores scaled by the share of
the softmax they keep beside each head's sink logit, and the backward's two row operations, each one pass over the
rows in fp32 registers (in torch: five casts and products through memory). Definitions: ``reference.sink_scale`` and
``reference.sink_scale_backward``; the algebra: capture.packed_attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # (row, head) pairs per program


@triton.jit
def _sink_scale_kernel(X, DY, Y, W, LSE, SINKS, n_pairs, H, D, s_lse_h, s_lse_n,
                       BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # pairs r = i * H + h of contiguous (n, H, D) tensors. Forward: Y = X * s. Backward (X the scaled output, DY its
    # gradient): Y = DY * s and W[r] = (1 - s) * dot(DY, X), with s = sigmoid(lse[h, i] - sinks[h]).
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    live = r < n_pairs
    h = r % H
    i = r // H
    lse = tl.load(LSE + h * s_lse_h + i * s_lse_n, mask=live, other=0.0).to(tl.float32)
    sink = tl.load(SINKS + h, mask=live, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(sink - lse))
    m = live[:, None] & (d[None, :] < D)
    at = r[:, None] * D + d[None, :]
    x = tl.load(X + at, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        dy = tl.load(DY + at, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + at, (dy * s[:, None]).to(Y.dtype.element_ty), mask=m)
        tl.store(W + r, (1.0 - s) * tl.sum(dy * x, axis=1), mask=live)
    else:
        tl.store(Y + at, (x * s[:, None]).to(Y.dtype.element_ty), mask=m)


def _launch(x, dy, lse, sinks, backward: bool):
    if x.dim() != 3 or not x.is_contiguous() or (dy is not None and (dy.shape != x.shape or not dy.is_contiguous())):
        raise ValueError(f"sink_scale takes contiguous (n, H, D) tensors, got {tuple(x.shape)}")
    n, heads, d = x.shape
    if lse.shape != (heads, n) or sinks.shape != (heads,):
        raise ValueError(f"sink_scale: lse {tuple(lse.shape)} and sinks {tuple(sinks.shape)} do not match "
                         f"(n, H) = ({n}, {heads})")
    y = torch.empty_like(x)
    w = torch.empty(n, heads, device=x.device, dtype=torch.float32) if backward else y
    pairs = n * heads
    _sink_scale_kernel[(triton.cdiv(pairs, BLOCK_R),)](
        x, dy if backward else x, y, w, lse, sinks, pairs, heads, d, lse.stride(0), lse.stride(1),
        BACKWARD=backward, BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(d))
    return y, w


def sink_scale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``reference.sink_scale``."""
    return _launch(out, None, lse, sinks, False)[0]


def sink_scale_backward(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.sink_scale_backward``: (dout x share, (1 - share) dot(dout, out) per row and head)."""
    return _launch(out, dout, lse, sinks, True)
