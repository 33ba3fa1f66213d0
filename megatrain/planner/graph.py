"""The :class:`~megatrain.ir.graph.LayerGraph` of a model built by hand (:func:`chain`), from an HF-style decoder
config dict (:func:`from_config`, no transformers import) or from a named preset (:func:`preset`), with each layer's
costs. Capture from a live ``nn.Module`` produces the same structure."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.graph import Layer, LayerGraph
from megatrain.layout import NORM_WITH_MLP
from megatrain.planner.hybrid import GATED_ATTENTION, as_recurrence, delta_net_block, linear_attention

# The fused linear + cross-entropy of a training step forms its logits this many elements at a time, in the compute
# dtype, one chunk alive at a time (kernels.linear_ce.LOGITS_PER_CHUNK; a test keeps the two equal, a GPU test
# checks what a LOSS allocates against cost.workspace_nbytes).
LOSS_LOGITS_PER_CHUNK = 1 << 29


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




def full_recompute(graph: "LayerGraph") -> "LayerGraph":
    """``graph`` with every recomputing backward forming its whole forward again (no
    ``Layer.unread_flops_per_token``): how the runtime ran before it skipped the unread projection, and how it runs a
    layer whose probe refused the skip (``megatrain plan --full-recompute``; recorded runs from before)."""
    from dataclasses import replace

    return LayerGraph([replace(lay, unread_flops_per_token=0.0) for lay in graph.layers], name=graph.name)


def attn_group_bytes(q_dim: int, kv_dim: int, heads: int, act_dtype_bytes: int) -> int:
    """Bytes per token the attention's backward holds for one key/value head's group of query heads at a time
    (``Layer.attn_bwd_group_bytes_per_token``): the group's fp32 query-gradient accumulator, its key/value
    gradients expanded to its query heads (where it has several) and its query gradient, each as wide as the
    group's query heads, and its key/value gradients (one head each). 0 where keys and values have one head (the
    backward is one call)."""
    a, head_dim = act_dtype_bytes, q_dim // heads
    kv_heads = max(1, kv_dim // head_dim)
    if kv_heads == 1:  # (one group: the whole call)
        return 0
    group = q_dim // kv_heads
    return (4 + a + (2 * a if group > head_dim else 0)) * group + 2 * a * head_dim


def layer_costs(kind: str, shape: DecoderShape, matmul_params: int, act_dtype_bytes: int, *,
                tiles: bool = True, tile_norm: bool = False, moe: "MoE | None" = None,
                unread_down: bool = False, grouped_attention: bool = True) -> dict:
    """The cost fields of a :class:`Layer` of ``kind`` (everything but its name, template, parameters and tie):
    the one source for graphs built from a config (:func:`from_config`) and captured from a model
    (``megatrain.capture``). ``matmul_params``: the parameters its matmuls multiply by (2 FLOPs each a token).

    Activations per token in the compute dtype: a layer's output (the next layer's checkpoint) is the hidden
    state; a block's forward holds at once 3 H (the attention's input norm, the residual, and the MLP's input norm
    or the attention's output), q, k and v, and the MLP's gate, up and their product (3 x intermediate; a mixture
    of experts' per routed pair, and each pair's gathered input and its expert's output, 2 x top-k x H); the embedding its output, the final norm its input
    and output; the head its input, its gradient and a token's fp32 log-sum-exp (logits exist one chunk of
    :data:`LOSS_LOGITS_PER_CHUNK` elements at a time, see ``cost.workspace_nbytes``). ``tiles``: a block whose MLP
    runs over tiles of the tokens (``ScheduleConfig.seq_tile``; a dense MLP, not a mixture of experts);
    ``tile_norm``: its post-attention norm with it (:data:`NORM_WITH_MLP`); ``moe``: a block whose MLP routes to
    experts (its routing's bytes, ``Layer.route_bytes_per_token``; its experts' gradients added into the fp32 slot,
    ``Layer.grad_add_params``); ``unread_down``: a dense block whose MLP's down
    projection a recomputing backward leaves out (:data:`UNREAD_PROJECTION`, ``Layer.unread_flops_per_token``);
    ``grouped_attention``: its attention takes the flash kernel, whose backward runs one key/value head's group of
    query heads at a time on long micro-batches (``Layer.attn_bwd_group_bytes_per_token``,
    ``capture.packed_attention``)."""
    H, a = shape.hidden, act_dtype_bytes
    if kind == "embedding":
        return dict(act_bytes_per_token=H * a, work_bytes_per_token=H * a)
    if kind == "norm":
        return dict(act_bytes_per_token=H * a, work_bytes_per_token=2 * H * a)
    if kind == "head":
        return dict(matmul_flops_per_token=2.0 * matmul_params, act_bytes_per_token=0,
                    work_bytes_per_token=2 * H * a + 8, logit_bytes_per_token=4 * shape.vocab,
                    loss_logit_bytes_per_token=a * shape.vocab)
    if kind != "block":
        raise ValueError(f"unknown layer kind {kind!r}")
    q, kv, inter, heads = shape.q_dim, shape.kv_dim, shape.inter, shape.heads
    return dict(
        matmul_flops_per_token=2.0 * matmul_params,
        # QK^T and AV: 2 matmuls x 2 FLOP per multiply-add x (seq/2 keys on average) x q_dim
        attn_flops_per_token_per_seq=2.0 * q,
        act_bytes_per_token=H * a,
        work_bytes_per_token=(3 * H + q + 2 * kv + 3 * inter + (2 * moe.top_k * H if moe is not None else 0)) * a,
        tile_work_bytes_per_token=(3 * inter + (H if tile_norm else 0)) * a if tiles else 0,
        tile_flops_per_token=6.0 * H * inter if tiles else 0.0,
        saved_bytes_per_token=block_saved_bytes(H, q, kv, inter, heads, a),
        lean_saved_bytes_per_token=block_saved_bytes(H, q, kv, inter, heads, a, lean=True),
        route_bytes_per_token=moe.top_k * (7 * H + (3 + (CLAMPED_GATE_PASSES if moe.expert_bias else 0))
                                           * moe.expert_inter) * a if moe is not None else 0,
        grad_add_params=moe.expert_params(H) if moe is not None else 0,
        unread_flops_per_token=2.0 * H * inter if unread_down and moe is None else 0.0,
        attn_bwd_bytes_per_token=(4 + (2 * a if kv < q else 0)) * q,
        attn_bwd_group_bytes_per_token=attn_group_bytes(q, kv, heads, a) if grouped_attention else 0)


# GPT-OSS's experts beyond a SwiGLU expert's routing, in passes of an expert's width a pair: the biases gathered per
# pair and added, and the clamped gate's elementwise kernels over strided halves (fitted: 69 ns a pair against 32
# at the routing rate, the experts of its 120B shape at 128-1,024 rows an expert, H100; docs/benchmarks.md)
CLAMPED_GATE_PASSES = 12


@dataclass(frozen=True)
class MoE:
    """The mixture-of-experts part of a decoder config: which blocks route their tokens to experts, and how."""

    experts: int  # routed experts per MoE block
    top_k: int  # experts each token goes to
    expert_inter: int  # one expert's intermediate width (gate, up, down)
    shared_inter: int  # the shared experts' intermediate width, together (0: none)
    layers: frozenset[int]  # MoE blocks; the others have a dense MLP of width dense_inter
    dense_inter: int
    expert_bias: bool = False  # GPT-OSS: router and experts with biases
    shared_gate: bool = False  # Qwen2-MoE: a sigmoid gate (hidden -> 1) on the shared expert
    score_bias: bool = False  # DeepSeek-V3: the router's per-expert bias on the scores that pick the experts
    # (e_score_correction_bias; a frozen parameter of the block once captured)

    def expert_params(self, hidden: int) -> int:
        """The routed experts' parameters in one MoE block."""
        return self.experts * (3 * hidden * self.expert_inter + ((2 * self.expert_inter + hidden)
                                                                  if self.expert_bias else 0))

    def inactive_params(self, hidden: int) -> int:
        """The routed experts' parameters in one MoE block that a token is not routed to."""
        return self.expert_params(hidden) * (self.experts - self.top_k) // self.experts


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOPK_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token")


