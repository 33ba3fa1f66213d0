"""What capture records of a model besides its layers, for the optimizer and the loss: the parameters the HF
Trainer applies no weight decay to, and the router load-balancing loss HF adds to a mixture of experts' loss
(computed by megatrain.runtime.layers.router_aux)."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from torch import nn

# parameter names the HF Trainer leaves out of weight decay (besides those of nn.LayerNorm modules)
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of ``model``'s parameters the HF Trainer applies no weight decay to: biases and norm weights (by their
    names) and the parameters of ``nn.LayerNorm`` modules."""
    patterns = [re.compile(p) for p in NO_DECAY_PATTERNS]
    out = set()
    for mod_name, mod in model.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(mod, nn.LayerNorm) or any(p.search(full.lower()) for p in patterns):
                out.add(full)
    return out


@dataclass(frozen=True)
class RouterAux:
    """How a captured model's router loss is computed: its coefficient, experts, top k, and where the logits come
    from (the router module class and the index of the logits in its output)."""

    coef: float
    num_experts: int
    top_k: int
    router_class: type
    index: int


def router_aux_of(model: nn.Module) -> RouterAux | None:
    """The router loss HF adds to ``model``'s loss, or None where it adds none (the config does not set
    ``output_router_logits``, the coefficient is 0, or the model family has no such loss)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "output_router_logits", False):
        return None
    module = importlib.import_module(type(model).__module__)
    coef = getattr(model, "router_aux_loss_coef", None)
    if not hasattr(module, "load_balancing_loss_func") or coef is None:
        return None  # HF's forward of this family adds nothing (DeepSeek-V3, Llama 4)
    if not coef:
        return None
    recorder = None
    for sub in model.modules():
        recorder = (getattr(type(sub), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            break
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if recorder is None or not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError(f"{type(model).__name__}: the config sets output_router_logits (router_aux_loss_coef="
                         f"{coef}), and megatrain does not know where this model's router logits come from; set "
                         f"config.output_router_logits=False to train without the router loss")
    return RouterAux(float(coef), experts, top_k, recorder.target_class, recorder.index)
