"""Kernel benchmarks on the GPU: forward + backward time of each Triton kernel vs eager PyTorch and torch.compile,
achieved bandwidth against the measured device copy rate, and the fused linear + cross-entropy's time and peak
extra memory vs eager F.linear + F.cross_entropy.

    PYTHONPATH=. python3 benchmarks/kernel_timings.py --json results.json

(Not named kernels.py: run from this folder, such a file would stand in for the ``kernels`` package, which
transformers imports where it is installed, as transformers 5.25 installs it.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatrain.kernels import linear_cross_entropy, rms_norm, rope, swiglu

BF = torch.bfloat16


def timed(fn, warmup=3, reps=10, batches=5) -> float:
    """Median device milliseconds per call of fn(): the GPU's own time, without the host's launch gaps.

    Each batch first queues a GPU sleep long enough to cover the host issuing ``reps`` calls, then records an event,
    the calls and a second event, so the GPU runs the calls back to back; time per call = event gap / reps. (One
    call between two events would also count the host's launch latency before the first kernel, which for a
    sub-millisecond kernel is a large part of what is measured.)"""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    issue_s = time.perf_counter() - t  # host time to issue reps calls (an upper bound: it includes their run)
    torch.cuda.synchronize()
    cycles = int(min(issue_s * 2 + 1e-3, 0.5) * 2e9)  # at <= 2 GHz the sleep lasts at least 2 x issue time
    times = []
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def copy_ceiling_gbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), reps=20)
    return 2 * x.numel() / ms / 1e6  # read + write


def fwd_bwd(fn, inputs, grad_out):
    def run():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grad_out)
    return run


# eager versions, written the way HF models compute them
def rms_eager(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu_eager(g, u):
    return F.silu(g) * u


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_eager(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def bench_elementwise(name, ours, eager, inputs, bytes_moved, ceiling):
    outs = eager(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = tuple(torch.randn_like(o) for o in outs)
    compiled = torch.compile(eager)
    row = {"kernel": name}
    for label, fn in (("megatrain", ours), ("eager", eager), ("torch.compile", compiled)):
        ms = timed(fwd_bwd(fn, inputs, grads))
        row[f"{label}_ms"] = ms
        row[f"{label}_gbs"] = bytes_moved / ms / 1e6
    row["megatrain_pct_of_copy"] = 100 * row["megatrain_gbs"] / ceiling
    row["speedup_vs_compile"] = row["torch.compile_ms"] / row["megatrain_ms"]
    return row


def bench_linear_ce(T, H, V):
    torch.manual_seed(0)
    h = (torch.randn(T, H, device="cuda") * 0.5).to(BF).requires_grad_()
    w = (torch.randn(V, H, device="cuda") * 0.02).to(BF).requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::11] = -100
    denom = float((labels != -100).sum())

    def eager():
        return F.cross_entropy(F.linear(h, w), labels, ignore_index=-100, reduction="sum") / denom

    def ours():
        return linear_cross_entropy(h, w, labels, denom)

    row = {"kernel": f"linear+CE T={T} H={H} V={V}"}
    losses = {}
    for label, fn in (("megatrain", ours), ("eager", eager)):
        def step():
            h.grad = w.grad = None
            loss = fn()
            loss.backward()
            return loss
        losses[label] = float(step())
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        row[f"{label}_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / (1 << 30)
        h.grad = w.grad = None
        row[f"{label}_ms"] = timed(step, warmup=2, reps=5)
    row["loss_megatrain"], row["loss_eager"] = losses["megatrain"], losses["eager"]
    # the runtime's path: gradients accumulated straight into an fp32 weight-gradient slot
    from megatrain.kernels.linear_ce import linear_cross_entropy_forward

    slot = torch.zeros(V, H, device="cuda")
    row["megatrain_fp32_slot_ms"] = timed(lambda: linear_cross_entropy_forward(h.detach(), w.detach(), labels, denom,
                                                                               grad_weight=slot), warmup=1, reps=3)
    row["speedup_vs_eager"] = row["eager_ms"] / row["megatrain_ms"]
    row["memory_ratio"] = row["megatrain_peak_extra_gib"] / row["eager_peak_extra_gib"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", nargs="+", choices=["rmsnorm", "swiglu", "rope", "linear_ce"],
                    help="run these benchmarks alone")
    args = ap.parse_args()
    want = set(args.only or ["rmsnorm", "swiglu", "rope", "linear_ce"])
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs()
    rows = []
    N, H, I = 32768, 3584, 18944
    if "rmsnorm" in want:
        x = torch.randn(N, H, device="cuda", dtype=BF).requires_grad_()
        w = (torch.rand(H, device="cuda", dtype=BF) + 0.5).requires_grad_()
        rows.append(bench_elementwise("rmsnorm 32768x3584", lambda a, b: rms_norm(a, b, 1e-6), rms_eager, (x, w),
                                      5 * N * H * 2, ceiling))
        del x
    if "swiglu" in want:
        g = torch.randn(N, I, device="cuda", dtype=BF).requires_grad_()
        u = torch.randn(N, I, device="cuda", dtype=BF).requires_grad_()
        rows.append(bench_elementwise("swiglu 32768x18944", swiglu, swiglu_eager, (g, u), 8 * N * I * 2, ceiling))
        del g, u
    if "rope" in want:
        rows.append(bench_rope(ceiling))
        rows.append(bench_rope(ceiling, halves_equal=True))
    torch.cuda.empty_cache()
    if "linear_ce" in want:
        rows.append(bench_linear_ce(32768, 3584, 152064))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_ceiling_gbs": ceiling, "rows": rows}
    print(json.dumps(result, indent=1))
    print(f"\ncopy ceiling {ceiling:.0f} GB/s")
    for r in rows:
        if "speedup_vs_compile" in r:
            print(f"{r['kernel']:36s} megatrain {r['megatrain_ms']:7.3f} ms ({r['megatrain_gbs']:6.0f} GB/s, "
                  f"{r['megatrain_pct_of_copy']:4.1f}% of copy)  eager {r['eager_ms']:7.3f}  compile "
                  f"{r['torch.compile_ms']:7.3f}  x{r['speedup_vs_compile']:.2f} vs compile")
        else:
            print(f"{r['kernel']:36s} megatrain {r['megatrain_ms']:7.1f} ms, {r['megatrain_peak_extra_gib']:.2f} "
                  f"GiB extra; eager {r['eager_ms']:7.1f} ms, {r['eager_peak_extra_gib']:.2f} GiB; "
                  f"x{r['speedup_vs_eager']:.2f} time, memory ratio {r['memory_ratio']:.3f}; loss "
                  f"{r['loss_megatrain']:.5f} vs {r['loss_eager']:.5f}; into an fp32 slot "
                  f"{r['megatrain_fp32_slot_ms']:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def bench_rope(ceiling, halves_equal=False):
    B, T, Hq, Hk, D = 32, 1024, 28, 4, 128
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=BF).requires_grad_()
    k = torch.randn(B, Hk, T, D, device="cuda", dtype=BF).requires_grad_()
    pos = torch.arange(T, device="cuda")[None].expand(B, -1)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(BF), emb.sin().to(BF)
    name = "rope q 32768x3584 + k 32768x512" + (" (halves equal)" if halves_equal else "")
    return bench_elementwise(name, lambda a, b: rope(a, b, cos, sin, halves_equal=halves_equal),
                             lambda a, b: rope_eager(a, b, cos, sin), (q, k), 4 * (q.numel() + k.numel()) * 2,
                             ceiling)


if __name__ == "__main__":
    main()
