"""Where the host thread waits for the device inside a training step: runs steps of a Qwen2.5-shaped model with
random weights under ``torch.cuda.set_sync_debug_mode``, and prints each distinct synchronizing call site (the
innermost megatrain and transformers frames) with how often a step hit it.

    PYTHONPATH=. python3 benchmarks/find_syncs.py --preset qwen2.5-0.5b --batch 4 --gpu-opt-every auto --slots all

A synchronizing call stalls the host until the device reaches it, so the ops behind it are issued late; in a steady
step the only expected ones are reading the gradient norm (clipping) and the losses.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from megatrain.cli import gpu_opt_every


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=1)
    ap.add_argument("--slots", default="all")
    ap.add_argument("--gpu-opt-every", type=gpu_opt_every, default="auto")
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--step-sync", action="store_true", help="keep the device-wide sync between steps")
    ap.add_argument("--steps", type=int, default=2, help="steps watched, after two unwatched ones")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the preset's)")
    args = ap.parse_args()
    from benchmarks.streamed import build

    sm, cfg = build(args.preset, args.seq, n_mb=args.mb, slots=args.slots, gpu_opt_every=args.gpu_opt_every,
                    clip=not args.no_clip, layers=args.layers)
    conf = next(m.config for m in sm.captured.segments[1].template.modules() if hasattr(m, "config"))
    print(f"{cfg.model_type}: attention {conf._attn_implementation}, experts "
          f"{getattr(conf, '_experts_implementation', None)}")
    sm.overlap_steps = True
    sm.executor.sync_between_steps = args.step_sync
    gen = torch.Generator().manual_seed(0)

    def step():
        return sm.train_step(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen))

    for _ in range(2):
        step()
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "megatrain" in f.filename or "transformers" in f.filename]
        inner = frames[-3:] if frames else traceback.extract_stack()[-4:-1]
        sites["\n    ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}: {f.line}"
                             for f in inner)] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(args.steps):
        step()
    torch.cuda.set_sync_debug_mode("default")
    sm.wait()
    print(f"{sum(sites.values())} synchronizing calls in {args.steps} steps, {len(sites)} call sites:")
    for site, n in sites.most_common():
        print(f"{n / args.steps:6.1f} per step\n    {site}")


if __name__ == "__main__":
    main()
