"""Attention with sinks on the flash kernel (capture.packed_attention, GPT-OSS's shape) against SDPA's flash kernel on
the same shapes without sinks: forward + backward milliseconds, one JSON line per shape."""

import argparse
import json

import torch
import torch.nn.functional as F

from megatrain.capture import packed_attention


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    for t in args.seqs:
        b = args.tokens // t
        q, k, v = (torch.randn(b, n, t, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for n in (hq, hkv, hkv))
        sinks = torch.randn(hq, device="cuda", generator=g).requires_grad_()
        dy = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device="cuda")

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(dy.transpose(1, 2))

        def ours(window):
            def run():
                packed_attention._flash(q, k, v, cu, t, d ** -0.5, window, sinks).backward(dy)
            return run

        base = _time(sdpa, args.reps)
        for window in (None, 128):
            ms = _time(ours(window), args.reps)
            print(json.dumps(dict(seq=t, batch=b, heads=hq, kv_heads=hkv, head_dim=d, window=window,
                                  sinks_ms=round(ms, 3), sdpa_flash_ms=round(base, 3),
                                  speed_vs_sdpa=round(base / ms, 3))), flush=True)


if __name__ == "__main__":
    main()
