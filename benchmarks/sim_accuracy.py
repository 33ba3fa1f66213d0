"""The simulator against measured steps: rebuilds each measured run's schedule from a throughput.py JSON and prints
the measured step time, the simulated steady-state step time, the bound, and their ratios. Runs on the CPU.

    PYTHONPATH=. python benchmarks/sim_accuracy.py docs/results/2026-11-29-h200-throughput-*-1b317cd.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace

from megatrain.ir import Layer, ScheduleConfig
from megatrain.planner.graph import (PRESETS, LayerGraph, from_config, full_recompute, preset,
                                     preset_model_type)
from megatrain.planner.hardware import HardwareSpec, hardware
from megatrain.planner.passes import build_schedule
from megatrain.planner.simulate import bound, simulate


def rows(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        data = json.load(open(p))
        for r in data if isinstance(data, list) else [data]:
            if "error" not in r:
                out.append({**r, "source": p})
    return out


def graph_of(r: dict):
    """The layer graph the run simulated where it recorded it (``graph``, since throughput.py records it), else
    the planner's graph of the run's model: the preset's shape, its head separate from the embedding where the
    run's parameter count says so (the benchmarks' models since 46bbcfd), with the saved bytes per token the run
    measured (runs since saved activations record it), and each recomputing backward forming its whole forward again
    unless the run records that it skipped the projections nothing reads (``unread_skipped``, recorded since)."""
    if "graph" in r:
        known = {f.name for f in fields(Layer)}
        return LayerGraph([Layer(**{k: v for k, v in lay.items() if k in known}) for lay in r["graph"]],
                          name=r.get("preset") or "model")
    if not r.get("preset"):
        raise ValueError(f"{r['source']}: neither a recorded graph nor a preset to build one from")
    graph = preset(r["preset"])
    cut = r.get("layers", PRESETS[r["preset"]]["num_hidden_layers"])  # a model cut to its first blocks
    if graph.n_params != r["params"]:
        shape = {**PRESETS[r["preset"]], "num_hidden_layers": cut}
        if cut == PRESETS[r["preset"]]["num_hidden_layers"]:
            shape["tie_word_embeddings"] = False
        graph = from_config({"model_type": preset_model_type(r["preset"]), **shape}, name=r["preset"])
        if graph.n_params != r["params"]:
            raise ValueError(f"{r['source']}: {r['params']:,} parameters match neither form of {r['preset']}")
    if r.get("saved_bytes_per_token"):
        lean = r.get("lean_saved_bytes_per_token", r["saved_bytes_per_token"])  # recorded since lean plans exist
        graph = LayerGraph([replace(lay, saved_bytes_per_token=r["saved_bytes_per_token"],
                                    lean_saved_bytes_per_token=lean)
                            if lay.saved_bytes_per_token else lay for lay in graph.layers], name=graph.name)
    return graph if r.get("unread_skipped") else full_recompute(graph)


def steady_mean_s(r: dict) -> float:
    """The run's mean step. Runs timed in the steady state (``drained_step_s`` recorded, since 49a0551) but before
    throughput.py's cool-down step (no ``cooldown_steps``): the mean of the intervals between step ends without
    the last, which ended early with no next step beside its update pass (docs/benchmark-history.md, "The last
    timed step ended early"); otherwise the recorded mean."""
    gaps = r.get("step_times_between_ends_s") or []
    if "drained_step_s" in r and "cooldown_steps" not in r and len(gaps) >= 2:
        return sum(gaps[:-1]) / len(gaps[:-1])
    return r["step_s"]


def spec_of(r: dict, spec):
    """``spec``, or where it is None the spec the run's own simulation used (recorded as ``hardware_spec``)."""
    if spec is not None:
        return spec
    if "hardware_spec" not in r:
        raise ValueError(f"{r['source']}: no hardware spec recorded (runs before it: name one with --hardware)")
    known = {f.name for f in fields(HardwareSpec)}
    return HardwareSpec(**{k: v for k, v in r["hardware_spec"].items() if k in known})


def config_of(r: dict, graph: LayerGraph, spec, seq: int | None) -> ScheduleConfig:
    """The run's plan over 3 steps: its recorded config (``schedule_config``) where there is one, else one built
    from the fields the record has (``seq``: the sequence length of records without one; 1,024 if None)."""
    if "schedule_config" in r:
        return ScheduleConfig.from_dict({**r["schedule_config"], "n_steps": 3})
    seq = r.get("seq", seq or 1024)
    return ScheduleConfig(n_layers=len(graph), n_steps=3, n_mb=r["n_mb"], mb_tokens=r["tokens_per_step"] // r["n_mb"],
                         seq_len=seq, weight_slots=r["weight_slots"], grad_slots=2,
                         wire_bytes_per_param=r["wire_bytes_per_param"], host_checkpoints=r["host_checkpoints"],
                         clip=r["clip"], budget_bytes=spec.budget_bytes, gpu_opt=tuple(r["gpu_opt"]),
                         saved_acts=tuple(r.get("saved_acts", ())), saved_lean=r.get("saved_lean", False),
                         resident_opt=tuple(r.get("resident_opt") or ()), grad_kept=tuple(r.get("grad_kept") or ()),
                         grad_host_bytes=r.get("grad_host_bytes", 4), split_opt=tuple(r.get("split_opt") or ()),
                         opt_part=r.get("opt_part") or 0, seq_tile=r.get("seq_tile") or 0,
                         speculate=tuple(r.get("speculate") or ()), host_grad_part=r.get("host_grad_part") or 0,
                         host_grad_slots=r.get("host_grad_slots", 2))


def predict(r: dict, spec, seq: int | None = None) -> tuple[float, float, str]:
    graph, spec = graph_of(r), spec_of(r, spec)
    cfg = config_of(r, graph, spec, seq)
    s = build_schedule(graph, cfg)
    b = bound(s, graph, spec)
    return simulate(s, graph, spec).steady_step_s, b.step_s, b.limiter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="throughput.py --json files")
    ap.add_argument("--hardware", default="h200",
                    help="the spec to simulate with (a preset name), or 'recorded': each run's own (records since "
                         "throughput.py keeps it)")
    ap.add_argument("--json", help="also write each run's figures here (a list: source, measured, simulated, bound)")
    ap.add_argument("--seq", type=int, help="tokens per sequence of records that do not say (default 1,024)")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override spec fields")
    ap.add_argument("--unread-skipped", action="store_true",
                    help="model every recomputing backward without the products nothing reads where the record does "
                         "not say (the runs of the commit that brought the skip, recorded before the field)")
    ap.add_argument("--measured", choices=["mean", "median"], default="mean",
                    help="the measured step: wall time per timed step (mean; for steady-state runs before the "
                         "cool-down step, without the last interval) or the median period between step ends "
                         "(throughput.py's two step times)")
    args = ap.parse_args()
    spec = None if args.hardware == "recorded" else hardware(args.hardware)
    override = {k: float(v) for k, v in (kv.split("=") for kv in args.set)}
    print(f"{'model':14s} {'mb':>3s} {'slots':>5s} {'clip':>5s} {'dev':>4s} {'sync':>5s} {'measured':>9s} {'sim':>7s} "
          f"{'sim/meas':>8s} {'bound':>7s} {'meas/bound':>10s} limiter   ({args.measured} step)")
    errs, ratios, out = [], [], []
    for r in rows(args.results):
        if args.unread_skipped:
            r = {"unread_skipped": True, **r}  # (what a record says wins)
        sim, b, limiter = predict(r, replace(spec_of(r, spec), **override), args.seq)
        meas = steady_mean_s(r) if args.measured == "mean" else r.get("median_step_s", r["step_s"])
        out.append({"source": r["source"], "measured_s": meas, "simulated_s": sim, "bound_s": b, "limiter": limiter})
        errs.append(abs(sim / meas - 1))
        ratios.append(meas / b)
        sync = {True: "yes", False: "no"}.get(r.get("sync_between_steps"), "yes")  # older runs: a sync
        print(f"{r.get('preset') or 'config':14s} {r['n_mb']:3d} {r['weight_slots']:5d} {str(r['clip']):>5s} "
              f"{len(r['gpu_opt']):4d} {sync:>5s} {meas:9.3f} {sim:7.3f} {sim / meas:8.2f} {b:7.3f} {meas / b:10.2f} "
              f"{limiter}")
    within = sum(e <= 0.15 for e in errs)
    bounded = sum(m <= 1.2 for m in ratios)
    print(f"{within} of {len(errs)} within 15%; mean |sim/measured - 1| = {sum(errs) / len(errs):.2f}; "
          f"{bounded} of {len(ratios)} within 1.2x of the bound")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
