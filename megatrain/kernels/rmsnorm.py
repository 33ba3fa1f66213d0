"""RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (offset + w), fp32 accumulation; offset=1 for Gemma's 1 + w."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatrain.kernels.util import programs_for, rows_2d

# Elements of a forward program's tile of rows on a GPU: one row of a model's width, 32 rows of a head's 128 (the q/k
# norms: 3.5x the bandwidth of one row a program on the H100, docs/kernels.md); in the CPU interpreter, where each
# program is a round of Python, tiles of TILE_INTERPRETED elements both ways (forward and backward)
FWD_TILE_CUDA = 4096
TILE_INTERPRETED = 1 << 16


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_rows, n_cols, eps, offset, BLOCK_R: tl.constexpr,
                         BLOCK: tl.constexpr):
    # BLOCK_R rows a program (int64: row * stride passes 2**31 at long sequences, 262,144 tokens x 8,192)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    rmask = rows < n_rows
    mask = rmask & (cols < n_cols)
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(Y + rows * stride_y + cols, (x * rstd[:, None] * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd[:, None], mask=rmask)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW, stride_dy, stride_x, stride_dx, n_rows, n_cols, offset,
                         rows_per_program, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    # Each program walks a run of rows, BLOCK_R at a time (more bytes in flight per iteration), and keeps its share
    # of dW in registers: one partial row per program, summed by the launcher.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program, BLOCK_R):
        rows = first + i + tl.arange(0, BLOCK_R)[:, None]
        rmask = rows < n_rows
        mask = cmask & rmask
        dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd
        wdy = w * dy
        c = tl.sum(xhat * wdy, axis=1)[:, None] / n_cols
        tl.store(DX + rows * stride_dx + cols, ((wdy - xhat * c) * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW + pid * n_cols + tl.arange(0, BLOCK), dw, mask=tl.arange(0, BLOCK) < n_cols)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                     num_warps: int | None = None, block_r: int | None = None):
    x2 = rows_2d(x)
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n_cols)
    block_r = block_r or max(1, (FWD_TILE_CUDA if x.is_cuda else TILE_INTERPRETED) // block)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        x2, weight, y, rstd, x2.stride(0), y.stride(0), n_rows, n_cols, eps, offset, BLOCK_R=block_r, BLOCK=block,
        num_warps=num_warps or min(8, max(1, block * block_r // 512)))
    return y.view_as(x), rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      offset: float = 0.0, num_warps: int | None = None, block_r: int | None = None,
                      programs_per_sm: int | None = None):
    x2, dy2 = rows_2d(x), rows_2d(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    block = triton.next_power_of_2(n_cols)
    # H200 sweep at 32768 x 3584 (docs/kernels.md): 4-row tiles, 4 programs per SM, 8 warps were fastest
    block_r = block_r or max(1, min(4, 16384 // block) if x.is_cuda else TILE_INTERPRETED // block)
    programs_per_sm = programs_per_sm or 4
    n_prog = programs_for(n_rows, x.device, programs_per_sm)
    per = triton.cdiv(triton.cdiv(n_rows, n_prog), block_r) * block_r
    n_prog = triton.cdiv(n_rows, per)
    dw_partial = torch.empty(n_prog, n_cols, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_prog,)](dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                                    n_rows, n_cols, offset, per, BLOCK_R=block_r, BLOCK=block,
                                    num_warps=num_warps or min(8, max(1, block * block_r // 512)))
    return dx.view_as(x), dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, offset: float = 0.0):
        y, rstd = rms_norm_forward(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, ctx.offset)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps, offset)
