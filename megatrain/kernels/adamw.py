"""AdamW over one layer's flat fp32 state (master, exp_avg, exp_avg_sq, grad) in one pass, torch.optim.AdamW's
update, that also writes the new weights rounded to the compute dtype (what the layer's next load reads).

One read of 16 bytes and one write of 12 (+2) per parameter; the update is memory-bound, so the pass and the
rounded copy in it are the whole cost.

The arithmetic is the host kernel's (``runtime/optim/cpu_adamw.c``), operation for operation: the same scalars rounded
to fp32, torch's lerp as one fused multiply-add, exp_avg_sq in the form torch's vector loop uses here, correctly
rounded division and square root, and no other contraction (the kernel is compiled without fp fusion). So an
update on the GPU leaves the bits the host's update of the same elements leaves (every element the host kernel
computes itself: all but the last ``n % 16`` of a tensor, which it leaves to torch), and the moments of an update
made on the GPU can be computed again on the host bit for bit (a split update whose moments the host computes after
the update pass: ``StreamExecutor.defer_moments``)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from megatrain.adamw_scalars import scalars

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _adamw_kernel(P, M, V, G, OUT, SCALE, n, coeff, beta2, w2, eps, decay, neg_step, bc2_sqrt,
                  LERP_FROM_GRAD: tl.constexpr, V_FMA: tl.constexpr, HAS_SCALE: tl.constexpr,
                  HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0)
    if HAS_SCALE:  # the clip factor's inverse: the gradient divided by it as it is read
        s = tl.load(SCALE)
        g = tl.math.div_rn(g, s)
    # torch's lerp(m, g, w1): from the start for a small weight, back from the end for a large one
    if LERP_FROM_GRAD:
        m1 = tl.math.fma(coeff, g - m, g)
    else:
        m1 = tl.math.fma(coeff, g - m, m)
    if V_FMA:
        v1 = tl.math.fma(w2 * g, g, v * beta2)
    else:
        v1 = v * beta2 + (w2 * g) * g
    denom = tl.math.div_rn(tl.math.sqrt_rn(v1), bc2_sqrt) + eps
    p1 = p * decay + tl.math.div_rn(neg_step * m1, denom)
    if HAS_SCALE:  # a non-finite scale marks a step that must not update (its loss or gradient norm is not
        # finite): everything stays as it was, and OUT gets the unchanged weights
        keep = (s == s) & (tl.abs(s) < float("inf"))
        p1 = tl.where(keep, p1, p)
        m1 = tl.where(keep, m1, m)
        v1 = tl.where(keep, v1, v)
    tl.store(P + offs, p1, mask=mask)
    tl.store(M + offs, m1, mask=mask)
    tl.store(V + offs, v1, mask=mask)
    if HAS_OUT:
        tl.store(OUT + offs, p1.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def adamw_step(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int,
               v_fma: bool, grad_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
    """One AdamW update in place of contiguous fp32 ``master``, ``exp_avg``, ``exp_avg_sq`` from ``grad``
    (divided by the 0-dim fp32 ``grad_scale`` if given; a non-finite ``grad_scale`` leaves all three as they are);
    ``step`` counts this update (1 for the first). ``out``: written with the new master in its dtype. ``v_fma``: the
    form of exp_avg_sq's update torch's fused CPU AdamW takes here (``runtime.optim.cpu_adamw.v_fma``), which this
    update takes too."""
    n = master.numel()
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)):
        if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"adamw_step: {name} must be contiguous fp32 with {n} elements, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if out is not None and (out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"adamw_step: out must be contiguous with {n} elements, got {tuple(out.shape)}")
    if step < 1:
        raise ValueError(f"adamw_step: step counts updates from 1, got {step}")
    a = {k: np.float32(x) for k, x in scalars(lr, betas, eps, weight_decay, step).items()}
    from_grad = not abs(a["w1"]) < np.float32(0.5)  # as the host kernel picks lerp's form, in fp32
    coeff = a["w1"] - np.float32(1.0) if from_grad else a["w1"]
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, exp_avg, exp_avg_sq, grad, master if out is None else out,
        master if grad_scale is None else grad_scale, n, float(coeff), float(a["beta2"]), float(a["w2"]),
        float(a["eps"]), float(a["decay"]), float(a["neg_step"]), float(a["bc2_sqrt"]),
        LERP_FROM_GRAD=from_grad, V_FMA=v_fma, HAS_SCALE=grad_scale is not None,
        HAS_OUT=out is not None, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
