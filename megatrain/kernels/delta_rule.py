"""The gated delta rule of the linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid), chunked as transformers'
``torch_chunk_gated_delta_rule`` chunks it, with the scan over chunks in Triton.

The chunked form splits the work in two. Within a chunk of C tokens everything is batched matrix algebra over many
chunks at once (the decays' cumulative sums, the unit-triangular system that folds C delta-rule updates into two
matrices, the chunk's own attention): that part stays in torch, with autograd, formed a piece of the sequence at a
time (:class:`GatedDeltaRule`). Across chunks a (K, V) state per head carries on, chunk by chunk; transformers runs
that as a Python loop of small matmuls (five kernel launches a chunk, each chunk's state kept for the backward by
autograd). Here one program per (sequence x head, block of V columns) holds its state block in registers for the
whole sequence:

    v_i = u_i - w_i S_i                 (the part of the chunk's values the state does not already predict)
    o_i = qd_i S_i + P_i v_i            (the read of the state plus the chunk's own attention)
    S_{i+1} = g_i S_i + kd_i^T v_i      (the decayed state plus the chunk's update)

and the backward runs the same loop in reverse with the state's gradient in registers for what must go chunk after
chunk (the values' and the state's gradients), then forms every chunk's other gradients in parallel from the states
the forward stored (S_i before each chunk: K x V fp32 per chunk and head) and the state gradients. Gradients that
sum over V (those of qd, w, kd, P and g) are written per V block and summed after, so the result does not depend on
the order programs finish in.
Definitions: ``reference.delta_scan``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatrain import layout

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
def _scan_backward_kernel(QD, W, KD, P, G, DO, DSF, DU, DSTATES, DS0, NC,
                          HAS_DSF: tl.constexpr, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          KP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    # the part that runs chunk after chunk: the gradients of the chunks' values (du) and of the state after each
    # chunk (DSTATES), back from the last chunk; what else the chunks need comes after, in parallel
    bh = tl.program_id(1).to(tl.int64)
    c, k, v, m_kv, m_ck, m_cv, at_kv, ds = _program_block(DSF, bh, HAS_DSF, C, K, V, KP, BV)
    for j in range(NC):
        i = NC - 1 - j
        tl.store(DSTATES + (bh * NC + i) * K * V + at_kv, ds, mask=m_kv)
        row = bh * NC * C + i * C + c
        at_ck = row[:, None] * K + k[None, :]
        at_cv = row[:, None] * V + v[None, :]
        do = tl.load(DO + at_cv, mask=m_cv, other=0.0)
        p_t = tl.load(P + (bh * NC + i) * C * C + c[None, :] * C + c[:, None])  # (C, C) transposed
        kd = tl.load(KD + at_ck, mask=m_ck, other=0.0)
        dvn = tl.dot(p_t, do, input_precision=PREC) + tl.dot(kd, ds, input_precision=PREC)
        tl.store(DU + at_cv, dvn, mask=m_cv)
        qd = tl.load(QD + at_ck, mask=m_ck, other=0.0)
        w = tl.load(W + at_ck, mask=m_ck, other=0.0)
        ds = ds * tl.load(G + bh * NC + i) + tl.dot(tl.trans(qd), do, input_precision=PREC) \
            - tl.dot(tl.trans(w), dvn, input_precision=PREC)
    tl.store(DS0 + bh * K * V + at_kv, ds, mask=m_kv)


@triton.jit
def _chunk_grads_kernel(W, U, STATES, DSTATES, DO, DU, DQD, DW, DKD, DP, DG, NC, BH,
                        C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                        PREC: tl.constexpr):
    # one program per (V block, sequence x head, chunk): the gradients that need the state before the chunk and the
    # gradient of the one after it, each V block's share of those that sum over V
    part = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    i = tl.program_id(2).to(tl.int64)
    c, k, v, m_kv, m_ck, m_cv, at_kv, s = _program_block(STATES + i * K * V, bh * NC, True, C, K, V, KP, BV)
    ds = tl.load(DSTATES + (bh * NC + i) * K * V + at_kv, mask=m_kv, other=0.0)
    row = bh * NC * C + i * C + c
    at_ck = row[:, None] * K + k[None, :]
    at_cv = row[:, None] * V + v[None, :]
    vn = tl.load(U + at_cv, mask=m_cv, other=0.0) - tl.dot(tl.load(W + at_ck, mask=m_ck, other=0.0), s,
                                                          input_precision=PREC)
    do = tl.load(DO + at_cv, mask=m_cv, other=0.0)
    dvn = tl.load(DU + at_cv, mask=m_cv, other=0.0)
    s_t = tl.trans(s)
    shared = part * BH * NC * C * K + at_ck
    tl.store(DQD + shared, tl.dot(do, s_t, input_precision=PREC), mask=m_ck)
    tl.store(DW + shared, -tl.dot(dvn, s_t, input_precision=PREC), mask=m_ck)
    tl.store(DKD + shared, tl.dot(vn, tl.trans(ds), input_precision=PREC), mask=m_ck)
    tl.store(DP + (part * BH * NC + bh * NC + i) * C * C + c[:, None] * C + c[None, :],
             tl.dot(do, tl.trans(vn), input_precision=PREC))
    tl.store(DG + part * BH * NC + bh * NC + i, tl.sum(tl.sum(s * ds, axis=1), axis=0))


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
    bv = block_v or min(triton.next_power_of_2(v), 32)
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
        PREC=DOT_PRECISION, num_warps=8 if k * bv >= 8192 else 4, num_stages=1)
    return o, states, (sf if want_final else None)


def delta_scan_backward(qd, w, u, kd, p, g, states, do, dsf=None, *, block_v: int | None = None):
    """The scan's backward: gradients of ``qd``, ``w``, ``u``, ``kd``, ``p``, ``g`` and the initial state."""
    bh, nc, c, k, v, bv = _dims(qd, u, p, block_v)
    parts = triton.cdiv(v, bv)
    new = lambda *shape: torch.empty(*shape, device=u.device, dtype=torch.float32)  # noqa: E731
    dqd, dw, dkd = (new(parts, bh, nc, c, k) for _ in range(3))
    dp, dg = new(parts, bh, nc, c, c), new(parts, bh, nc)
    du, ds0, dstates = torch.empty_like(u), new(bh, k, v), torch.empty_like(states)
    shape = dict(C=c, K=k, V=v, KP=triton.next_power_of_2(k), BV=bv, PREC=DOT_PRECISION,
                 num_warps=8 if k * bv >= 8192 else 4, num_stages=1)
    _scan_backward_kernel[(parts, bh)](qd, w, kd, p, g, do, dsf if dsf is not None else do, du, dstates, ds0, nc,
                                       HAS_DSF=dsf is not None, **shape)
    _chunk_grads_kernel[(parts, bh, nc)](w, u, states, dstates, do, du, dqd, dw, dkd, dp, dg, nc, bh, **shape)
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


