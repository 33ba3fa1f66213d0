"""LayerGraph: the model as a chain of layers with the numbers the planner needs.

Built by hand (:func:`chain`), from an HF-style decoder config dict (:func:`from_config`, no transformers import) or
from a named preset (:func:`preset`). Capture from a live ``nn.Module`` produces the same structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

# Logits of the fused linear + cross-entropy are materialized this many tokens at a time (fp32).
LOSS_CHUNK_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class Layer:
    name: str  # e.g. "embed", "block.3", "norm", "head"
    kind: str  # "embedding" | "block" | "norm" | "head"
    template: str  # layers with equal template keys share one weightless template
    params: int  # parameters this layer owns (0 for a head tied to the embedding)
    tie: int | None = None  # index of the layer whose weights this layer uses (tied head), else None
    matmul_flops_per_token: float = 0.0  # forward FLOPs per token that do not depend on sequence length
    attn_flops_per_token_per_seq: float = 0.0  # forward attention FLOPs per token per token of sequence length
    act_bytes_per_token: int = 0  # bytes per token of this layer's output (the next layer's checkpoint)
    work_bytes_per_token: int = 0  # bytes per token of activations the forward builds for backward
    logit_bytes_per_token: int = 0  # head only: bytes of one token's fp32 logits row
    # bytes per token of what the forward saves for backward (activations only; the weights it saves are views of
    # the weight slot, found again there by the BWD): what a layer in ScheduleConfig.saved_acts keeps on the
    # device from its FWD to its BWD. 0: the layer's backward always recomputes
    saved_bytes_per_token: int = 0
    # the same when the plan has saved layers keep less (ScheduleConfig.saved_lean): products that are cheap to
    # form again (the kernel MLP's silu(gate) * up) are recomputed in the backward instead. 0: no such variant
    lean_saved_bytes_per_token: int = 0

    def saved_bytes(self, lean: bool) -> int:
        """Bytes per token this layer keeps as a saved layer, lean (``ScheduleConfig.saved_lean``) or not."""
        return self.lean_saved_bytes_per_token if lean and self.lean_saved_bytes_per_token else \
            self.saved_bytes_per_token

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token at ``seq_len`` (causal attention: keys average seq_len / 2)."""
        return self.matmul_flops_per_token + self.attn_flops_per_token_per_seq * seq_len


