"""Streamed training throughput on the GPU for HF Qwen2.5-shaped models with random weights.

    PYTHONPATH=. python3 benchmarks/throughput.py --preset qwen2.5-1.5b --batch 16 --seq 1024 --mb 4 --json out.json

Builds the model on the meta device, fills the host store with the seeded initializer, trains --steps steps after
--warmup, and prints tokens/s, TFLOPS (6NT), the planner's bound and simulated time for the same schedule, GPU peak
and host RSS. With --trace it writes the measured and simulated timelines of the last timed step to one Chrome
trace/PNG.

A step ends when the host has issued it and the optimizer worker has finished its updates (moments included). The
timed steps run on behind the warm-up steps with nothing drained in between, as in a long training run, where the
next step's forward runs under the previous step's update pass, and --cooldown steps (default 1, untimed) follow
them, so that the last timed step's update pass and moments also run under a next step (with none after it they
run alone and end early: its interval came out 0.4-0.6 s shorter than the others' at 24 and 48 GiB budgets).
"s/step" is the seconds from the last warm-up step's end to the last timed step's end, per timed step (the steady
state: every timed step has a step before and after it to overlap); "median s" is the median of the seconds
between consecutive steps' ends; "drained s" counts to the end of everything issued, over the timed and cool-down
steps (the last one's tail, once, on top). "tokens/s" is from the first, "tok/s med" from the second. The host
thread's and the worker's times, and --trace, are the last timed step's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from megatrain.cli import (dropped_checkpoints, gpu_opt_every, grad_kept, host_checkpoints, resident_opt, saved_acts,
                           seq_tile, speculate, split_opt)
from megatrain.layout import WIRE_STAGE_PARAMS


def config_file(path: str, seq: int, layers: int | None):
    """The HF config in ``path`` (a JSON of config fields with its model_type), with ``layers`` decoder blocks where
    given and room for ``seq`` positions."""
    from transformers import AutoConfig

    fields = json.loads(Path(path).read_text())
    if "model_type" not in fields:
        raise SystemExit(f"{path}: an HF config needs its model_type")
    if layers is not None:
        if layers < 1:
            raise SystemExit(f"--layers {layers}: a model needs at least one decoder block")
        fields["num_hidden_layers"] = layers
        if "layer_types" in fields:  # (a hybrid's list of block kinds, cut with it)
            fields["layer_types"] = fields["layer_types"][:layers]
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), seq)
    return AutoConfig.for_model(**fields)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b", help="a planner preset, or tiny (CPU smoke runs)")
    ap.add_argument("--config", default=None, metavar="FILE",
                    help="an HF config (JSON, e.g. ../shared/model-shapes/*.json) instead of a preset; --layers cuts "
                         "it as it does a preset")
    ap.add_argument("--batch", type=int, nargs="+", default=[16], help="sequences per step; several: one run each")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder blocks (default: the preset's); fewer blocks of the same width measure what one "
                         "block costs")
    ap.add_argument("--mb", type=mb_arg, default=4, help="micro-batches, or auto (the planner's choice)")
    ap.add_argument("--slots", type=slots_arg, default=2,
                    help="weight slots, all (one per layer), or auto (the planner's choice)")
    ap.add_argument("--host-checkpoints", type=host_checkpoints, default="auto",
                    help="layers whose checkpoints wait on the host (auto: the planner's choice)")
    ap.add_argument("--dropped-checkpoints", type=dropped_checkpoints, default="auto",
                    help="checkpoints the forward drops, made again in the backward (auto: the planner's choice)")
    ap.add_argument("--seq-tile", type=seq_tile, default="auto",
                    help="tokens per tile the blocks' MLPs run over (0: untiled; auto: the planner's choice)")
    ap.add_argument("--gpu-opt-every", type=gpu_opt_every, default=0,
                    help="update every k-th layer on the GPU (0: none; auto: the fastest simulated set)")
    ap.add_argument("--split-opt", type=split_opt, default=0,
                    help="host-updated layers whose update runs on the GPU after the backward, state streamed in "
                         "parts (0: none; auto: the planner's choice)")
    ap.add_argument("--speculate", type=speculate, default="auto", metavar="N|auto|off",
                    help="host updates made before the step's global norm (the planner's --speculate)")
    ap.add_argument("--speculate-keeps", choices=["masters", "state", "auto"], default="masters",
                    help="what those updates keep to be made again (the planner's --speculate-keeps)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="the clipping threshold (1.0); a large one keeps exact clipping with no step clipped, a tiny "
                         "one clips every step")
    ap.add_argument("--wire", choices=["fp32", "bf16"], default="fp32", help="weights on the wire")
    ap.add_argument("--saved-acts", type=saved_acts, default="auto",
                    help="layers that keep their activations, no recompute (auto: as many as fit; 0: none)")
    ap.add_argument("--resident-opt", type=resident_opt, default="auto",
                    help="GPU-updated layers whose state stays on the GPU between steps (auto: the planner's)")
    ap.add_argument("--grad-kept", type=grad_kept, default="auto",
                    help="host-updated layers whose gradient stays on the GPU until the update pass (auto: as many "
                         "as fit)")
    ap.add_argument("--grad-host-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="allow bf16 gradients on the host where no plan with fp32 ones fits")
    ap.add_argument("--hardware", help="the spec the plan is made for: a preset or a spec file (megatrain probe "
                                       "writes one for this machine); default: the card's preset")
    ap.add_argument("--host-gib", type=float, help="host memory the plan may use (default: what the machine has)")
    ap.add_argument("--gpu-gib", type=float,
                    help="device memory the plan may fill, the allocator capped to it (default: the card's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cooldown", type=int, default=1,
                    help="untimed steps after the timed ones, so that the last timed step's update pass and moments "
                         "run under a next step as every other timed step's do (default 1)")
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--cpu-threads", type=int, nargs="+", default=[0],
                    help="host threads for AdamW (0: torch's default); several: one run each")
    ap.add_argument("--sync", action="store_true", help="program-order executor instead of streams")
    ap.add_argument("--step-sync", action="store_true",
                    help="streams: a device-wide sync between steps (default: steps ordered by events only)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of this script (program order)")
    ap.add_argument("--data", choices=DATA, default="random",
                    help="random tokens, or chat: packed rows of chat-like documents (seq / 16 to 2 x seq tokens, "
                         "the prompt part not trained on, each document attending to itself alone), or pairs: "
                         "DPO steps (sigmoid, beta 0.1) on batch / 2 random preference pairs of seq-token rows "
                         "(a quarter prompt), after their reference pass (one evaluation of the initial weights, "
                         "timed: reference_s)")
    ap.add_argument("--json")
    ap.add_argument("--save-state", metavar="DIR",
                    help="after the runs, time saving the training state to DIR and loading it back")
    ap.add_argument("--trace", help="path prefix for the measured + simulated trace and PNG")
    ap.add_argument("--memory-by-op", metavar="PATH",
                    help="(CUDA) write, for the last timed step, each op's device bytes allocated after it is issued "
                         "and at most while it is, against the plan's (JSON); prints the ops above the plan")
    ap.add_argument("--variant", action="append", type=parse_variant, default=[],
                    help="run again on the same model with these settings changed, e.g. "
                         "'gpu_opt=auto,wire=bf16,clip=0,mb=2' (keys: gpu_opt, wire, clip, mb, slots, step_sync, "
                         "saved, resident, tile, host_ckpt, split, split_queues, pace, host_kernel=native|torch, defer, "
                         "stage=elements of the fp32 wire's staging buffer, 0: torch's copy_; "
                         "host_block=N: the host kernel's threads take runs of N elements as they come free, 0: "
                         "equal contiguous shares); "
                         "repeatable; "
                         "the first run uses the flags above")
    args = ap.parse_args()
    if args.memory_by_op and (args.device != "cuda" or args.sync):
        ap.error("--memory-by-op reads the CUDA caching allocator around each op the stream issuer issues: it needs "
                 "--device cuda without --sync")
    if args.memory_by_op:  # every device block's Python stack, for the snapshot the report groups by
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=200_000)
    from transformers import AutoModelForCausalLM

    import megatrain
    from benchmarks.peers.common import hf_config
    from megatrain.capture.packed_attention import attention_for

    cfg = config_file(args.config, args.seq, args.layers) if args.config else hf_config(args.preset, args.seq,
                                                                                         layers=args.layers)
    if args.config:
        args.preset = Path(args.config).stem
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention_for(cfg))
    t0 = time.perf_counter()
    optim = megatrain.OptimConfig(lr=1e-4, max_grad_norm=None if args.no_clip else args.max_grad_norm)
    sm = megatrain.compile(model, init_seed=0, device=args.device, optim=optim, hardware=args.hardware,
                           streams=not args.sync and args.device != "cpu",
                           kernels=not args.no_kernels, n_mb=args.mb, weight_slots=args.slots,
                           host_checkpoints=args.host_checkpoints, gpu_opt_every=args.gpu_opt_every,
                           dropped_checkpoints=args.dropped_checkpoints,
                           wire=args.wire, saved_acts=args.saved_acts, resident_opt=args.resident_opt,
                           grad_kept=args.grad_kept, grad_host_dtype=args.grad_host_dtype,
                           seq_tile=args.seq_tile, host_budget_gib=args.host_gib, device_budget_gib=args.gpu_gib,
                           split_opt=args.split_opt, speculate=args.speculate, speculate_keeps=args.speculate_keeps)
    t_init = time.perf_counter() - t0
    args.sync = args.sync or args.device == "cpu"
    sm.overlap_steps = not args.sync  # steady state: a step's optimizer overlaps the next step's start
    step_sync = args.step_sync
    native_default = sm.optimizer.native
    n = sm.graph.n_params
    results, failed = [], []
    base = {"gpu_opt_every": args.gpu_opt_every, "wire": args.wire, "n_mb": args.mb, "weight_slots": args.slots,
            "saved_acts": args.saved_acts, "resident_opt": args.resident_opt, "grad_kept": args.grad_kept,
            "grad_host_dtype": args.grad_host_dtype, "host_checkpoints": args.host_checkpoints,
            "seq_tile": args.seq_tile, "split_opt": args.split_opt, "speculate": sm.plan_options.speculate,
            "speculate_keeps": args.speculate_keeps}
    for variant in [{}, *args.variant]:
        clip = variant.pop("clip", not args.no_clip)
        data = variant.pop("data", args.data)
        sm.wait()  # the previous variant's steps finish before the ordering and the host kernel change
        if hasattr(sm.executor, "sync_between_steps"):
            sm.executor.sync_between_steps = variant.pop("step_sync", step_sync)
            sm.executor.split_queues = variant.pop("split_queues", True)
            sm.executor.pace_split = variant.pop("pace_split", True)
            sm.executor.defer_moments = variant.pop("defer_moments", True)
        else:
            variant.pop("step_sync", None)
            variant.pop("split_queues", None)
            variant.pop("pace_split", None)
            variant.pop("defer_moments", None)
        stage = variant.pop("stage_params", WIRE_STAGE_PARAMS)
        if stage != sm.executor.dev.stage_params:  # (nothing in flight since the wait above)
            sm.executor.dev.stage_params, sm.executor.dev.stage = stage, None
        max_norm = variant.pop("max_grad_norm", args.max_grad_norm)
        sm.optimizer.cfg = replace(optim, max_grad_norm=max_norm if clip else None)
        sm.optimizer.native = variant.pop("host_native", native_default)
        sm.optimizer.block = variant.pop("host_block", optim.host_block)
        overrides = {**base, **variant}
        for threads in args.cpu_threads:
            sm.optimizer.threads = threads or None
            for batch in args.batch:
                try:
                    results.append(measure(args, sm, cfg, n, batch, t_init, overrides, data))
                except Exception as e:  # report it and go on with the next variant; the exit status says so
                    traceback.print_exc()
                    failed.append({"batch": batch, "clip": clip, **overrides, "error": f"{type(e).__name__}: {e}"})
                    sm.wait()
    if args.save_state and results:
        results[-1].update(time_train_state(sm, args.save_state))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results + failed if len(results) + len(failed) > 1 else (results + failed)[0], f, indent=1)
    if results:
        print_table(results)
    for f in failed:
        print(f"FAILED: {f}")
    if failed:
        raise SystemExit(1)


@contextlib.contextmanager
def allocated_by(op, out: list, held: dict):
    """(--memory-by-op) Around ``op``'s issue: the device bytes allocated after it, and the most while it was issued
    (the allocator's view, which its cap and peak statistic count; a GPU op the optimizer worker issues lands on the
    op the host thread issues then). ``held``: the allocator's snapshot after the op with the most allocated after
    it so far (``op``, ``bytes``, ``snapshot``)."""
    torch.cuda.reset_peak_memory_stats()
    yield
    now = torch.cuda.memory_allocated()
    out.append((str(op), now, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    if now > held.get("bytes", -1):
        held.update(op=str(op), bytes=now, snapshot=torch.cuda.memory._snapshot())


def held_blocks(snapshot: dict) -> list[tuple[str, int, int]]:
    """The live blocks of an allocator snapshot grouped by where they were allocated: the innermost frame in
    megatrain's code (file:line function), else the innermost frame; (place, bytes, blocks), largest first."""
    groups: dict[str, list[int]] = {}
    for seg in snapshot["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = blk.get("frames") or next(iter(blk.get("history") or []), {}).get("frames", [])
            own = [f for f in frames if "/megatrain/" in f["filename"]] or frames
            place = f"{own[0]['filename'].rsplit('/megatrain/', 1)[-1]}:{own[0]['line']} {own[0]['name']}" \
                if own else "(allocated before recording)"
            g = groups.setdefault(place, [0, 0])
            g[0] += blk["size"]
            g[1] += 1
    return sorted(((p, b, n) for p, (b, n) in groups.items()), key=lambda r: -r[1])


def write_memory_by_op(path: str, by_op: list, planned_reserved: int, planned_peak: int, budget: int,
                       held: dict) -> None:
    """``by_op`` as JSON, with the blocks held after the op with the most allocated after it (:func:`held_blocks`),
    and the ops whose most allocated bytes passed the plan's device bytes, printed."""
    blocks = held_blocks(held["snapshot"]) if held else []
    with open(path, "w") as f:
        json.dump({"planned_reserved_bytes": planned_reserved, "planned_peak_in_use_bytes": planned_peak,
                   "budget_bytes": budget,
                   "ops": [{"op": o, "allocated": a, "most": m, "most_reserved": r} for o, a, m, r in by_op],
                   "held_after": held.get("op"),
                   "held_blocks": [{"where": p, "bytes": b, "blocks": n} for p, b, n in blocks]}, f, indent=0)
    over = [(o, m) for o, _, m, _ in by_op if m > planned_reserved]
    top = max(by_op, key=lambda r: r[2])
    gib = 1 << 30
    print(f"memory by op: the most allocated {top[2] / gib:.2f} GiB at {top[0]!r}; planned {planned_reserved / gib:.2f} "
          f"GiB (in use at most {planned_peak / gib:.2f}), budget {budget / gib:.2f}; {len(over)} ops above the plan"
          + "".join(f"\n  {m / gib:6.2f} GiB  {o}" for o, m in sorted(over, key=lambda r: -r[1])[:10]))
    if blocks:
        print(f"held after {held['op']!r} ({held['bytes'] / gib:.2f} GiB), by where it was allocated:"
              + "".join(f"\n  {b / gib:6.2f} GiB  {n:5d} blocks  {p}" for p, b, n in blocks[:16]))


def time_train_state(sm, directory: str) -> dict:
    """Seconds to save the training state (after the last step's work is done) and to load it back."""
    from pathlib import Path

    sm.wait()
    t0 = time.perf_counter()
    d = sm.save_state(directory)
    t_save = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in Path(d).iterdir())
    t0 = time.perf_counter()
    sm.load_state(directory)
    t_load = time.perf_counter() - t0
    out = {"state_bytes": nbytes, "save_state_s": t_save, "load_state_s": t_load}
    print(f"training state: {nbytes / 2**30:.2f} GiB, saved in {t_save:.1f} s ({nbytes / t_save / 1e9:.2f} GB/s), "
          f"loaded in {t_load:.1f} s ({nbytes / t_load / 1e9:.2f} GB/s)")
    return out


