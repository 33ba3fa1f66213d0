"""Costs of the hybrid families' recurrent blocks: a gated delta net (Qwen3-Next, Qwen3.5, OLMo-hybrid) in place
of softmax attention, read from a config (``graph.from_config``) or from a captured block (``capture.blocks``)."""

from __future__ import annotations

# the chunk of tokens the gated delta rule runs in (transformers' default; kernels.delta_rule)
DELTA_CHUNK = 64
# families whose softmax-attention blocks gate their output per element: the query projection is twice as wide
GATED_ATTENTION = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def delta_rule_costs(v_heads: int, k_dim: int, v_dim: int, act_dtype_bytes: int = 2,
                     chunk: int = DELTA_CHUNK) -> tuple[float, int, int]:
    """A gated delta-net layer's recurrence per token (``kernels.delta_rule``): its forward FLOPs, the bytes its
    forward keeps for the backward, and the bytes of a piece's working set (the chunk-local algebra formed for at
    most ``layout.DELTA_PIECE_TOKENS`` tokens at a time, in the forward and again in the backward). Per value head,
    with key and value head dims K and V, chunks of C tokens and a-byte activations: FLOPs 6KV + 2CV (the scan:
    three K x V products and the chunk's attention) + 5CK + CV (the chunk-local products and the two triangular
    solves); kept a(2K + V) + a + 4 (q, k, v, the write strength and the fp32 decay) + 4KV/C (the fp32 state before
    each chunk); a piece's 36K + 12V + 24C + 4KV/C + 24 (fp32: what autograd keeps through the chunk-local algebra
    and the scan). tests/kernels/test_delta_rule.py measures the two byte counts."""
    k, v, c, a = k_dim, v_dim, chunk, act_dtype_bytes
    return (float(v_heads * (6 * k * v + 3 * c * v + 5 * c * k)),
            v_heads * (a * (2 * k + v) + a + 4 + 4 * k * v // c),
            v_heads * (36 * k + 12 * v + 24 * c + 4 * k * v // c + 24))


def linear_attention(cfg: dict, size) -> tuple[int, int, int, int, int] | None:
    """A hybrid config's gated delta-net layers (Qwen3-Next, Qwen3.5): key heads, value heads, key and value head
    dims, the convolution's width (``size(key, default)`` reads a field); None where the config has none."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if not all(cfg.get(k) for k in keys) or "linear_attention" not in (cfg.get("layer_types") or ()):
        return None
    return (*(size(k) for k in keys), size("linear_conv_kernel_dim", 4))


def delta_net_block(lin: tuple[int, ...], H: int, act_dtype_bytes: int) -> tuple[int, int, float, int, int]:
    """A gated delta-net mixer (Qwen3-Next's layout: q, k, v and the output gate z in one projection, the write
    strength b and the decay a in another, a depthwise convolution over q, k and v): its matmul parameters, its
    other parameters (each head's dt bias and decay, the gated norm), and :func:`delta_rule_costs`."""
    hk, hv, dk, dv, conv = lin
    # (the depthwise convolution's weights count as a matmul's: each multiplies once a token)
    matmul = H * (2 * hk * dk + 2 * hv * dv) + H * 2 * hv + hv * dv * H + (2 * hk * dk + hv * dv) * conv
    return (matmul, 2 * hv + dv, *delta_rule_costs(hv, dk, dv, act_dtype_bytes))


def as_recurrence(costs: dict, flops: float, kept: int, piece: int) -> dict:
    """``costs`` (``layer_costs``' fields for a block) for a block whose mixer is a gated delta net instead of
    softmax attention: no attention FLOPs or kernel buffers; the recurrence's FLOPs and its piece's working set, and
    the bytes it keeps for the backward added to the block's."""
    out = dict(costs, attn_flops_per_token_per_seq=0.0, attn_bwd_bytes_per_token=0, attn_bwd_group_bytes_per_token=0,
               scan_flops_per_token=flops, scan_piece_bytes_per_token=piece)
    for f in ("work_bytes_per_token", "saved_bytes_per_token", "lean_saved_bytes_per_token"):
        if out.get(f):
            out[f] += kept
    return out
