"""Which ``nn.ModuleList`` holds the decoder blocks.

In order: the list the user names (``compile(blocks=...)``); the list whose modules are all of a class HF names in
``_no_split_modules`` (the unit HF and distributed wrappers never split: the decoder layer); a list at a conventional
path (``model.layers``, ``model.decoder.layers``, ``transformer.h``, ``gpt_neox.layers``, ``blocks``, ...); and only
then the longest list of modules with parameters, with a warning naming it (attention may hold lists of its own: a
model with per-head norms has more of them than it has layers).
"""

from __future__ import annotations

import inspect
import warnings

from torch import nn

from megatrain.capture.tracer import CaptureError

# the last parts of the paths models keep their blocks at, most specific first
CONVENTIONAL = ("model.layers", "model.decoder.layers", "model.language_model.layers", "language_model.model.layers",
                "transformer.h", "transformer.blocks", "transformer.layers", "gpt_neox.layers", "decoder.layers",
                "layers", "h", "blocks")


def find_blocks(model: nn.Module, blocks: str | nn.ModuleList | None = None) -> tuple[str, nn.ModuleList]:
    """(path, the ModuleList of decoder blocks) of ``model``; :class:`CaptureError` naming what was found instead."""
    lists = {name: mod for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) > 0 and all(_has_params(m) for m in mod)}
    if blocks is not None:
        return _named(model, blocks, lists)
    split = set(getattr(model, "_no_split_modules", None) or ())
    if split:
        found = [n for n, mod in lists.items() if all(type(m).__name__ in split for m in mod)]
        if len(found) == 1:
            return found[0], lists[found[0]]
        if len(found) > 1:  # e.g. a vision tower's layers next to the decoder's: the conventional path decides
            for suffix in CONVENTIONAL:
                hit = [n for n in found if n == suffix or n.endswith("." + suffix)]
                if len(hit) == 1:
                    return hit[0], lists[hit[0]]
            raise CaptureError(f"{type(model).__name__}: several lists of {sorted(split)} modules ({found}); pass "
                               f"compile(blocks='...') naming the decoder's")
    for suffix in CONVENTIONAL:
        hit = [n for n in lists if n == suffix]
        if len(hit) == 1:
            return hit[0], lists[hit[0]]
    if not lists:
        raise CaptureError(f"{type(model).__name__}: found no nn.ModuleList of decoder blocks with parameters; pass "
                           f"compile(blocks='...') naming the module list that holds them")
    name = max(lists, key=lambda n: len(lists[n]))
    warnings.warn(f"{type(model).__name__}: no HF _no_split_modules or conventional path names the decoder blocks; "
                  f"taking the longest nn.ModuleList, '{name}' ({len(lists[name])} x "
                  f"{type(lists[name][0]).__name__}); pass compile(blocks='...') to choose another", stacklevel=3)
    return name, lists[name]


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _named(model: nn.Module, blocks, lists: dict[str, nn.ModuleList]) -> tuple[str, nn.ModuleList]:
    if isinstance(blocks, nn.ModuleList):
        name = next((n for n, m in model.named_modules() if m is blocks), None)
        if name is None:
            raise CaptureError(f"blocks=: the ModuleList given is not a submodule of {type(model).__name__}")
    elif isinstance(blocks, str):
        name = blocks
    else:
        raise CaptureError(f"blocks= must be a module path (str) or an nn.ModuleList, got {type(blocks).__name__}")
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        raise CaptureError(f"blocks='{name}': {type(model).__name__} has no such submodule; module lists with "
                           f"parameters: {sorted(lists) or 'none'}") from None
    if not isinstance(mod, nn.ModuleList) or not len(mod) or not all(_has_params(m) for m in mod):
        raise CaptureError(f"blocks='{name}' is a {type(mod).__name__}, not a non-empty nn.ModuleList whose modules "
                           f"all have parameters; module lists with parameters: {sorted(lists) or 'none'}")
    return name, mod


def mlp_tileable(mlp: nn.Module) -> bool:
    """Whether a block's MLP may run over tiles of the tokens (runtime.layers.tiling): its forward takes the hidden
    states and nothing else. Bloom's also takes the residual, and others take routing or masks, which a tiling of
    the hidden states alone would leave whole."""
    try:
        params = list(inspect.signature(mlp.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: left untiled
        return False
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


def delta_nets(block: nn.Module) -> list[nn.Module]:
    """The block's gated delta nets: modules with ``num_v_heads``, ``head_k_dim`` and ``head_v_dim`` (Qwen3-Next,
    Qwen3.5, OLMo-hybrid)."""
    return [m for m in block.modules() if all(hasattr(m, a) for a in ("num_v_heads", "head_k_dim", "head_v_dim"))]


def recurrence(block: nn.Module, act_dtype_bytes: int = 2) -> tuple[float, int, int] | None:
    """A block whose mixer is a gated delta net (:func:`delta_nets`) and no softmax attention: its recurrence's
    FLOPs, bytes kept and bytes of a piece per token (``planner.hybrid.delta_rule_costs``); None for any other
    block."""
    from megatrain.planner.hybrid import delta_rule_costs

    nets = delta_nets(block)
    if not nets or any(type(m).__name__.endswith("Attention") for m in block.modules()):
        return None
    costs = [delta_rule_costs(m.num_v_heads, m.head_k_dim, m.head_v_dim, act_dtype_bytes) for m in nets]
    return sum(c[0] for c in costs), sum(c[1] for c in costs), sum(c[2] for c in costs)


def mixes_tokens(block: nn.Module) -> bool:
    """Whether the block carries something from one token to the next besides attention, which a packed row's
    documents would share: a recurrence's state (a gated delta net's) or a convolution over the sequence (Mamba's,
    LFM2's and the delta nets' ``nn.Conv1d``)."""
    return recurrence(block) is not None or any(isinstance(m, nn.Conv1d) for m in block.modules())
