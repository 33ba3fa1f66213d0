"""The configuration of a ``megatrain train`` run: every option with its default and its checks, and the YAML file
that may give them."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from megatrain.data import MIN_VOCAB

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
FINE_TUNE_LR = 1e-5  # the learning rate when the model brings weights (3e-3 from scratch)
MAX_SEQ = 1 << 24  # 16,777,216 tokens: 16x the longest sequence a plan fits one H200 with (1M, docs/planner.md)
MAX_VOCAB = 1 << 20  # the largest BPE built from the data (vocabularies of released models: up to 262,144)
# what `megatrain train` says where packed rows (the default) cannot keep their documents apart
UNPACKABLE = ("{model}: this model cannot keep documents packed into one row apart (its masks are not built from "
              "positions, or its blocks carry a recurrent state or a convolution from token to token that is not run "
              "a document at a time); train with --no-packing (one document per row)")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "tiny-llama"  # "tiny-llama", a planner preset (qwen2.5-7b, ...) or an HF model directory
    data: str | None = None  # a file or directory (json, jsonl, parquet, arrow, txt), or a dataset in the local HF
    # cache by name; None: the default corpus (Python's own documentation)
    format: str | None = None  # text, alpaca, sharegpt or messages; None: from the first record's fields
    columns: str | None = None  # the format's fields under other names: "text=body,messages=conversation"
    packing: bool = True  # documents packed into rows, each attending to itself alone; False: one per row, padded
    method: str = "sft"  # sft: the loss on the data's trained tokens; dpo: preference pairs (prompt, chosen, rejected)
    beta: float = 0.1  # dpo: the strength of the reference model (TRL's beta)
    dpo_loss: str = "sigmoid"  # dpo: sigmoid, ipo or hinge, as TRL defines them
    ref_model: str | None = None  # dpo: an HF model directory as the reference (default: the initial weights)
    streaming: bool = False  # read the data as training goes (a corpus larger than memory), shuffled in a buffer
    eval_data: str | None = None  # held-out data (as data) to report the loss on
    eval_split: float = 0.0  # or this share of the data's documents held out (seeded); 0: none
    eval_every: int = 0  # the held-out loss every this many steps (0: at the end only)
    steps: int = 300
    chat_template: str | None = None  # a file holding a Jinja chat template used instead of the tokenizer's
    epochs: float | None = None  # passes over the data's rows; given, the steps are derived from it (rounded up)
    batch: int = 16  # sequences per step
    seq: int = 128  # tokens per sequence
    lr: float | None = None  # peak learning rate; None: 1e-5 where the model brings weights, else 3e-3
    warmup: int | None = None  # warmup steps, then the schedule; None: a tenth of the steps, at most 30 (fine-tuning
    # a model with weights: 3% of the steps)
    warmup_start: str | None = None  # "zero": the first warmup step at lr 0 (transformers' rule); "first": at
    # lr / warmup; None: "zero" for fine-tuning (a recipe from the HF Trainer or TRL takes the same steps), else "first"
    schedule: str = "cosine_with_min_lr"  # after warmup: one of transformers.get_scheduler's (optim_config.SCHEDULES)
    min_lr: float | None = None  # where cosine_with_min_lr / warmup_stable_decay end; None: lr / 10 / 0
    decay_steps: int | None = None  # warmup_stable_decay's decaying steps (None: a tenth of those after warmup)
    betas: str = "0.9,0.95"  # Adam's beta1,beta2
    weight_decay: float = 0.1  # on all but biases and norm weights (the HF Trainer's rule) unless decay_all
    decay_all: bool = False
    freeze: str | None = None  # parameters not to train: comma-separated name patterns (fnmatch), e.g.
    # "model.embed_tokens.*,model.layers.[0-3].*"
    clip: float | None = 1.0  # global-norm clipping; None: off
    mb: int | None = None  # micro-batches per step; None: 2 where the batch splits in two, else 1
    slots: int | str = 2  # weight slots; "all": one per layer
    dropped_checkpoints: int | str = "auto"  # checkpoints the forward drops, made again in the backward ("auto":
    # none unless no plan keeping them all fits a sequence of 131,072 tokens or more)
    host_checkpoints: int | str = "auto"  # layers whose checkpoints wait on the host ("auto": compile()'s, the
    # planner's choice of none or all on a GPU, none on the CPU)
    gpu_opt_every: int | str | None = None  # every k-th layer updated on the GPU (0: all on the host; "auto": the
    # planner's; None: compile()'s default, "auto" on a GPU and 0 on the CPU)
    split_opt: int | str | None = None  # host-updated layers updated on the GPU after the backward, state streamed
    # in parts (0: none; "auto": the planner's; None: compile()'s default, "auto" on a GPU and 0 on the CPU)
    speculate: int | str | None = None  # host-updated layers whose update starts before the step's global norm (0:
    # none; "auto": the planner's; None: compile()'s default, "auto" on a GPU and 0 on the CPU)
    speculate_keeps: str = "masters"  # what such an update keeps to be made again: "masters", "state" (a spare
    # block, 12 bytes a parameter, one update pass) or "auto": the planner's choice
    clip_rate: float = 0.1  # the share of steps expected to be clipped ("auto" speculation weighs it)
    wire: str = "fp32"  # weights on the wire: fp32 (cast on the device) or bf16 (host shadow; needs bf16 compute)
    saved_acts: int | str = "auto"  # layers whose backward reuses the forward's activations, no recompute (a
    # count, the last ones; "auto": as many as the device memory holds)
    resident_opt: int | str = "auto"  # GPU-updated layers whose state stays on the GPU between steps ("auto": the
    # planner's)
    grad_kept: int | str = "auto"  # host-updated layers whose gradient stays on the GPU until the update pass
    # ("auto": as many as fit)
    grad_host_dtype: str = "fp32"  # or "bf16": gradients may go to the host in bf16 where fp32 ones do not fit
    seq_tile: int | str = "auto"  # tokens per tile of the blocks' MLPs (long sequences; 0: untiled; "auto": planned)
    host_gib: float | None = None  # host memory the plan may use (default: what the machine has available)
    gpu_gib: float | None = None  # device memory the plan may fill, the allocator capped to it (default: the card's)
    hardware: str | None = None  # the spec the plan is made for: a preset (h100, h200, cpu) or a spec file such as
    # megatrain probe writes for this machine; None: the card's preset, with the host memory available
    vocab: int = 1024  # BPE vocabulary built from the data when the model brings no tokenizer
    export_dtype: str | None = None  # the exported weights' dtype (bf16, fp32, fp16); None: the model's own
    eos_token: str | None = None  # tokens the exported generation_config stops at besides its own and the chat
    # template's end of turn, comma-separated (each one token of the vocabulary)
    seed: int = 0
    device: str | None = None  # default: cuda when present, else cpu
    out: str | None = None  # default: megatrain-runs/<UTC time>
    save_every: int = 0  # also save the training state every this many steps (0: at the end only)
    on_nonfinite: str = "stop"  # a step whose loss or gradient norm is not finite applies no update; then "stop"
    # (save nothing more, say where the last state is) or "skip" (go on with the next batch; stop after
    # MAX_SKIPPED in a row)
    report_to: str = ""  # experiment trackers given the metrics, comma-separated: tensorboard, wandb, mlflow
    tensorboard: bool = False  # the same as tensorboard in report_to
    trust_remote_code: bool = False  # run the Python files of a model directory whose config names them (auto_map)
    resume: str | None = None  # an earlier run's directory: go on from the training state it saved (a flag only)

    @property
    def fine_tune(self) -> bool:
        """The model brings weights of its own (an HF directory with safetensors)."""
        from megatrain.inputs import WEIGHT_FILES

        return any((Path(self.model) / f).is_file() for f in WEIGHT_FILES)

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else FINE_TUNE_LR if self.fine_tune else 3e-3

    @property
    def warmup_steps(self) -> int:
        if self.warmup is not None:
            return self.warmup
        # (a run of one step has none: the default never asks for as many warmup steps as the run has)
        return min(math.ceil(0.03 * self.steps), self.steps - 1) if self.fine_tune else min(30, self.steps // 10)

    @property
    def min_lr_value(self) -> float:
        if self.min_lr is not None:
            return self.min_lr
        return self.peak_lr / 10 if self.schedule == "cosine_with_min_lr" else 0.0

    def beta_pair(self) -> tuple[float, float]:
        """``betas`` as two numbers; ValueError where it is not ``beta1,beta2``."""
        try:
            b1, b2 = (float(x) for x in self.betas.split(","))
        except ValueError:
            raise ValueError(f"betas must be two numbers separated by a comma, e.g. 0.9,0.95, got {self.betas!r}") \
                from None
        return b1, b2

    def stop_tokens(self) -> tuple[str, ...]:
        """``eos_token`` as a tuple of tokens."""
        return tuple(t.strip() for t in (self.eos_token or "").split(",") if t.strip())

    def freeze_patterns(self) -> list[str]:
        return [p.strip() for p in (self.freeze or "").split(",") if p.strip()]

    def optim_config(self):
        """The optimizer's settings (OptimConfig checks them: schedule names, min_lr, betas)."""
        from megatrain.runtime.optim import OptimConfig

        return OptimConfig(lr=self.peak_lr, betas=self.beta_pair(), weight_decay=self.weight_decay,
                           decay_all=self.decay_all, max_grad_norm=self.clip, warmup_steps=self.warmup_steps,
                           warmup_start=self.warmup_start or ("zero" if self.fine_tune else "first"),
                           total_steps=self.steps, schedule=self.schedule, min_lr=self.min_lr_value,
                           decay_steps=self.decay_steps)

    def plan_options(self, world: int = 1):
        """The plan this run asks for (the one place the run's option names become the plan's), for one of
        ``world`` data-parallel ranks: each runs ``mb / world`` micro-batches."""
        from megatrain.planner.request import PlanOptions

        return PlanOptions(n_mb=self.mb // world, weight_slots=self.slots, host_checkpoints=self.host_checkpoints,
                           dropped_checkpoints=self.dropped_checkpoints,
                           gpu_opt_every=self.gpu_opt_every, split_opt=self.split_opt, speculate=self.speculate,
                           clip_rate=self.clip_rate, speculate_keeps=self.speculate_keeps, wire=self.wire,
                           saved_acts=self.saved_acts, resident_opt=self.resident_opt, grad_kept=self.grad_kept,
                           grad_host_dtype=self.grad_host_dtype, seq_tile=self.seq_tile,
                           host_budget_gib=self.host_gib, device_budget_gib=self.gpu_gib)

    def column_map(self) -> dict[str, str]:
        """``columns`` as format field -> column; ValueError where it is not ``field=column,...``."""
        if not self.columns:
            return {}
        pairs = [p.split("=", 1) for p in self.columns.split(",") if p.strip()]
        if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
            raise ValueError(f"columns must be field=column pairs separated by commas, got {self.columns!r}")
        return {a.strip(): b.strip() for a, b in pairs}

    def __post_init__(self) -> None:
        if self.mb is None and isinstance(self.batch, int) and not isinstance(self.batch, bool):
            object.__setattr__(self, "mb", 2 if self.batch % 2 == 0 else 1)

    def check(self) -> None:
        self._check_types()  # (mb is None only where batch is not an integer, which this names)
        for name in ("steps", "batch", "mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0 (0: save the training state at the end only), got "
                             f"{self.save_every}")
        if self.seq < 2:
            raise ValueError(f"seq must be at least 2 (each token is predicted from the ones before it), got "
                             f"{self.seq}")
        if self.seq > MAX_SEQ:
            raise ValueError(f"seq must be at most {MAX_SEQ:,} tokens (the longest sequence megatrain plans for), got "
                             f"{self.seq:,}")
        if self.vocab > MAX_VOCAB:
            raise ValueError(f"vocab must be at most {MAX_VOCAB:,} (the largest vocabulary megatrain builds a "
                             f"tokenizer of), got {self.vocab:,}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer from 0 to 2**63 - 1, got {self.seed}")
        if self.vocab < MIN_VOCAB:
            raise ValueError(f"vocab must be at least {MIN_VOCAB} (the byte-level tokenizer's 256 bytes and its "
                             f"special tokens), got {self.vocab}")
        if self.wire == "auto":
            raise ValueError("wire must be 'fp32' or 'bf16' for a run (the search's choice of the two is for "
                             "megatrain plan)")
        self.plan_options()  # the plan options' own checks
        if self.hardware is not None:  # a preset's name or a spec file that reads, before anything is built
            from megatrain.planner.hardware import hardware

            hardware(self.hardware)
        if self.batch % self.mb:
            raise ValueError(f"batch ({self.batch}) must be a multiple of mb ({self.mb})")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        from megatrain.data import FORMATS
        from megatrain.export import export_dtype

        if not (0 <= self.eval_split < 1) or not math.isfinite(self.eval_split):
            raise ValueError(f"eval_split must be a share of the data from 0 up to (not including) 1, got "
                             f"{self.eval_split}")
        if self.eval_data is not None and self.eval_split:
            raise ValueError("give eval_data or eval_split, not both")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: at the end only), got {self.eval_every}")
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        self.column_map()
        if self.export_dtype is not None:
            export_dtype(self.export_dtype)
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0, or null for no clipping, got {self.clip}")
        if self.epochs is not None and not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"epochs must be a finite number > 0, got {self.epochs}")
        if self.epochs is not None and self.streaming:
            raise ValueError("--epochs needs the data's size, which streamed data (--streaming) does not have "
                             "before it is read: give --steps")
        if self.method not in ("sft", "dpo"):
            raise ValueError(f"method must be sft or dpo, got {self.method!r}")
        if self.method == "dpo":
            from megatrain.objectives import DPO

            DPO(self.beta, self.dpo_loss)  # (its own checks)
            if self.streaming or self.eval_data or self.eval_split:
                raise ValueError("--method dpo reads its pairs whole and holds none out (no --streaming, --eval-data "
                                 "or --eval-split)")
            if self.batch % (2 * self.mb):
                raise ValueError(f"--method dpo: --batch ({self.batch}) counts sequences, two per pair, and each of "
                                 f"the {self.mb} micro-batches holds whole pairs: a multiple of {2 * self.mb}")
        if self.ref_model is not None and self.method != "dpo":
            raise ValueError("--ref-model is the reference of --method dpo")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"need 0 <= warmup ({self.warmup_steps}) < steps ({self.steps})")
        self.optim_config()
        self.trackers()

    def trackers(self) -> tuple[str, ...]:
        """The trackers the run reports to (each one's package checked)."""
        from megatrain.trackers import parse

        return parse(",".join(["tensorboard"] * self.tensorboard + [self.report_to]))

    def _check_types(self) -> None:
        """Each value of the type its field declares (a YAML file can hold anything); an int serves a float."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
            if v is None and type(None) in allowed:
                continue
            kinds = [a for a in allowed if a is not type(None)]
            if (isinstance(v, bool) and bool not in allowed) or not any(
                    isinstance(v, int if a is float else a) or isinstance(v, a) for a in kinds):
                names = " or ".join(_TYPE_NAMES[a] for a in allowed)
                raise ValueError(f"{f.name} must be {names}, got {v!r}")


def _yaml_loader():
    """YAML's safe loader, reading ``1e-3`` as a number (YAML 1.1, which PyYAML implements, wants ``1.0e-3``)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader


def load_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {p} does not exist")
    try:
        d = yaml.load(p.read_text(encoding="utf-8"), Loader=_yaml_loader()) or {}
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        raise ValueError(f"{p} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{p}: expected a mapping of option names to values, got a {type(d).__name__}")
    d = {str(k).replace("-", "_"): v for k, v in d.items()}  # the flags' spelling works too
    if isinstance(d.get("betas"), list):  # betas: [0.9, 0.95]
        d["betas"] = ",".join(str(b) for b in d["betas"])
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    if d.get("trust_remote_code"):
        raise ValueError(f"{p}: 'trust_remote_code' is a flag only (--trust-remote-code): a config file, like a run "
                         f"directory, is data that may come from someone else, and cannot allow a model's code to run")
    if "resume" in d:
        raise ValueError(f"{p}: 'resume' is a flag only (megatrain train --resume RUN_DIR goes on with that run's own "
                         f"config, checked against it); a config file cannot name it")
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{p}: unknown keys {unknown}; known: {sorted(names - {'resume'})}")
    return d
