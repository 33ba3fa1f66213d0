"""Command line: ``megatrain train``, ``megatrain plan``, ``megatrain export`` and ``megatrain viz``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys

from megatrain import plan_command
from megatrain.plan_command import (dropped_checkpoints, gpu_opt_every, grad_kept, host_checkpoints, resident_opt,
                                     saved_acts, seq_tile, speculate, split_opt)
from megatrain.rundir import stop_at_once

GiB = 1 << 30


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
        if "epochs" in given and "steps" in given:
            raise ValueError(f"give --steps ({given['steps']}) or --epochs ({given['epochs']:g}), not both: the "
                             f"steps are derived from the epochs")
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


def _probe(args) -> int:
    from megatrain.probe import probe

    try:
        probe(args.out, device=args.device, seconds=args.seconds, json_path=args.json)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"megatrain probe: {e}", file=sys.stderr)
        return 2
    return 0


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
                           ("seq", int, "tokens per sequence (128)"), ("lr", float, "peak learning rate (1e-5 fine-tuning a model with "
                                                                         "weights, 3e-3 from scratch)"),
                           ("chat_template", str, "a file holding a Jinja chat template to render chat data "
                                                  "with instead of the tokenizer's, or a template's name: chatml "
                                                  "or llama3 (the export carries it)"),
                           ("epochs", float, "passes over the data's rows, the steps derived from it (rounded "
                                             "up; instead of --steps)"),
                           ("warmup", int, "warmup steps (3%% of the steps fine-tuning a model with weights; from "
                                           "scratch a tenth, at most 30)"),
                           ("warmup_start", str, "the first warmup step's learning rate: zero (transformers' rule, "
                                                 "the default with --model) or first (lr / warmup, the default "
                                                 "from scratch)"),
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
                           ("mb", int, "micro-batches per step (2 where --batch is even, else 1)"),
                           ("slots", _slots, "weight slots (2; all: one per layer)"),
                           ("host_checkpoints", host_checkpoints, "layers whose checkpoints wait on the host ("
                                                                  "auto: the planner's choice of none or all on a "
                                                                  "GPU, none on the CPU)"),
                           ("dropped_checkpoints", dropped_checkpoints, "checkpoints the forward drops, made again "
                                                                        "in the backward (auto: none unless no plan "
                                                                        "keeping them fits a long sequence)"),
                           ("gpu_opt_every", gpu_opt_every, "update every k-th layer on the GPU, not the host (0: none; "
                                                     "auto: the planner's choice; default auto on a GPU, 0 on "
                                                     "the CPU)"),
                           ("split_opt", split_opt, "layers updated on the host that are updated on the GPU instead "
                                                 "after the backward, state streamed in parts (0: none; auto: the "
                                                 "planner's choice; default auto on a GPU, 0 on the CPU)"),
                           ("speculate", speculate, "host-updated layers (the last ones) whose update starts "
                                                    "before the step's global norm, checked and made again where "
                                                    "the step is clipped (off: none; auto: the planner's window; "
                                                    "default auto on a GPU, off on the CPU)"),
                           ("speculate_keeps", str, "what an update before the norm keeps to be made again: "
                                                    "masters (the default), state (a spare block, 12 bytes a "
                                                    "parameter, one pass) or auto (the planner's choice)"),
                           ("clip_rate", float, "the share of steps expected to be clipped, which --speculate auto "
                                                "weighs (0.1)"),
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
                           ("hardware", str, "the hardware spec to plan for: a preset (h100, h200, cpu) or a "
                                              "spec file, e.g. what megatrain probe wrote on this machine "
                                              "(default: the card's preset, with the host memory available)"),
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
    t.add_argument("--method", choices=["sft", "dpo"],
                   help="sft (default): the loss on the data's trained tokens; dpo: direct preference optimization "
                        "on pairs (records with prompt, chosen, rejected: strings or message lists), the reference "
                        "the initial weights, their log-probabilities from one forward pass before the first step")
    t.add_argument("--beta", type=float, help="dpo: the strength of the reference model (0.1)")
    t.add_argument("--ref-model", dest="ref_model", metavar="DIR",
                   help="dpo: an HF model directory (the same tokenizer's) as the reference instead of the initial "
                        "weights: streamed alone before the model trained is loaded, its store then freed")
    t.add_argument("--dpo-loss", dest="dpo_loss", choices=["sigmoid", "ipo", "hinge"],
                   help="dpo: the loss of a pair, as TRL defines it (sigmoid)")
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
    t.add_argument("--eos-token", dest="eos_token", metavar="TOKEN[,TOKEN]",
                   help="tokens the exported model's generation stops at, besides its own end of sequence and its chat "
                        "template's end of turn (added without this flag)")
    t.add_argument("--on-nonfinite", dest="on_nonfinite", choices=["stop", "skip"],
                   help="a step whose loss or gradient norm is not finite applies no update; then stop (default) "
                        "or skip to the next batch (stopping after 10 in a row)")
    t.add_argument("--gpus", type=int, metavar="N",
                   help="data parallel over N processes (torchrun launched for them; on the CPU, N processes over "
                        "gloo): each trains batch / N sequences in mb / N micro-batches, the gradients summed across "
                        "them; the same as one process training the whole batch")
    t.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true", default=None,
                   help="run the Python files a model directory's config.json names (auto_map); off by default")
    t.add_argument("--report-to", dest="report_to", metavar="NAME[,NAME]",
                   help="experiment trackers given each step's metrics, through their own clients: tensorboard "
                        "(events in <out>/tensorboard), wandb ($WANDB_PROJECT, default megatrain; $WANDB_MODE=offline "
                        "to sync later), mlflow ($MLFLOW_TRACKING_URI, default an SQLite store <out>/mlflow.db); none "
                        "by default")
    t.add_argument("--tensorboard", action="store_true", default=None, help="the same as --report-to tensorboard")
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
    p.add_argument("--dropped-checkpoints", metavar="N|auto", default="auto",
                   help="checkpoints the forward drops (every other one, or runs of up to 3 between kept ones), "
                        "each made again in the backward from the kept one below; auto (default): none unless no "
                        "plan keeping them all fits a sequence of 131,072 tokens or more")
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
    p.add_argument("--speculate", metavar="N|auto|off",
                   help="of the layers updated on the host, N (the last ones: their gradients come first) start "
                        "their update before the step's global norm is known, validated once it is and made again "
                        "where the step is clipped (with clipping; 4 bytes of host memory a parameter); auto: the "
                        "window the host memory, the backward and --clip-rate allow; default: auto, or off for "
                        "--hardware cpu")
    p.add_argument("--speculate-keeps", choices=["auto", "masters", "state"], default="masters",
                   help="what an update made before the norm keeps to be made again where the step is clipped: "
                        "masters (4 bytes a parameter; its moments made after the norm, in a second pass over the "
                        "layer), state (it writes its whole update to a spare block, 12 bytes a parameter, in one "
                        "pass) or auto (the search's choice); default: masters")
    p.add_argument("--clip-rate", type=float, default=0.1, metavar="P",
                   help="the share of steps expected to be clipped, which --speculate auto weighs (default 0.1)")
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
    p.add_argument("--search", choices=["descent", "exhaustive"], default="descent",
                   help="descent (default): a coordinate descent over the decisions, candidates pruned by a floor "
                        "under their compute; exhaustive: every candidate built and simulated (the reference, "
                        "minutes for a 70B shape)")
    p.add_argument("--out", default="megatrain-plan", help="directory for the PNG, trace and schedule dumps")
    p.add_argument("--table", action="store_true", help="print every op with its simulated times")
    p.set_defaults(fn=plan_command.plan)
    e = sub.add_parser("export", help="a run's training state as an HF model directory (from_pretrained)")
    e.add_argument("run", help="a run directory of megatrain train (or its state directory)")
    e.add_argument("out", help="the model directory to write (new or empty)")
    e.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="dtype of the weights (default: the run's)")
    e.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                   help="run the Python files the model's config names (auto_map); never taken from the run")
    e.set_defaults(fn=_export)
    r = sub.add_parser("probe", help="measure this machine's host link and host AdamW: a hardware spec to plan with")
    r.add_argument("--out", default="hardware.json", help="the spec file to write (for --hardware FILE)")
    r.add_argument("--device", default="cuda", help="the GPU whose link is measured (cuda, cuda:1, ...)")
    r.add_argument("--seconds", type=float, default=3.0, help="each case's length (3; nine cases)")
    r.add_argument("--json", help="also write the measured rates and the fitted fields here")
    r.set_defaults(fn=_probe)
    v = sub.add_parser("viz", help="draw simulated and measured timelines on one picture and one Chrome trace")
    v.add_argument("--schedule", help="schedule text to simulate (with --preset/--config and --hardware)")
    vsrc = v.add_mutually_exclusive_group()
    vsrc.add_argument("--preset", default="qwen2.5-7b", help="model shape preset for the simulation")
    vsrc.add_argument("--config", help="HF config.json for the simulation")
    v.add_argument("--hardware", default="h200", help="hardware preset or JSON spec for the simulation")
    v.add_argument("--timeline", nargs="*", default=[], help="measured timeline JSON files (benchmarks write them)")
    v.add_argument("--out", default="megatrain-viz", help="output directory")
    v.set_defaults(fn=plan_command.viz)
    args = ap.parse_args(argv)
    args.argv = argv
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
