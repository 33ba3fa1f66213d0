"""``megatrain plan`` (a plan for a model shape, a config or a model directory, printed and drawn, nothing run) and
``megatrain viz`` (a schedule file drawn and simulated)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

GiB = 1 << 30


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


gpu_opt_every, saved_acts, resident_opt, grad_kept, seq_tile, host_checkpoints, split_opt, dropped_checkpoints = (
    _count_or_auto(n) for n in ("gpu_opt_every", "saved_acts", "resident_opt", "grad_kept", "seq_tile",
                                "host_checkpoints", "split_opt", "dropped_checkpoints"))


def speculate(value: str) -> int | str:
    """The argparse type of --speculate: auto, off (0) or a count of layers."""
    return 0 if value == "off" else _count_or_auto("speculate")(value)


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
    from megatrain.capture.packed_attention import attention_for
    from megatrain.inputs import model_source

    cfg = model_source(model_dir, 1024, 1024).config
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention_for(cfg))
    return capture(meta, compute_dtype=torch.bfloat16 if on_gpu else torch.float32).graph


def _read_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{what} {path} is not JSON ({e})") from None


def _n(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural where it is not one."""
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith(("ch", "s")) else "s")


def plan(args) -> int:
    from tqdm import tqdm

    from megatrain.planner import hardware
    from megatrain.planner.dump import PLOT_EXTRA, can_plot, plot, table
    from megatrain.planner.graph import full_recompute
    from megatrain.planner.request import PlanOptions
    from megatrain.planner.checks import NoFit
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
                           dropped_checkpoints=dropped_checkpoints(args.dropped_checkpoints),
                           gpu_opt_every=None if args.gpu_opt_every is None else gpu_opt_every(args.gpu_opt_every),
                           split_opt=None if args.split_opt is None else split_opt(args.split_opt),
                           saved_acts=saved_acts(args.saved_acts), resident_opt=resident_opt(args.resident_opt),
                           grad_kept=grad_kept(args.grad_kept), grad_host_dtype=args.grad_host_dtype,
                           seq_tile=auto(args.seq_tile),
                           speculate=None if args.speculate is None else speculate(args.speculate),
                           clip_rate=args.clip_rate, speculate_keeps=args.speculate_keeps)
        # what compile() plans on that device: the hardware spec of the CPU runtime, or a GPU's
        fixed = opts.search_kwargs(args.seq, on_gpu=spec.name != "cpu")
        budget = int(args.gpu_gib * GiB) if args.gpu_gib is not None else None
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        if Path(args.out).exists() and not Path(args.out).is_dir():  # (before the search, not after it)
            raise ValueError(f"--out {args.out} is a file, not a directory to write the plan's files in")
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

            search = functools.partial(plan, graph, spec, budget_bytes=budget, clip=not args.no_clip,
                                       n_steps=args.steps, workers=jobs, order=args.search,
                                       prune=args.search != "exhaustive")
            try:
                p = search(args.tokens, args.seq, progress=progress, **fixed)
            except NoFit as e:  # over the device budget: the longest sequence that plans (a search each)
                if not e.device:
                    raise
                bar.close()
                raise NoFit(f"{e}; {_longest(search, opts, args, spec.name != 'cpu', e.longest)}") from None
        searched_s = time.perf_counter() - t0
    except (PlanError, ValueError) as e:
        print(f"megatrain plan: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the PNG drawn in a process of its own (about a second for a 70B plan) while this one writes the rest
    with _drawing_pool() if can_plot() else contextlib.nullcontext() as pool:
        png = f"no plan.png ({PLOT_EXTRA})" if pool is None else pool.submit(
            plot, [p.timeline], out / "plan.png", budget_nbytes=p.schedule.config.budget_bytes,
            title=f"{graph.name} on {spec.name}: {args.tokens} tokens/step, seq {args.seq}")
        lines = _report(args, p, graph, spec, out, f"in {searched_s:.1f} s ({on})")
        if pool is not None:
            png = png.result()
    lines.append(f"wrote      {png}, {out / 'plan.trace.json'}, {out / 'schedule.txt'}, {out / 'schedule.json'}")
    print("\n".join(lines))
    if args.table:
        print(table(p.schedule, p.timeline))
    return 0


def _drawing_pool():
    """One worker process, forked where the platform can (it then starts at once, with this process's modules)."""
    import concurrent.futures
    import multiprocessing

    fork = "fork" in multiprocessing.get_all_start_methods()
    return concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork") if fork else None)


def _longest(search, opts, args, on_gpu: bool, below: int | None) -> str:
    """Where no plan fits ``args.seq``: the longest sequence that plans (as many sequences a step), in words, by
    bisection with ``search(tokens, seq, **options)`` (each probe a search of its own)."""
    from megatrain.planner.checks import PlanError
    from megatrain.planner.limits import longest_seq

    n_seqs = args.tokens // args.seq
    print(f"megatrain plan: no plan fits {args.seq:,}-token sequences; searching the longest that does",
          file=sys.stderr)

    def fits(seq: int) -> bool:
        try:
            search(n_seqs * seq, seq, **opts.search_kwargs(seq, on_gpu=on_gpu))
        except PlanError:
            print(f"  {seq:,} tokens: none fits", file=sys.stderr)
            return False
        print(f"  {seq:,} tokens: fits", file=sys.stderr)
        return True

    seq = longest_seq(fits, args.seq, None if below is None else below + 1)
    if not seq:
        return "no shorter sequence fits either"
    return f"the longest sequence that plans is {seq:,} tokens (--seq {seq} --tokens {n_seqs * seq})"


def _report(args, p, graph, spec, out: Path, searched: str) -> list[str]:
    """The plan's files but the PNG (trace, schedule as text and JSON) written, and its summary's lines
    (``searched``: the search's time, in words)."""
    from megatrain.planner.cost import device_memory, grad_placement, host_memory, speculation_redo_s
    from megatrain.planner.critical import critical_path
    from megatrain.planner.dump import write_trace
    from megatrain.planner.limits import largest_on_host

    s, tl, b, cfg = p.schedule, p.timeline, p.bound, p.schedule.config
    write_trace([tl], out / "plan.trace.json")
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
        f"checkpoints of {len(cfg.offloaded())} of {len(graph) - 2} layers on host"
        + (f" ({_n(cfg.dropped_checkpoints, 'checkpoint')} dropped, "
           + ("every other one" if cfg.drop_run() == 1 else f"in runs of up to {cfg.drop_run()} between kept ones")
           + ", and made again in the backward)" if cfg.dropped_checkpoints else "") + "; optimizer "
        f"{'after the step (exact global-norm clipping)' if cfg.clip else 'during backward (no clipping)'}"
        + (f", layers {list(cfg.gpu_opt)} updated on the GPU" if cfg.gpu_opt else "")
        + (f" ({'all' if len(cfg.resident_opt) == len(cfg.gpu_opt) else len(cfg.resident_opt)} keeping their "
           f"state there)" if cfg.resident_opt else "")
        + (f"; after the backward layers {list(cfg.split_opt)} updated on the GPU, their state streamed in parts of "
           f"{cfg.opt_part / 1e6:.1f}M" if cfg.split_opt else "")
        + (f"; {len(cfg.saved_acts)} layers keep their activations for the backward (no recompute"
           + ("; lean: the MLP's gate x up formed again there" if cfg.saved_lean else "") + ")"
           if cfg.saved_acts else "; every backward recomputes its forward")
        + (f"; the blocks' MLPs over {cfg.seq_tile}-token tiles" if cfg.seq_tile else "")
        + (f"; layers {list(cfg.speculate)} updated before the step's global norm, checked after it (a clipped "
           f"step makes them again: +{speculation_redo_s(graph, cfg, spec):.3f} s; "
           f"{'a spare block each for their new state' if cfg.speculate_keeps == 'state' else 'their masters kept'})"
           if cfg.speculate else "")
        + ("; every host update makes its moments in its pass (none left for after it)"
           if cfg.clip and not cfg.defer_moments else "")
        + (f"; {p.speculation_left}" if p.speculation_left else ""),
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
        + (f"values blocks hand on {mem.carry_nbytes / GiB:.2f}, " if mem.carry_nbytes else "")
        + f"working set {mem.workspace_nbytes / GiB:.2f}"
        + (f", cuBLAS workspaces {mem.gemm_nbytes / GiB:.2f}" if mem.gemm_nbytes else "")
        + (f", wire stage {mem.stage_nbytes / GiB:.2f}" if mem.stage_nbytes else "")
        + f", allocator rounding {mem.slack_nbytes / GiB:.2f})",
        f"gradients  {grads}",
        f"host       {sum(host.values()) / GiB:.1f} GiB needed ("
        + ", ".join(f"{k} {v / GiB:.1f}" for k, v in host.items())
        + f") of {spec.host_bytes / GiB:.0f} GiB less {spec.host_margin / GiB:.1f} left free: "
        f"{'fits' if sum(host.values()) <= spec.host_plan_bytes else 'DOES NOT FIT'}; "
        f"{sum(host.values()) / graph.n_params:.2f} bytes per parameter all in"
        + (f"; {p.margin_taken}" if p.margin_taken else ""),
        f"largest    {largest}",
        f"searched   {p.n_searched} of {_n(p.n_candidates, 'candidate plan')} ({args.search})"
        + (f" and {_n(len(p.tried) - p.n_searched, 'candidate')} with split updates" if len(p.tried) > p.n_searched
           else "") + f" {searched}",
    ]
    return lines


def viz(args) -> int:
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
