"""Mixture-of-experts blocks' experts as grouped GEMMs without the expert-parallel bookkeeping.

transformers' ``grouped_mm`` experts implementation (the default where torch has grouped matmuls) sorts the
(token, expert) pairs by expert, gathers the tokens, runs one grouped GEMM per projection and scatters back. Some
versions (5.17, installed on the GPU machine) also zero rows reserved for expert parallelism with three
``masked_fill`` passes over (pairs x width) tensors in every forward, and gather / scatter the pairs with indexing
whose backward is an accumulating ``index_put``: in an OLMoE-1B-7B-shaped step at 32,768 tokens the masks alone
took 0.21 s of 1.15 s on the H200 (``docs/benchmark-history.md``). A single process holds every expert, so nothing needs
masking; the captured model (capture's own copy) is switched to :func:`forward`, which

- moves rows with a gather whose backward is the adjoint gather-and-sum over each token's k pairs (no
  accumulating scatter, deterministic), in both directions (:class:`_ToPairs`, :class:`_FromPairs`);
- runs torch's grouped matmul where its layout rules allow (bf16 on the GPU, 16-byte aligned rows on the CPU) and
  a loop over the experts' row ranges elsewhere.

The routing (which experts, their weights, dropless) is the model's own; only the arithmetic's order changes.
"""

from __future__ import annotations

import torch

NAME = "megatrain_grouped"


def enable(model: torch.nn.Module) -> bool:
    """Switch ``model`` (the captured model's own copy) from transformers' ``grouped_mm`` experts to :func:`forward`
    where the installed transformers dispatches experts by name; whether it was switched."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_experts_implementation", None) != "grouped_mm":
        return False
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(NAME, forward)
    cfg._experts_implementation = NAME
    return True


class _ToPairs(torch.autograd.Function):
    """(tokens, d) -> (pairs, d): row ``token[i]`` for each pair ``i`` (pairs sorted by expert); the backward sums each
    token's k pair gradients, found through ``inv`` (pair position of token t's j-th choice = inv[t * k + j])."""

    @staticmethod
    def forward(ctx, x, token, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x[token]

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return _sum_pairs(g, inv, ctx.k), None, None, None


class _FromPairs(torch.autograd.Function):
    """(pairs, d) -> (tokens, d): each token's k pair rows summed (the adjoint of :class:`_ToPairs`)."""

    @staticmethod
    def forward(ctx, y, token, inv, k):
        ctx.save_for_backward(token)
        return _sum_pairs(y, inv, k)

    @staticmethod
    def backward(ctx, g):
        (token,) = ctx.saved_tensors
        return g[token], None, None, None


def _sum_pairs(y: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    return y[inv].view(-1, k, y.shape[-1]).sum(dim=1)


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(pairs, K) @ (experts, K, N) over the experts' consecutive row ranges ending at ``offs``."""
    mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    item = x.element_size()
    aligned = all((n * item) % 16 == 0 for n in (x.shape[-1], w.shape[-1], w.shape[-2]))
    if mm is not None and aligned and (x.dtype == torch.bfloat16 if x.is_cuda else x.device.type == "cpu"):
        return mm(x, w.to(x.dtype), offs=offs)
    ends = offs.tolist()  # the fallback reads the ranges on the host
    starts = [0, *ends[:-1]]
    return torch.cat([x[s:e] @ w[i].to(x.dtype) for i, (s, e) in enumerate(zip(starts, ends))])


def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for (tokens, hidden) states routed to ``top_k_index`` with ``top_k_weights`` (tokens, k),
    as transformers' experts modules compute it (``self``: one of them, with its layout flags)."""
    k = top_k_index.shape[-1]
    n_exp = self.num_experts
    expert, perm = torch.sort(top_k_index.reshape(-1))
    token = perm // k
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    counts = torch.histc(expert.int() if expert.is_cuda else expert.float(), bins=n_exp, min=0, max=n_exp - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    weights = top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    x = _ToPairs.apply(hidden_states, token, inv, k)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    h = _grouped(x, up if self.is_transposed else up.transpose(-2, -1), offs)
    if self.has_bias:
        h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[expert]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    down = self.down_proj
    y = _grouped(h, down if self.is_transposed else down.transpose(-2, -1), offs)
    if self.has_bias:
        y = y + self.down_proj_bias[expert]
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y * weights.to(y.dtype)  # after the down projection, as transformers orders it (fp32 parity)
    return _FromPairs.apply(y, token, inv, k).to(hidden_states.dtype)
