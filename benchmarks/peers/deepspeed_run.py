"""DeepSpeed ZeRO-3 with parameter and optimizer offload to pinned host memory on the peer benchmark's model and
data (one GPU). See run.py.

ZeRO stage 3, offload_param and offload_optimizer to the CPU (pinned), bf16 with fp32 master weights, DeepSpeedCPUAdam
(AdamW mode), HF gradient checkpointing, micro-batches with gradient accumulation, gradient clipping 1.0. The loss of
each micro-batch is already divided by the step's valid tokens, so DeepSpeed is told not to divide it again.
"""

import argparse
import inspect
import os
import time

import torch

from common import CLIP, LR, Result, StepTimer, batches, build_model, hf_config, host_peak_gib, loss_sum, next_labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    deepspeed.init_distributed()
    cfg = hf_config(args.preset, args.seq)
    seqs = args.tokens // args.seq
    ds_config = {
        "train_micro_batch_size_per_gpu": seqs // args.mb,
        "gradient_accumulation_steps": args.mb,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10 ** 9,
    }
    t0 = time.perf_counter()
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    res = Result("deepspeed-zero3-offload", args.preset, n, args.tokens, args.seq, args.mb,
                 notes=f"deepspeed {deepspeed.__version__}")
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, adamw_mode=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        no_rescale = "scale_wrt_gas" in inspect.signature(engine.backward).parameters
        res.setup_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        for ids in batches(cfg.vocab_size, args.tokens, args.seq, args.steps):
            nxt, denom = next_labels(ids)
            with StepTimer() as t:
                total = 0.0
                for sl in torch.arange(len(ids)).chunk(args.mb):
                    logits = engine(input_ids=ids[sl].cuda()).logits
                    loss = loss_sum(logits, nxt[sl].cuda()) / denom
                    if no_rescale:
                        engine.backward(loss, scale_wrt_gas=False)
                    else:  # the engine divides by the accumulation steps: undo it
                        engine.backward(loss * args.mb)
                    engine.step()  # applies the update at the accumulation boundary
                    total += float(loss)
            res.step_times_s.append(t.t)
            res.losses.append(total)
    except torch.OutOfMemoryError as e:
        res.error = f"out of GPU memory: {e}"
    except MemoryError as e:
        res.error = f"out of host memory: {e}"
    res.gpu_peak_gib = torch.cuda.max_memory_allocated() / (1 << 30)
    res.host_peak_gib = host_peak_gib()
    res.finish(args.json)


if __name__ == "__main__":
    main()