def _piece(q, k, v, g, beta, chunk: int, l2: bool):
    """The scan's inputs for a piece of tokens: (b, t, h, d) ``q``, ``k``, ``v`` and (b, t, h) ``g``, ``beta``
    (t padded here to whole chunks) -> (qd, w, u, kd, the chunks' attention, the chunks' decay), flattened to
    (b h, chunks, ...), all fp32; as transformers' torch_chunk_gated_delta_rule forms them."""
    b, t, h, _ = k.shape
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    if l2:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - t % chunk) % chunk
    if pad:  # (a piece of whole chunks is not copied)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunked = lambda x: x.reshape(b, h, -1, chunk, x.shape[-1])  # noqa: E731
    v_beta, k_beta = chunked(v * beta[..., None]), chunked(k * beta[..., None])
    q, k = chunked(q), chunked(k)
    cum = g.reshape(b, h, -1, chunk).cumsum(dim=3)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    # the unit-lower-triangular system's inverse (one solve against the identity), then two products: cheaper on a
    # GPU than two solves against the wider right-hand sides
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device).expand_as(system)
    inv = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u, w = inv @ v_beta, inv @ (k_beta * cum.exp()[..., None])
    qd, kd = q * cum.exp()[..., None], k * (cum[..., -1:] - cum).exp()[..., None]
    flat = lambda x: x.reshape(b * h, *x.shape[2:]).contiguous()  # noqa: E731
    return [flat(x) for x in (qd, w, u, kd, attn)] + [cum[..., -1].exp().reshape(b * h, -1).contiguous()]


