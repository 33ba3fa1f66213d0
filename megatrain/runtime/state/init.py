"""Seeded initialization of the host store, one module at a time (the model may live on the meta device)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megatrain.capture import Captured, meta_copy
from megatrain.runtime.memory.store import HostStore


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


def _unset(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether any element of ``t`` is NaN (the fill an initializer did not overwrite), a chunk at a time."""
    flat = t.reshape(-1)
    return any(bool(torch.isnan(flat[i: i + chunk]).any()) for i in range(0, flat.numel(), chunk))


def _from_ancestor(model: nn.Module, init, path: str, pname: str) -> torch.Tensor:
    """``path.pname`` as the initializer sets it when it runs on a module that holds ``path`` (Qwen3-Next's MoE
    block initializes its router's weight; the router's own call leaves it): the nearest such ancestor, run on the
    CPU with that one parameter real (the rest stay on the meta device)."""
    parts = path.split(".") if path else []
    for cut in range(len(parts) - 1, -1, -1):
        anc, rel = ".".join(parts[:cut]), ".".join(parts[cut:] + [pname])
        mod = meta_copy(model.get_submodule(anc))
        owner, _, leaf = rel.rpartition(".")
        p = mod.get_parameter(rel)
        data = torch.full(p.shape, float("nan"), dtype=p.dtype)
        mod.get_submodule(owner)._parameters[leaf] = nn.Parameter(data, requires_grad=p.requires_grad)
        for sub in mod.modules():
            if hasattr(sub, "_is_hf_initialized"):
                del sub._is_hf_initialized
        init(mod)
        value = mod.get_parameter(rel)
        if not _unset(value):
            return value
    raise ValueError(f"the initializer left {path}.{pname} unset ({type(model.get_submodule(path)).__name__})")


@torch.no_grad()
def init_seeded(model: nn.Module, captured: Captured, store: HostStore, seed: int,
                progress: Callable[[int], None] | None = None) -> None:
    """Fill the master weights with the model's own initializer. Each layer draws from its own seed
    (``seed * 1_000_003 + layer``) so the result does not depend on how many layers exist before it. Each module is
    built on the CPU alone, its fp32 parameters as views of the store's master weights, so the initializer writes
    them in place (a 256,000-row embedding needs no second copy); parameters in another dtype are initialized in it
    and copied."""
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
            mod = meta_copy(model.get_submodule(path))
            views = {}
            for name, p in list(mod.named_parameters()):
                owner, _, pname = name.rpartition(".")
                view = store.param_view(f"{path}.{pname}" if path else pname) if not owner and pname in pnames \
                    else None
                if view is not None and view.dtype == p.dtype and view.shape == p.shape:
                    views[pname] = data = view
                else:
                    data = torch.empty_like(p, device="cpu")
                data.fill_(float("nan"))
                mod.get_submodule(owner)._parameters[pname] = nn.Parameter(data, requires_grad=p.requires_grad)
            for sub in mod.modules():
                for b, t in list(sub._buffers.items()):
                    if t is not None and t.is_meta:
                        sub._buffers[b] = torch.empty_like(t, device="cpu")
                if hasattr(sub, "_is_hf_initialized"):
                    del sub._is_hf_initialized
            init(mod)
            for pname in pnames:
                value = getattr(mod, pname)
                if _unset(value):  # (an architecture may set it from the module that holds this one)
                    value = _from_ancestor(model, init, path, pname)
                if pname not in views or value.data_ptr() != views[pname].data_ptr():
                    store.param_view(f"{path}.{pname}" if path else pname).copy_(value)
        if progress is not None:
            progress(seg.numel)
