"""Side-by-side: megatrain vs DeepSpeed ZeRO-3 CPU offload vs FSDP2 CPU offload, one model size per call.

    PYTHONPATH=. python3 benchmarks/peers/run.py --preset qwen2.5-1.5b --tokens 16384 --out results/

Each system runs in its own process (clean host and GPU memory, one killed by the OOM killer is recorded as such),
on the same model, data and seed; prints one table and writes each system's JSON to --out.
"""

import json
import os
import subprocess
import sys

from common import base_parser

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = {"megatrain": "megatrain_run.py", "deepspeed": "deepspeed_run.py", "fsdp2": "fsdp2_run.py"}


def main():
    ap = base_parser(__doc__)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per system")
    ap.add_argument("--meta", action="store_true", help="megatrain builds on the meta device (seeded init)")
    ap.add_argument("--out", default="peer-results")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.systems:
        path = os.path.join(args.out, f"{name}-{args.preset}-{args.tokens}.json")
        cmd = [sys.executable, os.path.join(HERE, SYSTEMS[name]), "--preset", args.preset, "--tokens",
               str(args.tokens), "--seq", str(args.seq), "--mb", str(args.mb), "--steps", str(args.steps),
               "--json", path] + (["--meta"] if args.meta and name == "megatrain" else [])
        print("$", " ".join(cmd), flush=True)
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            tail = (proc.stdout + proc.stderr)[-2000:]
            if proc.returncode != 0 or not os.path.exists(path):
                why = "killed (out of host memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
                rows.append({"system": name, "error": why, "tail": tail})
                continue
            with open(path) as f:
                rows.append(json.load(f))
        except subprocess.TimeoutExpired:
            rows.append({"system": name, "error": f"timed out after {args.timeout} s"})
    with open(os.path.join(args.out, f"table-{args.preset}-{args.tokens}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{args.preset}, {args.tokens} tokens/step, seq {args.seq}")
    print(f"{'system':26s} {'tokens/s':>10s} {'TFLOPS':>7s} {'step s':>8s} {'GPU GiB':>8s} {'host GiB':>9s}  losses")
    for r in rows:
        if r.get("error"):
            print(f"{r['system']:26s} {r['error']}")
            continue
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{r['system']:26s} {r['tokens_per_s']:10,.0f} {r['tflops_6nt']:7.0f} {r['step_s']:8.3f} "
              f"{r['gpu_peak_gib']:8.1f} {r['host_peak_gib']:9.1f}  {losses}")


if __name__ == "__main__":
    main()