def with_aliases(cfg: dict) -> dict:
    """``cfg`` with the names its transformers config class maps to its own fields (``attribute_map``: Hunyuan's
    ``moe_topk`` is ``num_experts_per_tok``), where the family is one transformers knows. Only where a name this
    module reads may be missing: a field naming experts without both an expert count and a top-k of
    :data:`_EXPERT_KEYS` and :data:`_TOPK_KEYS`, or no layer count (transformers takes a second to import, which a
    plan for a preset's dense or fully named shape does not need)."""
    experts = any("expert" in k or "moe" in k for k in cfg)
    named = any(k in cfg for k in _EXPERT_KEYS) and any(k in cfg for k in _TOPK_KEYS)
    if (named or not experts) and cfg.get("num_hidden_layers") is not None:
        return cfg
    try:
        from transformers import CONFIG_MAPPING

        aliases = CONFIG_MAPPING[cfg["model_type"]].attribute_map
    except (ImportError, KeyError):
        return cfg
    out = dict(cfg)
    for alias, field in aliases.items():
        if alias not in out and field in out:
            out[alias] = out[field]
    if out.get("num_hidden_layers") is None and isinstance(out.get("layers_block_type"), list):
        out["num_hidden_layers"] = len(out["layers_block_type"])  # (Nemotron-H derives its count from the list)
    return out


