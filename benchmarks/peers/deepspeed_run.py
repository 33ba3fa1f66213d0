"""DeepSpeed ZeRO-3 with parameter and optimizer offload to pinned host memory on the peer benchmark's model and
data (one GPU). See run.py.

ZeRO stage 3, offload_param and offload_optimizer to the CPU (pinned), bf16 with fp32 master weights, DeepSpeedCPUAdam
(AdamW mode), HF gradient checkpointing, micro-batches with gradient accumulation, gradient clipping 1.0. The loss of
each micro-batch is already divided by the step's valid tokens, so DeepSpeed is told not to divide it again.
"""

import inspect
import os
import time

import torch

from common import CLIP, LR, Result, base_parser, build_model, hf_config, loss_sum, run_peer


def main():
    ap = base_parser(__doc__)
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
    res = Result("deepspeed-zero3-offload", args.preset, sum(p.numel() for p in model.parameters()), args.tokens,
                 args.seq, args.mb, notes=f"deepspeed {deepspeed.__version__}")

    def setup():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, adamw_mode=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        no_rescale = "scale_wrt_gas" in inspect.signature(engine.backward).parameters

        def step(ids, nxt, denom):
            total = 0.0
            for sl in torch.arange(len(ids)).chunk(args.mb):
                logits = engine(input_ids=ids[sl].to(engine.device)).logits
                loss = loss_sum(logits, nxt[sl].to(engine.device)) / denom
                if no_rescale:
                    engine.backward(loss, scale_wrt_gas=False)
                else:  # the engine divides by the accumulation steps: undo it
                    engine.backward(loss * args.mb)
                engine.step()  # applies the update at the accumulation boundary
                total += float(loss)
            return total

        return step

    run_peer(res, args, cfg, t0, setup)


if __name__ == "__main__":
    main()
