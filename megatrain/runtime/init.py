"""Seeded initialization of the host store, one module at a time (the model may live on the meta device)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megatrain.capture import Captured, meta_copy
from megatrain.runtime.store import HostStore


def _initializer(model: nn.Module):
    init = getattr(model, "_init_weights", None)  # HF models: the architecture's own per-module initializer
    if callable(init):
        return init

    def reset(m: nn.Module) -> None:
        if not hasattr(m, "reset_parameters"):
            raise ValueError(f"no initializer for {type(m).__name__}: it has no reset_parameters(); build the model "
                             f"with real weights or pass checkpoint=")
        m.reset_parameters()

    return reset


@torch.no_grad()
def init_seeded(model: nn.Module, captured: Captured, store: HostStore, seed: int,
                progress: Callable[[int], None] | None = None) -> None:
    """Fill the master weights with the model's own initializer. Each layer draws from its own seed
    (``seed * 1_000_003 + layer``) so the result does not depend on how many layers exist before it; each module is
    materialized on the CPU alone, so peak memory is the store plus one module."""
    init = _initializer(model)
    for seg in captured.segments:
        if not seg.numel:
            continue
        torch.manual_seed(seed * 1_000_003 + seg.index)
        by_module: dict[str, list[str]] = {}
        for ref in seg.params:
            path, _, pname = ref.model_name.rpartition(".")
            by_module.setdefault(path, []).append(pname)
        for path, pnames in by_module.items():
            mod = meta_copy(model.get_submodule(path)).to_empty(device="cpu")
            for p in mod.parameters(recurse=False):
                p.fill_(float("nan"))
                if hasattr(p, "_is_hf_initialized"):
                    del p._is_hf_initialized
            if hasattr(mod, "_is_hf_initialized"):
                del mod._is_hf_initialized
            init(mod)
            for pname in pnames:
                value = getattr(mod, pname)
                if torch.isnan(value).any():
                    raise ValueError(f"the initializer left {path}.{pname} unset ({type(mod).__name__})")
                store.param_view(f"{path}.{pname}" if path else pname).copy_(value)
        if progress is not None:
            progress(seg.numel)
