"""RoPE, HF rotate-half convention: out = x * cos + rotate_half(x) * sin, on q and k of shape (B, H, T, D)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 32  # rows (one position of one head: D values) per program; H200 sweep in docs/kernels.md
NUM_WARPS = 4


@triton.jit
def _rope_kernel(X, COS, SIN, Y, n_rows, T, n_heads, half, sxb, sxh, sxt, syb, syh, syt, scb, sct, ssb, sst,
                 BACKWARD: tl.constexpr, HEADS_INNER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program: BLOCK_R consecutive rows (a row: one position of one head, D values) in memory order, (b, h, t)
    # for the contiguous (B, H, T, D) layout, (b, t, h) for HF's transposed projection; each program streams one
    # contiguous span of x and y. cos/sin rows (B, T, D) are shared by all heads and stay in L2.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (r < n_rows) & (d < half)
    if HEADS_INNER:
        h = r % n_heads
        bt = r // n_heads
        t = bt % T
        b = bt // T
    else:
        t = r % T
        bh = r // T
        b = bh // n_heads
        h = bh % n_heads
    c_ptr = COS + b * scb + t * sct + d
    s_ptr = SIN + b * ssb + t * sst + d
    c1 = tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the rotation: (g1, g2) -> (g1 c1 + g2 s2, g2 c2 - g1 s1)
        a1, b1, a2, b2 = c1, s2, c2, -s1
    else:  # (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)
        a1, b1, a2, b2 = c1, -s1, c2, s2
    x_ptr = X + b * sxb + h * sxh + t * sxt + d
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    y_ptr = Y + b * syb + h * syh + t * syt + d
    tl.store(y_ptr, (x1 * a1 + x2 * b1).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + half, (x2 * a2 + x1 * b2).to(Y.dtype.element_ty), mask=mask)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, block_r: int | None = None,
           num_warps: int | None = None) -> torch.Tensor:
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"rope expects x (B, H, T, D) and cos/sin (B or 1, T, D); got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    B, H, T, D = x.shape
    if D % 2 or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)} (even head dim needed)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    y = torch.empty_like(x)  # keeps x's layout: (B, H, T, D) or HF's (B, T, H, D) seen through a transpose
    cb = cos.stride(0) if cos.shape[0] == B else 0
    sb = sin.stride(0) if sin.shape[0] == B else 0
    br = block_r or BLOCK_R
    n_rows = B * H * T
    _rope_kernel[(triton.cdiv(n_rows, br),)](
        x, cos, sin, y, n_rows, T, H, D // 2, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
        y.stride(2), cb, cos.stride(1), sb, sin.stride(1),
        BACKWARD=backward, HEADS_INNER=x.stride(1) < x.stride(2), BLOCK_R=br, BLOCK_D=triton.next_power_of_2(D // 2), num_warps=num_warps or NUM_WARPS)
    return y


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _apply(q, cos, sin, False), _apply(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _apply(dq, cos, sin, True), _apply(dk, cos, sin, True), None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated; cos/sin as HF's rotary embedding returns them."""
    return RoPEFunction.apply(q, k, cos, sin)
