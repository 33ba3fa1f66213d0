"""A streamed Qwen2.5/Llama-shaped model with random weights for the GPU diagnostics (built on the meta device, the
host store filled from the seeded initializer)."""

from __future__ import annotations

import torch


def build(preset: str, seq: int, *, n_mb: int, slots: str, gpu_opt_every, clip: bool, layers: int | None = None,
          saved_acts="auto"):
    """(streamed model, HF config) for ``preset`` at sequence length ``seq``; ``slots``: a count or "all";
    ``layers``: decoder blocks instead of the preset's."""
    from transformers import AutoModelForCausalLM

    import megatrain
    from benchmarks.peers.common import hf_config

    cfg = hf_config(preset, seq, layers=layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    optim = megatrain.OptimConfig(lr=1e-4, max_grad_norm=1.0 if clip else None)
    sm = megatrain.compile(model, init_seed=0, device="cuda", optim=optim, n_mb=n_mb,
                           weight_slots=slots if slots == "all" else int(slots), gpu_opt_every=gpu_opt_every, saved_acts=saved_acts)
    return sm, cfg
