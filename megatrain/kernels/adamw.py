"""AdamW over one layer's flat fp32 state (master, exp_avg, exp_avg_sq, grad) in one pass, torch.optim.AdamW's
update, that also writes the new weights rounded to the compute dtype (what the layer's next load reads).

One read of 16 bytes and one write of 12 (+2) per parameter; the update is memory-bound, so the pass and the
rounded copy in it are the whole cost."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(P, M, V, G, OUT, SCALE, n, beta1, beta2, eps, decay, step_size, bc2_sqrt,
                  HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    p0 = p
    if HAS_SCALE:  # the clip factor's inverse: the gradient divided by it as it is read
        s = tl.load(SCALE)
        g = g / s
    p = p * decay
    m1 = m + (1.0 - beta1) * (g - m)
    v1 = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m1 / (tl.sqrt(v1) / bc2_sqrt + eps))
    if HAS_SCALE:  # a non-finite scale marks a step that must not update (its loss or gradient norm is not
        # finite): everything stays as it was, and OUT gets the unchanged weights
        keep = (s == s) & (tl.abs(s) < float("inf"))
        p = tl.where(keep, p, p0)
        m1 = tl.where(keep, m1, m)
        v1 = tl.where(keep, v1, v)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m1, mask=mask)
    tl.store(V + offs, v1, mask=mask)
    if HAS_OUT:
        tl.store(OUT + offs, p.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int,
               grad_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
    """One AdamW update in place of contiguous fp32 ``master``, ``exp_avg``, ``exp_avg_sq`` from ``grad``
    (divided by the 0-dim fp32 ``grad_scale`` if given; a non-finite ``grad_scale`` leaves all three as they are);
    ``step`` counts this update (1 for the first). ``out``: written with the new master in its dtype."""
    n = master.numel()
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)):
        if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"adamw_step: {name} must be contiguous fp32 with {n} elements, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if out is not None and (out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"adamw_step: out must be contiguous with {n} elements, got {tuple(out.shape)}")
    if step < 1:
        raise ValueError(f"adamw_step: step counts updates from 1, got {step}")
    beta1, beta2 = betas
    step_size = lr / (1.0 - beta1 ** step)
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, exp_avg, exp_avg_sq, grad, master if out is None else out,
        master if grad_scale is None else grad_scale, n, float(beta1), float(beta2), float(eps),
        1.0 - lr * weight_decay, step_size, bc2_sqrt, HAS_SCALE=grad_scale is not None, HAS_OUT=out is not None,
        BLOCK=BLOCK, num_warps=NUM_WARPS)