def moe_of(cfg: dict) -> MoE | None:
    """The MoE part of an HF config (Qwen2-MoE / Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3, Llama 4), None for a
    dense one. Which blocks are MoE follows each family's modeling code: ``mlp_only_layers`` and
    ``decoder_sparse_step`` (Qwen), ``first_k_dense_replace`` and ``moe_layer_freq`` (DeepSeek),
    ``interleave_moe_layer_step`` (Llama 4); every block otherwise. A family's own names for these (transformers'
    ``attribute_map``) are read as these."""
    cfg = with_aliases(cfg)
    key = next((k for k in _EXPERT_KEYS if cfg.get(k)), None)
    if key is None:
        return None
    size = lambda k, default=None: config_size(cfg, k, default)  # noqa: E731
    experts = size(key)
    top = next((k for k in _TOPK_KEYS if cfg.get(k)), None)
    if top is None:
        raise ValueError(f"model config has {experts} experts but no {' / '.join(_TOPK_KEYS)}")
    top_k = size(top)
    if top_k > experts:
        raise ValueError(f"model config routes each token to {top_k} experts of {experts}")
    n = size("num_hidden_layers")
    mtype = str(cfg.get("model_type", ""))
    expert_inter = size("moe_intermediate_size", cfg.get("intermediate_size"))
    dense_inter = size("intermediate_size_mlp" if cfg.get("intermediate_size_mlp") else "intermediate_size")
    shared = 0
    if cfg.get("shared_expert_intermediate_size"):
        shared = size("shared_expert_intermediate_size")
    elif cfg.get("n_shared_experts"):
        shared = size("n_shared_experts") * expert_inter
    elif mtype.startswith("llama4"):
        shared = expert_inter
    elif mtype == "hunyuan_v1_moe":  # (a shared MLP of the dense width in every block)
        shared = dense_inter
    if "mlp_only_layers" in cfg or "decoder_sparse_step" in cfg:
        step = size("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        layers = {l for l in range(n) if l not in dense and (l + 1) % step == 0}
    elif "first_k_dense_replace" in cfg:
        first, freq = int(cfg.get("first_k_dense_replace") or 0), size("moe_layer_freq", 1)
        layers = {l for l in range(n) if l >= first and l % freq == 0}
    elif isinstance(cfg.get("layers_block_type"), list) and "moe" in cfg["layers_block_type"]:  # (Nemotron-H)
        layers = {l for l, kind in enumerate(cfg["layers_block_type"]) if kind == "moe"}
    elif cfg.get("interleave_moe_layer_step"):
        step = size("interleave_moe_layer_step")
        layers = set(range(step - 1, n, step))
    else:
        layers = set(range(n))
    return MoE(experts=experts, top_k=top_k, expert_inter=expert_inter, shared_inter=shared,
               layers=frozenset(layers), dense_inter=dense_inter, expert_bias=mtype == "gpt_oss",
               shared_gate=bool(cfg.get("shared_expert_intermediate_size")), score_bias=mtype == "deepseek_v3")


def moe_block(moe: MoE, hidden: int) -> tuple[int, int, int]:
    """One MoE block's MLP part: (its parameters, the parameters a token's matmuls multiply by -- the router, its
    top-k experts and the shared ones --, the intermediate width a token's activations have: its k routed copies
    and the shared experts')."""
    router = hidden * moe.experts + (moe.experts if moe.expert_bias else 0) + (moe.experts if moe.score_bias else 0)
    shared = 3 * hidden * moe.shared_inter + (hidden if moe.shared_gate else 0)
    params = router + moe.expert_params(hidden) + shared
    active = hidden * moe.experts + moe.top_k * 3 * hidden * moe.expert_inter + shared
    return params, active, moe.top_k * moe.expert_inter + moe.shared_inter


def latent_attention(cfg: dict) -> tuple[int, int, int] | None:
    """For multi-head latent attention (DeepSeek: ``kv_lora_rank`` set): (the queries' and keys' width, heads x
    (qk_nope_head_dim + qk_rope_head_dim); the values' width, heads x v_head_dim; attention's FLOPs per token per
    token of sequence, QK^T over the first and AV over the second at 2 FLOPs per multiply-add over seq / 2 keys).
    None for other attention."""
    if not cfg.get("kv_lora_rank"):
        return None
    heads = config_size(cfg, "num_attention_heads")
    qk = heads * (config_size(cfg, "qk_rope_head_dim") + config_size(cfg, "qk_nope_head_dim"))
    v = heads * config_size(cfg, "v_head_dim")
    return qk, v, qk + v


# families whose blocks hand the next block a value besides the hidden state (capture's carries)
CARRIES = frozenset({"glm_moe_dsa"})


def carry_bytes(cfg: dict) -> int:
    """Bytes per token of what a block hands the next besides its hidden state: GLM-MoE-DSA's top-k key indices
    (int32, ``index_topk`` of them per token; at most the sequence's length). Raises ValueError where the config
    does not say."""
    k = cfg.get("index_topk")
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"a {cfg.get('model_type') or 'model'} block hands the next one a value besides the hidden "
                         f"state whose size the planner cannot tell (it reads index_topk, the top-k indices' count)")
    return 4 * k


