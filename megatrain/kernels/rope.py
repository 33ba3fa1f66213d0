"""RoPE, HF rotate-half convention: out = x * cos + rotate_half(x) * sin, on q and k of shape (B, H, T, D)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # rows (one position of one head: D values) per program; H200 sweep in docs/kernels.md
BLOCK_R_INTERPRETED = 1024  # in the CPU interpreter, where each program is a round of Python
NUM_WARPS = 2


@triton.jit
def _rope_rows(X, Y, COS, SIN, block, n_rows, T, n_heads, half, sxb, sxh, sxt, syb, syh, syt, scb, sct, ssb, sst,
               BACKWARD: tl.constexpr, HEADS_INNER: tl.constexpr, HALVES_EQUAL: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr):
    # BLOCK_R consecutive rows (a row: one position of one head, D values) in memory order, (b, h, t) for the
    # contiguous (B, H, T, D) layout, (b, t, h) for HF's transposed projection: one contiguous span of x and y.
    # cos/sin rows (B, T, D) are shared by all heads and stay in L2.
    r = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
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
    s1 = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
    if HALVES_EQUAL:  # cos/sin = cat(f, f), as HF's rotary embeddings build them: half the cos/sin reads
        c2, s2 = c1, s1
    else:
        c2 = tl.load(c_ptr + half, mask=mask, other=0.0).to(tl.float32)
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


@triton.jit
def _rope_kernel(Q, YQ, K, YK, COS, SIN, q_blocks, q_rows, q_heads, k_rows, k_heads, T, half,
                 sqb, sqh, sqt, syqb, syqh, syqt, skb, skh, skt, sykb, sykh, sykt, scb, sct, ssb, sst,
                 BACKWARD: tl.constexpr, Q_HEADS_INNER: tl.constexpr, K_HEADS_INNER: tl.constexpr,
                 HALVES_EQUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # q and k in one launch: the first q_blocks programs take q's rows, the rest k's
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rope_rows(Q, YQ, COS, SIN, pid, q_rows, T, q_heads, half, sqb, sqh, sqt, syqb, syqh, syqt,
                   scb, sct, ssb, sst, BACKWARD, Q_HEADS_INNER, HALVES_EQUAL, BLOCK_R, BLOCK_D)
    else:
        _rope_rows(K, YK, COS, SIN, pid - q_blocks, k_rows, T, k_heads, half, skb, skh, skt, sykb, sykh, sykt,
                   scb, sct, ssb, sst, BACKWARD, K_HEADS_INNER, HALVES_EQUAL, BLOCK_R, BLOCK_D)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"rope expects x (B, H, T, D) and cos/sin (B or 1, T, D); got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    B, H, T, D = x.shape
    if D % 2 or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)} (even head dim needed)")
    return x if x.stride(-1) == 1 else x.contiguous()


def _apply_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
              block_r: int | None = None, num_warps: int | None = None,
              halves_equal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _check(q, cos, sin), _check(k, cos, sin)
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, length or head dim")
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    yq, yk = torch.empty_like(q), torch.empty_like(k)  # keep the layout: (B, H, T, D) or HF's (B, T, H, D)^T
    cb = cos.stride(0) if cos.shape[0] == B else 0
    sb = sin.stride(0) if sin.shape[0] == B else 0
    br = block_r or (BLOCK_R if q.is_cuda else BLOCK_R_INTERPRETED)
    q_rows, k_rows = B * Hq * T, B * Hk * T
    q_blocks = triton.cdiv(q_rows, br)
    _rope_kernel[(q_blocks + triton.cdiv(k_rows, br),)](
        q, yq, k, yk, cos, sin, q_blocks, q_rows, Hq, k_rows, Hk, T, D // 2,
        q.stride(0), q.stride(1), q.stride(2), yq.stride(0), yq.stride(1), yq.stride(2),
        k.stride(0), k.stride(1), k.stride(2), yk.stride(0), yk.stride(1), yk.stride(2),
        cb, cos.stride(1), sb, sin.stride(1), BACKWARD=backward, Q_HEADS_INNER=q.stride(1) < q.stride(2),
        K_HEADS_INNER=k.stride(1) < k.stride(2), HALVES_EQUAL=halves_equal, BLOCK_R=br, BLOCK_D=triton.next_power_of_2(D // 2),
        num_warps=num_warps or NUM_WARPS)
    return yq, yk


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, block_r: int | None = None,
           num_warps: int | None = None, halves_equal: bool = False) -> torch.Tensor:
    """One tensor alone (a launch whose k part is empty)."""
    return _apply_qk(x, x[:, :0], cos, sin, backward, block_r, num_warps, halves_equal)[0]


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, halves_equal=False):
        ctx.save_for_backward(cos, sin)
        ctx.halves_equal = halves_equal
        return _apply_qk(q, k, cos, sin, False, halves_equal=halves_equal)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _apply_qk(dq, dk, cos, sin, True, halves_equal=ctx.halves_equal)
        return dq, dk, None, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves_equal: bool = False):
    """(q, k) rotated; cos/sin as HF's rotary embedding returns them. ``halves_equal``: the caller guarantees
    ``cos[..., :D/2] == cos[..., D/2:]`` (and the same for sin), so the kernel reads only the first halves."""
    return RoPEFunction.apply(q, k, cos, sin, halves_equal)