class LayerGraph:
    """A chain of :class:`Layer` in execution order, kept as a networkx DiGraph (node i -> node i+1)."""

    def __init__(self, layers: list[Layer], name: str = "model"):
        if len(layers) < 2:
            raise ValueError(f"a layer graph needs at least 2 layers (a first layer and a head), got {len(layers)}")
        if layers[-1].kind != "head":
            raise ValueError(f"the last layer must be the head+loss layer, got kind {layers[-1].kind!r}")
        for i, lay in enumerate(layers):
            if lay.tie is not None and not (0 <= lay.tie < i and layers[lay.tie].tie is None):
                raise ValueError(f"layer {i} ({lay.name}) ties to layer {lay.tie}, which is not an earlier owner")
            if lay.params < 0 or (lay.tie is None and lay.params == 0):
                raise ValueError(f"layer {i} ({lay.name}) has {lay.params} parameters and no tie")
        self.name = name
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.g = nx.DiGraph()
        for i, lay in enumerate(layers):
            self.g.add_node(i, layer=lay)
        nx.add_path(self.g, range(len(layers)))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Layer:
        return self.layers[i]

    def tied_to(self, i: int) -> list[int]:
        """Layers that use layer i's weights."""
        return [j for j, lay in enumerate(self.layers) if lay.tie == i]

    def owner(self, i: int) -> int:
        """Index of the layer whose host block holds layer i's weights."""
        tie = self.layers[i].tie
        return i if tie is None else tie

    def weight_params(self, i: int) -> int:
        """Parameters layer i reads (its own, or its owner's when tied)."""
        return self.layers[self.owner(i)].params

    @property
    def n_params(self) -> int:
        return sum(lay.params for lay in self.layers)

    def train_flops(self, tokens: int, seq_len: int) -> float:
        """Model FLOPs of a training step over ``tokens`` tokens in sequences of ``seq_len``: forward and backward
        (twice the forward), not counting recomputation -- what model FLOPs utilization divides by time."""
        return 3.0 * tokens * sum(lay.flops_per_token(seq_len) for lay in self.layers)

    def templates(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, lay in enumerate(self.layers):
            out.setdefault(lay.template, []).append(i)
        return out


def chain(specs: list[dict], name: str = "model") -> LayerGraph:
    """A LayerGraph from plain dicts of :class:`Layer` fields (the last must have kind 'head')."""
    return LayerGraph([Layer(**s) for s in specs], name=name)


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


# What capture and planning refuse before building anything: no model has come near (the largest open ones have
# fewer than 200 layers and widths under 30,000), and a model config asking for more is a mistake that would
# otherwise fill the host's memory with layer objects before any check runs
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20


def config_size(cfg: dict, key: str, default: int | None = None) -> int:
    """A positive integer field of an HF config (``default`` where absent or null), refused in one line where it
    is not an integer, not positive, or beyond the limits above."""
    v = cfg.get(key)
    if v is None and default is not None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
        raise ValueError(f"model config {key} must be a positive integer, got {v!r}")
    v = int(v)
    limit = MAX_LAYERS if key == "num_hidden_layers" else MAX_WIDTH
    if not 0 < v <= limit:
        raise ValueError(f"model config {key} must be a positive integer of at most {limit:,}, got {v:,}")
    return v


def block_saved_bytes(hidden: int, q_dim: int, kv_dim: int, inter: int, heads: int, act_dtype_bytes: int,
                      lean: bool = False) -> int:
    """Bytes per token a Llama/Qwen2-style decoder block (RMSNorm, GQA attention with a fused kernel, SwiGLU MLP)
    saves for its backward, besides its input (the checkpoint, counted apart): both norm outputs (the inputs of the
    q/k/v and gate/up projections) and the second norm's input, q and k after rotary, v, the attention output
    (which is also the o-projection's input), gate, up and their product (the down projection's input), in the
    compute dtype; plus each norm's fp32 reciprocal RMS and the attention's fp32 log-sum-exp per head. ``lean``
    (``ScheduleConfig.saved_lean``): without the product, which the kernel MLP then computes again in the
    backward (``kernel_rewrite.keep_less``). Measured with the Triton kernels on the H200
    (benchmarks/saved_tensors.py), one byte more than this formula (the measurement rounds up): 70,201, 87,625
    and 151,673 bytes for the Qwen2.5-1.5B, 3B and 7B shapes; lean 52,281, 65,609 and 113,785."""
    return (3 * hidden + 2 * q_dim + 2 * kv_dim + (2 if lean else 3) * inter) * act_dtype_bytes + 2 * 4 + 4 * heads


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder that its layers' costs follow from."""

    hidden: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # key/value heads x head_dim
    inter: int  # the MLP's intermediate width
    heads: int
    vocab: int


def layer_costs(kind: str, shape: DecoderShape, matmul_params: int, act_dtype_bytes: int) -> dict:
    """The cost fields of a :class:`Layer` of ``kind`` (everything but its name, template, parameters and tie):
    the one source for graphs built from a config (:func:`from_config`) and captured from a model
    (``megatrain.capture``). ``matmul_params``: the parameters its matmuls multiply by (2 FLOPs each a token).

    Activations per token in the compute dtype: a layer's output (the next layer's checkpoint) is the hidden
    state; a block's forward builds for its backward both norm outputs and the residual (4 H), q, k and v, and
    the MLP's gate, up and their product (3 x intermediate); the embedding its output, the final norm its input
    and output; the head its input, its gradient and a token's fp32 log-sum-exp (logits exist one chunk of
    :data:`LOSS_CHUNK_TOKENS` at a time, see ``cost.loss_work_nbytes``)."""
    H, a = shape.hidden, act_dtype_bytes
    if kind == "embedding":
        return dict(act_bytes_per_token=H * a, work_bytes_per_token=H * a)
    if kind == "norm":
        return dict(act_bytes_per_token=H * a, work_bytes_per_token=2 * H * a)
    if kind == "head":
        return dict(matmul_flops_per_token=2.0 * matmul_params, act_bytes_per_token=0,
                    work_bytes_per_token=2 * H * a + 8, logit_bytes_per_token=4 * shape.vocab)
    if kind != "block":
        raise ValueError(f"unknown layer kind {kind!r}")
    q, kv, inter, heads = shape.q_dim, shape.kv_dim, shape.inter, shape.heads
    return dict(
        matmul_flops_per_token=2.0 * matmul_params,
        # QK^T and AV: 2 matmuls x 2 FLOP per multiply-add x (seq/2 keys on average) x q_dim
        attn_flops_per_token_per_seq=2.0 * q,
        act_bytes_per_token=H * a, work_bytes_per_token=(4 * H + q + 2 * kv + 3 * inter) * a,
        saved_bytes_per_token=block_saved_bytes(H, q, kv, inter, heads, a),
        lean_saved_bytes_per_token=block_saved_bytes(H, q, kv, inter, heads, a, lean=True))


def from_config(cfg: dict, *, act_dtype_bytes: int = 2, name: str | None = None) -> LayerGraph:
    """A LayerGraph for an HF-style decoder-only config (Llama / Qwen2 / Mistral layout: RMSNorm, GQA, SwiGLU MLP).

    Keys read: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    vocab_size, head_dim, tie_word_embeddings, attention_bias (Qwen2 sets q/k/v biases).
    """
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"model config is missing {missing} (needs {list(_REQUIRED)})")
    size = lambda k, default=None: config_size(cfg, k, default)  # noqa: E731
    H = size("hidden_size")
    inter = size("intermediate_size")
    n_blocks = size("num_hidden_layers")
    heads = size("num_attention_heads")
    kv_heads = size("num_key_value_heads", heads)
    V = size("vocab_size")
    head_dim = size("head_dim", H // heads)
    tied = bool(cfg.get("tie_word_embeddings", False))
    qkv_bias = bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2"))
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")

    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attn_w = H * q_dim + 2 * H * kv_dim + q_dim * H  # q, k, v, o projections
    mlp_w = 3 * H * inter  # gate, up, down
    block_params = attn_w + mlp_w + 2 * H + (q_dim + 2 * kv_dim if qkv_bias else 0)
    shape = DecoderShape(hidden=H, q_dim=q_dim, kv_dim=kv_dim, inter=inter, heads=heads, vocab=V)
    a = act_dtype_bytes
    layers = [Layer(name="embed", kind="embedding", template="embedding", params=V * H,
                    **layer_costs("embedding", shape, 0, a))]
    for i in range(n_blocks):
        layers.append(Layer(name=f"block.{i}", kind="block", template="block", params=block_params,
                            **layer_costs("block", shape, attn_w + mlp_w, a)))
    layers.append(Layer(name="norm", kind="norm", template="norm", params=H, **layer_costs("norm", shape, 0, a)))
    layers.append(Layer(name="head", kind="head", template="head", params=0 if tied else V * H,
                        tie=0 if tied else None, **layer_costs("head", shape, H * V, a)))
    return LayerGraph(layers, name=name or cfg.get("_name_or_path") or cfg.get("model_type") or "model")


def _cfg(H, inter, L, heads, kv, V, tied, bias=True, **kw):
    return dict(hidden_size=H, intermediate_size=inter, num_hidden_layers=L, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=V, tie_word_embeddings=tied, attention_bias=bias, **kw)


# Shapes from the models' published config.json files.
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": _cfg(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": _cfg(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": _cfg(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": _cfg(3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": _cfg(5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": _cfg(5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": _cfg(8192, 29568, 80, 64, 8, 152064, False),
    "llama-3-8b": _cfg(4096, 14336, 32, 32, 8, 128256, False, bias=False),
    "llama-3-70b": _cfg(8192, 28672, 80, 64, 8, 128256, False, bias=False),
}


def preset(name: str, *, act_dtype_bytes: int = 2) -> LayerGraph:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return from_config(PRESETS[key], act_dtype_bytes=act_dtype_bytes, name=key)
