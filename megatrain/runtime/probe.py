"""How many bytes a layer's forward keeps for its backward on this device, measured by running it once."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from megatrain.runtime.kernel_rewrite import keep_less


def saved_bytes(ex, layer: int, seq_len: int, lean: bool = False) -> int:
    """Bytes that ``layer``'s forward saves for its backward on ``ex``'s device with its templates (kernels or not,
    whatever attention the model uses), for one sequence of ``seq_len`` tokens: activations only, not the weights
    (views of the slot), the layer's input (its checkpoint, counted apart) or the side inputs every layer shares;
    ``lean``: keeping less (``ScheduleConfig.saved_lean``). Runs the embedding and the layer once on random tokens,
    with weights copied from the host store into temporary buffers; the random generators are left as they were (a
    seeded run draws the same whether it measures or not)."""
    with torch.random.fork_rng(devices=[ex.device] if ex.device.type == "cuda" else []):
        return _measure(ex, layer, seq_len, lean)


def _measure(ex, layer: int, seq_len: int, lean: bool) -> int:
    captured, graph, device = ex.captured, ex.graph, ex.device
    ids = torch.randint(0, captured.vocab_size, (1, seq_len), device=device)
    mask = None if captured.mask_optional else torch.ones_like(ids)
    first = ex.store.master(graph.owner(0)).to(device, ex.dtype)
    with torch.no_grad():
        h, side = ex.runner.run(0, first, (ids, mask, torch.arange(seq_len, device=device)[None]))
    del first
    flat = ex.store.master(graph.owner(layer)).to(device, ex.dtype)
    x = h.detach().requires_grad_()
    skip = {flat.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    skip |= {v.untyped_storage().data_ptr() for v in tree_leaves(side) if isinstance(v, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), keep_less(lean):
        out = ex.runner.run(layer, flat, x, side, grad_views=[])
    del out
    return sum(kept.values())
