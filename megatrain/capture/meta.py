"""The model as capture traces it: a structural copy on the meta device (no weight memory), with the buffers a model
built on the meta device lacks rebuilt from its config, and the blocks' persistent float buffers as frozen
parameters (the store holds them with the layer's weights)."""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from megatrain.capture.tracer import CaptureError


def meta_copy(module: nn.Module) -> nn.Module:
    """A structural copy whose parameters live on the meta device (no weight memory); buffers are copied."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    return copy.deepcopy(module, memo)


def materialize_meta_buffers(module: nn.Module) -> None:
    """Buffers of a model built on the meta device (rotary tables, embedding scales) hold no values; rebuild each
    owning module from its config on the CPU and take its buffers, or a scalar buffer from the number the module
    keeps beside it (HF's scaled embeddings: ``embed_scale`` and ``scalar_embed_scale``). A module that keeps no
    config of its own but is built from one (DeepSeek-V3's router: ``e_score_correction_bias``) is rebuilt from the
    model's."""
    root_config = getattr(module, "config", None)
    for name, mod in module.named_modules():
        meta = [b for b, t in mod._buffers.items() if t is not None and t.is_meta]
        for b in list(meta):
            value = getattr(mod, f"scalar_{b}", None)
            if mod._buffers[b].dim() == 0 and isinstance(value, (int, float)) and not isinstance(value, bool):
                mod._buffers[b] = torch.tensor(value, dtype=mod._buffers[b].dtype)
                meta.remove(b)
        if not meta:
            continue
        config = getattr(mod, "config", None)
        if config is None and root_config is not None and _built_from_config(type(mod)):
            config = root_config
        if config is None:
            raise CaptureError(f"buffers {meta} of '{name}' ({type(mod).__name__}) are on the meta device and the "
                               f"module has no config to rebuild them from; build the model with real buffers")
        with torch.device("cpu"):
            fresh = type(mod)(config=config)
        for b in meta:
            mod._buffers[b] = fresh._buffers[b]


def block_buffers(block_list: nn.ModuleList) -> list[str]:
    """Names (within the block list) of the decoder blocks' persistent floating-point buffers."""
    out = []
    for i, blk in enumerate(block_list):
        persistent = set(blk.state_dict(keep_vars=True))
        for path, mod in blk.named_modules():
            for b, t in mod._buffers.items():
                name = f"{path}.{b}" if path else b
                if t is not None and t.is_floating_point() and name in persistent:
                    out.append(f"{i}.{name}")
    return out


def structural_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s module tree (new module objects, their own parameter and buffer tables) holding the
    same tensors: what the capture changes in it (buffers registered as parameters) the caller's model does not
    see, and no weight is copied."""
    memo: dict[int, nn.Module] = {}

    def copy_of(m: nn.Module) -> nn.Module:
        if id(m) not in memo:
            new = memo[id(m)] = copy.copy(m)
            new._parameters = m._parameters.copy()
            new._buffers = m._buffers.copy()
            new._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
            new._modules = m._modules.copy()
            for k, sub in m._modules.items():
                new._modules[k] = copy_of(sub) if sub is not None else None
        return memo[id(m)]

    return copy_of(module)


def block_buffers_as_parameters(block_list: nn.ModuleList) -> None:
    """The decoder blocks' persistent floating-point buffers (DeepSeek-V3's router bias, ``e_score_correction_bias``)
    made frozen parameters of their blocks, in place (on the capture's :func:`structural_copy`, never the caller's
    model): a checkpoint holds one per layer, and the blocks run through one shared template, which binds a layer's
    parameters alone. As parameters they live in the store with the layer's weights (4 bytes each, no moments: they
    do not train; the model's forward reads them as before) and load, save and export under their names."""
    for blk in block_list:
        persistent = set(blk.state_dict(keep_vars=True))
        for path, mod in blk.named_modules():
            for b, t in list(mod._buffers.items()):
                name = f"{path}.{b}" if path else b
                if t is None or not t.is_floating_point() or name not in persistent:
                    continue
                del mod._buffers[b]
                mod.register_parameter(b, nn.Parameter(t, requires_grad=False))


def _built_from_config(cls: type) -> bool:
    """Whether ``cls(config=...)`` is how the class is built: its constructor takes a config and nothing else it
    needs."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    need = [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return need == ["config"]
