"""The optimizer's settings and its learning-rate schedule: :class:`OptimConfig` and :func:`lr_at` (the update itself
is :mod:`megatrain.runtime.optim.adamw`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch


# learning-rate schedules by their names in transformers.get_scheduler
SCHEDULES = ("cosine_with_min_lr", "cosine", "linear", "constant", "warmup_stable_decay")
_DECAYING = ("cosine_with_min_lr", "cosine", "linear", "warmup_stable_decay")
_WITH_MIN_LR = ("cosine_with_min_lr", "warmup_stable_decay")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (AdamW); not on biases and norm weights unless ``decay_all``
    decay_all: bool = False  # weight decay on every parameter (default: the HF Trainer's rule, see no_decay_names)
    max_grad_norm: float | None = 1.0  # clip by the exact global norm; None: no clipping
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps to lr
    warmup_start: str = "first"  # "first": the first step at lr / warmup_steps; "zero": at 0, the k-th at
    # lr x k / warmup_steps (transformers' schedules: a first step that moves only the moments and step counts)
    total_steps: int | None = None  # the steps the schedule spans; None: constant after warmup
    schedule: str | None = None  # after warmup, transformers.get_scheduler's schedule of this name (SCHEDULES);
    # None: cosine_with_min_lr where total_steps is given, else constant
    min_lr: float = 0.0  # where cosine_with_min_lr and warmup_stable_decay end
    decay_steps: int | None = None  # warmup_stable_decay: the last steps, which decay (None: a tenth of the steps
    # after warmup)
    fused: bool = True  # torch's fused AdamW kernel on the host, megatrain's Triton one for device updates (False:
    # torch's per-tensor loop on both)
    threads: int | None = None  # host threads for the update (None: torch's setting); fewer than the cores leaves
    # one free for the thread that issues GPU work, so no update waits on a descheduled thread
    host_block: int = 0  # megatrain's host kernel: 0, each OpenMP thread takes an equal contiguous share of a pass;
    # N > 0, threads take runs of N elements as they come free (a thread the OS runs late then holds up one run)
    host_kernel: str = "auto"  # with ``fused``, the host update's kernel: "native", megatrain's (cpu_adamw.c here:
    # torch's fused arithmetic, bit for bit, in one pass that does not write the gradient back, the bf16 shadow
    # written from it), built with the machine's C compiler on first use; "torch", torch's fused kernel; "auto":
    # native where it builds, else torch's (saying so once)

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"learning rate must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.warmup_start not in ("first", "zero"):
            raise ValueError(f"warmup_start must be 'first' or 'zero', got {self.warmup_start!r}")
        if self.host_kernel not in ("auto", "native", "torch"):
            raise ValueError(f"host_kernel must be 'auto', 'native' or 'torch', got {self.host_kernel!r}")
        if self.host_block < 0:
            raise ValueError(f"host_block must be 0 (a static schedule) or a positive run of elements, got "
                             f"{self.host_block}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.warmup_steps < 0 or (self.total_steps is not None and self.total_steps <= self.warmup_steps):
            raise ValueError(f"need 0 <= warmup_steps ({self.warmup_steps}) < total_steps ({self.total_steps})")
        name = self.schedule_name
        if name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
        if name in _DECAYING and self.total_steps is None:
            raise ValueError(f"the {name} schedule decays over total_steps, which is not given")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be from 0 up to the peak lr ({self.lr}), got {self.min_lr}")
        if self.min_lr and name not in _WITH_MIN_LR:
            raise ValueError(f"min_lr ({self.min_lr}) is where {' and '.join(_WITH_MIN_LR)} end; the {name} "
                             f"schedule has none")
        if self.decay_steps is not None and name != "warmup_stable_decay":
            raise ValueError(f"decay_steps is warmup_stable_decay's; the {name} schedule has none")
        if name == "warmup_stable_decay" and not 0 < self.wsd_decay_steps <= self.total_steps - self.warmup_steps:
            raise ValueError(f"decay_steps must be from 1 to the {self.total_steps - self.warmup_steps} steps after "
                             f"warmup, got {self.wsd_decay_steps}")

    @property
    def schedule_name(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "cosine_with_min_lr" if self.total_steps is not None else "constant"

    @property
    def wsd_decay_steps(self) -> int:
        if self.decay_steps is not None:
            return self.decay_steps
        return max(1, math.ceil(0.1 * (self.total_steps - self.warmup_steps)))


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup from ``lr / warmup_steps`` (or, with
    ``warmup_start="zero"``, from 0 as transformers' schedules start: a step at learning rate 0 only moves the
    moments), then the named schedule's value at ``step`` as transformers.get_scheduler computes it."""
    if cfg.warmup_start == "zero":  # transformers' factor at every step, its warmup's included
        return cfg.lr * _schedule_factor(cfg, True)(step)
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * _schedule_factor(cfg)(step)


@functools.lru_cache(maxsize=16)
def _schedule_factor(cfg: OptimConfig, warm: bool = False) -> Callable[[int], float]:
    """transformers' multiplier of the peak learning rate at a step, for ``cfg``'s schedule (``warm``: its own
    warmup included, the constant schedule's being constant_with_warmup)."""
    from transformers import get_scheduler

    name = "constant_with_warmup" if warm and cfg.schedule_name == "constant" else cfg.schedule_name
    kwargs = ({"min_lr": cfg.min_lr} if name == "cosine_with_min_lr" else
              {"num_decay_steps": cfg.wsd_decay_steps, "min_lr_ratio": cfg.min_lr / cfg.lr}
              if name == "warmup_stable_decay" else {})
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    sched = get_scheduler(name, holder, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.total_steps,
                          scheduler_specific_kwargs=kwargs)
    return sched.lr_lambdas[0]
