"""megatrain on the peer benchmark's model and data. See run.py."""

import time

import torch

from common import CLIP, LR, Result, base_parser, build_model, hf_config, run_peer

import megatrain
from megatrain.cli import gpu_opt_every, resident_opt, saved_acts


def main():
    ap = base_parser(__doc__)
    ap.add_argument("--meta", action="store_true", help="build on the meta device, seeded init (models too large "
                                                         "to exist twice in host memory)")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--cpu-threads", type=int, default=None, help="host threads for AdamW (default: torch's)")
    ap.add_argument("--slots", default="3", help="weight slots, or all (one per layer)")
    ap.add_argument("--step-sync", action="store_true",
                    help="a device-wide sync between steps (default: steps ordered by events only)")
    ap.add_argument("--gpu-opt-every", type=gpu_opt_every, default=0,
                    help="update every k-th layer on the GPU (0: none; auto: the fastest simulated set)")
    ap.add_argument("--saved-acts", type=saved_acts, default="auto",
                    help="layers that keep their activations for the backward (auto: as many as fit; 0: none)")
    ap.add_argument("--resident-opt", type=resident_opt, default="auto",
                    help="GPU-updated layers whose state stays on the GPU between steps (auto: the planner's; 0: "
                         "every state goes to the host and back each step)")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = hf_config(args.preset, args.seq)
    t0 = time.perf_counter()
    model = build_model(cfg, meta=args.meta)
    res = Result("megatrain", args.preset, sum(p.numel() for p in model.parameters()), args.tokens, args.seq,
                 args.mb)

    def setup():
        nonlocal model
        optim = megatrain.OptimConfig(lr=LR, max_grad_norm=CLIP, threads=args.cpu_threads)
        sm = megatrain.compile(model, init_seed=0 if args.meta else None, device=args.device, optim=optim,
                               n_mb=args.mb, gpu_opt_every=args.gpu_opt_every, saved_acts=args.saved_acts,
                               resident_opt=args.resident_opt,
                               weight_slots=args.slots if args.slots == "all" else int(args.slots))
        model = None  # the weights live in the host store now; the model's own copy is freed
        res.notes = (f"kernels: {sorted(sm.kernels)}; executor: {type(sm.executor).__name__}; AdamW threads: "
                     f"{args.cpu_threads or torch.get_num_threads()}; layers updated on the GPU: every "
                     f"{args.gpu_opt_every or 'none'}; weight slots: {args.slots}; "
                     f"device sync between steps: {args.step_sync}; saved activations: {args.saved_acts}; states kept on "
                     f"the GPU: {args.resident_opt}")
        sm.overlap_steps = sm.device.type == "cuda"  # a step's optimizer tail overlaps the next step's start
        if hasattr(sm.executor, "sync_between_steps"):
            sm.executor.sync_between_steps = args.step_sync
        return (lambda ids, nxt, denom: sm.train_step(ids).loss), sm.wait

    run_peer(res, args, cfg, t0, setup)


if __name__ == "__main__":
    main()