def slots_arg(value: str) -> int | str:
    return value if value in ("all", "auto") else int(value)


def mb_arg(value: str) -> int | str:
    return value if value == "auto" else int(value)


def host_kernel(value: str) -> bool:
    """``host_kernel=native|torch``: the host update's kernel (native: megatrain's, which must build here)."""
    if value not in ("native", "torch"):
        raise argparse.ArgumentTypeError(f"host_kernel is native or torch, got {value!r}")
    if value == "native":
        from megatrain.runtime.optim import cpu_adamw

        cpu_adamw.library()
    return value == "native"


VARIANT_KEYS = {"gpu_opt": ("gpu_opt_every", gpu_opt_every), "wire": ("wire", str), "mb": ("n_mb", mb_arg),
                "slots": ("weight_slots", slots_arg), "clip": ("clip", lambda v: bool(int(v))),
                "step_sync": ("step_sync", lambda v: bool(int(v))), "saved": ("saved_acts", saved_acts),
                "resident": ("resident_opt", resident_opt), "data": ("data", str),
                "tile": ("seq_tile", seq_tile), "host_ckpt": ("host_checkpoints", host_checkpoints),
                "split": ("split_opt", split_opt), "split_queues": ("split_queues", lambda v: bool(int(v))),
                "pace": ("pace_split", lambda v: bool(int(v))),
                "host_kernel": ("host_native", host_kernel), "defer": ("defer_moments", lambda v: bool(int(v))),
                "stage": ("stage_params", int), "host_block": ("host_block", int), "spec": ("speculate", speculate),
                "max_norm": ("max_grad_norm", float), "keeps": ("speculate_keeps", str)}


