"""The host link and the host's AdamW measured against each other, in the terms the simulator's hardware spec uses.

Each copy direction alone, both at once, megatrain's host AdamW alone and beside each direction and both: from these
the spec's link and host fields are fitted (``HardwareSpec``: h2d / d2h / duplex rates, ``cpu_adam_params_per_s``,
the host's AdamW slowed by each direction and each direction slowed by it), the case with everything running is
predicted by the simulator's rate model (``planner.simulate``) next to what it measured, and ``--spec-out`` writes a
spec file for ``megatrain plan --hardware FILE``: a preset's other fields (matmul, attention, issue floors) with the
fitted ones in their place. GPU only (pinned host memory, the native host kernel).

    PYTHONPATH=. python3 benchmarks/link_rates.py --base h100 --spec-out h100-here.json --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

# the most a fitted slowdown may be (the spec refuses shares that stop a queue; a measured 1.0 is noise on a stall)
MAX_SLOWDOWN = 0.9


def _share_lost(loaded: float, alone: float) -> float:
    return min(max(1.0 - loaded / alone, 0.0), MAX_SLOWDOWN)


def fit(m: dict) -> dict:
    """HardwareSpec fields from measured rates ``m`` (bytes/s for copies, parameters/s for AdamW): ``h2d``, ``d2h``,
    ``both`` (h2d, d2h rates when both run), ``adam``, ``adam_h2d`` (AdamW, h2d rates when both run), ``adam_d2h``.
    The inverse of the simulator's model: a direction at its full rate alone; both within their total; the AdamW
    losing a share of its rate per direction at its full rate, each direction a share of its rate while AdamW runs."""
    h2d, d2h, adam = m["h2d"], m["d2h"], m["adam"]
    out = {"h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h, "duplex_bytes_per_s": min(sum(m["both"]), h2d + d2h),
           "cpu_adam_params_per_s": adam,
           "cpu_h2d_slowdown": _share_lost(m["adam_h2d"][0], adam),
           "h2d_cpu_slowdown": _share_lost(m["adam_h2d"][1], h2d),
           "cpu_d2h_slowdown": _share_lost(m["adam_d2h"][0], adam),
           "d2h_cpu_slowdown": _share_lost(m["adam_d2h"][1], d2h)}
    over = out["cpu_h2d_slowdown"] + out["cpu_d2h_slowdown"] - MAX_SLOWDOWN
    if over > 0:  # (the spec needs the two below 1 together: both shares scaled down alike)
        k = MAX_SLOWDOWN / (MAX_SLOWDOWN + over)
        out["cpu_h2d_slowdown"] *= k
        out["cpu_d2h_slowdown"] *= k
    return out


def predict(spec, h2d: bool, d2h: bool, adam: bool) -> dict:
    """The rates the simulator gives ``spec``'s queues with the named ones running: bytes/s per copy direction,
    parameters/s for the AdamW (its share of ``cpu_adam_params_per_s``)."""
    from megatrain.ir import Stream
    from megatrain.planner.simulate import _rates

    queues = [(s, 0) for s, on in ((Stream.H2D, h2d), (Stream.D2H, d2h), (Stream.CPU, adam)) if on]
    rates = _rates(spec, queues)
    out = {s.name.lower(): r for (s, _), r in rates.items()}
    if "cpu" in out:
        out["adam"] = out.pop("cpu") * spec.cpu_adam_params_per_s
    return out


def spec_with(base: str, fields: dict):
    """Preset ``base`` with ``fields`` in place, named ``<base>-measured`` (validated as a spec file would be)."""
    from megatrain.planner.hardware import PRESETS, HardwareSpec

    d = dataclasses.asdict(PRESETS[base])
    d.update(fields, name=f"{base}-measured")
    return HardwareSpec.from_dict(d)


def write_spec(spec, path: str) -> None:
    """``spec`` as a file ``--hardware`` reads (``HardwareSpec.from_json``)."""
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(spec), f, indent=1)


def measure(numel: int, layers: int, seconds: float, gib: float) -> dict:
    """The rates ``fit`` takes, each case run for about ``seconds``."""
    import torch

    from benchmarks.host_adamw import Traffic, blocks, native_all
    from megatrain.layout import HOST_UPDATE_CHUNK
    from megatrain.runtime.optim import cpu_adamw

    cpu_adamw.library()
    bs = blocks(layers, numel, True)
    n_params = numel * layers

    def adam_rate() -> float:  # whole passes over the blocks until the time is up
        t0, done = time.perf_counter(), 0
        while True:
            native_all(bs, HOST_UPDATE_CHUNK, cpu_adamw.FULL, None, 0.8)
            done += n_params
            if time.perf_counter() - t0 >= seconds:
                return done / (time.perf_counter() - t0)

    def copies(h2d: bool, d2h: bool, work=None):
        with Traffic(gib, h2d, d2h) as tr:
            out = work() if work else time.sleep(seconds)
        torch.cuda.synchronize()
        return tr.gbps, out

    adam_rate()  # warm: first touch, the kernel's threads
    m = {"adam": adam_rate()}
    for name, dirs in (("h2d", (True, False)), ("d2h", (False, True))):
        gbps, _ = copies(*dirs)
        m[name] = gbps[name] * 1e9
        gbps, rate = copies(*dirs, work=adam_rate)
        m[f"adam_{name}"] = (rate, gbps[name] * 1e9)
    gbps, _ = copies(True, True)
    m["both"] = (gbps["h2d"] * 1e9, gbps["d2h"] * 1e9)
    gbps, rate = copies(True, True, work=adam_rate)
    m["all"] = {"h2d": gbps["h2d"] * 1e9, "d2h": gbps["d2h"] * 1e9, "adam": rate}
    return m


def report(m: dict, spec) -> list[str]:
    """Lines: each case measured next to what the fitted spec's simulator model gives it."""
    cases = [("h2d alone", (True, False, False), {"h2d": m["h2d"]}),
             ("d2h alone", (False, True, False), {"d2h": m["d2h"]}),
             ("both ways", (True, True, False), dict(zip(("h2d", "d2h"), m["both"]))),
             ("AdamW alone", (False, False, True), {"adam": m["adam"]}),
             ("AdamW + h2d", (True, False, True), dict(zip(("adam", "h2d"), m["adam_h2d"]))),
             ("AdamW + d2h", (False, True, True), dict(zip(("adam", "d2h"), m["adam_d2h"]))),
             ("AdamW + both ways", (True, True, True), m["all"])]
    lines = []
    for name, running, got in cases:
        model = predict(spec, *running)
        parts = [f"{k} {v / 1e9:.1f} ({model[k] / 1e9:.1f})" for k, v in sorted(got.items())]
        lines.append(f"{name:18s} " + ", ".join(parts))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="h200", help="the preset whose other fields the spec file keeps")
    ap.add_argument("--numel", type=int, default=233_000_000, help="parameters per block (default: a 7B block)")
    ap.add_argument("--layers", type=int, default=2, help="blocks the AdamW passes over (pinned, 16 B a parameter)")
    ap.add_argument("--seconds", type=float, default=3.0, help="each case's length")
    ap.add_argument("--gib", type=float, default=2.0, help="each copy's size")
    ap.add_argument("--spec-out", metavar="FILE", help="write the fitted spec here (for --hardware FILE)")
    ap.add_argument("--json", help="the measured rates and the fitted fields")
    args = ap.parse_args()
    m = measure(args.numel, args.layers, args.seconds, args.gib)
    fields = fit(m)
    spec = spec_with(args.base, fields)
    print("measured GB/s for copies, G params/s for AdamW (the fitted spec's model in brackets):")
    print("\n".join(report(m, spec)).replace(" (", "  (").replace("adam ", "AdamW "))
    print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in fields.items()))
    if args.spec_out:
        write_spec(spec, args.spec_out)
        print(f"wrote {args.spec_out} ({args.base}'s other fields)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured": m, "fitted": fields, "base": args.base, "numel": args.numel,
                       "layers": args.layers, "seconds": args.seconds, "gib": args.gib}, f, indent=1)


if __name__ == "__main__":
    main()
