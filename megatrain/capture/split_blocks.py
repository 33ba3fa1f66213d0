"""Blocks cut in two where part of a block is a module other blocks use too, so that each part is a layer of its
own weights or a whole layer tied to an earlier one (what the runtime streams and the gradient machinery sums).

Zamba2: each hybrid layer runs one of ``num_mem_blocks`` shared transformer blocks (attention and MLP, with the
per-layer adapters they hold) on the hidden state and the embeddings, projects its output (``linear``, the layer's
own) and adds it inside the layer's own Mamba-2 mixer. Cut there: :class:`SharedPart` runs the shared transformer
and hands ``[hidden, transformer output]`` on (twice the hidden width); :class:`OwnPart` splits it, projects and runs
the mixer. Both take the call the hybrid layer took; their parameters keep the hybrid layer's names."""

from __future__ import annotations

import torch
from torch import nn


class SharedPart(nn.Module):
    """The shared transformer of a Zamba2 hybrid layer; returns the hidden state and its output side by side."""

    width_factor = 2  # of the hidden state, what it hands on

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.shared_transformer = layer.shared_transformer

    def forward(self, hidden_states, original_hidden_states=None, layer_idx=None, attention_mask=None,
                causal_mask=None, cache=None, use_cache=False, position_embeddings=None, position_ids=None, **kwargs):
        out = self.shared_transformer(hidden_states, original_hidden_states=original_hidden_states,
                                      layer_idx=layer_idx, attention_mask=causal_mask, cache=cache,
                                      position_embeddings=position_embeddings, position_ids=position_ids, **kwargs)
        return torch.cat([hidden_states, out], dim=-1)


class OwnPart(nn.Module):
    """The rest of a Zamba2 hybrid layer: its projection of the shared transformer's output and its Mamba-2 layer."""

    width_factor = 1

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.linear, self.mamba_decoder = layer.linear, layer.mamba_decoder

    def forward(self, both, original_hidden_states=None, layer_idx=None, attention_mask=None, causal_mask=None,
                cache=None, use_cache=False, position_embeddings=None, position_ids=None, **kwargs):
        hidden_states, out = both.chunk(2, dim=-1)
        return self.mamba_decoder(hidden_states, transformer_hidden_states=self.linear(out),
                                  attention_mask=attention_mask, cache=cache, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)


def parts(block: nn.Module) -> list[nn.Module] | None:
    """The layers ``block`` is cut into, or None where it is one."""
    if type(block).__name__ == "Zamba2HybridLayer":
        return [SharedPart(block), OwnPart(block)]
    return None
