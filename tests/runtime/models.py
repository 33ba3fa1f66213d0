"""Tiny models the runtime tests train: HF families from configs, and a plain GPT-2 style module."""

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 97


def hf_param_groups(model: nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """torch.optim parameter groups of ``model``'s trainable parameters as the HF Trainer forms them: weight decay on
    all but biases and norm weights (transformers' own rule), or with ``decay_all`` on every parameter."""
    from transformers import Trainer

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = {n for n, _ in params} if decay_all else set(Trainer.get_decay_parameter_names(None, model))
    return [{"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]

FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=5),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=5),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=5, sliding_window_pattern=2),
    "phi3": dict(model_type="phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


# families whose capture needs more than the HF conventions of the ones above: GPT-2 (learned positions, Conv1D, a
# reshape to the input's shape after the blocks), GPTBigCode (multi-query attention; the same reshape), Falcon with
# ALiBi (branches on the mask's rank and dtype), OPT (blocks at model.decoder.layers), Phi, StableLM with per-head
# q/k norms (a list of norms per attention module, longer than the list of blocks)
MORE_FAMILIES = {
    "gpt2": dict(model_type="gpt2", n_inner=96, bos_token_id=1, eos_token_id=2),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_inner=96, multi_query=True, bos_token_id=1, eos_token_id=2),
    "falcon_alibi": dict(model_type="falcon", alibi=True, new_decoder_architecture=False, multi_query=True,
                         parallel_attn=True, bias=True),
    "opt": dict(model_type="opt", ffn_dim=96, word_embed_proj_dim=64, enable_bias=True),
    "phi": dict(model_type="phi", partial_rotary_factor=0.5),
    "stablelm": dict(model_type="stablelm", qk_layernorm=True, num_key_value_heads=4, partial_rotary_factor=0.5),
    # ALiBi, fused query-key-value, and an MLP whose forward takes the residual too (it is not tiled)
    "bloom": dict(model_type="bloom", bos_token_id=1, eos_token_id=2),
    # hybrid: Mamba-2, attention and MoE blocks, its layer count derived from the list of block types
    "nemotron_h": dict(model_type="nemotron_h", head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                       n_groups=1, layers_block_type=["mamba", "attention", "moe"], num_hidden_layers=None,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32),
    # LayerNorm with a 1 + weight scale, its autocast chosen by the device type (the norm runs as a leaf)
    "nemotron": dict(model_type="nemotron", partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2),
    # hybrid (gated delta-net and gated attention blocks), its positions laid out as (4, b, T) for text, time,
    # height and width: a branch on that 4 the capture decides
    "qwen3_5_text": dict(model_type="qwen3_5_text", head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # Qwen3.5's predecessor: the same hybrid with every MLP a mixture of experts and a shared expert
    "qwen3_next": dict(model_type="qwen3_next", head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2),
    # OLMo's hybrid: gated delta nets whose head dims are no power of two here (the kernel's masked path)
    "olmo_hybrid": dict(model_type="olmo_hybrid", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        linear_key_head_dim=24, linear_value_head_dim=40,
                        linear_num_key_heads=2, linear_num_value_heads=2,
                        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3_5_moe_text": dict(model_type="qwen3_5_moe_text", head_dim=16, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                             moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2),
    # keys and values shared by no block (num_kv_shared_layers 0: the blocks are handed a KVSharingDict that only
    # stores), no per-layer inputs
    "gemma4_text": dict(model_type="gemma4_text", head_dim=16, sliding_window=8, hidden_size_per_layer_input=0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Gemma 3n without keys and values shared between blocks: per-layer inputs, AltUp, LAuReL, MLP widths per layer
    "gemma3n_text": dict(model_type="gemma3n_text", head_dim=16, sliding_window=8, vocab_size_per_layer_input=97,
                         hidden_size_per_layer_input=8, num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # a mixture of experts whose top-k is named moe_topk (transformers' alias of num_experts_per_tok)
    "hunyuan_v1_moe": dict(model_type="hunyuan_v1_moe", head_dim=16, num_experts=4, moe_topk=2,
                           moe_intermediate_size=32, use_qk_norm=True),
}
# each family's dropout probabilities, by config field
DROPOUT_FIELDS = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "gpt_bigcode": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "opt": ("dropout", "attention_dropout"),
    "phi": ("resid_pdrop", "embd_pdrop", "attention_dropout"),
    "falcon_alibi": ("hidden_dropout", "attention_dropout"),
    "bloom": ("hidden_dropout", "attention_dropout"),
}


def hf_config(family: str, **kw):
    from transformers import AutoConfig

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    fam = FAMILIES[family] if family in FAMILIES else MORE_FAMILIES[family]
    return AutoConfig.for_model(**{**base, **fam, **kw})


def with_dropout(family: str, p: float) -> dict:
    """Config fields that turn every dropout of ``family`` to ``p``."""
    return {f: p for f in DROPOUT_FIELDS[family]}


def hf_model(family: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(family, **kw), attn_implementation="eager")


def gemma_model(family: str, **kw):
    """A tiny Gemma 3n or Gemma 4 (sliding and full attention alternating, untied head); ``kw``: config fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                               sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                               tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


GLM_DSA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
               first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
               v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=4, max_position_embeddings=128,
               indexer_types=["full", "shared", "full", "shared"])


def zamba2_model(tied: bool = True, adapters: bool = True):
    """A tiny Zamba2: Mamba-2 layers and two hybrid layers sharing one transformer block."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "zamba2", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=16,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], hybrid_layer_ids=[1, 3], num_mem_blocks=1,
        use_mem_rope=False, use_shared_attention_adapter=adapters, use_shared_mlp_adapter=adapters, adapter_rank=4,
        tie_word_embeddings=tied)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def state_model(case: str):
    """Models whose blocks hand state on or take it from outside the chain, by name: GLM-MoE-DSA's top-k indices,
    Gemma 4's stored keys and values, Gemma 4's and 3n's per-layer inputs, Zamba2's shared transformer block."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if case == "glm_moe_dsa":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("glm_moe_dsa", vocab_size=VOCAB, **GLM_DSA),
                                                attn_implementation="eager")
    if case == "gemma4_kv_shared":
        return gemma_model("gemma4_text", num_kv_shared_layers=2, hidden_size_per_layer_input=0)
    if case == "gemma4_per_layer_inputs":
        return gemma_model("gemma4_text", hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
    if case == "gemma3n_kv_shared":
        return gemma_model("gemma3n_text", hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                           laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=2)
    if case == "zamba2":
        return zamba2_model()
    if case == "deepseek_v32":  # its indexer's weights get no gradient
        from ..planner.test_moe import FAMILIES as MOE, TINY

        torch.manual_seed(0)
        cfg = AutoConfig.for_model("deepseek_v32", **{**TINY, "vocab_size": VOCAB, **MOE["deepseek_v3"],
                                                      "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4})
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    raise KeyError(case)


STATE_CASES = ("glm_moe_dsa", "gemma4_kv_shared", "gemma4_per_layer_inputs", "gemma3n_kv_shared", "zamba2",
               "deepseek_v32")


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):  # (B, T, d)
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2 style: learned positions, LayerNorm, the head optionally tied to the token embedding."""

    def __init__(self, vocab: int = VOCAB, d: int = 48, layers: int = 3, heads: int = 4, max_len: int = 64,
                 tied: bool = True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.5 / math.sqrt(d))

    def forward(self, input_ids):  # (B, T) -> (B, T, V)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def compile_cpu(model, **kw):
    """megatrain.compile on the CPU in fp32 (also on a machine with a GPU): the parity tests' setting. Every
    backward recomputes its forward unless ``saved_acts`` says otherwise (tests/runtime/test_saved_acts.py covers
    the layers that keep their activations)."""
    import megatrain

    kw.setdefault("saved_acts", 0)
    return megatrain.compile(model, device="cpu", **kw)


def watch_steps(sm):
    """After each op the executor issues: (activations holding an autograd graph, forwards kept for a backward).
    Returns the list it fills."""
    import contextlib

    seen = []

    @contextlib.contextmanager
    def after(op):
        yield
        st = sm.executor.st
        seen.append(([t for t in st.act.values() if t.grad_fn is not None or t.requires_grad], dict(st.saved)))

    sm.executor.on_op = after
    return seen


def record_grads(sm) -> dict:
    """Parameter name -> its gradient (fp32) as it reaches its host buffer in the steps that follow (the last
    step's): the buffers take turns, so they need not hold it after the step."""
    import contextlib

    from megatrain.ir import OpKind, Stream

    graph, names, out = sm.graph, sm.captured.model_param_names, {}

    @contextlib.contextmanager
    def after(op):
        yield
        if op.kind is OpKind.STORE_G and op.stream is Stream.D2H and graph.owner(op.layer) == op.layer:
            buf = sm.store.grads.view(op.slot("h"), graph.weight_params(op.layer)).float()
            for name, (layer, off, shape) in names.items():
                if layer == op.layer:
                    out[name] = buf[off: off + math.prod(shape)].view(shape).clone()

    sm.executor.on_op = after
    return out
