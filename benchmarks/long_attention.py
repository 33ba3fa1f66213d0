"""Attention kernels at long sequences on the GPU: forward and backward seconds, TFLOP/s and peak memory of one
causal GQA attention with Qwen2.5-7B's heads (28 query, 4 key/value, 128 wide), per kernel and sequence length.

    python3 benchmarks/long_attention.py 131072 262144

ours: torch's flash kernel over offsets, its backward a key/value group at a time (capture.packed_attention._flash);
whole: that kernel's backward over every head at once; sdpa-grp: SDPA a key/value head's group at a time
(capture.packed_attention.sdpa_by_group's way); default: one SDPA call with its own choice of kernel; flash, cudnn:
one SDPA call with that kernel forced (key/value heads repeated to the query heads), -gqa: without the repeat.
TFLOP/s count the causal forward as 2 T^2 Hq D and the backward as 2.5 forwards (planner.cost.ATTN_BWD_PASSES);
each kernel's second run is printed.
"""

import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatrain.capture import packed_attention as pa

HQ, HKV, D = 28, 4, 128
DEV = "cuda"


def flops(t: int) -> float:
    """A causal forward's FLOPs."""
    return 2 * t * t * HQ * D


def bench(name: str, fn, t: int) -> None:
    q = torch.randn(1, HQ, t, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, HKV, t, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, HKV, t, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    try:
        for _ in range(2):  # the second run's figures
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = fn(q, k, v)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            dout = torch.randn_like(out)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out.backward(dout)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            q.grad = k.grad = v.grad = None
            del out, dout
        f = flops(t)
        print(f"T={t} {name:10s} fwd {t1 - t0:7.3f} s ({f / (t1 - t0) / 1e12:5.0f} TF/s)  bwd {t3 - t2:7.3f} s "
              f"({2.5 * f / (t3 - t2) / 1e12:5.0f} TF/s at 2.5x)  peak {peak:6.2f} GiB", flush=True)
    except Exception as e:  # noqa: BLE001 - a kernel that refuses the shape is said, and the next one runs
        print(f"T={t} {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    del q, k, v
    torch.cuda.empty_cache()


def sdpa(backend):
    def fn(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn


def sdpa_rep(backend):
    def fn(q, k, v):
        r = HQ // HKV
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                                  is_causal=True)
    return fn


def sdpa_grouped(q, k, v):
    r = HQ // HKV
    return torch.cat([F.scaled_dot_product_attention(q[:, g * r:(g + 1) * r], k[:, g:g + 1], v[:, g:g + 1],
                                                     is_causal=True, enable_gqa=True) for g in range(HKV)], 1)


def ours(q, k, v):
    t = q.shape[2]
    return pa._flash(q, k, v, torch.tensor([0, t], dtype=torch.int32, device=DEV), t, None)


class Whole(torch.autograd.Function):
    """The flash kernel over offsets with its backward over every head at once."""

    @staticmethod
    def forward(ctx, q, k, v, cu, t):
        out, lse, rng, unused = pa.kernel_forward(q, k, v, cu, t, None, None, None)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.t = t
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = pa.kernel_backward(dout.contiguous(), q, k, v, out, lse, cu, ctx.t, rng, unused, None, None, None)
        return dq, dk, dv, None, None


def whole(q, k, v):
    t, d = q.shape[2], q.shape[3]
    qq, kk, vv = (x.transpose(1, 2).reshape(t, x.shape[1], d) for x in (q, k, v))
    return Whole.apply(qq, kk, vv, torch.tensor([0, t], dtype=torch.int32, device=DEV), t)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("long_attention.py times CUDA kernels: it needs a GPU")
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name())
    for t in [int(a) for a in sys.argv[1:]]:
        bench("ours", ours, t)
        bench("whole", whole, t)
        bench("sdpa-grp", sdpa_grouped, t)
        bench("default", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), t)
        bench("flash", sdpa_rep(SDPBackend.FLASH_ATTENTION), t)
        bench("cudnn", sdpa_rep(SDPBackend.CUDNN_ATTENTION), t)
        bench("cudnn-gqa", sdpa(SDPBackend.CUDNN_ATTENTION), t)
        bench("flash-gqa", sdpa(SDPBackend.FLASH_ATTENTION), t)
