"""Pure-torch references for every kernel: the definitions the Triton kernels are tested against (fp32 math)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (offset + weight), computed in fp32, returned in x's dtype.
    ``offset=1`` is Gemma's ``1 + w`` form."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())
    return y.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, returned in gate's dtype."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate-half RoPE. x: (B, H, T, D); cos, sin: (B or 1, T, D)."""
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    xf = x.float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, denom: float,
                         ignore_index: int = -100, softcap: float | None = None) -> torch.Tensor:
    """sum over valid tokens of cross_entropy(hidden @ weight.T, labels) / denom, with fp32 logits
    (soft-capped to softcap * tanh(logits / softcap) when given)."""
    logits = hidden.float() @ weight.float().t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum") / denom


def adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *, lr: float,
          betas: tuple[float, float], eps: float, weight_decay: float, step: int,
          grad_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments; ``step`` counts this update) of
    fp32 tensors, the gradient divided by ``grad_scale`` if given: new (master, exp_avg, exp_avg_sq). A non-finite
    ``grad_scale`` (a step whose loss or gradient norm is not finite) changes nothing."""
    if grad_scale is not None and not bool(torch.isfinite(grad_scale)):
        return master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    g = grad / grad_scale if grad_scale is not None else grad
    b1, b2 = betas
    m = exp_avg.lerp(g, 1 - b1)
    v = exp_avg_sq * b2 + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2 ** step) + eps
    return master * (1 - lr * weight_decay) - lr / (1 - b1 ** step) * m / denom, m, v


def sink_share(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """(n, H): the share of each row's softmax its real scores keep beside the head's sink logit, from the
    log-sum-exp of the real scores (H, n) and the sinks (H,); in fp32 (fp64 stays)."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    return torch.sigmoid(lse.to(acc).t() - sinks.to(acc)[None, :])


def sink_scale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output (n, H, D) of the real scores scaled to the softmax that includes the sinks."""
    share = sink_share(lse, sinks)
    return (out.to(share.dtype) * share[..., None]).to(out.dtype)


def sink_scale_backward(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the gradient ``dout`` of the scaled output ``out``: the gradient the kernel's output takes (dout x share)
    and each row's (1 - share) dot(dout, out), (n, H), whose sum over rows, negated, is the sinks' gradient."""
    share = sink_share(lse, sinks)
    rows = (dout.to(share.dtype) * out.to(share.dtype)).sum(-1)
    return (dout.to(share.dtype) * share[..., None]).to(dout.dtype), (1 - share) * rows


def delta_scan(qd, w, u, kd, p, g, s0=None, want_final: bool = False):
    """The gated delta rule's scan over chunks (``kernels.delta_rule``): per chunk i, ``v = u_i - w_i S``,
    ``o_i = qd_i S + P_i v``, ``S <- g_i S + kd_i^T v``, from S = ``s0`` (zeros if None). ``qd``, ``w``, ``kd``:
    (BH, NC, C, K); ``u``: (BH, NC, C, V); ``p``: (BH, NC, C, C); ``g``: (BH, NC). Returns the outputs (BH, NC, C,
    V) and the final state (BH, K, V) if ``want_final``, else None."""
    bh, nc, _, k = qd.shape
    s = s0 if s0 is not None else qd.new_zeros(bh, k, u.shape[-1])
    out = []
    for i in range(nc):
        v = u[:, i] - w[:, i] @ s
        out.append(qd[:, i] @ s + p[:, i] @ v)
        s = s * g[:, i, None, None] + kd[:, i].transpose(-1, -2) @ v
    return torch.stack(out, 1), (s if want_final else None)
