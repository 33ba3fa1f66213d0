"""megatrain on the peer benchmark's model and data. See run.py."""

import argparse
import time

import torch

from common import CLIP, LR, Result, StepTimer, batches, build_model, hf_config, host_peak_gib

import megatrain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--meta", action="store_true", help="build on the meta device, seeded init (models too large "
                                                         "to exist twice in host memory)")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = hf_config(args.preset, args.seq)
    t0 = time.perf_counter()
    model = build_model(cfg, meta=args.meta)
    n = sum(p.numel() for p in model.parameters())
    sm = megatrain.compile(model, init_seed=0 if args.meta else None, device=args.device,
                           optim=megatrain.OptimConfig(lr=LR, max_grad_norm=CLIP), n_mb=args.mb, weight_slots=3)
    del model
    res = Result("megatrain", args.preset, n, args.tokens, args.seq, args.mb, setup_s=time.perf_counter() - t0,
                 notes=f"kernels: {sorted(sm.kernels)}; streams: {type(sm.executor).__name__}")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for ids in batches(cfg.vocab_size, args.tokens, args.seq, args.steps):
        with StepTimer() as t:
            st = sm.train_step(ids)
        res.step_times_s.append(t.t)
        res.losses.append(st.loss)
    res.gpu_peak_gib = torch.cuda.max_memory_allocated() / (1 << 30) if torch.cuda.is_available() else 0.0
    res.host_peak_gib = host_peak_gib()
    res.finish(args.json)


if __name__ == "__main__":
    main()
