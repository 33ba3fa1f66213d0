"""Command line: ``megatrain train``, ``megatrain plan``, ``megatrain export`` and ``megatrain viz``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatrain.rundir import stop_at_once

GiB = 1 << 30


def _model(args):
    from megatrain.planner.graph import from_config, preset

    if args.config:
        p = Path(args.config)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ValueError(f"model config {p} does not exist")
        cfg = _read_json(p, "model config")
        if not isinstance(cfg, dict):
            raise ValueError(f"model config {p}: expected an object of fields, got a {type(cfg).__name__}")
        # a checkpoint directory's config.json: the directory's name; another file: its own
        return from_config(cfg, name=(p.parent.name if p.name == "config.json" else p.stem) or p.stem)
    return preset(args.preset)


def _captured_graph(model_dir: str, on_gpu: bool):
    """The layer graph ``compile()`` plans for the model of an HF directory (its config captured on the meta
    device, in the compute dtype of that device): the same graph, so the same plan, as a run of it."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatrain.capture import capture
    from megatrain.inputs import model_source

    cfg = model_source(model_dir, 1024, 1024).config
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return capture(meta, compute_dtype=torch.bfloat16 if on_gpu else torch.float32).graph


def _read_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{what} {path} is not JSON ({e})") from None


def _n(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural where it is not one."""
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith(("ch", "s")) else "s")


def _plan(args) -> int:
    from tqdm import tqdm

    from megatrain.planner import hardware
    from megatrain.planner.cost import device_memory, grad_placement, host_memory
    from megatrain.planner.critical import critical_path
    from megatrain.planner.dump import PLOT_EXTRA, can_plot, plot, table, write_trace
    from megatrain.planner.graph import full_recompute
    from megatrain.planner.request import PlanOptions
    from megatrain.planner.limits import largest_on_host
    from megatrain.planner.search import PlanError, plan

    try:
        spec = hardware(args.hardware)
        graph = _captured_graph(args.model, spec.name != "cpu") if args.model else _model(args)
        if args.full_recompute:
            graph = full_recompute(graph)
        for flag in ("host_gib", "gpu_gib"):
            v = getattr(args, flag)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of GiB > 0, got {v}")
        if args.host_gib is not None:
            spec = dataclasses.replace(spec, host_bytes=int(args.host_gib * GiB))
        if args.one_pass_updates:
            spec = dataclasses.replace(spec, cpu_adam_master_params_per_s=0.0)
        auto = lambda v: "auto" if v is None else v  # noqa: E731 - a flag not given: the search's
        opts = PlanOptions(n_mb=auto(args.mb), weight_slots=auto(args.slots), wire=auto(args.wire),
                           host_checkpoints=auto(args.host_checkpoints),
                           gpu_opt_every=None if args.gpu_opt_every is None else gpu_opt_every(args.gpu_opt_every),
                           split_opt=None if args.split_opt is None else split_opt(args.split_opt),
                           saved_acts=saved_acts(args.saved_acts), resident_opt=resident_opt(args.resident_opt),
                           grad_kept=grad_kept(args.grad_kept), grad_host_dtype=args.grad_host_dtype,
                           seq_tile=auto(args.seq_tile))
        # what compile() plans on that device: the hardware spec of the CPU runtime, or a GPU's
        fixed = opts.search_kwargs(args.seq, on_gpu=spec.name != "cpu")
        budget = int(args.gpu_gib * GiB) if args.gpu_gib is not None else None
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        jobs = args.jobs or os.cpu_count() or 1
        on = _n(jobs, "process")
        t0 = time.perf_counter()
        with tqdm(desc="megatrain plan: searching", unit=" plans", file=sys.stderr, disable=None,
                  leave=False) as bar:
            def progress(done: int, total: int) -> None:
                if bar.disable and bar.total is None:  # no terminal: one line instead of a bar
                    print(f"megatrain plan: searching {_n(total, 'candidate plan')} on {on}", file=sys.stderr)
                bar.total = total
                bar.update(done - bar.n)

            p = plan(graph, spec, args.tokens, args.seq, budget_bytes=budget, clip=not args.no_clip,
                     n_steps=args.steps, workers=jobs, progress=progress, **fixed)
        searched_s = time.perf_counter() - t0
    except (PlanError, ValueError) as e:
        print(f"megatrain plan: {e}", file=sys.stderr)
        return 2
    s, tl, b, cfg = p.schedule, p.timeline, p.bound, p.schedule.config
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot([tl], out / "plan.png", title=f"{graph.name} on {spec.name}: {args.tokens} tokens/step, seq {args.seq}",
               budget_nbytes=cfg.budget_bytes) if can_plot() else f"no plan.png ({PLOT_EXTRA})"
    trace = write_trace([tl], out / "plan.trace.json")
    (out / "schedule.txt").write_text(s.to_text())
    (out / "schedule.json").write_text(s.to_json())
    mem = device_memory(graph, s)
    host = host_memory(graph, s)
    grads = grad_placement(graph, s)
    largest = largest_on_host(graph, s, spec.host_plan_bytes)
    steady = tl.steady_step_s
    flops_6nt = 6 * graph.active_params * args.tokens
    lines = [
        f"model      {graph.name}: {len(graph)} layers, {graph.n_params / 1e9:.3f}B params"
        + (f" ({graph.active_params / 1e9:.3f}B active per token: the N of 6NT)" if graph.is_moe else ""),
        f"hardware   {spec.name}: {spec.gpu_bytes / GiB:.0f} GiB device, budget {cfg.budget_bytes / GiB:.1f} GiB, "
        f"host {spec.host_bytes / GiB:.0f} GiB",
        f"batch      {args.tokens} tokens/step = {_n(cfg.n_mb, 'micro-batch')} x {cfg.mb_tokens} tokens "
        f"(seq {args.seq})",
        f"plan       {cfg.weight_slots} weight slots, {mem.slot_count['g']} gradient slots, "
        f"{mem.slot_count['a']} activation slots; weights on the wire as "
        f"{'bf16 (host shadow)' if cfg.wire_bytes_per_param == 2 else 'fp32 (cast on the GPU)'}; "
        f"checkpoints of {cfg.host_checkpoints} of {len(graph) - 2} layers on host; optimizer "
        f"{'after the step (exact global-norm clipping)' if cfg.clip else 'during backward (no clipping)'}"
        + (f", layers {list(cfg.gpu_opt)} updated on the GPU" if cfg.gpu_opt else "")
        + (f" ({'all' if len(cfg.resident_opt) == len(cfg.gpu_opt) else len(cfg.resident_opt)} keeping their "
           f"state there)" if cfg.resident_opt else "")
        + (f"; after the backward layers {list(cfg.split_opt)} updated on the GPU, their state streamed in parts of "
           f"{cfg.opt_part / 1e6:.1f}M" if cfg.split_opt else "")
        + (f"; {len(cfg.saved_acts)} layers keep their activations for the backward (no recompute"
           + ("; lean: the MLP's gate x up formed again there" if cfg.saved_lean else "") + ")"
           if cfg.saved_acts else "; every backward recomputes its forward")
        + (f"; the blocks' MLPs over {cfg.seq_tile}-token tiles" if cfg.seq_tile else ""),
        f"predicted  {steady:.3f} s/step steady ({args.tokens / steady:,.0f} tokens/s, "
        f"{flops_6nt / steady / 1e12:.0f} TFLOPS 6NT); {tl.makespan_s:.3f} s for {cfg.n_steps} steps",
        f"bound      {b.step_s:.3f} s/step ({b.limiter}-bound; per step: "
        + ", ".join(f"{r} {v:.3f}" for r, v in b.per_step_busy_s.items())
        + f"); critical path {b.critical_path_s:.3f} s for {cfg.n_steps} steps",
        f"efficiency bound / predicted = {b.step_s / steady:.2f}",
        f"critical   {critical_path(s, graph, spec).text()}, over {cfg.n_steps} steps: the chain of dependencies "
        f"and stream order that bounds them",
        f"device     peak {tl.peak_nbytes / GiB:.2f} GiB in use, {mem.total_nbytes / GiB:.2f} GiB reserved "
        f"(weights {mem.pool_nbytes['w'] / GiB:.2f}, gradients {mem.pool_nbytes['g'] / GiB:.2f}, "
        f"activations {mem.pool_nbytes['a'] / GiB:.2f}, "
        + (f"optimizer {mem.pool_nbytes['o'] / GiB:.2f}, " if mem.pool_nbytes['o'] else "")
        + (f"kept gradients {mem.pool_nbytes['k'] / GiB:.2f}, " if mem.pool_nbytes['k'] else "")
        + (f"updated weights kept {mem.kept_nbytes / GiB:.2f}, " if mem.kept_nbytes else "")
        + (f"saved activations {mem.saved_nbytes / GiB:.2f}, " if mem.saved_nbytes else "")
        + f"working set {mem.workspace_nbytes / GiB:.2f}"
        + (f", cuBLAS workspaces {mem.gemm_nbytes / GiB:.2f}" if mem.gemm_nbytes else "")
        + f", allocator rounding {mem.slack_nbytes / GiB:.2f})",
        f"gradients  {grads}",
        f"host       {sum(host.values()) / GiB:.1f} GiB needed ("
        + ", ".join(f"{k} {v / GiB:.1f}" for k, v in host.items())
        + f") of {spec.host_bytes / GiB:.0f} GiB less {spec.host_margin / GiB:.1f} left free: "
        f"{'fits' if sum(host.values()) <= spec.host_plan_bytes else 'DOES NOT FIT'}; "
        f"{sum(host.values()) / graph.n_params:.2f} bytes per parameter all in"
        + (f"; {p.margin_taken}" if p.margin_taken else ""),
        f"largest    {largest}",
        f"searched   {_n(len(p.tried), 'candidate plan')} in {searched_s:.1f} s ({on})",
        f"wrote      {png}, {trace}, {out / 'schedule.txt'}, {out / 'schedule.json'}",
    ]
    print("\n".join(lines))
    if args.table:
        print(table(s, tl))
    return 0


def _launch(args, cfg) -> int | None:
    """``--gpus N`` (N > 1) outside torchrun: the same command under torchrun with N processes (``cfg`` checked
    for them first), its exit status; None where this process is to train itself."""
    from megatrain.train import check_ranks

    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    if not args.gpus or args.gpus == 1 or "WORLD_SIZE" in os.environ:
        return None
    cfg.check()
    check_ranks(cfg, args.gpus)
    rest, skip = [], False
    for a in args.argv:  # the command without --gpus
        if skip or a == "--gpus" or a.startswith("--gpus="):
            skip = a == "--gpus"
            continue
        rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
           "-m", "megatrain", *rest]
    print(f"megatrain train: {args.gpus} data-parallel processes: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.call(cmd)


def _train(args) -> int:
    from megatrain.data import DataError
    from megatrain.resume import resume_config
    from megatrain.train import run
    from megatrain.train_config import TrainConfig, load_yaml

    try:
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if f.name != "resume" and getattr(args, f.name, None) is not None}
        if args.no_clip:
            given["clip"] = None
        if args.resume:
            if args.config:
                raise ValueError("--resume goes on with the run's own config; --config cannot change it")
            cfg = resume_config(args.resume, **given)
        else:
            cfg = TrainConfig(**{**(load_yaml(args.config) if args.config else {}), **given})
        launched = _launch(args, cfg)
        if launched is not None:
            return launched
        summary = run(cfg)
    except (ValueError, DataError, OSError) as e:  # OSError: a file that cannot be read or written (disk full)
        print(f"megatrain train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once; the last training state saved stays whole
        print("megatrain train: interrupted; the last training state saved (if any) is whole", file=sys.stderr)
        return 130
    return summary.get("exit_code", 0)


def _export(args) -> int:
    from megatrain.data import DataError
    from megatrain.saving import export_run

    try:
        files = export_run(args.run, args.out, args.dtype, args.trust_remote_code)
    except (ValueError, DataError, OSError) as e:
        print(f"megatrain export: {e}", file=sys.stderr)
        return 2
    print(f"megatrain export: {args.out}/ ({len(files)} weight file{'s' if len(files) > 1 else ''}, config, "
          f"tokenizer, generation config)")
    return 0


def _viz(args) -> int:
    from megatrain.ir import IRError, Schedule
    from megatrain.planner import hardware
    from megatrain.planner.dump import PLOT_EXTRA, can_plot, plot, write_trace
    from megatrain.planner.simulate import Timeline, simulate

    if not can_plot():
        print(f"megatrain viz: {PLOT_EXTRA}", file=sys.stderr)
        return 2
    try:
        timelines = []
        if args.schedule:
            try:
                schedule = Schedule.from_text(Path(args.schedule).read_text())
            except IRError as e:
                raise ValueError(f"{args.schedule}: {e}") from None
            graph = _model(args)
            if len(graph) != schedule.config.n_layers:
                raise ValueError(f"the schedule has {schedule.config.n_layers} layers, the model {len(graph)}")
            timelines.append(simulate(schedule, graph, hardware(args.hardware)))
        for path in args.timeline:
            try:
                timelines.append(Timeline.from_json(Path(path).read_text()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}: not a timeline this megatrain reads ({type(e).__name__}: {e})") from None
        if not timelines:
            raise ValueError("nothing to draw: pass --schedule (simulated) and/or --timeline files (measured)")
    except (OSError, ValueError, IRError) as e:
        print(f"megatrain viz: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = write_trace(timelines, out / "timelines.trace.json")
    png = plot(timelines, out / "timelines.png", title=" vs ".join(t.source for t in timelines))
    for t in timelines:
        busy = ", ".join(f"{k} {v:.3f}" for k, v in t.busy_s().items())
        print(f"{t.source:10s} {t.makespan_s:.3f} s for {t.n_steps} step(s); busy: {busy}")
    print(f"wrote {png}, {trace}")
    return 0


def _count_or_auto(name: str):
    """The argparse type of the integer-or-'auto' option ``name`` (its range is checked where it is used)."""
    def parse(value: str) -> int | str:
        if value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer >= 0 or 'auto', got {value!r}") from None

    parse.__name__ = name  # argparse names the option's type in its error message
    return parse


gpu_opt_every, saved_acts, resident_opt, grad_kept, seq_tile, host_checkpoints, split_opt = (
    _count_or_auto(n) for n in ("gpu_opt_every", "saved_acts", "resident_opt", "grad_kept", "seq_tile",
                                "host_checkpoints", "split_opt"))


def _slots(value: str):
    if value == "all":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"weight slots must be an integer >= 1 or 'all', got {value!r}")
    return n


def main(argv: list[str] | None = None) -> int:
    """The ``megatrain`` command; SIGINT or SIGTERM from its first moment stop it in one line (a run takes them
    over once it trains, to finish the step in flight and save)."""
    import threading

    before = {}
    if threading.current_thread() is threading.main_thread():
        before = {s: signal.signal(s, stop_at_once) for s in (signal.SIGINT, signal.SIGTERM)}
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _main(argv: list[str]) -> int:
    from megatrain.data.formats import FORMATS

    ap = argparse.ArgumentParser(prog="megatrain", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model streamed from host memory (default: a tiny Llama, offline)")
    t.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    t.add_argument("--model", help="tiny-llama (default), a preset such as qwen2.5-0.5b, or an HF model directory")
    t.add_argument("--data", help="a file or directory (json, jsonl, parquet, arrow, csv, txt) or a dataset in the "
                                  "local HF cache; default: Python's own documentation")
    for name, typ, hlp in [("steps", int, "optimizer steps (300)"), ("batch", int, "sequences per step (16)"),
                           ("seq", int, "tokens per sequence (128)"), ("lr", float, "peak learning rate (3e-3)"),
                           ("warmup", int, "warmup steps (a tenth of the steps, at most 30)"),
                           ("schedule", str, "learning rate after warmup: cosine_with_min_lr (default), cosine, "
                                             "linear, constant or warmup_stable_decay, as transformers names them"),
                           ("min_lr", float, "where cosine_with_min_lr (default lr / 10) and warmup_stable_decay "
                                             "(default 0) end"),
                           ("decay_steps", int, "warmup_stable_decay: the last N steps decay (default a tenth of "
                                                "those after warmup)"),
                           ("betas", str, "Adam's beta1,beta2 (0.9,0.95)"),
                           ("weight_decay", float, "AdamW weight decay (0.1), not on biases and norm weights (the "
                                                   "HF Trainer's rule) unless --decay-all"),
                           ("freeze", str, "parameters not to train, by name patterns separated by commas, e.g. "
                                           "'model.embed_tokens.*,model.layers.[0-3].*'"),
                           ("clip", float, "global-norm clipping threshold (1.0)"),
                           ("mb", int, "micro-batches per step (2)"),
                           ("slots", _slots, "weight slots (2; all: one per layer)"),
                           ("host_checkpoints", host_checkpoints, "layers whose checkpoints wait on the host ("
                                                                  "auto: the planner's choice of none or all on a "
                                                                  "GPU, none on the CPU)"),
                           ("gpu_opt_every", gpu_opt_every, "update every k-th layer on the GPU, not the host (0: none; "
                                                     "auto: the planner's choice; default auto on a GPU, 0 on "
                                                     "the CPU)"),
                           ("split_opt", split_opt, "layers updated on the host that are updated on the GPU instead "
                                                 "after the backward, state streamed in parts (0: none; auto: the "
                                                 "planner's choice; default auto on a GPU, 0 on the CPU)"),
                           ("wire", str, "weights on the wire: fp32 (default) or bf16 (host shadow, bf16 compute)"),
                           ("saved_acts", saved_acts, "layers (the last ones) whose backward reuses the forward's "
                                                  "activations instead of recomputing them (auto: as many as fit)"),
                           ("resident_opt", resident_opt, "GPU-updated layers (the first ones) whose master weights "
                                                       "and moments stay on the GPU between steps (auto: the "
                                                       "planner's choice)"),
                           ("grad_kept", grad_kept, "host-updated layers (the first ones) whose gradient stays on "
                                                 "the GPU until the update pass (auto: as many as fit)"),
                           ("grad_host_dtype", str, "gradients on the host: fp32 (default), or bf16 allowed where "
                                                    "no plan with fp32 ones fits the host memory"),
                           ("seq_tile", seq_tile, "tokens per tile the blocks' MLPs run over in long sequences (0: "
                                                  "untiled; auto: the planner's choice)"),
                           ("host_gib", float, "host memory the plan may use, GiB (default: what the machine has "
                                               "available)"),
                           ("gpu_gib", float, "device memory the plan may fill, GiB, torch's allocator capped to it plus "
                                              "the spec's reserve: a smaller card's plan (default: the card's, less the "
                                              "reserve)"),
                           ("vocab", int, "BPE vocabulary when the model brings no tokenizer (1024)"),
                           ("seed", int, "seed for initialization and batches (0)"),
                           ("save_every", int, "also save the training state (weights, Adam moments, step, data "
                                               "order; in <out>/state, replaced each time) every N steps (0: at "
                                               "the end only)"),
                           ("resume", str, "an earlier run's directory: go on from the training state it saved, "
                                           "with its config (all but --model, --data, --batch, --seq, --vocab "
                                           "and --seed may change, e.g. --steps or --lr); writes a new run "
                                           "directory")]:
        t.add_argument(f"--{name.replace('_', '-')}", dest=name, type=typ, help=hlp)
    t.add_argument("--no-clip", action="store_true", help="no gradient clipping")
    t.add_argument("--decay-all", dest="decay_all", action="store_true", default=None,
                   help="weight decay on every parameter, biases and norm weights too")
    t.add_argument("--format", choices=FORMATS,
                   help="the data's format (default: from the first record's fields)")
    t.add_argument("--columns", help="the format's fields under other names, e.g. text=body,messages=conversation")
    t.add_argument("--streaming", dest="streaming", action="store_true", default=None,
                   help="read --data as training goes, never whole (a corpus larger than memory): rows shuffled "
                        "through a buffer, epochs in the stream's order; held-out data with --eval-data")
    t.add_argument("--no-packing", dest="packing", action="store_false", default=None,
                   help="one document per row, padded (default: documents packed into rows, each attending to "
                        "itself alone)")
    t.add_argument("--eval-data", dest="eval_data", help="held-out data (as --data) to report the loss on")
    t.add_argument("--eval-split", dest="eval_split", type=float,
                   help="or hold out this share of the data's documents (e.g. 0.01)")
    t.add_argument("--eval-every", dest="eval_every", type=int,
                   help="the held-out loss every N steps (default: at the end only)")
    t.add_argument("--export-dtype", choices=["bf16", "fp32", "fp16"],
                   help="dtype of the exported weights (default: the model's own)")
    t.add_argument("--on-nonfinite", dest="on_nonfinite", choices=["stop", "skip"],
                   help="a step whose loss or gradient norm is not finite applies no update; then stop (default) "
                        "or skip to the next batch (stopping after 10 in a row)")
    t.add_argument("--gpus", type=int, metavar="N",
                   help="data parallel over N processes (torchrun launched for them; on the CPU, N processes over "
                        "gloo): each trains batch / N sequences in mb / N micro-batches, the gradients summed across "
                        "them; the same as one process training the whole batch")
    t.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true", default=None,
                   help="run the Python files a model directory's config.json names (auto_map); off by default")
    t.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write the metrics as TensorBoard events in <out>/tensorboard (pip install "
                        "'megatrain[tensorboard]')")
    t.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    t.add_argument("--out", help="output directory (default: megatrain-runs/<UTC time>); must be new or empty")
    t.set_defaults(fn=_train)
    p = sub.add_parser("plan", help="plan a training step: schedule, predicted time, bound, memory, pictures")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="qwen2.5-7b", help="model shape preset (default qwen2.5-7b)")
    src.add_argument("--config", help="HF config.json or a directory holding one (its shape read by the planner)")
    src.add_argument("--model", help="an HF model directory, captured as megatrain train and compile() capture it: "
                                     "the plan they would make for the same options")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per optimizer step")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--hardware", default="h200", help="hardware preset (h200, h100, cpu) or a JSON spec file")
    p.add_argument("--gpu-gib", "--budget-gib", dest="gpu_gib", type=float,
                   help="device memory the plan may fill (default: the card's less reserve)")
    p.add_argument("--host-gib", type=float, help="host memory the plan may use (default: the hardware spec's)")
    p.add_argument("--one-pass-updates", action="store_true",
                   help="model every host update as one pass over master and moments (the streaming executor with "
                        "defer_moments off, or without megatrain's host kernel); default: with clipping, updates "
                        "whose gradient has its own host buffer write the masters alone in the update pass")
    p.add_argument("--full-recompute", action="store_true",
                   help="model every recomputing backward as the whole forward again; default: a Llama/Qwen-style "
                        "block's recompute leaves out its MLP's down projection, whose product nothing reads")
    p.add_argument("--mb", type=int, help="fix the number of micro-batches")
    p.add_argument("--slots", type=_slots, help="fix the number of weight slots (all: one per layer)")
    p.add_argument("--wire", choices=["bf16", "fp32"], help="fix the weights' dtype on the wire")
    p.add_argument("--host-checkpoints", type=int, help="fix how many layers' checkpoints go to host")
    p.add_argument("--seq-tile", type=int, metavar="TOKENS",  # plan: unset means searched
                   help="fix the tokens per tile the blocks' MLPs run over (0: untiled; default: search, for "
                        "micro-batches longer than a tile)")
    p.add_argument("--no-clip", action="store_true", help="no global-norm clipping: optimizer overlaps backward")
    p.add_argument("--gpu-opt-every", metavar="K|auto",
                   help="update every K-th layer (of those owning weights) on the GPU instead of the host; 0: all "
                        "on the host; auto: search every 4th, 3rd and 2nd layer (each with and without the first), "
                        "every layer and the first 2, 4, 6, ...; default: auto, or 0 for --hardware cpu (what "
                        "compile() does on that device)")
    p.add_argument("--split-opt", metavar="N|auto",
                   help="of the layers updated on the host, N (spread evenly) updated on the GPU instead after the "
                        "backward, their master weights and moments streamed over PCIe in parts (with clipping); "
                        "auto: search a quarter to three quarters of them, then one more or fewer around the "
                        "fastest while that is faster; default: auto, or 0 for --hardware cpu")
    p.add_argument("--saved-acts", default="auto", metavar="N|auto",
                   help="layers (the last N blocks) whose forward keeps its activations on the GPU so that their "
                        "backward does not recompute it; auto (default): as many as the memory the plan leaves "
                        "free holds")
    p.add_argument("--resident-opt", default="auto", metavar="N|auto",
                   help="of the layers updated on the GPU, how many (the first ones) keep their master weights and "
                        "moments there between steps (no trip over the bus); auto (default): all of them with "
                        "clipping (no device memory more), without it none, half or all, whichever the simulation "
                        "finds fastest")
    p.add_argument("--grad-kept", default="auto", metavar="N|auto",
                   help="layers updated on the host whose gradient stays on the GPU until the update pass (the first "
                        "N that can; auto: as many as the device memory holds, before saved activations): host "
                        "memory for gradients only as they pass through")
    p.add_argument("--grad-host-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="gradients on the host in fp32 (default), or allow bf16 where no plan with fp32 fits")
    p.add_argument("--steps", type=int, default=3, help="steps to simulate (default 3)")
    p.add_argument("--jobs", type=int, help="processes the search runs on (default: one per CPU core)")
    p.add_argument("--out", default="megatrain-plan", help="directory for the PNG, trace and schedule dumps")
    p.add_argument("--table", action="store_true", help="print every op with its simulated times")
    p.set_defaults(fn=_plan)
    e = sub.add_parser("export", help="a run's training state as an HF model directory (from_pretrained)")
    e.add_argument("run", help="a run directory of megatrain train (or its state directory)")
    e.add_argument("out", help="the model directory to write (new or empty)")
    e.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="dtype of the weights (default: the run's)")
    e.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                   help="run the Python files the model's config names (auto_map); never taken from the run")
    e.set_defaults(fn=_export)
    v = sub.add_parser("viz", help="draw simulated and measured timelines on one picture and one Chrome trace")
    v.add_argument("--schedule", help="schedule text to simulate (with --preset/--config and --hardware)")
    vsrc = v.add_mutually_exclusive_group()
    vsrc.add_argument("--preset", default="qwen2.5-7b", help="model shape preset for the simulation")
    vsrc.add_argument("--config", help="HF config.json for the simulation")
    v.add_argument("--hardware", default="h200", help="hardware preset or JSON spec for the simulation")
    v.add_argument("--timeline", nargs="*", default=[], help="measured timeline JSON files (benchmarks write them)")
    v.add_argument("--out", default="megatrain-viz", help="output directory")
    v.set_defaults(fn=_viz)
    args = ap.parse_args(argv)
    args.argv = argv
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
