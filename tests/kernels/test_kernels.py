"""Every kernel's forward and gradients against the pure-torch reference (interpreter on CPU; bf16 on the GPU)."""

import pytest
import torch

from megatrain.kernels import linear_ce, reference
from megatrain.kernels import linear_cross_entropy, rms_norm, rope, swiglu

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def grads(fn, *inputs, seed=0):
    """Output and gradients of sum(fn(*inputs) * random) with respect to every floating input."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cpu").manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
    loss.backward()
    return outs, [x.grad for x in xs if x.requires_grad]


def assert_close(a, b, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol["rtol"] * scale, atol=tol["atol"] * scale)


def rand(*shape, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(37, 123), (2, 5, 123), (1, 64)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(dtype, shape, offset):
    x = rand(*shape, dtype=dtype)
    w = rand(shape[-1], dtype=dtype, seed=1) * 0.5
    (y,), (dx, dw) = grads(lambda a, b: rms_norm(a, b, 1e-6, offset), x, w)
    (yr,), (dxr, dwr) = grads(lambda a, b: reference.rms_norm(a, b, 1e-6, offset), x.float(), w.float())
    assert y.dtype == dtype and dw.dtype == dtype
    assert_close(y, yr, dtype)
    assert_close(dx, dxr, dtype)
    assert_close(dw, dwr, dtype, scale=4)  # summed over rows


@pytest.mark.parametrize("block_r", [1, 4, 64])
def test_rms_norm_forward_row_tiles(block_r):
    # rows a forward program takes: one (a GPU's wide rows), a count that leaves a part tile (37 = 9 x 4 + 1), more
    # than there are
    from megatrain.kernels.rmsnorm import rms_norm_forward

    x, w = rand(37, 123, dtype=torch.float32), rand(123, dtype=torch.float32, seed=1)
    y, rstd = rms_norm_forward(x, w, 1e-6, 1.0, block_r=block_r)
    assert_close(y, reference.rms_norm(x, w, 1e-6, 1.0), torch.float32)
    assert_close(rstd, x.pow(2).mean(-1).add(1e-6).rsqrt(), torch.float32)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", [(37, 123), (3, 7, 301), (5000,)])
def test_swiglu(dtype, shape):
    g, u = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype, seed=1)
    (y,), (dg, du) = grads(swiglu, g, u)
    (yr,), (dgr, dur) = grads(reference.swiglu, g.float(), u.float())
    assert_close(y, yr, dtype)
    assert_close(dg, dgr, dtype)
    assert_close(du, dur, dtype)


def rotary(B, T, D, positions, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = positions.float()[..., None] * inv  # (B, T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("B,H,KV,T,D,shared,hf_layout", [(2, 3, 1, 37, 16, False, False), (1, 4, 2, 5, 8, True, False),
                                                         (3, 2, 2, 9, 6, True, True), (2, 5, 1, 7, 16, False, True)])
def test_rope(dtype, B, H, KV, T, D, shared, hf_layout):
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4096, (1 if shared else B, T), generator=g)  # arbitrary position ids
    cos, sin = rotary(B, T, D, positions, dtype)
    if hf_layout:  # (B, T, H, D) in memory, seen as (B, H, T, D): what HF's projection + transpose gives
        q = rand(B, T, H, D, dtype=dtype).transpose(1, 2)
        k = rand(B, T, KV, D, dtype=dtype, seed=1).transpose(1, 2)
    else:
        q, k = rand(B, H, T, D, dtype=dtype), rand(B, KV, T, D, dtype=dtype, seed=1)
    (qo, ko), (dq, dk) = grads(lambda a, b: rope(a, b, cos, sin), q, k)
    (qr, kr), (dqr, dkr) = grads(lambda a, b: (reference.rope(a, cos, sin), reference.rope(b, cos, sin)),
                                 q.float(), k.float())
    for a, b in [(qo, qr), (ko, kr), (dq, dqr), (dk, dkr)]:
        assert_close(a, b, dtype)


@pytest.mark.parametrize("block_r", [4, 16])
@pytest.mark.parametrize("hf_layout", [False, True])
def test_rope_row_tiles(block_r, hf_layout):
    # rows a program takes (the GPU's 16; 4, which leaves a part tile of the 222 q rows) across heads and positions
    from megatrain.kernels.rope import _apply_qk

    B, H, KV, T, D = 2, 3, 1, 37, 16
    cos, sin = rotary(B, T, D, torch.randint(0, 4096, (B, T), generator=torch.Generator().manual_seed(7)),
                      torch.float32)
    shape = (lambda h: (B, T, h, D)) if hf_layout else (lambda h: (B, h, T, D))
    q, k = rand(*shape(H), dtype=torch.float32), rand(*shape(KV), dtype=torch.float32, seed=1)
    if hf_layout:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    for backward in (False, True):
        qo, ko = _apply_qk(q, k, cos, sin, backward, block_r=block_r)
        ref = (lambda x: reference.rope(x, cos, -sin)) if backward else (lambda x: reference.rope(x, cos, sin))
        assert_close(qo, ref(q), torch.float32)
        assert_close(ko, ref(k), torch.float32)


@pytest.mark.parametrize("hf_layout", [False, True])
def test_rope_reading_half_of_cos_sin_when_the_halves_are_equal(hf_layout):
    B, H, KV, T, D = 2, 3, 1, 11, 16
    positions = torch.randint(0, 4096, (B, T), generator=torch.Generator().manual_seed(5))
    cos, sin = rotary(B, T, D, positions, torch.float32)  # cat(f, f): equal halves
    if hf_layout:
        q = rand(B, T, H, D, dtype=torch.float32).transpose(1, 2)
        k = rand(B, T, KV, D, dtype=torch.float32, seed=1).transpose(1, 2)
    else:
        q, k = rand(B, H, T, D, dtype=torch.float32), rand(B, KV, T, D, dtype=torch.float32, seed=1)
    (qo, ko), (dq, dk) = grads(lambda a, b: rope(a, b, cos, sin, halves_equal=True), q, k)
    (qr, kr), (dqr, dkr) = grads(lambda a, b: (reference.rope(a, cos, sin), reference.rope(b, cos, sin)), q, k)
    for a, b in [(qo, qr), (ko, kr), (dq, dqr), (dk, dkr)]:
        assert_close(a, b, torch.float32)
    # the flag really skips the second halves: with unequal halves it gives another (wrong) answer
    cos2 = cos.clone()
    cos2[..., D // 2:] += 1.0
    assert not torch.allclose(rope(q, k, cos2, sin, halves_equal=True)[0], reference.rope(q, cos2, sin))


def test_the_plan_counts_a_chunk_of_the_fused_loss():
    """The planner's chunk of the fused loss is the kernel's, and a LOSS's working set counts one in the compute
    dtype (Qwen2.5-7B's head at 8,192 tokens: 3,530 tokens of 152,064 bf16 logits) beside the head's input and
    gradient."""
    from megatrain.ir import Op, OpKind, Stream
    from megatrain.planner.cost import workspace_nbytes
    from megatrain.planner.graph import LOSS_LOGITS_PER_CHUNK, preset

    from ..planner.helpers import config

    assert linear_ce.LOGITS_PER_CHUNK == LOSS_LOGITS_PER_CHUNK
    g = preset("qwen2.5-7b")
    head = len(g) - 1
    for tokens, rows in [(8192, (1 << 29) // 152064), (1000, 1000)]:
        op = Op(0, OpKind.LOSS, Stream.COMPUTE, 0, head, 0)
        got = workspace_nbytes(g, config(g, mb_tokens=tokens), op)
        assert got == (2 * 3584 * 2 + 8) * tokens + rows * 152064 * 2


def test_rope_refuses_odd_head_dim():
    with pytest.raises(ValueError, match="even head dim"):
        rope(torch.zeros(1, 1, 2, 5), torch.zeros(1, 1, 2, 5), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("chunk_rows,softcap", [(None, None), (8, None), (8, 3.0)])
def test_linear_cross_entropy(dtype, chunk_rows, softcap, monkeypatch):
    T, H, V = 37, 123, 1001
    if chunk_rows:  # several chunks, the last one short
        monkeypatch.setattr(linear_ce, "LOGITS_PER_CHUNK", chunk_rows * V)
    h = rand(T, H, dtype=dtype) * 0.5
    w = rand(V, H, dtype=dtype, seed=1) * 0.1
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[0, 5, 36]] = -100
    labels = labels.to(DEV)
    denom = 50.0  # e.g. the valid tokens of the whole step, not of this micro-batch
    if softcap:
        h = h * 8  # logits large enough for the cap to bend them
    (loss,), (dh, dw) = grads(lambda a, b: linear_cross_entropy(a, b, labels, denom, softcap=softcap), h, w)
    (lr,), (dhr, dwr) = grads(lambda a, b: reference.linear_cross_entropy(a, b, labels, denom, softcap=softcap),
                              h.float(), w.float())
    assert dh.dtype == dtype and dw.dtype == dtype
    assert_close(loss, lr, dtype)
    assert_close(dh, dhr, dtype)
    assert_close(dw, dwr, dtype)


def test_linear_cross_entropy_accumulates_into_an_fp32_buffer():
    T, H, V = 9, 16, 33
    h, w = rand(T, H, dtype=torch.float32), rand(V, H, dtype=torch.float32, seed=1)
    labels = torch.arange(T).to(DEV) % V
    acc = torch.ones(V, H, device=DEV)
    loss, dh, dw = linear_ce.linear_cross_entropy_forward(h, w, labels, 4.0, grad_weight=acc)
    ref = torch.func.grad(lambda b: reference.linear_cross_entropy(h, b, labels, 4.0))(w)
    assert dw is acc
    torch.testing.assert_close(acc - 1, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaled", [False, True])
def test_adamw_matches_torch_adamw_over_steps(scaled):
    """Three updates of a block of 5,000 parameters (the last program partly masked), from a non-zero state,
    against torch.optim.AdamW (per-tensor loop) and the reference; the 16-bit copy is the new master rounded."""
    from megatrain.kernels import adamw_step
    from megatrain.runtime.optim import cpu_adamw

    n, lr, betas, eps, wd = 5000, 1e-2, (0.9, 0.95), 1e-8, 0.1
    master, grads = rand(n, dtype=torch.float32), [rand(n, dtype=torch.float32, seed=s) for s in (1, 2, 3)]
    m0, v0 = 0.1 * rand(n, dtype=torch.float32, seed=4), rand(n, dtype=torch.float32, seed=5).abs() * 0.01
    scale = torch.tensor(2.5, device=DEV) if scaled else None
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    mine = [master.clone(), m0.clone(), v0.clone()]
    ref = [master.clone(), m0.clone(), v0.clone()]
    # the compute dtype's copy: bf16 on the GPU; fp16 under the interpreter, which truncates to bf16
    low = torch.bfloat16 if DEV == "cuda" else torch.float16
    out = torch.empty(n, dtype=low, device=DEV)
    for step, g in enumerate(grads, 1):
        p.grad = g / scale if scaled else g
        opt.step()
        adamw_step(*mine, g.clone(), lr=lr, betas=betas, eps=eps, weight_decay=wd, step=step, grad_scale=scale,
                   out=out, v_fma=cpu_adamw.v_fma())
        ref = list(reference.adamw(*ref, g, lr=lr, betas=betas, eps=eps, weight_decay=wd, step=step,
                                   grad_scale=scale))
    state = opt.state[p]
    for got, want in zip(mine, (p.detach(), state["exp_avg"], state["exp_avg_sq"])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(mine, ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(out, mine[0].to(low))  # rounded to nearest even, as a cast on the device


@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp from the moment, and back from the gradient
@pytest.mark.parametrize("scaled", [False, True])
def test_adamw_gives_the_host_kernels_bits(beta1, scaled):
    """Three updates on the device against megatrain's host kernel (runtime/optim/cpu_adamw.c, torch's fused CPU AdamW
    arithmetic) on the same numbers: master, moments and the 16-bit copy equal bit for bit (5,008 elements, a
    multiple of the width torch's vector loop takes; moments spanning many magnitudes, tiny ones included)."""
    from megatrain.kernels import adamw_step
    from megatrain.runtime.optim import cpu_adamw

    if not cpu_adamw.available():
        pytest.skip("no C compiler to build the host kernel")
    n, lr, eps, wd = 5008, 3e-3, 1e-8, 0.1
    betas = (beta1, 0.95)
    g = torch.Generator().manual_seed(7)
    host = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3,
            torch.rand(n, generator=g) * torch.logspace(-30, -2, n)]
    dev = [t.to(DEV, copy=True) for t in host]  # (a copy on the CPU too)
    low = torch.bfloat16 if DEV == "cuda" else torch.float16
    out_host, out_dev = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=low, device=DEV)
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=g) * torch.logspace(-12, 1, n)
        scale = 1.7 + step if scaled else None
        cpu_adamw.adamw(*host, grad, lr=lr, betas=betas, eps=eps, weight_decay=wd, step=step, grad_scale=scale,
                        out=out_host)
        adamw_step(*dev, grad.to(DEV), lr=lr, betas=betas, eps=eps, weight_decay=wd, step=step,
                   v_fma=cpu_adamw.v_fma(), grad_scale=torch.tensor(scale, device=DEV) if scaled else None, out=out_dev)
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), host, dev):
        assert torch.equal(a, b.cpu()), f"{name}: {int((a != b.cpu()).sum())} of {n} differ"
    if DEV == "cuda":
        assert torch.equal(out_host, out_dev.cpu())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_adamw_with_a_non_finite_scale_changes_nothing(bad):
    """A step whose loss or gradient norm is not finite passes a non-finite scale: master and moments keep their
    bits (the gradient here is non-finite too), and the 16-bit copy is the unchanged master rounded."""
    from megatrain.kernels import adamw_step
    from megatrain.runtime.optim import cpu_adamw

    n = 3000
    state = [rand(n, dtype=torch.float32, seed=s) for s in (1, 2)] + [rand(n, dtype=torch.float32, seed=3).abs()]
    before = [t.clone() for t in state]
    grad = rand(n, dtype=torch.float32, seed=4)
    grad[7] = float("nan")
    low = torch.bfloat16 if DEV == "cuda" else torch.float16
    out = torch.empty(n, dtype=low, device=DEV)
    scale = torch.tensor(bad, device=DEV)
    adamw_step(*state, grad, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, step=3, grad_scale=scale, out=out,
               v_fma=cpu_adamw.v_fma())
    assert all(torch.equal(a, b) for a, b in zip(state, before))
    assert torch.equal(out, before[0].to(low))
    ref = reference.adamw(*before, grad, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, step=3,
                          grad_scale=scale)
    assert all(torch.equal(a, b) for a, b in zip(ref, before))


