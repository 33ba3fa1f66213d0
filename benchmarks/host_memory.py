"""Peak host memory of compiling a large model from the meta device with the seeded initializer.

    PYTHONPATH=. python benchmarks/host_memory.py --preset qwen2.5-7b [--json out.json]

Builds the HF model on the meta device, compiles it (capture, pinned host store of fp32 master + exp_avg +
exp_avg_sq + gradient, per-module seeded init) and reports the peak resident set against the store's size.
"""

import argparse
import json
import resource
import time

import torch


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # ru_maxrss is in KiB on Linux


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    import megatrain
    from megatrain.planner.graph import PRESETS

    kind = "llama" if args.preset.startswith("llama") else "qwen2"
    cfg = AutoConfig.for_model(model_type=kind, **PRESETS[args.preset])
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    t1 = time.perf_counter()
    sm = megatrain.compile(model, init_seed=args.seed, device="cuda" if torch.cuda.is_available() else "cpu")
    t2 = time.perf_counter()
    store = sum(sm.store.nbytes.values())
    n = sm.graph.n_params
    w = sm.state_dict()["model.layers.3.mlp.up_proj.weight"]
    res = {
        "preset": args.preset, "params": n, "store_gib": store / (1 << 30), "peak_rss_gib": rss_gib(),
        "pinned": sm.store.pinned, "build_meta_s": t1 - t0, "compile_and_init_s": t2 - t1,
        "sample_weight_std": float(w.std()), "initializer_range": cfg.initializer_range,
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
