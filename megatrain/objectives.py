"""What a training step minimizes at the head instead of the mean cross-entropy (``train_step(objective=...)``).

An objective sees, per micro-batch, each position's log-probability of its label (0 where the label is ignored),
the mask of labelled positions and the batch's per-row values (``rows``, sliced with the micro-batch), and returns
its loss summed over the micro-batch and a vector of statistics, also sums; the step divides the loss by the
objective's :meth:`Objective.denominator` and reports the statistics' sums over the step divided by it. Everything
upstream of the head (the layers' forwards and backwards, the streamed weights, the updates) is as for any step.

:class:`DPO` is direct preference optimization as TRL defines it: each micro-batch holds pairs, its first half the
chosen completions and its second half the rejected ones (pair i: rows i and i + half), with the reference model's
log-probability sums in ``rows["ref_logps"]``. :class:`SequenceWeights` is what an RL loop (GRPO-style) drives:
each sequence's log-probability sum weighted by ``rows["weights"]`` (advantages), averaged over the sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Objective:
    """The interface (see the module's docstring)."""

    stat_names: tuple[str, ...] = ()

    def denominator(self, next_labels: torch.Tensor, rows: dict) -> int:
        """What the step's loss sum is divided by (the cross-entropy's: the labelled positions)."""
        return int((next_labels != -100).sum())

    def __call__(self, logps: torch.Tensor, mask: torch.Tensor, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, stats: torch.Tensor, denom: int) -> dict[str, float]:
        """The step's statistics (their sums over its micro-batches) as the step reports them."""
        return {name: float(v) / denom for name, v in zip(self.stat_names, stats)}


DPO_LOSSES = ("sigmoid", "ipo", "hinge")


class DPO(Objective):
    """Direct preference optimization over pairs of sequences, as TRL's DPOTrainer computes it: ``loss`` "sigmoid"
    (the DPO paper's), "hinge" (SLiC's) or "ipo" (IPO's, on log-ratios averaged over each completion's tokens);
    ``beta`` the strength of the reference; the loss and statistics averaged over the step's pairs."""

    stat_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")

    def __init__(self, beta: float = 0.1, loss: str = "sigmoid"):
        if loss not in DPO_LOSSES:
            raise ValueError(f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {loss!r}")
        if not (isinstance(beta, (int, float)) and beta > 0 and beta == beta and beta != float("inf")):
            raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
        self.beta, self.loss = float(beta), loss

    def denominator(self, next_labels: torch.Tensor, rows: dict) -> int:
        return next_labels.shape[0] // 2  # the step's pairs

    def __call__(self, logps: torch.Tensor, mask: torch.Tensor, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        seq = logps.sum(1)
        half = len(seq) // 2
        ratio = seq - rows["ref_logps"].to(seq.dtype)  # log pi / pi_ref of each completion
        chosen, rejected = ratio[:half], ratio[half:]
        delta = chosen - rejected
        if self.loss == "sigmoid":
            per_pair = -F.logsigmoid(self.beta * delta)
        elif self.loss == "hinge":
            per_pair = torch.relu(1 - self.beta * delta)
        else:  # ipo: log-ratios per completion token
            n = mask.sum(1).clamp(min=1).to(seq.dtype)
            per_pair = (chosen / n[:half] - rejected / n[half:] - 1 / (2 * self.beta)) ** 2
        r_chosen, r_rejected = self.beta * chosen.detach(), self.beta * rejected.detach()
        stats = torch.stack([r_chosen.sum(), r_rejected.sum(), (r_chosen > r_rejected).float().sum(),
                             (r_chosen - r_rejected).sum(), seq[:half].detach().sum(), seq[half:].detach().sum()])
        return per_pair.sum(), stats


class SequenceWeights(Objective):
    """Minus each sequence's log-probability sum times its weight (``rows["weights"]``: an RL loop's advantages or
    rewards), averaged over the step's sequences: the REINFORCE / GRPO policy-gradient step for sequences sampled
    elsewhere (e.g. by vLLM). Reports the mean weight and the mean log-probability sum."""

    stat_names = ("weights/mean", "logps/mean")

    def denominator(self, next_labels: torch.Tensor, rows: dict) -> int:
        return next_labels.shape[0]

    def __call__(self, logps: torch.Tensor, mask: torch.Tensor, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        seq = logps.sum(1)
        w = rows["weights"].to(seq.dtype)
        return -(w * seq).sum(), torch.stack([w.sum(), seq.detach().sum()])
