"""Where the host thread's time goes in streamed training steps: torch.profiler over steps after warm-up.

    PYTHONPATH=. python3 benchmarks/profile_step.py --preset qwen2.5-1.5b --batch 16 --mb 1 --slots all \
        --gpu-opt-every auto --steps 2

Each op the executor issues is a profiler range named after it (``OPT L12 mb0``), so the slowest ops to issue and
the CUDA runtime calls that made them slow show up by name. Steps overlap as in training (a step's device updates
run on under the next step's start) unless --step-sync. Prints the operators with the most host (self CPU) time,
the GPU kernels with the most device time and the ops that took longest to issue, and writes the profiler's Chrome
trace with --trace.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from megatrain.cli import gpu_opt_every, saved_acts


@contextmanager
def op_ranges(executor):
    """Every op ``executor`` issues wrapped in a profiler range named after it (benchmark instrumentation)."""
    from torch.profiler import record_function

    executor.on_op = lambda op: record_function(f"{op.kind.value} L{op.layer} mb{op.mb}")
    try:
        yield
    finally:
        executor.on_op = None


def slow_issues(prof, rows: int, min_ms: float = 1.0) -> list[str]:
    """The op ranges that took longest on the host, each with its slowest CUDA runtime calls."""
    from torch.autograd import DeviceType

    from megatrain.ir import OpKind

    kinds = tuple(k.value + " " for k in OpKind)
    # the host side of each range (the profiler also shows each range on the GPU, from its first kernel to its last)
    ranges = [e for e in prof.events() if e.name.startswith(kinds) and e.device_type == DeviceType.CPU]
    ranges.sort(key=lambda e: -e.time_range.elapsed_us())
    out = []
    for e in ranges[:rows]:
        calls = []
        stack = list(e.cpu_children)
        while stack:
            c = stack.pop()
            if c.name.startswith("cuda") and c.time_range.elapsed_us() >= min_ms * 1e3:
                calls.append(f"{c.name} {c.time_range.elapsed_us() / 1e3:.1f} ms")
            stack.extend(c.cpu_children)
        out.append(f"{e.time_range.elapsed_us() / 1e3:8.2f} ms  {e.name}" + (f"  [{', '.join(calls)}]" if calls
                                                                              else ""))
    return out


def kernel_table(prof) -> list[str]:
    """Every GPU kernel the profiled steps ran (copies included), by total device time: ms, calls, name."""
    from torch.autograd import DeviceType

    total, calls = {}, {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            total[e.name] = total.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
            calls[e.name] = calls.get(e.name, 0) + 1
    rows = sorted(total, key=lambda k: -total[k])
    return [f"{total[k]:10.3f} ms {calls[k]:6d}  {k[:140]}" for k in rows]


def op_kernels(prof, name: str) -> list[str]:
    """The GPU kernels (copies included) inside the first device-side range of the op named ``name`` (``BWD L1
    mb1``), in the order they ran: start (ms from the range's start), duration, name; then the range's length
    and the time in it no kernel ran."""
    from torch.autograd import DeviceType

    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ranges = sorted((e for e in gpu if e.name == name), key=lambda e: e.time_range.start)
    if not ranges:
        return [f"no device range named {name!r}"]
    r = ranges[0].time_range
    inside = sorted((e for e in gpu if e.name != name and r.start <= e.time_range.start < r.end),
                    key=lambda e: e.time_range.start)
    out, busy, end = [], 0.0, r.start
    for e in inside:
        t = e.time_range
        busy += max(0.0, t.end - max(t.start, end))
        end = max(end, t.end)
        out.append(f"{(t.start - r.start) / 1e3:8.3f} {t.elapsed_us() / 1e3:8.3f} ms  {e.name[:120]}")
    total = r.elapsed_us()
    out.append(f"{name}: {total / 1e3:.3f} ms on the device, {(total - busy) / 1e3:.3f} ms of it with no kernel running")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b", help="a planner preset, or tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--slots", default="3")
    ap.add_argument("--gpu-opt-every", type=gpu_opt_every, default=0)
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the preset's)")
    ap.add_argument("--saved-acts", type=saved_acts, default="auto")
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--step-sync", action="store_true", help="a device-wide sync between steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="steps profiled (consecutive, overlapping)")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--data", choices=("random", "chat"), default="random",
                    help="random tokens, or packed rows of chat-like documents (as benchmarks/throughput.py makes)")
    ap.add_argument("--trace", help="write the profiler's Chrome trace here")
    ap.add_argument("--op", action="append", default=[],
                    help="list the kernels of this op's first profiled run in order (e.g. 'BWD L1 mb1'); repeatable")
    ap.add_argument("--kernels", action="store_true",
                    help="also list every GPU kernel (not the operators above them): device ms, calls, name")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.streamed import build

    sm, cfg = build(args.preset, args.seq, n_mb=args.mb, slots=args.slots, gpu_opt_every=args.gpu_opt_every,
                    clip=not args.no_clip, layers=args.layers, saved_acts=args.saved_acts)
    streaming = hasattr(sm.executor, "drain")
    sm.overlap_steps = streaming
    if streaming:
        sm.executor.sync_between_steps = args.step_sync
    gen = torch.Generator().manual_seed(0)
    if args.data == "chat":
        import numpy as np

        from benchmarks.throughput import chat_rows
        from megatrain.data.rows import rows_batch

        rows = chat_rows(cfg.vocab_size, args.seq, args.batch * (args.warmup + args.steps))
        order = iter(range(args.warmup + args.steps))

        def batch():
            i = next(order)
            b = rows_batch(rows, np.arange(i * args.batch, (i + 1) * args.batch), args.batch)
            return b["input_ids"], b["attention_mask"], b["labels"], b["position_ids"]
    else:
        def batch():
            return (torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen),)
    for _ in range(args.warmup):
        sm.train_step(*batch())
    sm.wait()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, op_ranges(sm.executor):
        for _ in range(args.steps):
            st = sm.train_step(*batch())
            print(f"step: {st.seconds:.3f} s on the host, loss {st.loss:.4f}")
            if streaming:
                print("  host issue s by kind: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in sorted(sm.executor.timer.host_issue_s.items(), key=lambda kv: -kv[1])))
        sm.wait()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    try:
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    except (KeyError, AttributeError, RuntimeError):  # older torch names it after CUDA
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    if args.kernels:
        print("\n".join(kernel_table(prof)))
    for name in args.op:
        print("\n".join(op_kernels(prof, name)))
    print("ops slowest to issue (host), with CUDA runtime calls of 1 ms or more:")
    print("\n".join(slow_issues(prof, args.rows)))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
