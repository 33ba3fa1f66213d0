"""PyTorch FSDP2 with CPU offload on the peer benchmark's model and data (one GPU). See run.py.

fully_shard per decoder layer and at the root with CPUOffloadPolicy (parameters, gradients and optimizer state on
the host) and MixedPrecisionPolicy (bf16 compute, fp32 reduction); activation checkpointing per decoder layer;
torch AdamW on the host parameters; gradient accumulation over micro-batches (unsharded on the GPU, one reduction
and offload per step); clip_grad_norm_.
"""

import os
import time

import torch
import torch.distributed as dist

from common import CLIP, LR, Result, base_parser, build_model, hf_config, loss_sum, run_peer


def main():
    ap = base_parser(__doc__)
    ap.add_argument("--json")
    args = ap.parse_args()
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda" if cuda else "cpu")
    cfg = hf_config(args.preset, args.seq)
    t0 = time.perf_counter()
    model = build_model(cfg)
    res = Result("fsdp2-cpu-offload", args.preset, sum(p.numel() for p in model.parameters()), args.tokens,
                 args.seq, args.mb)

    def setup():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        if cuda:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
            res.notes = "AdamW fused on the host"
        except (RuntimeError, TypeError) as e:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
            res.notes = f"AdamW per-tensor on the host (fused refused: {e})"

        def step(ids, nxt, denom):
            total = 0.0
            chunks = torch.arange(len(ids)).chunk(args.mb)
            for i, sl in enumerate(chunks):
                # accumulate the micro-batches' gradients unsharded on the GPU (in the fp32 reduce dtype) and
                # reduce + offload them once, after the last: without this FSDP2 offloads and adds them on the host
                # after every micro-batch (about 10x slower per step at 4 micro-batches on the H200)
                model.set_requires_gradient_sync(i == len(chunks) - 1)
                logits = model(input_ids=ids[sl].to(device)).logits
                loss = loss_sum(logits, nxt[sl].to(device)) / denom
                loss.backward()
                total += float(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            return total

        return step

    run_peer(res, args, cfg, t0, setup)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