def _pieces(b: int, t: int, chunk: int) -> list[tuple[int, int]]:
    """Token ranges of the pieces: whole chunks, about DELTA_PIECE_TOKENS tokens over the b rows (the state handed
    from piece to piece)."""
    step = chunk * max(1, layout.DELTA_PIECE_TOKENS // (b * chunk))
    return [(a, min(t, a + step)) for a in range(0, t, step)]


class GatedDeltaRule(torch.autograd.Function):
    """The whole rule over the sequence in pieces. It keeps for its backward its inputs and the state before each
    chunk; the backward forms each piece's chunk-local algebra again (autograd through it for the piece alone) and
    runs the scan's backward over it, the state's gradient handed back from piece to piece."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, chunk: int, l2: bool, want_final: bool):
        b, t, h, _ = k.shape
        dv = v.shape[-1]
        out = torch.empty(b, t, h, dv, device=v.device, dtype=q.dtype)
        s, states = (s0.to(torch.float32).reshape(b * h, *s0.shape[-2:]).contiguous() if s0 is not None else None), []
        for a, z in _pieces(b, t, chunk):
            pre = _piece(*(x[:, a:z] for x in (q, k, v, g, beta)), chunk, l2)
            o, st, s = delta_scan_forward(*pre, s, want_final=True)
            states.append(st)
            out[:, a:z] = o.reshape(b, h, -1, dv)[:, :, :z - a].transpose(1, 2)
        ctx.save_for_backward(q, k, v, g, beta, *states)
        ctx.chunk, ctx.l2, ctx.has_s0, ctx.s0_shape = chunk, l2, s0 is not None, None if s0 is None else s0.shape
        return out, (s.reshape(b, h, *s.shape[-2:]) if want_final else None)

    @staticmethod
    def backward(ctx, dout, dsf):
        q, k, v, g, beta, *states = ctx.saved_tensors
        b, t, h, _ = k.shape
        grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
        ds = dsf.to(torch.float32).reshape(b * h, *dsf.shape[-2:]).contiguous() if dsf is not None else None
        for (a, z), st in reversed(list(zip(_pieces(b, t, ctx.chunk), states))):
            with torch.enable_grad():
                xs = [x[:, a:z].detach().requires_grad_() for x in (q, k, v, g, beta)]
                pre = _piece(*xs, ctx.chunk, ctx.l2)
            do = dout[:, a:z].transpose(1, 2).to(torch.float32)
            do = F.pad(do, (0, 0, 0, pre[2].shape[1] * ctx.chunk - (z - a))).reshape_as(pre[2]).contiguous()
            *dpre, ds = delta_scan_backward(*(x.detach() for x in pre), st, do, ds)
            torch.autograd.backward(pre, dpre)
            for full, x in zip(grads, xs):
                full[:, a:z] = x.grad
        ds0 = ds.reshape(ctx.s0_shape) if ctx.has_s0 else None
        return (*grads, ds0, None, None, None)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (same arguments and results; (batch, seq, heads, dim)
    layouts; key heads repeated to the value heads where fewer) through :class:`GatedDeltaRule`. Like it,
    ``cu_seqlens`` among ``kwargs`` is not read: a row's documents share one state (the capture refuses packed rows
    for such blocks)."""
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query, key = (x.repeat_interleave(hv // hk, dim=2) for x in (query, key))
    out, final = GatedDeltaRule.apply(query, key, value, g, beta, initial_state, chunk_size,
                                      use_qk_l2norm_in_kernel, output_final_state)
    return out, final
