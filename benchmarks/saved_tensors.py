"""What one decoder block's forward saves for its backward on this device (the bytes a layer in saved_acts keeps):
each saved tensor's shape, dtype and bytes per token, next to the planner's formula. A Qwen2.5-shaped model with
two blocks and random weights.

    PYTHONPATH=. python3 benchmarks/saved_tensors.py --preset qwen2.5-3b --seq 1024
"""

import argparse
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-3b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--no-kernels", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    import megatrain
    from benchmarks.peers.common import hf_config
    from megatrain.planner.graph import preset

    cfg = hf_config(args.preset, args.seq, layers=2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    sm = megatrain.compile(model, device=dev, kernels=not args.no_kernels and dev == "cuda", saved_acts=2)
    ex = sm.executor
    rows = []
    real = torch.autograd.graph.saved_tensors_hooks

    class Listing(real):  # the measurement's own hooks, with every saved tensor listed too
        def __init__(self, pack, unpack):
            def listing(t):
                rows.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), t.untyped_storage().nbytes(),
                             t.untyped_storage().data_ptr()))
                return pack(t)

            super().__init__(listing, unpack)

    torch.autograd.graph.saved_tensors_hooks = Listing
    try:
        per_token = -(-ex.measure_saved_bytes(1, args.seq) // args.seq)
    finally:
        torch.autograd.graph.saved_tensors_hooks = real
    seen = set()
    for shape, dtype, nbytes, ptr in rows:
        note = "same storage as above" if ptr in seen else ""
        seen.add(ptr)
        print(f"{str(shape):28s} {dtype:9s} {nbytes / args.seq:12,.1f} B/token  {note}")
    lean = -(-ex.measure_saved_bytes(1, args.seq, lean=True) // args.seq)
    block = preset(args.preset)[1]
    print(f"measured {per_token:,} B/token (unique storages, activations only); formula "
          f"{block.saved_bytes_per_token:,}; kernels {sorted(sm.kernels)}")
    print(f"lean (the MLP's product formed again in the backward): measured {lean:,} B/token; formula "
          f"{block.saved_bytes(True):,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