def test_adamw_refuses_what_it_cannot_update():
    from megatrain.kernels import adamw_step

    x = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="grad must be contiguous fp32 with 8 elements"):
        adamw_step(x, x.clone(), x.clone(), torch.zeros(8, dtype=torch.bfloat16, device=DEV), lr=1e-3,
                   betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, step=1, v_fma=True)
    with pytest.raises(ValueError, match="step counts updates from 1"):
        adamw_step(x, x.clone(), x.clone(), x.clone(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                   step=0, v_fma=True)


# ---- bf16 on the GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bf16_kernels_on_gpu():
    bf = torch.bfloat16
    x, w = rand(4096, 3584, dtype=bf), rand(3584, dtype=bf, seed=1) * 0.5
    (y,), (dx, dw) = grads(lambda a, b: rms_norm(a, b, 1e-6), x, w)
    (yr,), (dxr, dwr) = grads(lambda a, b: reference.rms_norm(a, b, 1e-6), x.float(), w.float())
    assert_close(y, yr, bf)
    assert_close(dx, dxr, bf)
    torch.testing.assert_close(dw.float(), dwr, rtol=2e-2, atol=2e-2 * float(dwr.abs().max()))
    g, u = rand(4096, 18944, dtype=bf), rand(4096, 18944, dtype=bf, seed=1)
    (y,), (dg, du) = grads(swiglu, g, u)
    (yr,), (dgr, dur) = grads(reference.swiglu, g.float(), u.float())
    for a, b in [(y, yr), (dg, dgr), (du, dur)]:
        assert_close(a, b, bf)
    pos = torch.arange(1024)[None].expand(2, -1)
    cos, sin = rotary(2, 1024, 128, pos, bf)
    q, k = rand(2, 28, 1024, 128, dtype=bf), rand(2, 4, 1024, 128, dtype=bf, seed=1)
    (qo, ko), (dq, dk) = grads(lambda a, b: rope(a, b, cos, sin), q, k)
    (qr, kr), (dqr, dkr) = grads(lambda a, b: (reference.rope(a, cos, sin), reference.rope(b, cos, sin)),
                                 q.float(), k.float())
    for a, b in [(qo, qr), (ko, kr), (dq, dqr), (dk, dkr)]:
        assert_close(a, b, bf)
    T, H, V = 2048, 1024, 32000
    h, wt = rand(T, H, dtype=bf), rand(V, H, dtype=bf, seed=1) * 0.05
    labels = torch.randint(0, V, (T,), device=DEV)
    labels[::7] = -100
    (loss,), (dh, dw) = grads(lambda a, b: linear_cross_entropy(a, b, labels, 1500.0), h, wt)
    (lr,), (dhr, dwr) = grads(lambda a, b: reference.linear_cross_entropy(a, b, labels, 1500.0), h.float(),
                              wt.float())
    torch.testing.assert_close(loss.float(), lr, rtol=1e-3, atol=1e-3)
    for a, b in [(dh, dhr), (dw, dwr)]:
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


@pytest.mark.gpu
def test_kernels_past_two_to_the_31_elements():
    """Long sequences: RMSNorm over 262,400 rows of 8,192 (a 70B-wide model at 262K tokens per micro-batch) and
    SwiGLU over as many elements, where an offset held in 32 bits would wrap; the rows and elements past 2**31
    against the reference."""
    bf = torch.bfloat16
    rows, cols = 262_400, 8192
    assert rows * cols > 2**31
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(rows, cols, device=DEV, dtype=bf, generator=g)
    w = (torch.randn(cols, device=DEV, generator=g) * 0.5).to(bf).requires_grad_()
    xr = x.requires_grad_()
    y = rms_norm(xr, w, 1e-6)
    dy = torch.randn(rows, cols, device=DEV, dtype=bf, generator=g)
    dx, dw = torch.autograd.grad(y, (xr, w), dy)
    tail = slice(rows - 300, rows)  # past element 2**31
    xt = x[tail].detach().float().requires_grad_()
    wt = w.detach().float().requires_grad_()
    yt = reference.rms_norm(xt, wt, 1e-6)
    dxt, = torch.autograd.grad(yt, xt, dy[tail].float())
    assert_close(y[tail], yt, bf)
    assert_close(dx[tail], dxt, bf)
    dw_ref = torch.zeros(cols, device=DEV)
    for i in range(0, rows, 16384):  # sum(dy * xhat) over rows, in chunks
        xc = x[i:i + 16384].detach().float()
        dw_ref += (dy[i:i + 16384].float() * xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
    torch.testing.assert_close(dw.float(), dw_ref, rtol=2e-2, atol=2e-2 * float(dw_ref.abs().max()))
    del y, dx, dy, xr, xt
    gate, up = x.detach().view(-1), torch.randn(rows * cols, device=DEV, dtype=bf, generator=g)
    out = swiglu(gate, up)
    end = slice(rows * cols - 4096, rows * cols)
    assert_close(out[end], reference.swiglu(gate[end].float(), up[end].float()), bf)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n,heads,d", [(37, 4, 16), (5, 3, 24)])
def test_sink_scale_forward_and_backward(dtype, n, heads, d):
    """The attention-sink row operations (kernels.sink_scale) against their pure-torch definitions; the log-sum-exp
    as the flash kernel lays it out, (H, n), possibly a transposed view."""
    from megatrain.kernels import sink_scale

    out, dout = rand(n, heads, d, dtype=dtype, seed=1), rand(n, heads, d, dtype=dtype, seed=2)
    lse = rand(n, heads, dtype=torch.float32, seed=3).t()
    sinks = rand(heads, dtype=dtype, seed=4)
    assert_close(sink_scale.sink_scale(out, lse, sinks), reference.sink_scale(out, lse, sinks), dtype)
    got, want = sink_scale.sink_scale_backward(dout, out, lse, sinks), reference.sink_scale_backward(dout, out, lse,
                                                                                                     sinks)
    assert_close(got[0], want[0], dtype)
    assert got[1].dtype == torch.float32 and got[1].shape == (n, heads)
    assert_close(got[1], want[1], dtype, scale=4.0)
    with pytest.raises(ValueError, match="do not match"):
        sink_scale.sink_scale(out, lse.t(), sinks)
