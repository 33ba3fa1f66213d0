"""The router's load-balancing loss of a mixture-of-experts model, as the HF model adds it to its loss.

Where the model's config sets ``output_router_logits``, HF's causal-LM forward adds ``router_aux_loss_coef x aux`` to
the loss, with ``aux`` (its ``load_balancing_loss_func``) computed over every MoE layer's router logits of that
forward at once: with N the rows (tokens, weighted by the attention mask) over all layers, c_e how many of them
picked expert e among their top k, and P_e the sum of their softmax probabilities for e,

    aux = E * sum_e (c_e / N) * (P_e / N).

The counts are not differentiable, so the gradient reaching layer l's router logits is that of
``E / N^2 * sum_e c_e * P_e(l)``, with P_e(l) layer l's own sum: known once the micro-batch's forward has passed
every layer, which it has before any backward of that micro-batch. So each forward adds its layer's c and P to the
micro-batch's :class:`Stats`, the head's LOSS adds the value (``coef x aux / n_mb``: the step's loss is the mean of
its micro-batches' losses, each HF's), and each backward differentiates its layer's P(l) against
``coef / n_mb x E c / N^2`` along with its output.

Whether a model has such a loss, and where its logits come from, capture records
(:func:`megatrain.capture.params.router_aux_of`). The routers are found by the module class HF records
``router_logits`` from (``OutputRecorder``); a forward hook on each such module of the templates hands the logits to
the list the running layer's binding gives it (:func:`collecting`, through ``LayerRunner.routers``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from megatrain.capture.params import RouterAux


@dataclass
class Stats:
    """One micro-batch's sums over the layers its forward has passed: top-k picks per expert (weighted by the
    attention mask), softmax probabilities per expert, and rows."""

    counts: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    rows: torch.Tensor | float = 0.0


def install(module: nn.Module, spec: RouterAux) -> list[nn.Module]:
    """A forward hook on each router module under ``module`` (once per module) that hands its logits to the list
    :func:`collecting` gives that module, if any. Returns the router modules."""
    routers = [sub for sub in module.modules() if isinstance(sub, spec.router_class)]
    for sub in routers:
        if not hasattr(sub, "_megatrain_logits"):
            sub._megatrain_logits = None
            sub.register_forward_hook(_hook(spec.index))
    return routers


def _hook(index: int):
    def hook(mod, _inputs, output):
        if mod._megatrain_logits is not None:
            mod._megatrain_logits.append(output[index] if isinstance(output, (tuple, list)) else output)

    return hook


@contextlib.contextmanager
def collecting(routers: list[nn.Module], out: list):
    """Router logits of ``routers`` (a template's) go to ``out`` while the layer runs inside (in the order the
    routers run)."""
    if any(r._megatrain_logits is not None for r in routers):
        raise RuntimeError("router logits of this template are already being collected")
    for r in routers:
        r._megatrain_logits = out
    try:
        yield out
    finally:
        for r in routers:
            r._megatrain_logits = None


def _weights(mask: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)


def add(stats: Stats, logits: list[torch.Tensor], spec: RouterAux, mask: torch.Tensor | None) -> None:
    """Add a layer's router logits (one tensor per router: rows x experts) to the micro-batch's sums, as HF's
    ``load_balancing_loss_func`` forms them (softmax in the logits' dtype, top k of it, counts weighted by the
    attention mask)."""
    for lg in logits:
        lg = lg.detach()
        w = _weights(mask, lg.device)
        p = torch.softmax(lg, dim=-1)
        _, picked = torch.topk(p, spec.top_k, dim=-1)
        if stats.counts is None:
            stats.counts = torch.zeros(spec.num_experts, dtype=torch.float32, device=lg.device)
            stats.probs = torch.zeros(spec.num_experts, dtype=torch.float32, device=lg.device)
        ones = torch.ones(picked.numel(), device=lg.device) if w is None else w.repeat_interleave(spec.top_k)
        stats.counts.scatter_add_(0, picked.reshape(-1), ones)
        stats.probs += (p.float() if w is None else p.float() * w.unsqueeze(-1)).sum(0)
        stats.rows = stats.rows + (p.shape[0] if w is None else w.sum())


def value(stats: Stats, spec: RouterAux) -> torch.Tensor:
    """The micro-batch's aux loss (HF's ``load_balancing_loss_func`` over all its layers), unscaled."""
    return torch.sum((stats.counts / stats.rows) * (stats.probs / stats.rows)) * spec.num_experts


def layer_probs(logits: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """P(l): the sum over the rows (mask-weighted) of the softmax probabilities of a layer's router logits, with
    autograd: what the backward differentiates."""
    out = None
    for lg in logits:
        w = _weights(mask, lg.device)
        p = torch.softmax(lg, dim=-1).float()
        s = (p if w is None else p * w.unsqueeze(-1)).sum(0)
        out = s if out is None else out + s
    return out


def probs_grad(stats: Stats, spec: RouterAux, coef: float, n_mb: int) -> torch.Tensor:
    """The gradient of ``coef x aux / n_mb`` with respect to a layer's P(l), ``coef / n_mb x E x c / N^2``, in
    fp32 in the order autograd forms it from HF's expression (1 / n_mb, times coef, times E, times c / N, over N),
    so that it rounds alike."""
    s = torch.ones((), device=stats.counts.device) / n_mb * coef * spec.num_experts
    return s * (stats.counts / stats.rows) / stats.rows
