"""The plan a run asks for: every decision the planner may be told (the rest it searches), with one name each and
checked once; what is left to the device is decided here, and the search's arguments are formed here alone
(``megatrain plan``, ``megatrain train`` and ``compile()`` all plan through :meth:`PlanOptions.search_kwargs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatrain.planner.checks import SPECULATE_KEEPS
from megatrain.planner.choices import LONG_SEQ, check_resident


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    n_mb: int | str = 1  # micro-batches per step; "auto": the search's choice for the step's shape (a divisor of
    # the batch, micro-batches of up to choices.MAX_MB_TOKENS tokens)
    weight_slots: int | str = 2  # device buffers for layers' weights; "all": one per layer, so the backward finds
    # every layer's weights still there from the forward and each layer is loaded once per step; "auto": the
    # search's choice (2, 3 or all)
    grad_slots: int | str = "auto"  # device fp32 gradient slots; "auto": 2, or the search's 1 or 2 for sequences of
    # choices.LONG_SEQ tokens and more
    host_checkpoints: int | str = "auto"  # layers (from the first block up) whose checkpoints wait on the host;
    # "auto": on a GPU the search's choice of all on the device or all on the host, on the CPU none; for sequences
    # of choices.LONG_SEQ tokens or more also the search's split (long checkpoints)
    dropped_checkpoints: int | str = "auto"  # checkpoints the forward drops (those at blocks 2, 4, ..: every other
    # one), each made again in the backward by a forward of the layer below: a forward more per checkpoint dropped,
    # for memory; "auto": none, unless no plan keeping them all fits a sequence of choices.LONG_SEQ tokens or more
    # (then the search's count)
    gpu_opt_every: int | str | None = None  # every k-th layer (of those owning weights) is updated on the GPU;
    # 0: none; "auto": the set the simulation finds fastest for the step's shape (see megatrain.planner.search);
    # None: the device's default (DEVICE_DEFAULTS: "auto" on a GPU, 0 on the CPU)
    wire: str = "fp32"  # weights on the wire: "fp32" (the master, cast on the device) or "bf16" (a host shadow
    # the optimizer keeps current: half the bytes per load, a host cast per update, 2 more bytes per param of RAM);
    # "auto": the search's choice of the two
    saved_acts: int | str = "auto"  # layers whose forward keeps its activations on the device so that their
    # backward does not recompute it: a count (the last ones), or "auto": as many as the device memory the plan
    # leaves free holds (see megatrain.planner.choices.saved_act_layers)
    resident_opt: int | str = "auto"  # of the layers updated on the GPU, how many (the first ones) keep their
    # master weights and moments there between steps instead of sending them to the host and back every step
    # (state_dict() writes them back); "auto": the simulation's choice (see megatrain.planner.choices.resident_sets)
    grad_kept: int | str = "auto"  # of the layers updated on the host, how many (the first ones) keep their
    # gradient on the device until the update pass instead of in a host buffer of their own (with clipping); "auto":
    # as many as the device memory holds, before saved activations (see megatrain.planner.choices.with_grad_kept)
    grad_host_dtype: str = "fp32"  # "bf16" allows gradients to go to the host in bf16 where no plan with fp32 ones
    # fits the host memory
    host_budget_gib: float | None = None  # host memory the plan may use (the store, its buffers and host
    # checkpoints), GiB: a plan leaves the rest to other work; None: what the machine has available (or the hardware
    # spec's, where one is given)
    seq_tile: int | str = "auto"  # tokens per tile of the blocks' MLPs in recomputed layers (ScheduleConfig.seq_tile;
    # long sequences: the MLP's intermediate held for one tile at a time); 0: untiled; "auto": the search's choice
    split_opt: int | str | None = None  # of the layers updated on the host, how many have their update done on
    # the GPU instead, in the update pass after the backward (with clipping), their master weights and moments
    # streamed over PCIe in parts, next to the host's updates of the others; "auto": the simulation's choice (see
    # megatrain.planner.choices.split_sets); None: the device's default (as gpu_opt_every)
    opt_part: int | None = None  # elements of one part of a split update's state (None: the planner's SPLIT_PART)
    speculate: int | str | None = None  # of the layers updated on the host, how many (the last ones, whose
    # gradients come first) start their update before the step's global norm is known, with clipping: validated
    # once it is, and made again where the step is clipped (bit for bit the update after the norm; 4 bytes of host
    # memory per parameter); 0: none; "auto": the search's window (see megatrain.planner.speculation); None: the
    # device's default (as gpu_opt_every)
    speculate_keeps: str = "masters"  # what an update before the norm keeps to be made again: "masters" (4 bytes a
    # parameter; its moments made after the norm, a second pass), "state" (a spare block of 12 bytes a parameter
    # its whole update goes to, one pass), or "auto": the search's choice (not the default: the plans where the
    # two forms differ, the whole 70B's, are not measured)
    clip_rate: float = 0.1  # the share of steps expected to be clipped, which the search weighs "auto" speculation by
    device_budget_gib: float | None = None  # device memory the plan may fill, GiB; on a GPU torch's caching
    # allocator is capped for this process to it plus the hardware spec's reserve (its rounding and fragmentation),
    # as on a card of that size (a 24, 48 or 80 GB card's plan on a larger one); None: the card's, less the reserve

    def __post_init__(self):
        if self.wire not in ("fp32", "bf16", "auto"):
            raise ValueError(f"wire must be 'fp32', 'bf16' or 'auto', got {self.wire!r}")
        if self.speculate_keeps not in ("auto", *SPECULATE_KEEPS):
            raise ValueError(f"speculate_keeps must be 'masters', 'state' or 'auto', got {self.speculate_keeps!r}")
        if self.grad_host_dtype not in ("fp32", "bf16"):
            raise ValueError(f"grad_host_dtype must be 'fp32' or 'bf16', got {self.grad_host_dtype!r}")
        for name in ("n_mb", "grad_slots"):
            v = getattr(self, name)
            if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or 'auto', got {v!r}")
        if self.seq_tile != "auto" and (not isinstance(self.seq_tile, int) or isinstance(self.seq_tile, bool)
                                        or self.seq_tile < 0):
            raise ValueError(f"seq_tile must be 'auto' or a number of tokens >= 0 (0: untiled), got "
                             f"{self.seq_tile!r}")
        h = self.host_checkpoints
        if h != "auto" and (not isinstance(h, int) or isinstance(h, bool) or h < 0):
            raise ValueError(f"host_checkpoints must be 'auto' or an integer >= 0, got {h!r}")
        w = self.weight_slots
        if w not in ("all", "auto") and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"weight_slots must be an integer >= 1, 'all' or 'auto', got {w!r}")
        for name, zero in (("gpu_opt_every", "every update on the host"), ("saved_acts", "every backward recomputes"),
                           ("resident_opt", "every device update's state goes back to the host each step"),
                           ("grad_kept", "every gradient goes to the host during the backward"),
                           ("split_opt", "every host-updated layer stays on the host"),
                           ("speculate", "every update waits for the step's global norm"),
                           ("dropped_checkpoints", "the forward keeps every checkpoint")):
            v = getattr(self, name)
            if v is None and name in DEVICE_DEFAULTS:
                continue
            if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0 (0: {zero}) or 'auto', got {v!r}")
        check_resident(self.gpu_opt_every, self.resident_opt)  # a PlanError, which is a ValueError
        if isinstance(self.clip_rate, bool) or not isinstance(self.clip_rate, (int, float)) or \
                not 0 <= self.clip_rate <= 1:
            raise ValueError(f"clip_rate must be a share of steps in 0..1, got {self.clip_rate!r}")
        if self.opt_part is not None and (not isinstance(self.opt_part, int) or isinstance(self.opt_part, bool)
                                          or self.opt_part < 1):
            raise ValueError(f"opt_part must be a number of elements >= 1 or None, got {self.opt_part!r}")
        for name in ("host_budget_gib", "device_budget_gib"):
            h = getattr(self, name)
            if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) or
                                  h <= 0):
                raise ValueError(f"{name} must be a finite number of GiB > 0, got {h!r}")

    def on_device(self, on_gpu: bool) -> "PlanOptions":
        """These options with the device's defaults filled in where they were left to it (None)."""
        return replace(self, **{k: DEVICE_DEFAULTS[k][0 if on_gpu else 1] for k in DEVICE_DEFAULTS
                                if getattr(self, k) is None})

    def search_kwargs(self, seq_len: int, on_gpu: bool) -> dict:
        """The arguments of :func:`megatrain.planner.search.plan` for these options (a fixed value pins a
        decision, "auto" leaves it to the search) on a GPU or the CPU, for sequences of ``seq_len`` tokens."""
        o = self.on_device(on_gpu)
        auto = lambda v: None if v == "auto" else v  # noqa: E731
        return dict(saved_acts=o.saved_acts, grad_kept=o.grad_kept, grad_host_dtype=o.grad_host_dtype,
                    split_opt=o.split_opt, opt_part=o.opt_part, n_mb=auto(o.n_mb), weight_slots=auto(o.weight_slots),
                    grad_slots=auto(o.grad_slots), wire_bytes={"bf16": 2, "fp32": 4, "auto": None}[o.wire],
                    host_checkpoints=host_checkpoints(o.host_checkpoints, seq_len, on_gpu),
                    gpu_opt_every=auto(o.gpu_opt_every), resident_opt=auto(o.resident_opt),
                    seq_tile=auto(o.seq_tile), speculate=o.speculate, clip_rate=o.clip_rate,
                    speculate_keeps=o.speculate_keeps, dropped_checkpoints=auto(o.dropped_checkpoints))


# decisions whose default depends on the device: (on a GPU, on the CPU). On the H200 device updates and split
# updates were faster at every size measured (docs/benchmark-history.md); on the CPU a "device" update is a host
# update by another path. Updates before the norm (speculate): on an H100 6% faster on a Mistral-123B slice at
# 24 GiB, slower on the 7B shape (docs/benchmarks.md), so the search takes a window only where it is simulated well
# ahead (search.SPECULATE_GAIN); the CPU's program order overlaps nothing
DEVICE_DEFAULTS = {"gpu_opt_every": ("auto", 0), "split_opt": ("auto", 0), "speculate": ("auto", 0)}


def host_checkpoints(choice: int | str, seq_len: int, on_gpu: bool) -> int | None:
    """The search's ``host_checkpoints`` (None: searched). "auto" on a GPU searches every checkpoint on the device
    against every one on the host (and the splits of long sequences): with the checkpoints in pinned buffers of
    their own size the host ones measured faster at 24 and 48 GiB budgets. On the CPU the host is the device, so a
    checkpoint "offloaded" only adds a copy: none there, except for long sequences, where the search's split is
    what fits."""
    if choice != "auto":
        return choice
    return None if on_gpu or seq_len >= LONG_SEQ else 0
