"""The gated delta rule of the linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid), chunked as transformers'
``torch_chunk_gated_delta_rule`` chunks it, with the scan over chunks in one Triton kernel each way.

The chunked form splits the work in two. Within a chunk of C tokens everything is batched matrix algebra over all
chunks at once (the decays' cumulative sums, the unit-triangular solve that folds C delta-rule updates into two
matrices, the chunk's own attention): that part stays in torch, with autograd. Across chunks a (K, V) state per
head carries on, chunk by chunk; transformers runs that as a Python loop of small matmuls (five kernel launches a
chunk, each chunk's state kept for the backward by autograd). Here one program per (sequence x head, block of V
columns) holds its state block in registers for the whole sequence:

    v_i = u_i - w_i S_i                 (the part of the chunk's values the state does not already predict)
    o_i = qd_i S_i + P_i v_i            (the read of the state plus the chunk's own attention)
    S_{i+1} = g_i S_i + kd_i^T v_i      (the decayed state plus the chunk's update)

and the backward runs the same loop in reverse with the state's gradient in registers, reading the states the
forward stored (S_i before each chunk: K x V fp32 per chunk and head). Gradients that sum over V (those of qd, w, kd,
P and g) are written per V block and summed after, so the result does not depend on the order programs finish in.
Definitions: ``reference.delta_scan``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# precision of the scan's fp32 dots on a GPU: three TF32 passes (about fp32's accuracy on tensor cores); the
# interpreter computes them in fp32 whatever this says
DOT_PRECISION = "tf32x3"


@triton.jit
def _program_block(S, bh, HAS_S: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   KP: tl.constexpr, BV: tl.constexpr):
    """A program's index ranges (chunk rows, K padded, its V block), their masks and state offsets, and the state
    (or its gradient) it starts from: read from S where given, else zeros."""
    c = tl.arange(0, C)
    k = tl.arange(0, KP)
    v = tl.program_id(0) * BV + tl.arange(0, BV)
    m_kv = (k[:, None] < K) & (v[None, :] < V)
    at_kv = k[:, None] * V + v[None, :]
    if HAS_S:
        s = tl.load(S + bh * K * V + at_kv, mask=m_kv, other=0.0)
    else:
        s = tl.zeros((KP, BV), dtype=tl.float32)
    return c, k, v, m_kv, k[None, :] < K, v[None, :] < V, at_kv, s


@triton.jit
def _scan_forward_kernel(QD, W, U, KD, P, G, S0, O, STATES, SF, NC,
                         HAS_S0: tl.constexpr, STORE_SF: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    # K, V: the head dims; KP: K to a power of two; BV: this program's block of V (masked past V)
    bh = tl.program_id(1).to(tl.int64)
    c, k, v, m_kv, m_ck, m_cv, at_kv, s = _program_block(S0, bh, HAS_S0, C, K, V, KP, BV)
    for i in range(NC):
        tl.store(STATES + (bh * NC + i) * K * V + at_kv, s, mask=m_kv)
        row = bh * NC * C + i * C + c
        w = tl.load(W + row[:, None] * K + k[None, :], mask=m_ck, other=0.0)
        u = tl.load(U + row[:, None] * V + v[None, :], mask=m_cv, other=0.0)
        vn = u - tl.dot(w, s, input_precision=PREC)
        qd = tl.load(QD + row[:, None] * K + k[None, :], mask=m_ck, other=0.0)
        p = tl.load(P + (bh * NC + i) * C * C + c[:, None] * C + c[None, :])
        o = tl.dot(qd, s, input_precision=PREC) + tl.dot(p, vn, input_precision=PREC)
        tl.store(O + row[:, None] * V + v[None, :], o, mask=m_cv)
        kd_t = tl.load(KD + row[None, :] * K + k[:, None], mask=k[:, None] < K, other=0.0)  # (KP, C)
        s = s * tl.load(G + bh * NC + i) + tl.dot(kd_t, vn, input_precision=PREC)
    if STORE_SF:
        tl.store(SF + bh * K * V + at_kv, s, mask=m_kv)


@triton.jit
def _scan_backward_kernel(QD, W, U, KD, P, G, STATES, DO, DSF, DQD, DW, DU, DKD, DP, DG, DS0, NC, BH,
                          HAS_DSF: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          KP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    part = tl.program_id(0).to(tl.int64)  # this V block's share of the gradients that sum over V
    bh = tl.program_id(1).to(tl.int64)
    c, k, v, m_kv, m_ck, m_cv, at_kv, ds = _program_block(DSF, bh, HAS_DSF, C, K, V, KP, BV)
    for j in range(NC):
        i = NC - 1 - j
        s = tl.load(STATES + (bh * NC + i) * K * V + at_kv, mask=m_kv, other=0.0)
        row = bh * NC * C + i * C + c
        at_ck = row[:, None] * K + k[None, :]
        at_cv = row[:, None] * V + v[None, :]
        w = tl.load(W + at_ck, mask=m_ck, other=0.0)
        vn = tl.load(U + at_cv, mask=m_cv, other=0.0) - tl.dot(w, s, input_precision=PREC)
        do = tl.load(DO + at_cv, mask=m_cv, other=0.0)
        p_t = tl.load(P + (bh * NC + i) * C * C + c[None, :] * C + c[:, None])  # (C, C) transposed
        kd = tl.load(KD + at_ck, mask=m_ck, other=0.0)
        dvn = tl.dot(p_t, do, input_precision=PREC) + tl.dot(kd, ds, input_precision=PREC)
        tl.store(DU + at_cv, dvn, mask=m_cv)
        s_t = tl.trans(s)
        shared = part * BH * NC * C * K + at_ck
        tl.store(DQD + shared, tl.dot(do, s_t, input_precision=PREC), mask=m_ck)
        tl.store(DW + shared, -tl.dot(dvn, s_t, input_precision=PREC), mask=m_ck)
        tl.store(DKD + shared, tl.dot(vn, tl.trans(ds), input_precision=PREC), mask=m_ck)
        tl.store(DP + (part * BH * NC + bh * NC + i) * C * C + c[:, None] * C + c[None, :],
                 tl.dot(do, tl.trans(vn), input_precision=PREC))
        tl.store(DG + part * BH * NC + bh * NC + i, tl.sum(tl.sum(s * ds, axis=1), axis=0))
        qd = tl.load(QD + at_ck, mask=m_ck, other=0.0)
        ds = ds * tl.load(G + bh * NC + i) + tl.dot(tl.trans(qd), do, input_precision=PREC) \
            - tl.dot(tl.trans(w), dvn, input_precision=PREC)
    tl.store(DS0 + bh * K * V + at_kv, ds, mask=m_kv)


def supported(chunk: int, k: int, v: int) -> str | None:
    """Why the kernels do not take a chunk and head dims, or None where they do."""
    if chunk < 16 or chunk & (chunk - 1):
        return f"a chunk of {chunk} tokens (the kernels take powers of two from 16)"
    if min(k, v) < 16 or k > 256:
        return f"key and value head dims {k} and {v} (the kernels take 16 to 256 and from 16)"
    return None


def _dims(qd: torch.Tensor, u: torch.Tensor, p: torch.Tensor, block_v: int | None) -> tuple[int, ...]:
    bh, nc, c, k = qd.shape
    v = u.shape[-1]
    why = supported(c, k, v)
    if why is not None:
        raise ValueError(f"delta_scan: {why}")
    bv = block_v or min(triton.next_power_of_2(v), 64)
    if p.shape != (bh, nc, c, c):
        raise ValueError(f"delta_scan: P {tuple(p.shape)}, not {(bh, nc, c, c)}")
    return bh, nc, c, k, v, bv


def delta_scan_forward(qd, w, u, kd, p, g, s0=None, *, want_final: bool = False, block_v: int | None = None):
    """The scan's forward. ``qd``, ``w``, ``kd``: (BH, NC, C, K); ``u``: (BH, NC, C, V); ``p``: (BH, NC, C, C);
    ``g``: (BH, NC); ``s0``: (BH, K, V) or None (zeros); all contiguous fp32. Returns the output (BH, NC, C, V),
    the state before each chunk (BH, NC, K, V) and the final state (or None)."""
    bh, nc, c, k, v, bv = _dims(qd, u, p, block_v)
    o = torch.empty_like(u)
    states = torch.empty(bh, nc, k, v, device=u.device, dtype=torch.float32)
    sf = torch.empty(bh, k, v, device=u.device, dtype=torch.float32) if want_final else o
    _scan_forward_kernel[(triton.cdiv(v, bv), bh)](
        qd, w, u, kd, p, g, s0 if s0 is not None else o, o, states, sf, nc,
        HAS_S0=s0 is not None, STORE_SF=want_final, C=c, K=k, V=v, KP=triton.next_power_of_2(k), BV=bv,
        PREC=DOT_PRECISION, num_warps=8 if k * bv >= 8192 else 4)
    return o, states, (sf if want_final else None)


def delta_scan_backward(qd, w, u, kd, p, g, states, do, dsf=None, *, block_v: int | None = None):
    """The scan's backward: gradients of ``qd``, ``w``, ``u``, ``kd``, ``p``, ``g`` and the initial state."""
    bh, nc, c, k, v, bv = _dims(qd, u, p, block_v)
    parts = triton.cdiv(v, bv)
    new = lambda *shape: torch.empty(*shape, device=u.device, dtype=torch.float32)  # noqa: E731
    dqd, dw, dkd = (new(parts, bh, nc, c, k) for _ in range(3))
    dp, dg = new(parts, bh, nc, c, c), new(parts, bh, nc)
    du, ds0 = torch.empty_like(u), new(bh, k, v)
    _scan_backward_kernel[(parts, bh)](
        qd, w, u, kd, p, g, states, do, dsf if dsf is not None else do, dqd, dw, du, dkd, dp, dg, ds0, nc, bh,
        HAS_DSF=dsf is not None, C=c, K=k, V=v, KP=triton.next_power_of_2(k), BV=bv, PREC=DOT_PRECISION,
        num_warps=8 if k * bv >= 8192 else 4)
    return dqd.sum(0), dw.sum(0), du, dkd.sum(0), dp.sum(0), dg.sum(0), ds0


class DeltaScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qd, w, u, kd, p, g, s0, want_final: bool):
        ins = [x.contiguous() for x in (qd, w, u, kd, p, g)]
        s0 = s0.contiguous() if s0 is not None else None
        o, states, sf = delta_scan_forward(*ins, s0, want_final=want_final)
        ctx.save_for_backward(*ins, states)
        ctx.has_s0 = s0 is not None
        return o, sf

    @staticmethod
    def backward(ctx, do, dsf):
        *ins, states = ctx.saved_tensors
        dqd, dw, du, dkd, dp, dg, ds0 = delta_scan_backward(
            *ins, states, do.contiguous(), dsf.contiguous() if dsf is not None else None)
        return dqd, dw, du, dkd, dp, dg, ds0 if ctx.has_s0 else None, None


def delta_scan(qd, w, u, kd, p, g, s0=None, want_final: bool = False):
    """``reference.delta_scan`` through the kernels (autograd)."""
    return DeltaScan.apply(qd, w, u, kd, p, g, s0, want_final)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           scan=delta_scan, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (same arguments and results; (batch, seq, heads, dim)
    layouts; key heads repeated to the value heads where fewer) with the scan over chunks in the kernels. Like it,
    ``cu_seqlens`` among ``kwargs`` is not read: a row's documents share one state."""
    dtype = query.dtype
    b, t, hk, _ = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query, key = (x.repeat_interleave(hv // hk, dim=2) for x in (query, key))
    query, key, value, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - t % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    dk = key.shape[-1]
    chunked = lambda x: x.reshape(b, hv, -1, chunk_size, x.shape[-1])  # noqa: E731
    v_beta, k_beta = chunked(value * beta[..., None]), chunked(key * beta[..., None])
    query, key = chunked(query), chunked(key)
    cum = g.reshape(b, hv, -1, chunk_size).cumsum(dim=3)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * decay
    attn = (query @ key.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    qd = query * cum.exp()[..., None]
    kd = key * (cum[..., -1:] - cum).exp()[..., None]
    nc = cum.shape[2]
    flat = lambda x: x.reshape(b * hv, nc, *x.shape[3:])  # noqa: E731
    s0 = initial_state.to(torch.float32).reshape(b * hv, dk, dv) if initial_state is not None else None
    o, sf = scan(flat(qd), flat(w), flat(u), flat(kd), flat(attn), cum[..., -1].exp().reshape(b * hv, nc), s0,
                 output_final_state)
    o = o.reshape(b, hv, nc * chunk_size, dv)[:, :, :t]
    out = o.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, (sf.reshape(b, hv, dk, dv) if output_final_state else None)
