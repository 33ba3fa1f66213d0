"""How much of the H2D copy engine the next forward's weight loads get beside a split update's state loads, by how a
weight load crosses: torch's copy_ (one fp32 copy of the whole layer, then the cast), or megatrain's staging buffer
in parts of a given size (DeviceState.load_cast). A chain of state-part loads (4 row copies of 33.6M fp32 each, then
a short kernel the next part waits for, as the paced split queue issues them) runs on one stream while weight loads
of one 7B block (233M parameters, fp32 to bf16) run on another; prints each variant's weight-load and chain rates.

    PYTHONPATH=. python3 benchmarks/stage_share.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from megatrain.runtime.memory.device import DeviceState


def run(variant: str, part_params: int, rows: list, dev_rows: list, src: torch.Tensor, dst: torch.Tensor,
        parts: int, loads: int) -> dict:
    state = DeviceState(graph=None, store=None, device=torch.device("cuda"), dtype=torch.bfloat16,
                        quiesce=torch.cuda.synchronize)
    state.stage = torch.empty(part_params, dtype=torch.float32, device="cuda") if part_params else None
    chain, weights = torch.cuda.Stream(), torch.cuda.Stream()
    spin = torch.empty(1 << 20, device="cuda")
    torch.cuda.synchronize()
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("c0", "c1", "w0", "w1")}
    with torch.cuda.stream(chain):
        ev["c0"].record()
        for _ in range(parts):
            for h, d in zip(rows, dev_rows):
                d.copy_(h, non_blocking=True)
            spin.mul_(1.0)  # the part's update, which the next part's load follows
        ev["c1"].record()
    with torch.cuda.stream(weights):
        ev["w0"].record()
        for _ in range(loads):
            if part_params:
                state.load_cast(dst, src, non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)
        ev["w1"].record()
    torch.cuda.synchronize()
    chain_s, w_s = ev["c0"].elapsed_time(ev["c1"]) / 1e3, ev["w0"].elapsed_time(ev["w1"]) / 1e3
    return {"variant": variant, "weights_s": w_s, "weights_gb_s": loads * src.numel() * 4 / w_s / 1e9,
            "chain_s": chain_s, "chain_gb_s": parts * sum(r.numel() * 4 for r in rows) / chain_s / 1e9 if parts else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    part = 1 << 25
    rows = [torch.randn(part).pin_memory() for _ in range(4)]
    dev_rows = [torch.empty(part, device="cuda") for _ in range(4)]
    src = torch.randn(233_000_000).pin_memory()
    dst = torch.empty(src.numel(), dtype=torch.bfloat16, device="cuda")
    out = []
    variants = [("torch copy_", 0), ("stage 128 MiB", 1 << 25), ("stage 512 MiB", 1 << 27)]
    for variant, p in variants + variants:
        r = run(variant, p, rows, dev_rows, src, dst, parts=24, loads=4)
        out.append(r)
        print(f"{r['variant']:14s} weights {r['weights_s']:.3f} s ({r['weights_gb_s']:.1f} GB/s), state chain "
              f"{r['chain_s']:.3f} s ({r['chain_gb_s']:.1f} GB/s)", flush=True)
    for variant, p in variants:
        alone = run(variant + ", alone", p, rows, dev_rows, src, dst, parts=0, loads=4)
        print(f"{alone['variant']:22s} weights {alone['weights_gb_s']:.1f} GB/s", flush=True)
        out.append(alone)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
