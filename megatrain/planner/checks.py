"""The error of a request that cannot be planned, and the checks of a schedule config's decisions that both the
passes which build from it and the verifier make: a decision the graph or the other decisions rule out is refused
with the rule it breaks."""

from __future__ import annotations

from megatrain.ir import LayerGraph, ScheduleConfig
from megatrain.ir.schedule import MAX_DROP_RUN, droppable, max_dropped


class PlanError(ValueError):
    """The request cannot be planned; the message names the limit and the numbers."""


class NoFit(PlanError):
    """No plan of the request fits the device budget or the host, though a shorter sequence might: what the memory
    of each candidate decided, not an option no plan can take. ``longest``: the longest sequence whose smallest plan
    fits the budget, where the request was refused before a search (None: a search found none); ``device``: the
    device budget refused some candidate (a shorter sequence needs less of it)."""

    def __init__(self, message: str, longest: int | None = None, device: bool = False):
        super().__init__(message)
        self.longest, self.device = longest, device


def check_grad_kept(graph: LayerGraph, cfg: ScheduleConfig) -> None:
    """Refuse ``grad_kept`` layers that cannot keep their gradient on the device until the update pass: it is for
    layers updated on the host, that own their weights and share them with none, with clipping (without it each
    update follows its gradient anyway)."""
    kept = cfg.grad_kept
    bad = sorted(l for l in kept if not 0 <= l < len(graph) or graph[l].tie is not None or graph.tied_to(l)
                 or l in cfg.gpu_opt)
    if bad or len(set(kept)) != len(kept) or (kept and not (cfg.clip and cfg.train)):
        raise ValueError(f"grad_kept {list(kept)}: each layer at most once, only with clipping, and only layers "
                         f"updated on the host that own their weights and share them with none (not {bad})")


def check_split_opt(graph: LayerGraph, cfg: ScheduleConfig) -> None:
    """Refuse ``split_opt`` layers that cannot be updated on the device in the update pass: it is for layers that
    own their weights and share them with none, have parameters to train, are not in ``gpu_opt``, with clipping
    (the update pass follows the backward)."""
    split = cfg.split_opt
    bad = sorted(l for l in split if not 0 <= l < len(graph) or graph[l].tie is not None or graph.tied_to(l)
                 or graph[l].frozen or l in cfg.gpu_opt)
    if bad or len(set(split)) != len(split) or (split and not (cfg.clip and cfg.train)) or cfg.opt_part < 0:
        raise ValueError(f"split_opt {list(split)} (parts of {cfg.opt_part} elements): each layer at most once, "
                         f"only with clipping, only layers that own their weights, share them with none, train and "
                         f"are not in gpu_opt (not {bad}); parts of >= 0 elements")


SPECULATE_KEEPS = ("masters", "state")  # ScheduleConfig.speculate_keeps


def check_speculate(graph: LayerGraph, cfg: ScheduleConfig) -> None:
    """Refuse ``speculate`` layers whose update cannot start before the step's global norm: it is for layers
    updated on the host (not in ``gpu_opt`` or ``split_opt``) whose gradient goes to the host during the backward
    (not in ``grad_kept``), that own their weights and share them with none and have parameters to train, with
    clipping (without it every update follows its gradient anyway)."""
    spec = cfg.speculate
    bad = sorted(l for l in spec if not 0 <= l < len(graph) or graph[l].tie is not None or graph.tied_to(l)
                 or graph[l].frozen or l in cfg.gpu_opt or l in cfg.split_opt or l in cfg.grad_kept)
    if bad or len(set(spec)) != len(spec) or (spec and not (cfg.clip and cfg.train)):
        raise ValueError(f"speculate {list(spec)}: each layer at most once, only with clipping, and only layers "
                         f"updated on the host whose gradient goes to the host during the backward (not in gpu_opt, "
                         f"split_opt or grad_kept), that own their weights, share them with none and train "
                         f"(not {bad})")
    if cfg.speculate_keeps not in SPECULATE_KEEPS:
        raise ValueError(f"speculate_keeps must be one of {', '.join(SPECULATE_KEEPS)}, got {cfg.speculate_keeps!r}")


def check_dropped(graph: LayerGraph, cfg: ScheduleConfig) -> None:
    """Refuse ``dropped_checkpoints`` beyond what runs of :data:`~megatrain.ir.schedule.MAX_DROP_RUN` drop, or
    dropping the checkpoint of a layer in ``saved_acts`` (its backward reads what its forward kept, not a forward
    made again)."""
    n, most = cfg.dropped_checkpoints, max_dropped(droppable(len(graph)), MAX_DROP_RUN)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
        raise ValueError(f"dropped_checkpoints must be an integer in 0..{most} (of the {droppable(len(graph))} "
                         f"checkpoints below the top block's, at most {MAX_DROP_RUN} in a row after one kept), "
                         f"got {n!r}")
    handing = handing_on(graph)
    if n and handing:
        raise ValueError(f"blocks of this model hand the next more than their output ({handing[0]}: items it stores "
                         f"for later blocks or a state they share), which a forward made again would store twice: "
                         f"its checkpoints cannot be dropped")
    both = sorted(l for l in cfg.saved_acts if cfg.dropped(l))
    if both:
        raise ValueError(f"layers {both} keep their activations (saved_acts): their checkpoints cannot be dropped")


def handing_on(graph: LayerGraph) -> list[str]:
    """The blocks that hand the next more than their output (items they store for later blocks, a state they
    share: ``Layer.carry_bytes_per_token``), whose checkpoints a forward made again would store twice."""
    return [lay.name for lay in graph.layers[1:] if lay.carry_bytes_per_token]
