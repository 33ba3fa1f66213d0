"""What a run of ``megatrain train`` says of itself: the header's plan and host memory, the learning-rate schedule,
frozen parameters, and per step the figures besides the loss (model FLOPs utilization, peak memory; the trackers)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from megatrain.train_config import TrainConfig


class Meter:
    """Per-step figures besides the loss: on a GPU, model FLOPs utilization against the planner's hardware spec
    (its measured matmul rate; the cpu spec's rate is a placeholder, not a measurement, so there is none on the CPU)
    and the GPU's peak allocation in the step; host memory resident; and the experiment trackers of --report-to
    (the lead process's alone)."""

    def __init__(self, sm, cfg: TrainConfig, out: Path, report: bool = True):
        self.sm = sm
        self.tokens_per_step = cfg.batch * cfg.seq
        self.flops = sm.graph.train_flops(self.tokens_per_step, cfg.seq)
        self.rate = sm.hardware.matmul_flops_per_s
        self.cuda = sm.device.type == "cuda"
        self.host_peak = self.gpu_peak = 0.0
        import dataclasses

        from megatrain.trackers import Trackers

        self.trackers = Trackers(cfg.trackers() if report else (), out, dataclasses.asdict(cfg))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(sm.device)

    def step(self, seconds: float) -> dict:
        from megatrain.runtime.memory.store import host_rss_bytes

        rec = {"mfu": self.flops / seconds / self.rate if seconds > 0 else 0.0} if self.cuda else {}
        rss = host_rss_bytes()
        if rss is not None:
            rec["host_rss_gib"] = rss / 2**30
            self.host_peak = max(self.host_peak, rec["host_rss_gib"])
        if self.cuda:
            rec["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.sm.device) / 2**30
            self.gpu_peak = max(self.gpu_peak, rec["gpu_peak_gib"])
            torch.cuda.reset_peak_memory_stats(self.sm.device)
        return rec

    def write(self, rec: dict) -> None:
        self.trackers.log(rec)

    def summary(self, tokens_per_s: float) -> dict:
        out = {"host_rss_peak_gib": self.host_peak}
        if self.cuda:
            out.update(mfu=tokens_per_s / self.tokens_per_step * self.flops / self.rate,
                       mfu_against_flops_per_s=self.rate, gpu_peak_gib=self.gpu_peak)
        return out

    def postfix(self, rec: dict) -> dict:
        return {"mfu": f"{rec['mfu']:.1%}", "gpu": f"{rec['gpu_peak_gib']:.1f}G"} if "mfu" in rec else {}

    def close(self, summary: dict | None = None) -> None:
        self.trackers.finish(summary)


def header(cfg: TrainConfig, sm, schedule, weights: str, tokenizer: str, data: str, saves: str, out: Path) -> str:
    """The run's first line: the model and where its weights and tokenizer come from, the data, the steps and the
    learning rate, the plan, the host memory it counts, what the run saves and where it writes."""
    c, left = schedule.config, sm.run_plan(schedule).speculation_left
    return (f"megatrain train: {cfg.model} ({sm.graph.n_params / 1e6:.2f}M params, {len(sm.graph)} layers) on "
            f"{sm.device}, {weights}, {tokenizer}; {data}; {cfg.steps} steps"
            f"{f' ({cfg.epochs:g} epochs)' if cfg.epochs is not None else ''} x {cfg.batch} x {cfg.seq} tokens, "
            f"{cfg.mb} micro-batches, {schedule_text(cfg)}" + (f", {frozen_text(sm)}" if sm.captured.frozen else "")
            + f"; plan{f' for the {sm.hardware.name} spec' if cfg.hardware else ''}: {c.weight_slots} weight slots, {len(c.gpu_opt)} layers updated on the device "
            f"({len(c.resident_opt)} keeping their state there), {len(c.grad_kept)} keeping their gradients there "
            f"until the update, {len(c.saved_acts)} keeping their activations"
            + (f", {c.dropped_checkpoints} checkpoints dropped and made again in the backward" if c.dropped_checkpoints
               else "") + (f", {len(c.speculate)} updated on the host before the step's global norm" if c.speculate
                           else "")
            + (f"; {left}" if left else "")
            + f" ({planned_text(sm, schedule, cfg)}); "
            f"host {host_text(sm, schedule)}; " + (f"{saves}; " if saves else "")
            + (f"resuming {cfg.resume} at step {sm.step}; " if cfg.resume else "") + f"writing {out}/")


def planned_text(sm, schedule, cfg) -> str:
    """Where the plan came from and how long that took."""
    if sm.run_plan(schedule).from_cache:
        return f"the plan {cfg.resume} took, not searched again ({sm.planned_s:.1f} s)"
    return f"searched in {sm.planned_s:.1f} s"


def host_planned(sm, schedule) -> int:
    """The host bytes the plan counts for the whole run (the store, its buffers, the process, the stages)."""
    from megatrain.planner.cost import host_memory

    return sum(host_memory(sm.graph_for(schedule), schedule).values())


def device_planned(sm, schedule) -> int:
    """The device bytes the plan reserves (slots, kept weights, saved activations, workspaces)."""
    from megatrain.planner.cost import device_memory

    return device_memory(sm.graph_for(schedule), schedule).total_nbytes


def host_text(sm, schedule) -> str:
    from megatrain.planner.cost import host_memory

    host = host_memory(sm.graph_for(schedule), schedule)
    # the process's own (libraries, Python) and its reads and writes of weights, whatever the model's size
    process = host.pop("process", 0) + host.pop("stages", 0)
    model = sum(host.values())
    spec = sm.hardware
    taken = sm.run_plan(schedule).margin_taken
    where = "this machine has available" if sm.measure_host else "the hardware spec gives"
    return (f"{(model + process) / 2**30:.2f} GiB ({model / sm.graph.n_params:.1f} bytes per parameter, and "
            f"{process / 2**30:.1f} GiB for the process itself and its reads and writes) of the "
            f"{spec.host_bytes / 2**30:.2f} GiB {where}"
            + (f", {spec.host_margin / 2**30:.2f} GiB of it left free" if spec.host_margin else "")
            + (f" ({taken})" if taken else ""))


def schedule_text(cfg: TrainConfig) -> str:
    o = cfg.optim_config()
    end = f" to {o.min_lr:g}" if o.schedule_name in ("cosine_with_min_lr", "warmup_stable_decay") else ""
    start = (" from 0" if o.warmup_start == "zero" else f" from {o.lr / o.warmup_steps:g}") if o.warmup_steps else ""
    return f"lr {o.lr:g} ({o.warmup_steps} warmup steps{start}, then {o.schedule_name}{end})"


def frozen_text(sm) -> str:
    names = sm.captured.model_param_names
    n = sum(math.prod(names[p][2]) for p in sm.captured.frozen)
    return f"{len(sm.captured.frozen)} parameters frozen ({n / 1e6:.2f}M weights)"


def warn_positions(model, data, cfg: TrainConfig) -> None:
    """One line on stderr where a model with weights would see positions past its config's
    ``max_position_embeddings``: ones its weights were not trained on (a run may mean to extend its context; it is
    not refused)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if model.weights is None or not limit or data.longest <= limit:
        return
    what = (f"rows of {cfg.seq:,} tokens, streamed, may hold a document of up to {cfg.seq:,} positions"
            if cfg.streaming else f"the longest document takes {data.longest:,} positions in a row of {cfg.seq:,}")
    print(f"megatrain train: warning: {what}, past the model's max_position_embeddings ({limit:,}): positions its "
          f"weights were not trained on (lower --seq, or give its config.json a rope_scaling to extend them)",
          file=sys.stderr, flush=True)


def warn_repeats(data, cfg: TrainConfig) -> None:
    """One line on stderr where the data is small for the run: a batch larger than its rows (each batch then holds
    some rows twice), or steps that go over it more than ten times (a fine-tuning recipe counts epochs)."""
    rows = getattr(data.batches, "rows", None)  # (a streamed source's size is not known before it is read)
    if rows is None or not len(rows):
        return
    n, epochs = len(rows), cfg.steps * cfg.batch / len(rows)
    if cfg.batch > n:
        print(f"megatrain train: warning: --batch {cfg.batch:,} is more than the data's {n:,} rows: each batch holds "
              f"rows more than once ({epochs:,.0f} passes over the data in {cfg.steps:,} steps)", file=sys.stderr,
              flush=True)
    elif epochs > 10:
        print(f"megatrain train: warning: {cfg.steps:,} steps of {cfg.batch:,} rows go over the data's {n:,} rows "
              f"{epochs:,.0f} times (--epochs 3 is {math.ceil(3 * n / cfg.batch):,} steps)",
              file=sys.stderr, flush=True)
