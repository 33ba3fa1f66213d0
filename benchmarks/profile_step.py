"""Where the host thread's time goes in one streamed training step: torch.profiler over one step after warm-up.

    PYTHONPATH=. python3 benchmarks/profile_step.py --preset qwen2.5-1.5b --batch 16 --mb 4 --slots 3

Prints the operators with the most host (self CPU) time and the GPU kernels with the most device time, and writes
the profiler's Chrome trace with --trace.
"""

from __future__ import annotations

import argparse

import torch

from megatrain.api import gpu_opt_every


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b", help="a planner preset, or tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--slots", default="3")
    ap.add_argument("--gpu-opt-every", type=gpu_opt_every, default=0)
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--trace", help="write the profiler's Chrome trace here")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.streamed import build

    sm, cfg = build(args.preset, args.seq, n_mb=args.mb, slots=args.slots, gpu_opt_every=args.gpu_opt_every,
                    clip=not args.no_clip)
    gen = torch.Generator().manual_seed(0)
    batch = lambda: torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)  # noqa: E731
    for _ in range(args.warmup):
        sm.train_step(batch())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sm.train_step(batch())
        if hasattr(sm.executor, "drain"):
            sm.executor.drain()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    try:
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    except (KeyError, AttributeError, RuntimeError):  # older torch names it after CUDA
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
