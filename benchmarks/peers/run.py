"""Side-by-side: megatrain vs DeepSpeed ZeRO-3 CPU offload vs FSDP2 CPU offload, one model size per call.

    PYTHONPATH=. python3 benchmarks/peers/run.py --preset qwen2.5-1.5b --tokens 16384 --mb 1 2 4 --out results/

Each system runs in its own process (clean host and GPU memory) on the same model, data and seed, once per
micro-batch count; one that runs the host out of memory is stopped and recorded as such. Prints one table, then
each system at its fastest micro-batch count and megatrain's speed over each peer's there (fewer, larger
micro-batches help the peers too: ZeRO-3 gathers the parameters once per micro-batch). Writes each run's JSON, the
table and the summary to --out.
"""

import json
import os
import subprocess
import sys
import threading
import time

from common import base_parser

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30
SYSTEMS = {"megatrain": "megatrain_run.py", "deepspeed": "deepspeed_run.py", "fsdp2": "fsdp2_run.py"}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def run_watched(cmd: list[str], timeout: float, reserve: int) -> tuple[int, str, str]:
    """Run one system, echoing its output; stop it when the host's available memory falls under ``reserve`` bytes
    (before the kernel's OOM killer picks a process, perhaps not this one). Returns (exit code, output, why it was
    stopped or '')."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    t0, why = time.monotonic(), ""
    while proc.poll() is None:
        avail = mem_available()
        if avail < reserve:
            why = f"out of host memory: available host memory fell to {avail / GIB:.1f} GiB (stopped)"
        elif time.monotonic() - t0 > timeout:
            why = f"timed out after {timeout:.0f} s"
        if why:
            proc.kill()
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=5)
    return proc.returncode, "".join(lines), why


def main():
    ap = base_parser(__doc__, several_mb=True)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per system")
    ap.add_argument("--reserve-gib", type=float, default=3.0,
                    help="stop a system when available host memory falls below this")
    ap.add_argument("--meta", action="store_true", help="megatrain builds on the meta device (seeded init)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="megatrain's host AdamW threads")
    ap.add_argument("--gpu-opt-every", default="0", help="megatrain: update every k-th layer on the GPU, or auto")
    ap.add_argument("--slots", default="3", help="megatrain: weight slots, or all (one per layer)")
    ap.add_argument("--saved-acts", default="auto", help="megatrain: layers that keep their activations for the "
                                                         "backward (auto: as many as fit; 0: every one recomputes)")
    ap.add_argument("--resident-opt", default="auto", help="megatrain: GPU-updated layers whose state stays on the "
                                                           "GPU between steps (auto: the planner's)")
    ap.add_argument("--step-sync", action="store_true", help="megatrain: a device-wide sync between steps")
    ap.add_argument("--out", default="peer-results")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if any(m < 1 for m in args.mb):
        raise SystemExit(f"--mb {args.mb}: micro-batch counts must be positive")
    rows = []
    for name in args.systems:
        for mb in args.mb:
            rows.append(run_system(args, name, mb))
    with open(os.path.join(args.out, f"table-{args.preset}-{args.tokens}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{args.preset}, {args.tokens} tokens/step, seq {args.seq}")
    print(f"{'system':26s} {'mb':>3s} {'tokens/s':>10s} {'TFLOPS':>7s} {'step s':>8s} {'median s':>9s} {'GPU GiB':>8s} "
          f"{'host GiB':>9s}  losses")
    for r in rows:
        if r.get("error"):
            print(f"{r['system']:26s} {r['n_mb']:3d} {r['error']}")
            continue
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{r['system']:26s} {r['n_mb']:3d} {r['tokens_per_s']:10,.0f} {r['tflops_6nt']:7.0f} "
              f"{r['step_s']:8.3f} {r['median_step_s']:9.3f} {r['gpu_peak_gib']:8.1f} {r['host_peak_gib']:9.1f}  "
              f"{losses}")
    summary = best_of(rows)
    with open(os.path.join(args.out, f"summary-{args.preset}-{args.tokens}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\neach system at its fastest micro-batch count:")
    for name, b in summary["best"].items():
        print(f"{name:26s} {b['n_mb']:3d} {b['tokens_per_s']:10,.0f}")
    for name, ratio in summary["megatrain_over"].items():
        print(f"megatrain / {name}: {ratio:.2f}x (on the median steps of those runs: "
              f"{summary['megatrain_over_median'][name]:.2f}x)")


def run_system(args, name: str, mb: int) -> dict:
    """One system at one micro-batch count, in its own process: its result record, or an error row."""
    path = os.path.join(args.out, f"{name}-{args.preset}-{args.tokens}-mb{mb}.json")
    if os.path.exists(path):
        os.remove(path)  # a failed run must not leave an older run's record to be read as its own
    cmd = [sys.executable, os.path.join(HERE, SYSTEMS[name]), "--preset", args.preset, "--tokens",
           str(args.tokens), "--seq", str(args.seq), "--mb", str(mb), "--steps", str(args.steps), "--json", path]
    if name == "megatrain":
        cmd += (["--meta"] if args.meta else []) + (["--cpu-threads", str(args.cpu_threads)]
                                                     if args.cpu_threads else [])
        cmd += ["--gpu-opt-every", str(args.gpu_opt_every), "--slots", str(args.slots), "--saved-acts",
                str(args.saved_acts), "--resident-opt", str(args.resident_opt)]
        cmd += ["--step-sync"] if args.step_sync else []
    print("$", " ".join(cmd), flush=True)
    code, text, why = run_watched(cmd, args.timeout, int(args.reserve_gib * GIB))
    if why or code != 0 or not os.path.exists(path):
        if not why:
            why = "killed by the OOM killer (out of host memory)" if code in (-9, 137) else f"exit {code}"
        return {"system": name, "n_mb": mb, "error": why, "tail": text[-3000:]}
    with open(path) as f:
        return json.load(f)


def best_of(rows: list[dict]) -> dict:
    """Each system's fastest run that finished ({system: {n_mb, tokens_per_s, median_step_s}}), and megatrain's
    speed over each peer's, both at their fastest (absent where either has no finished run): by tokens/s (the mean
    over the timed steps) and by the median timed step of the same runs."""
    best: dict[str, dict] = {}
    for r in rows:
        if not r.get("error") and (r["system"] not in best or r["tokens_per_s"] > best[r["system"]]["tokens_per_s"]):
            best[r["system"]] = {"n_mb": r["n_mb"], "tokens_per_s": r["tokens_per_s"],
                                 "median_step_s": r["median_step_s"]}
    ours = best.get("megatrain")
    peers = {name: b for name, b in best.items() if ours is not None and name != "megatrain"}
    return {"best": best,
            "megatrain_over": {name: ours["tokens_per_s"] / b["tokens_per_s"] for name, b in peers.items()},
            "megatrain_over_median": {name: b["median_step_s"] / ours["median_step_s"] for name, b in peers.items()}}


if __name__ == "__main__":
    main()
