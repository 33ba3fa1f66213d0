"""``megatrain train``: train a causal LM streamed from host memory. With no arguments: a tiny Llama-family model
from scratch on the default corpus, offline."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from megatrain import train_report as report
from megatrain.data import DataError
from megatrain.export import save_tokenizer
from megatrain.dpo import pair_source, reference_logps, reference_model
from megatrain.inputs import chat_template_file, data_source, model_source, steps_for_epochs, tokenizer_for
from megatrain.resume import last_state
from megatrain.rundir import PLAN_FILE, RUN_FILE, STATE_DIR, RunDirectory, StopSignals, answering_signals, write_whole
from megatrain.runtime.state import train_state
from megatrain.saving import outlook, save_state, save_weights, weights_nbytes
from megatrain.stages import Stages
from megatrain.train_config import UNPACKABLE, TrainConfig

MAX_SKIPPED = 10  # with on_nonfinite "skip": this many steps in a row without an update stop the run


def _prepare(cfg: TrainConfig, dp=None):
    """The model source, tokenizer, data and the compiled model with its schedule (with ``cfg.resume``, at the saved
    step, the data where it was); raises on any bad input, before the model's memory is allocated."""
    from transformers import AutoModelForCausalLM

    import megatrain
    from megatrain.capture.documents import can_keep_apart
    from megatrain.capture.packed_attention import attention_for
    from megatrain.export import set_special_ids, stop_ids

    model = model_source(cfg.model, cfg.vocab, cfg.seq, cfg.trust_remote_code)
    # (on threads of their own, so that a signal is answered while a tokenizer trains or a reader parses)
    tok, tok_from = answering_signals(tokenizer_for, model, cfg.data, cfg.vocab, cfg.resume, cfg.trust_remote_code,
                                      cfg.streaming)
    if cfg.chat_template:
        tok.chat_template = chat_template_file(cfg.chat_template, tok)
    stop_ids(tok, cfg.stop_tokens())  # an --eos-token the vocabulary lacks: refused before anything is built
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tok)} tokens, the model's vocabulary {model.config.vocab_size}")
    if model.weights is None:  # from scratch: its special tokens are the tokenizer's
        set_special_ids(model.config, tok)
    _check_step_inputs(cfg)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config, attn_implementation=attention_for(model.config),
                                                trust_remote_code=cfg.trust_remote_code)
    freeze(meta, cfg.freeze_patterns())
    if cfg.packing and cfg.method == "sft" and not can_keep_apart(meta):  # (refused before the data is read)
        raise ValueError(UNPACKABLE.format(model=cfg.model))
    if cfg.method == "dpo" and dp is not None:
        raise ValueError("--method dpo runs in one process (not with --gpus)")
    data = answering_signals(lambda: pair_source(cfg, tok) if cfg.method == "dpo" else data_source(
        cfg.data, tok, seq=cfg.seq, seed=cfg.seed, fmt=cfg.format, columns=cfg.column_map(), packing=cfg.packing,
        eval_data=cfg.eval_data, eval_split=cfg.eval_split, streaming=cfg.streaming))
    if cfg.epochs is not None:  # the steps that go over the data's rows that many times
        cfg = steps_for_epochs(cfg, data)
    report.warn_positions(model, data, cfg)
    report.warn_repeats(data, cfg)
    if cfg.resume:
        began = json.loads((Path(cfg.resume) / RUN_FILE).read_text())
        if began.get("data_sha256") != data.digest:
            raise DataError(f"{cfg.data or 'the default corpus'} is not the data {cfg.resume} was trained on "
                            f"({data.tokens:,} tokens now, {began.get('data_tokens', 0):,} then)")
    if cfg.method == "dpo" and cfg.ref_model and not cfg.resume:  # (alone: its store is freed before this one's)
        data.batches.ref_s = reference_model(cfg, data.batches, cfg.device)
    optim = cfg.optim_config()
    # the state resumed from, found once: what is checked is what is read
    state = train_state.find(Path(cfg.resume) / STATE_DIR) if cfg.resume else None
    source_of_weights = (dict(state=state) if cfg.resume else
                         dict(checkpoint=model.weights) if model.weights else dict(init_seed=cfg.seed))
    world = 1 if dp is None else dp.world
    sm = megatrain.compile(meta, **source_of_weights, optim=optim, **({} if dp is None else {"streams": False}),
                           device=cfg.device, hardware=cfg.hardware, **dataclasses.asdict(cfg.plan_options(world)))
    if cfg.packing and not sm.captured.packs and cfg.method == "sft":
        raise ValueError(UNPACKABLE.format(model=cfg.model))
    if cfg.resume:
        m = train_state.read_manifest(sm.captured, state)
        if "data_order" not in m["extra"]:
            raise ValueError(f"{state} does not say where the data stood (saved by another program than megatrain "
                             f"train, or by an earlier megatrain)")
        data.batches.restore(m["extra"]["data_order"], str(state))
        taken = data.batches.taken(cfg.batch)
        if taken is not None and (taken < m["step"] or taken != int(taken)):
            raise DataError(f"{state}: the data order saved is {taken:g} batches of {cfg.batch} rows into the data, "
                            f"{'fewer than' if taken < m['step'] else 'not a whole number of batches for'} the "
                            f"{m['step']} steps the state took (an inconsistent training state)")
    if cfg.resume and (Path(cfg.resume) / PLAN_FILE).is_file():  # the run resumed from planned this request
        sm.plan_files = ((Path(cfg.resume) / PLAN_FILE).read_text(),)
    t0 = time.perf_counter()
    schedule = sm.schedule_for(cfg.batch // world, cfg.seq)
    sm.planned_s = time.perf_counter() - t0
    if cfg.method == "dpo":  # (each micro-batch holds whole pairs)
        data.batches.n_mb = schedule.config.n_mb
    return model, tok, tok_from, data, sm, schedule, cfg


STEP_INPUT_BYTES_PER_TOKEN = 4 * 8  # a step's input ids, mask, labels and positions, int64


def _check_step_inputs(cfg: TrainConfig) -> None:
    """Refuse a step whose token tensors alone (``--batch`` x ``--seq`` tokens) would take more than a quarter of
    the host memory available, before the data is read or anything is allocated."""
    from megatrain.runtime.memory.store import available_host_bytes

    need, free = cfg.batch * cfg.seq * STEP_INPUT_BYTES_PER_TOKEN, available_host_bytes()
    if free is not None and need > free // 4:
        raise ValueError(f"a step of --batch {cfg.batch:,} x --seq {cfg.seq:,} tokens takes {need / 2**30:.1f} GiB as "
                         f"its input tensors alone, more than a quarter of the {free / 2**30:.1f} GiB of host memory "
                         f"available: a smaller --batch (or more steps)")


def freeze(model, patterns: list[str]) -> int:
    """``requires_grad=False`` on the parameters whose names match any of ``patterns`` (fnmatch); a pattern that
    matches none is refused, naming a parameter to show what names look like. Returns how many were frozen."""
    from fnmatch import fnmatchcase

    names = [n for n, _ in model.named_parameters()]
    for pat in patterns:
        if not any(fnmatchcase(n, pat) for n in names):
            raise ValueError(f"freeze: {pat!r} matches no parameter of the model (names look like {names[-1]!r})")
    hit = [n for n in names if any(fnmatchcase(n, pat) for pat in patterns)]
    for n in hit:
        model.get_parameter(n).requires_grad_(False)
    if hit and len(hit) == len(names):
        raise ValueError(f"freeze: {', '.join(patterns)} matches every parameter of the model: nothing would train")
    return len(hit)


def _nonfinite_message(step: int, stats, out: Path, cfg: TrainConfig, why: str) -> str:
    """What to say when a run stops on steps whose loss or gradient norm is not finite (none of them was applied):
    the step, and the training state to go on from."""
    what = " and ".join(f"{k} {v}" for k, v in (("loss", stats.loss), ("gradient norm", stats.grad_norm))
                        if v is not None and not math.isfinite(v))
    last = last_state(out, cfg)
    where = ("No training state was saved before it (--save-every N saves one every N steps)." if last is None else
             f"The last training state saved is step {last[1]}'s, in {last[0]}/{STATE_DIR}"
             + (" (the weights this step started from)" if last[1] == step - 1 else "")
             + f": go on from it with, e.g., a lower learning rate: megatrain train --resume {last[0]} --lr ...")
    return (f"step {step}: {what}; no update was applied, and the run stops ({why}); nothing more is saved "
            f"(metrics up to this step are in {out}/metrics.jsonl). {where}")


def run(cfg: TrainConfig) -> dict:
    """Train; returns the summary (also written to ``<out>/summary.json``). SIGINT / SIGTERM stop the run after
    the step in flight, with the weights and the training state saved (the summary's ``exit_code``: 130 / 143).
    Under ``torchrun`` (WORLD_SIZE > 1) the ranks train data parallel (:func:`_data_parallel`): each takes its
    share of every batch; rank 0 writes the run directory, the others only compute."""
    cfg.check()
    import torch.distributed as dist

    ours = dist.is_available() and not dist.is_initialized()  # the process group, if this run starts one
    dp = _data_parallel(cfg)
    ours = ours and dp is not None
    done = False
    try:
        out = Path(cfg.out or f"megatrain-runs/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        if dp is not None:
            out = Path(dp.from_rank0(str(out)))
        run_dir = _run_directory(out, dp)
        lead = dp is None or dp.rank == 0
        stages = Stages()
        try:
            # (a stop before the first step: what this run wrote goes)
            with StopSignals(run_dir.discard if run_dir is not None else None) as signals, _quiet(not lead) as side:
                try:
                    with stages("prepare"):  # the data, the model's store filled, the plan
                        prepared = _prepare(cfg, dp)
                except BaseException:
                    if run_dir is not None:
                        run_dir.abandon()  # nothing is written before this point
                    raise
                summary = _train(prepared[-1], out if lead else side, prepared, signals, dp, stages)
                done = True
                return summary
        finally:
            if run_dir is not None:
                run_dir.close()
    finally:
        if ours:  # torn down here, not at the interpreter's exit (where gloo's threads can abort the process); after
            # a run that ended well, once every rank is done with its collectives
            if done:
                dp.barrier()
            dist.destroy_process_group()


def _data_parallel(cfg: TrainConfig):
    """Under ``torchrun`` (WORLD_SIZE > 1): the default process group (NCCL on GPUs, one per local rank; gloo on
    the CPU), checked against the batch: each rank trains ``batch / N`` sequences in ``mb / N`` micro-batches, so
    the step's micro-batches are those of one process training them all. None for a single process."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return None
    check_ranks(cfg, world)
    import torch.distributed as dist

    from megatrain.runtime.issue.data_parallel import DataParallel

    if not dist.is_initialized():
        cuda = (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return DataParallel.from_env()


def check_ranks(cfg: TrainConfig, world: int) -> None:
    """``cfg`` trains on ``world`` data-parallel ranks: each takes batch / world sequences in mb / world micro-batches
    (ValueError naming the numbers otherwise)."""
    if cfg.batch % world or cfg.mb % world:
        raise ValueError(f"{world} data-parallel ranks: --batch ({cfg.batch}) and --mb ({cfg.mb}) must be multiples "
                         f"of {world} (each rank trains batch / {world} sequences in mb / {world} micro-batches)")


def _run_directory(out: Path, dp) -> RunDirectory | None:
    """The run directory, made and locked by the one process that writes it (rank 0 of a data-parallel run, whose
    refusal the others raise too)."""
    return RunDirectory(out) if dp is None else dp.after_rank0(lambda: RunDirectory(out))


@contextlib.contextmanager
def _quiet(quiet: bool):
    """For a data-parallel rank other than 0: its console output dropped and its side files (metrics, plots) in
    a directory of its own, removed after (yields it; None for the writing process)."""
    if not quiet:
        yield None
        return
    import os
    import shutil
    import tempfile

    side = Path(tempfile.mkdtemp(prefix="megatrain-rank-"))
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            yield side
    finally:
        shutil.rmtree(side, ignore_errors=True)


def _share(batch: dict, dp) -> dict:
    """A data-parallel rank's rows of a step's (or an evaluation's) batch: the rank-th of N equal parts."""
    if dp is None:
        return batch
    n = next(t for t in batch.values() if t is not None).shape[0] // dp.world
    return {k: None if t is None else t[dp.rank * n: (dp.rank + 1) * n] for k, t in batch.items()}


def _stopping(signals: StopSignals, dp) -> bool:
    """A stop was asked for (with data parallel: on any rank; the ranks agree before each step)."""
    asked = signals.requested is not None
    return asked if dp is None else dp.sum_int(int(asked)) > 0


def _train(cfg: TrainConfig, out: Path, prepared, signals: StopSignals, dp=None, stages: Stages | None = None
           ) -> dict:
    from tqdm import tqdm

    from megatrain.planner.dump import can_plot, plot
    from megatrain.planner.simulate import simulate

    model, tok, tok_from, data, sm, schedule, _ = prepared
    write_whole(out / RUN_FILE, json.dumps({"config": dataclasses.asdict(cfg), "data_tokens": data.tokens,
                                            "data_sha256": data.digest}, indent=1))
    write_whole(out / "schedule.txt", schedule.to_text())
    write_whole(out / PLAN_FILE, sm.run_plan(schedule).to_json())
    timeline = simulate(schedule, sm.graph_for(schedule), sm.hardware)
    if can_plot():  # matplotlib is an extra (megatrain[plot]); schedule.txt says the same in text
        plot([timeline], out / "schedule.png",
             title=f"{cfg.model}: {cfg.batch} x {cfg.seq} tokens/step on the {sm.hardware.name} spec",
             budget_nbytes=schedule.config.budget_bytes)
    save_tokenizer(tok, out)
    from megatrain.export import export_dtype

    dtype = export_dtype(cfg.export_dtype or model.dtype)
    lead = dp is None or dp.rank == 0  # the process that writes the weights and the state
    saves = outlook(sm, out, timeline.steady_step_s, weights_nbytes(sm, dtype))[0] if lead else ""
    n_params = sm.graph.n_params
    print(report.header(cfg, sm, schedule, model.describe(), f"{tok_from} ({len(tok):,} tokens)", data.description,
                        saves, out), flush=True)
    sm.nonfinite = "skip"  # decided here, by cfg.on_nonfinite
    meter = report.Meter(sm, cfg, out, report=lead)
    log = (out / "metrics.jsonl").open("w")
    history, skipped, in_row, evals = [], 0, 0, []
    saved_at, save_s, refused = None, [], None  # refused: why a state could not be saved (the disk)
    t_start = time.perf_counter()
    start = sm.step
    bar = tqdm(desc="train", unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=1.0, initial=start,
               total=cfg.steps)
    say = lambda m: tqdm.write(m, file=sys.stderr)  # noqa: E731
    stages = stages or Stages()
    if cfg.method == "dpo":
        with stages("reference"):
            ref_s = reference_logps(sm, data.batches, cfg, out)
        say(f"reference log-probabilities of {len(data.batches.pairs):,} pairs: " + (
            f"{ref_s:.1f} s, one forward pass of the initial weights" if ref_s else f"those of {cfg.resume}"
            if cfg.resume else f"{cfg.ref_model}'s, {data.batches.ref_s:.1f} s, streamed before this model"))
        t_start = time.perf_counter()  # (the run's tokens/s: its steps')
    training = stages("train")  # (its saves and evaluations are stages of their own within it)
    training.__enter__()
    signals.begin_steps()
    try:
        while sm.step < cfg.steps and not _stopping(signals, dp):
            st = sm.train_step(**_share(data.batches.batch(cfg.batch), dp))
            rec = {"step": st.step + st.skipped, "loss": st.loss, "lr": st.lr, "grad_norm": st.grad_norm,
                   "clipped": st.clipped, "tokens": st.tokens, "seconds": st.seconds, "tokens_per_s": cfg.batch * cfg.seq / st.seconds,
                   **st.metrics, **meter.step(st.seconds)}
            if st.skipped:
                rec["skipped"] = True
            log.write(json.dumps(rec) + "\n")
            log.flush()
            meter.write(rec)
            if st.skipped:
                skipped, in_row = skipped + 1, in_row + 1
                if cfg.on_nonfinite == "stop" or in_row >= MAX_SKIPPED:
                    why = ("--on-nonfinite stop" if cfg.on_nonfinite == "stop" else
                           f"{MAX_SKIPPED} steps in a row were skipped")
                    raise ValueError(_nonfinite_message(st.step + 1, st, out, cfg, why))
                say(f"step {st.step + 1}: loss {st.loss}, gradient norm {st.grad_norm}: not finite, no update "
                    f"applied; the next batch is tried ({skipped} skipped so far)")
                continue
            in_row = 0
            history.append(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{st.loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", **meter.postfix(rec),
                            **({"eval": f"{evals[-1]['eval_loss']:.3f}"} if evals else {}))
            if data.eval_rows is not None and cfg.eval_every and st.step % cfg.eval_every == 0:
                with stages("eval"):
                    evals.append(_evaluate(sm, data.eval_rows, cfg.batch, log, dp))
                meter.write(evals[-1])
            if cfg.save_every and st.step % cfg.save_every == 0 and st.step < cfg.steps:
                try:
                    with stages("state save"):
                        save_s.append(save_state(sm, data.batches, out, say))
                except train_state.NoSpace as e:  # the run stops: the weights are written, nothing else
                    refused = f"step {st.step}: {e}"
                    break
                saved_at = st.step
        sm.wait()  # the last step's updates, which may run on after its train_step returned
    except BaseException:
        meter.close()
        raise
    finally:
        bar.close()
        log.close()
        training.__exit__(None, None, None)
    wall = time.perf_counter() - t_start
    if data.eval_rows is not None and (not evals or evals[-1]["step"] != sm.step):
        with (out / "metrics.jsonl").open("a") as log, stages("eval"):
            evals.append(_evaluate(sm, data.eval_rows, cfg.batch, log, dp))
        meter.write(evals[-1])
    if signals.requested is not None:
        say(f"{signals.requested.name} after step {sm.step}: saving the weights and the training state, then "
            f"stopping (a second one stops at once)")
    export_s = None
    if lead:  # the ranks' weights are the same
        # first: the smaller files survive a disk that fills up with the state
        with stages("export"):
            export_s = save_weights(sm, model, tok, out, dtype, cfg.stop_tokens())
        print(f"step {sm.step}: weights written to {out}/ in {export_s:.1f} s "
              f"({weights_nbytes(sm, dtype) / max(export_s, 1e-9) / 1e9:.2f} GB/s)", file=sys.stderr, flush=True)
    if saved_at != sm.step and refused is None:
        try:
            with stages("state save"):
                save_s.append(save_state(sm, data.batches, out, lambda m: print(m, file=sys.stderr, flush=True)))
        except train_state.NoSpace as e:
            refused = f"step {sm.step}: {e}"
    done = len(history)
    first = history[0]["loss"] if history else float("nan")
    last = sum(h["loss"] for h in history[-5:]) / min(5, done) if history else float("nan")
    summary = {
        "model": cfg.model, "params": n_params, "device": str(sm.device), "steps": cfg.steps,
        "tokens_per_step": cfg.batch * cfg.seq, "first_loss": first, "final_loss_avg_last5": last,
        "loss_drop_pct": 100 * (first - last) / first if history else 0.0, "wall_s": wall,
        "tokens_per_s": done * cfg.batch * cfg.seq / wall if wall > 0 else 0.0, "out": str(out),
        "first_step": start + 1, "last_step": sm.step, "skipped_steps": skipped, "warmup_steps": cfg.warmup_steps,
        # the share of the run's steps the clip factor scaled (what --speculate's window pays for)
        "clipped_steps": sum(h["clipped"] for h in history), "clip_rate": sum(h["clipped"] for h in history) / done
        if done else 0.0,
        **meter.summary(done * cfg.batch * cfg.seq / wall if wall > 0 else 0.0),
        **({"eval_loss": evals[-1]["eval_loss"], "eval_losses": [(e["step"], e["eval_loss"]) for e in evals]}
           if evals else {}),
        "export_s": export_s, "state_save_s": save_s, **({"state_refused": refused} if refused else {}),
        "host_planned_gib": report.host_planned(sm, schedule) / 2**30, "host_rss_peak_run_gib": stages.peak_rss_gib,
        "device_planned_gib": report.device_planned(sm, schedule) / 2**30,
        "stages": stages.record,
        "config": dataclasses.asdict(cfg),
    }
    if signals.requested is not None:
        summary["stopped_by"] = signals.requested.name
        summary["exit_code"] = signals.exit_code
    write_whole(out / "summary.json", json.dumps(summary, indent=1))
    meter.close(summary)  # (the trackers end with the run's summary)
    if refused is not None:
        last = last_state(out, cfg)
        raise ValueError(f"{refused}; the run stops after step {sm.step}, whose weights are in {out}/ "
                         f"(from_pretrained reads them); "
                         + (f"the last training state saved is step {last[1]}'s, in {last[0]}/{STATE_DIR}"
                            if last else "no training state was saved"))
    files = (f"metrics {out}/metrics.jsonl, schedule {out}/schedule.{'png' if can_plot() else 'txt'}, model {out}/ "
             f"(from_pretrained), training state {out}/{STATE_DIR}/")
    if signals.requested is not None:
        print(f"stopped by {signals.requested.name} after step {sm.step} of {cfg.steps}: {files}; go on with: "
              f"megatrain train --resume {out}")
        return summary
    drop = summary["loss_drop_pct"]
    print(f"done: loss {first:.3f} -> {last:.3f} ({abs(drop):.0f}% {'lower' if drop >= 0 else 'higher'})"
          + (f", held-out loss {evals[-1]['eval_loss']:.3f}" if evals else "") + f" in "
          f"{wall:.1f} s, {summary['tokens_per_s']:,.0f} tokens/s"
          + (f" ({summary['mfu']:.1%} model FLOPs utilization of the {sm.hardware.name} spec's "
             f"{summary['mfu_against_flops_per_s'] / 1e12:g} TFLOP/s)" if "mfu" in summary else "")
          + (f", {skipped} steps skipped (not finite)" if skipped else "")
          + (f", {summary['clipped_steps']} of {done} steps clipped" if cfg.clip is not None else "")
          + (f"; host memory at most {stages.peak_rss_gib:.2f} GiB (the plan counted "
             f"{summary['host_planned_gib']:.2f}"
             + (f", and {summary['device_planned_gib']:.2f} of device memory, which on the CPU is host memory too"
                if sm.device.type == "cpu" else "") + ")" if stages.peak_rss_gib else "") + f"; {files}")
    return summary


def _evaluate(sm, rows, batch: int, log, dp=None) -> dict:
    """The loss on every held-out row (in batches of the training batch's shape; a last batch filled with rows
    whose labels are all ignored), one metrics line."""
    import numpy as np

    from megatrain.data import Batches

    order = Batches(rows, 0)
    total, tokens, t0 = 0.0, 0, time.perf_counter()
    for start in range(0, len(rows), batch):
        b = order.rows_batch(np.arange(start, min(start + batch, len(rows))), batch)
        ev = sm.evaluate(**_share(b, dp))  # with data parallel: the loss and tokens of every rank's share
        total += ev.loss * ev.tokens
        tokens += ev.tokens
    rec = {"step": sm.step, "eval_loss": total / tokens, "eval_tokens": tokens, "seconds": time.perf_counter() - t0}
    log.write(json.dumps(rec) + "\n")
    log.flush()
    return rec