def from_config(cfg: dict, *, act_dtype_bytes: int = 2, name: str | None = None) -> LayerGraph:
    """A LayerGraph for an HF-style decoder-only config (Llama / Qwen2 / Mistral layout: RMSNorm, GQA, SwiGLU MLP;
    mixtures of experts as :func:`moe_of` reads them, DeepSeek's multi-head latent attention).

    Keys read: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    vocab_size, head_dim, tie_word_embeddings, attention_bias (Qwen2 sets q/k/v biases); the MoE keys of
    :func:`moe_of`; q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim (MLA).
    A MoE block's parameters are all its experts'; its FLOPs and activations those of the experts a token is
    routed to (top-k), the shared experts and the router.
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
    mtype = str(cfg.get("model_type", ""))
    qkv_bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", mtype in ("qwen2", "qwen2_moe"))))
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    moe = moe_of(cfg)

    mla = latent_attention(cfg)
    if mla is not None:
        q_dim, kv_dim, attn_dims = mla
        rope, nope, v_head = size("qk_rope_head_dim"), size("qk_nope_head_dim"), size("v_head_dim")
        q_lora, kv_lora = cfg.get("q_lora_rank"), size("kv_lora_rank")
        q_w = (H * q_lora + q_lora * q_dim) if q_lora else H * q_dim
        attn_w = q_w + H * (kv_lora + rope) + kv_lora * heads * (nope + v_head) + heads * v_head * H
        attn_extra = (q_lora or 0) + kv_lora  # their norms
    else:
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        attn_w = H * q_dim + 2 * H * kv_dim + q_dim * H  # q, k, v, o projections
        attn_extra = (q_dim + 2 * kv_dim if qkv_bias else 0) + (H if qkv_bias and mtype == "gpt_oss" else 0) \
            + (heads if mtype == "gpt_oss" else 0) \
            + (2 * head_dim if mtype.startswith("qwen3") or mtype == "hunyuan_v1_moe" else 0) \
            + (q_dim + kv_dim if mtype == "olmoe" else 0)  # GPT-OSS's sinks; Qwen3's, Hunyuan's, OLMoE's q/k norms
        attn_dims = 2 * q_dim
        if mtype in GATED_ATTENTION:
            attn_w += H * q_dim
    lin = linear_attention(cfg, size)
    a = act_dtype_bytes
    layers = [Layer(name="embed", kind="embedding", template="embedding", params=V * H,
                    **layer_costs("embedding", DecoderShape(H, q_dim, kv_dim, inter, heads, V), 0, a))]
    for i in range(n_blocks):
        inactive = 0
        if moe is not None and i in moe.layers:
            mlp_params, mlp_active, width = moe_block(moe, H)
            template, inactive = "moe-block", moe.inactive_params(H)
        else:
            width = moe.dense_inter if moe is not None else inter
            mlp_params = mlp_active = 3 * H * width
            template = "block"
        shape = DecoderShape(hidden=H, q_dim=q_dim, kv_dim=kv_dim, inter=width, heads=heads, vocab=V)
        mixer_w, mixer_extra = attn_w, attn_extra
        recurrent = lin is not None and cfg["layer_types"][i] == "linear_attention"
        if recurrent:
            mixer_w, mixer_extra, *scan = delta_net_block(lin, H, a)
            template = "linear-" + template
        costs = layer_costs("block", shape, mixer_w + mlp_active, a, tiles=moe is None,
                            tile_norm=moe is None and mtype in NORM_WITH_MLP,
                            moe=moe if template.endswith("moe-block") else None,
                            unread_down=template == "block" and mtype in NORM_WITH_MLP)
        costs["attn_flops_per_token_per_seq"] = float(attn_dims)
        if recurrent:
            costs = as_recurrence(costs, *scan)
        if mtype in CARRIES and i < n_blocks - 1:
            costs["carry_bytes_per_token"] = carry_bytes(cfg)
        layers.append(Layer(name=f"block.{i}", kind="block", template=template,
                            params=mixer_w + mlp_params + 2 * H + mixer_extra, inactive_params=inactive, **costs))
    shape = DecoderShape(hidden=H, q_dim=q_dim, kv_dim=kv_dim, inter=inter, heads=heads, vocab=V)
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
    # mixtures of experts
    "qwen3-30b-a3b": _cfg(2048, 6144, 48, 32, 4, 151936, False, bias=False, head_dim=128, model_type="qwen3_moe",
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": _cfg(4096, 12288, 94, 64, 4, 151936, False, bias=False, head_dim=128,
                            model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536),
    "mixtral-8x22b": _cfg(6144, 16384, 56, 48, 8, 32768, False, bias=False, model_type="mixtral",
                          num_local_experts=8, num_experts_per_tok=2),
    "gpt-oss-120b": _cfg(2880, 2880, 36, 64, 8, 201088, False, head_dim=64, model_type="gpt_oss",
                         num_local_experts=128, num_experts_per_tok=4),
    # hybrid: three gated delta-net blocks to one gated-attention block, every MLP 512 experts (10 routed a token)
    # and a shared one
    "qwen3-next-80b-a3b": _cfg(2048, 5120, 48, 16, 2, 151936, False, bias=False, head_dim=256,
                               model_type="qwen3_next", num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
                               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               layer_types=[t for _ in range(12)
                                            for t in ("linear_attention",) * 3 + ("full_attention",)]),
    "olmoe-1b-7b": _cfg(2048, 1024, 16, 16, 16, 50304, False, bias=False, model_type="olmoe", num_experts=64,
                        num_experts_per_tok=8),
}


def preset(name: str, *, act_dtype_bytes: int = 2) -> LayerGraph:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return from_config({"model_type": preset_model_type(key), **PRESETS[key]}, act_dtype_bytes=act_dtype_bytes,
                       name=key)


def preset_model_type(name: str) -> str:
    """The HF model type a preset's shape is built as: its own where it names one, else Llama's for the Llama
    presets and Qwen2's for the others."""
    return PRESETS[name].get("model_type") or ("llama" if name.startswith("llama") else "qwen2")