def parse_variant(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in VARIANT_KEYS:
            raise argparse.ArgumentTypeError(f"variant item {item!r}: expected key=value with key in "
                                             f"{sorted(VARIANT_KEYS)}")
        name, conv = VARIANT_KEYS[key]
        out[name] = conv(value)
    return out


def print_table(results: list[dict]) -> None:
    cols = [("data", "data", "{}"), ("tokens/step", "tokens_per_step", "{:,}"), ("mb", "n_mb", "{}"),
            ("clip", "clip", "{}"), ("gpu_opt", "gpu_opt", "{}"), ("split", "split_opt", "{}"),
            ("spec", "speculate", "{}"), ("max norm", "max_grad_norm", "{}"), ("clipped", "clipped_steps", "{}"),
            ("saved", "saved_acts", "{}"), ("resident", "resident_opt", "{}"), ("paced", "pace_split", "{}"),
            ("host kernel", "host_kernel", "{}"), ("deferred", "defer_moments", "{}"),
            ("wire B", "wire_bytes_per_param", "{}"), ("s/step", "step_s", "{:.3f}"),
            ("median s", "median_step_s", "{:.3f}"), ("drained s", "drained_step_s", "{:.3f}"),
            ("tokens/s", "tokens_per_s", "{:,.0f}"),
            ("tok/s med", "tokens_per_s_median", "{:,.0f}"),
            ("TFLOPS 6NT", "tflops_6nt", "{:.0f}"), ("HW TFLOPS", "hardware_tflops", "{:.0f}"),
            ("bound s", "bound_step_s", "{:.3f}"), ("sim s", "simulated_steady_step_s", "{:.3f}"),
            ("bound/meas", "efficiency_bound_over_measured", "{:.2f}"),
            ("bound/med", "efficiency_bound_over_median", "{:.2f}"), ("GPU GiB", "gpu_peak_gib", "{:.1f}"),
            ("host GiB", "host_rss_gib", "{:.1f}")]
    rows = [[fmt.format(len(r.get(key, ())) if key in ("gpu_opt", "saved_acts", "resident_opt", "split_opt", "speculate")
                        else r[key])
             + (" lean" if key == "saved_acts" and r.get("saved_lean") else "") for _, key, fmt in cols]
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (h, _, _) in enumerate(cols)]
    print(f"\n{results[0]['preset']} ({results[0]['params'] / 1e9:.2f}B params), {results[0]['executor']}; "
          f"gpu_opt = layers updated on the GPU, resident = of them, those whose state stays there")
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


DATA = ("random", "chat", "pairs")


def dpo_pairs(vocab: int, seq: int, n_pairs: int, seed: int = 0):
    """``n_pairs`` preference pairs of random token ids, each row ``seq`` tokens: a prompt of a quarter of them and
    two completions of the rest (the chosen and the rejected), as ``megatrain train --method dpo`` lays them out."""
    from megatrain.data.preference import Pairs

    g = torch.Generator().manual_seed(seed)
    p = seq // 4
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    return Pairs([draw(p) for _ in range(n_pairs)], [draw(seq - p) for _ in range(n_pairs)],
                 [draw(seq - p) for _ in range(n_pairs)])


def chat_rows(vocab: int, seq: int, n_rows: int, seed: int = 0):
    """``n_rows`` rows of ``seq`` tokens packed from chat-like documents (megatrain.data.rows.pack): random token
    ids, lengths from seq / 16 to 2 x seq tokens (64 to 2,048 for 1,024-token rows), the first 20-60% of each (its
    prompt) not trained on."""
    import numpy as np

    from megatrain.data.formats import Documents, Example
    from megatrain.data.rows import pack

    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_rows * seq:
        length = int(rng.integers(max(8, seq // 16), 2 * seq + 1))
        prompt = int(length * rng.uniform(0.2, 0.6))
        docs.append(Example(rng.integers(3, vocab, length).tolist(), [False] * prompt + [True] * (length - prompt)))
        total += length
    return pack(Documents.of(docs), seq, pad_id=0)


def measure(args, sm, cfg, n, batch, t_init, overrides, data="random"):
    from megatrain.ir import ScheduleConfig
    from megatrain.planner.dump import plot, write_trace
    from megatrain.planner.passes import build_schedule
    from megatrain.planner.simulate import bound, simulate

    tokens = batch * args.seq
    gen = torch.Generator().manual_seed(0)
    times, losses, done, norms = [], [], [], []
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    worker = getattr(sm.executor, "worker", None)
    if data == "chat":
        import numpy as np

        from megatrain.data.rows import rows_batch

        rows = chat_rows(cfg.vocab_size, args.seq, batch * (args.warmup + args.steps + args.cooldown))
    elif data == "pairs":
        from megatrain.data.preference import PairBatches
        from megatrain.dpo import evaluate_pairs
        from megatrain.objectives import DPO

        if batch % 2:
            raise SystemExit(f"--data pairs: --batch {batch} must be even (whole pairs)")
        rows = PairBatches(dpo_pairs(cfg.vocab_size, args.seq, batch // 2 * (args.warmup + args.steps + args.cooldown)),
                           0, args.seq, 0, DPO(0.1, "sigmoid"))
        rows.n_mb = sm.schedule_for(batch, args.seq, **overrides).config.n_mb
        t = time.perf_counter()
        evaluate_pairs(sm, rows, batch)
        reference_s = time.perf_counter() - t
    else:
        rows = None
    trained = []  # tokens trained on, per step
    t_first = time.perf_counter()  # with no warm-up step, the timed steps start here (the plan's set-up counted)
    timer = getattr(sm.executor, "timer", None)
    marked_index = None
    last = None  # the last timed step, as measured (with cool-down steps after it, the executor's last is theirs)
    by_op: list = []  # --memory-by-op: (op, bytes allocated after its issue, the most allocated and reserved while
    # it was issued)
    held: dict = {}  # --memory-by-op: the allocator's snapshot after the op with the most allocated after it
    for i in range(args.warmup + args.steps + args.cooldown):
        marked = i == args.warmup + args.steps - 1
        if marked and worker is not None:  # the worker's optimizer step index while it runs this step's updates
            marked_index = worker.submit(lambda: sm.optimizer.step_index)
        if marked and cuda and args.memory_by_op:
            by_op.append(("(before the step)", torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                          torch.cuda.max_memory_reserved()))
            sm.executor.on_op = lambda op: allocated_by(op, by_op, held)
        if data == "pairs":
            b = rows.batch(batch)
            trained.append(int((b["labels"] != -100).sum()))
            t = time.perf_counter()
            st = sm.train_step(b["input_ids"], b["attention_mask"], b["labels"], objective=b["objective"],
                               rows=b["rows"], **overrides)
        elif rows is not None:
            b = rows_batch(rows, np.arange(i * batch, (i + 1) * batch), batch)
            trained.append(int((b["labels"] != -100).sum()))
            t = time.perf_counter()
            st = sm.train_step(b["input_ids"], b["attention_mask"], b["labels"], b["position_ids"], **overrides)
        else:
            ids = torch.randint(0, cfg.vocab_size, (batch, args.seq), generator=gen)
            t = time.perf_counter()
            st = sm.train_step(ids, **overrides)
        times.append(time.perf_counter() - t)
        losses.append(st.loss)
        norms.append(st.grad_norm)
        # when the optimizer worker gets past this step's updates (it runs its tasks in order): the step's end
        done.append(worker.submit(time.perf_counter) if worker is not None else time.perf_counter())
        sm.executor.on_op = None
        if marked and timer is not None:
            last = (timer.mark(), sm.executor.moments_s, sm.executor.moments_wait_s)
    sm.wait()
    t_drained = time.perf_counter()  # everything issued is done
    ends = [d.result() if worker is not None else d for d in done][:args.warmup + args.steps]
    t_timed = ends[args.warmup - 1] if args.warmup else t_first
    step_s = (ends[-1] - t_timed) / args.steps  # mean over the timed steps, each overlapping the one before
    # and the cool-down steps, the last one's tail on top, once
    drained_s = (t_drained - t_timed) / (args.steps + args.cooldown)
    per_step = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])] if args.warmup else []
    median_s = statistics.median(per_step) if per_step else step_s
    sched = sm.schedule_for(batch, args.seq, **overrides)
    spec = sm.hardware  # (the spec the plan was made with: this card's)
    c = sched.config
    graph = sm.graph_for(sched)  # with the saved bytes per token measured on this device
    three = build_schedule(graph, ScheduleConfig.from_dict({**c.to_dict(), "n_steps": 3}))
    from megatrain.planner.cost import compute_flops, device_memory, host_memory

    hw_flops = sum(compute_flops(graph, c, op) for op in sched.ops)  # recompute included
    sim = simulate(three, graph, spec)
    b = bound(three, graph, spec)
    planned_peak = simulate(sched, graph, spec).peak_nbytes
    if by_op:
        write_memory_by_op(args.memory_by_op, by_op, device_memory(graph, sched).total_nbytes, planned_peak,
                           c.budget_bytes, held)
    res = {
        "preset": args.preset, "data": data, "trained_tokens_per_step": trained or None,
        # --data pairs: the reference pass over the run's pairs (evaluation steps of batch rows), before the steps
        "reference_s": reference_s if data == "pairs" else None, "dpo_metrics": st.metrics or None,
        "layers": cfg.num_hidden_layers, "params": n, "executor": "program order" if args.sync else "streams",
        "split_queues": getattr(sm.executor, "split_queues", None),
        "pace_split": getattr(sm.executor, "pace_split", None),
        "host_kernel": "native" if sm.optimizer.native else "torch",
        "defer_moments": getattr(sm.executor, "defer_moments", None),
        "stage_params": sm.executor.dev.stage_params if c.wire_bytes_per_param == 4 else None,
        # whether the blocks' recomputes left out the projections nothing reads (grad_sink.outputs_unread)
        "unread_skipped": any(m.unread for i in range(len(sm.graph)) for m in sm.executor.runner.unread(i)),
        "kernels": sorted(sm.kernels), "tokens_per_step": tokens, "n_mb": c.n_mb, "weight_slots": c.weight_slots,
        "host_checkpoints": c.host_checkpoints, "dropped_checkpoints": c.dropped_checkpoints, "clip": c.clip,
        "gpu_opt": list(c.gpu_opt),
        "wire_bytes_per_param": c.wire_bytes_per_param, "saved_acts": list(c.saved_acts),
        "resident_opt": list(c.resident_opt), "grad_kept": list(c.grad_kept), "grad_host_bytes": c.grad_host_bytes,
        "planned_host_gib": sum(host_memory(graph, sched).values()) / (1 << 30),
        "planned_host_bytes_per_param": sum(host_memory(graph, sched).values()) / n,
        "saved_lean": c.saved_lean, "seq_tile": c.seq_tile, "split_opt": list(c.split_opt), "opt_part": c.opt_part,
        "host_grad_part": c.host_grad_part, "host_grad_slots": c.host_grad_slots,
        "speculate": list(c.speculate), "speculate_keeps": c.speculate_keeps,
        "max_grad_norm": sm.optimizer.cfg.max_grad_norm,
        # the simulator's device memory in use at its peak, for the measured peak below
        "planned_gpu_peak_gib": planned_peak / (1 << 30),
        # and what the plan reserves (every slot, the largest working set), for the allocator's reserved peak below
        "planned_gpu_reserved_gib": device_memory(graph, sched).total_nbytes / (1 << 30),
        "saved_bytes_per_token": max((graph[l].saved_bytes_per_token for l in c.saved_acts), default=0),
        "lean_saved_bytes_per_token": max((graph[l].saved_bytes(True) for l in c.saved_acts), default=0),
        "sync_between_steps": getattr(sm.executor, "sync_between_steps", None),
        "cpu_threads": sm.optimizer.threads or torch.get_num_threads(), "host_block": sm.optimizer.block,
        "step_times_s": times, "losses": losses, "grad_norms": norms,
        # the steps the clip factor scaled (those it left alone keep the updates made before the norm)
        "clipped_steps": sum(1 for g in norms[args.warmup:args.warmup + args.steps] if sm.optimizer.cfg.max_grad_norm is not None and g is not None
                             and sm.optimizer.clip_factor(torch.tensor(g)) < 1),
        "cooldown_steps": args.cooldown, "step_s": step_s, "step_times_between_ends_s": per_step, "median_step_s": median_s,
        "drained_step_s": drained_s, "tokens_per_s_drained": tokens / drained_s,
        "tokens_per_s": tokens / step_s, "tokens_per_s_median": tokens / median_s,
        # 6 x the parameters a token's compute touches (a mixture of experts' active ones) x tokens
        "active_params": n - sum(lay.inactive_params for lay in graph.layers),
        "tflops_6nt": 6 * (n - sum(lay.inactive_params for lay in graph.layers)) * tokens / step_s / 1e12,
        "hardware_tflops": hw_flops / step_s / 1e12,
        "bound_step_s": b.step_s, "bound_limiter": b.limiter, "simulated_steady_step_s": sim.steady_step_s,
        "efficiency_bound_over_measured": b.step_s / step_s, "efficiency_bound_over_median": b.step_s / median_s,
        # (the peak statistic is reset before each op of a --memory-by-op step: the most over every op then)
        "gpu_peak_gib": max([torch.cuda.max_memory_allocated()] + [p for _, _, p, _ in by_op]) / (1 << 30) if cuda else 0.0,
        "gpu_reserved_peak_gib": max([torch.cuda.max_memory_reserved()] + [r for *_, r in by_op]) / (1 << 30)
        if cuda else 0.0,
        "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20), "init_s": t_init,
        # what the simulation above ran on, for benchmarks/sim_accuracy.py to rebuild it as it was: the plan's
        # config, the layer graph (as captured, with the saved bytes measured here) and the hardware spec
        "seq": args.seq, "schedule_config": c.to_dict(), "graph": [asdict(lay) for lay in graph.layers],
        "hardware_spec": asdict(spec),
    }
    if last is not None:  # the last timed step's host thread: issuing ops, and waiting within that
        marked, moments_s, moments_wait_s = last
        res["host_issue_s"] = dict(marked.host_issue_s)
        res["host_wait_s"] = marked.host_wait_s
        res["host_loss_wait_s"] = marked.host_loss_wait_s
        if not args.sync:  # the host AdamW rate in the running worker, from the last timed step's host OPT ops
            from megatrain.ir import OpKind, Stream

            tl = sm.executor.timeline(marked)
            from megatrain.planner.cost import op_params

            spans = [(op_params(graph, c, op), e - s) for op, s, e in zip(tl.ops, tl.start_s, tl.end_s)
                     if op.kind is OpKind.OPT and op.stream is Stream.CPU]
            if spans:
                res["host_adamw_params"] = sum(p for p, _ in spans)
                res["host_adamw_busy_s"] = sum(d for _, d in spans)
                res["host_adamw_params_per_s"] = res["host_adamw_params"] / max(res["host_adamw_busy_s"], 1e-9)
            kt = sm.optimizer.kernel_time.get(marked_index.result()) if marked_index is not None else None
            if kt and kt[0] > 0:  # the same passes by the kernel's own clock: the ops' spans less the calls' overhead
                res["host_kernel_s"], res["host_kernel_params"] = kt
                res["host_kernel_params_per_s"] = kt[1] / kt[0]
            deferred = [op for op in tl.ops if op.id in sm.executor.deferred_moments]
            if deferred:  # of them, those that wrote the masters alone; their moments after the update pass
                res["host_moments_params"] = sum(op_params(graph, c, op) for op in deferred)
                res["host_moments_s"] = sum(moments_s)
                res["host_moments_wait_s"] = moments_wait_s
    if args.trace and not args.sync:
        tag = (f"b{batch}-mb{c.n_mb}-{'clip' if c.clip else 'noclip'}-opt{len(c.gpu_opt)}-w{c.wire_bytes_per_param}"
               f"-s{c.weight_slots}-saved{len(c.saved_acts)}"
               f"{'' if res['sync_between_steps'] is not False else '-nosync'}"
               f"{'' if res['pace_split'] is not False else '-unpaced'}"
               f"{'' if res['defer_moments'] is not False else '-undeferred'}")
        measured = sm.executor.timeline(last[0])
        one = simulate(sched, graph, spec)
        write_trace([one, measured], f"{args.trace}-{tag}.trace.json")
        with open(f"{args.trace}-{tag}.timeline.json", "w") as f:
            f.write(measured.to_json())
        with open(f"{args.trace}-{tag}.schedule.txt", "w") as f:
            f.write(sched.to_text())
        plot([one, measured], f"{args.trace}-{tag}.png", title=f"{args.preset}: simulated vs measured, one step")
        busy = measured.busy_s()
        res["measured_busy_s"] = busy
        res["measured_step_span_s"] = measured.makespan_s
    print(json.dumps(res, indent=1))
    if "host_issue_s" in res:
        issue = res["host_issue_s"]
        print(f"host thread, last step: {sum(issue.values()):.3f} s issuing ops (of which {res['host_wait_s']:.3f} s "
              f"waiting for the optimizer worker): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(issue.items()))
              + f"; then {res['host_loss_wait_s']:.3f} s waiting for the losses")
    print(f"{args.preset} {res['executor']} clip={c.clip} threads={res['cpu_threads']} gpu_opt={list(c.gpu_opt)}: "
          f"{tokens} tokens/step, {step_s:.3f} s/step, "
          f"{res['tokens_per_s']:,.0f} tokens/s, {res['tflops_6nt']:.0f} TFLOPS(6NT); bound {b.step_s:.3f} s "
          f"({b.limiter}), simulated {sim.steady_step_s:.3f} s; GPU peak {res['gpu_peak_gib']:.1f} GiB allocated "
          f"(planned {res['planned_gpu_peak_gib']:.1f} in use), {res['gpu_reserved_peak_gib']:.1f} reserved (planned "
          f"{res['planned_gpu_reserved_gib']:.1f}), host RSS {res['host_rss_gib']:.1f} GiB "
          f"(planned {res['planned_host_gib']:.1f})"
          + (f"; host AdamW in the worker {res['host_adamw_params_per_s'] / 1e9:.2f} G params/s "
             f"({res['host_adamw_params'] / 1e9:.2f}B params in {res['host_adamw_busy_s']:.3f} s)"
             if "host_adamw_params_per_s" in res else "")
          + (f" (by the kernel's clock {res['host_kernel_params_per_s'] / 1e9:.2f}: "
             f"{res['host_kernel_params'] / 1e9:.2f}B in {res['host_kernel_s']:.3f} s)"
             if "host_kernel_params_per_s" in res else "")
          + (f", of them {res['host_moments_params'] / 1e9:.2f}B masters alone, their moments after the update pass "
             f"in {res['host_moments_s']:.3f} s ({res['host_moments_params'] / res['host_moments_s'] / 1e9:.2f} G "
             f"params/s; gradient stores waited {res['host_moments_wait_s']:.3f} s for them)"
             if "host_moments_params" in res else ""))
    return res




if __name__ == "__main__":
    main()
