import pytest

from megatrain.planner.graph import PRESETS, from_config, preset
from megatrain.planner.hardware import HardwareSpec, hardware

from .helpers import TINY


# Parameter counts published for these checkpoints.
@pytest.mark.parametrize("name,params", [("llama-3-8b", 8_030_261_248), ("qwen2.5-0.5b", 494_032_768),
                                         ("qwen2.5-7b", 7_615_616_512), ("qwen2.5-1.5b", 1_543_714_304)])
def test_preset_parameter_counts(name, params):
    assert preset(name).n_params == params


def test_every_preset_builds_a_chain_with_shared_block_template():
    for name in PRESETS:
        g = preset(name)
        templates = g.templates()
        # dense, MoE, or a mix of the two; a hybrid's gated delta-net blocks a template of their own
        blocks = [i for kind in ("block", "moe-block", "linear-block", "linear-moe-block") for i in templates.get(kind, [])]
        assert len(blocks) == PRESETS[name]["num_hidden_layers"]
        assert list(g.g.successors(0)) == [1] and g[len(g) - 1].kind == "head"


def test_tied_head_reads_the_embedding():
    g = from_config(TINY)
    head = len(g) - 1
    assert g[head].params == 0 and g.owner(head) == 0 and g.weight_params(head) == g[0].params
    untied = from_config({**TINY, "tie_word_embeddings": False})
    assert untied.owner(head) == head and untied[head].params == TINY["vocab_size"] * TINY["hidden_size"]


def test_attention_flops_grow_with_sequence_length():
    b = from_config(TINY)[1]
    assert b.flops_per_token(2048) - b.flops_per_token(1024) == pytest.approx(1024 * 2 * TINY["hidden_size"])


@pytest.mark.parametrize("cfg,msg", [({"hidden_size": 64}, "missing"),
                                     ({**TINY, "num_key_value_heads": 3}, "multiple"),
                                     ({**TINY, "num_hidden_layers": 0}, "positive")])
def test_bad_model_config_is_refused(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        from_config(cfg)


def test_hardware_from_json(tmp_path):
    d = hardware("h200").to_dict()
    p = tmp_path / "hw.json"
    import json

    p.write_text(json.dumps({**d, "name": "mine", "h2d_bytes_per_s": 10e9}))
    assert hardware(str(p)).h2d_bytes_per_s == 10e9
    p.write_text(json.dumps({**d, "h2d_bytes_per_s": 0}))
    with pytest.raises(ValueError, match="h2d_bytes_per_s must be a finite number > 0, got 0"):
        hardware(str(p))
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware("tpu")
    assert HardwareSpec.from_dict(d) == hardware("h200")


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3-8b"])
def test_a_preset_graph_equals_the_graph_captured_from_the_same_config(name):
    """One source for per-layer costs: the planner's graph of a preset (no model built) and the graph capture
    makes of that model (built on the meta device) agree in every number; only names and template keys differ."""
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain.capture import capture
    from megatrain.planner.graph import PRESETS, preset

    kind = "llama" if name.startswith("llama") else "qwen2"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type=kind, **PRESETS[name]),
                                                 attn_implementation="sdpa")
    captured = capture(model, compute_dtype=torch.bfloat16).graph
    planned = preset(name)
    assert len(captured) == len(planned) and captured.n_params == planned.n_params
    for a, b in zip(captured.layers, planned.layers):
        assert dataclasses.replace(a, name="", template="") == dataclasses.replace(b, name="", template="")


def test_train_flops_are_three_forward_passes():
    """Model FLOPs of a step (what MFU divides by time): forward and backward (twice the forward), every layer's
    matmuls and causal attention at the sequence length; for Qwen2.5-7B at 1,024 tokens about 6 N per token plus
    attention."""
    g = preset("qwen2.5-7b")
    tokens, seq = 32768, 1024
    forward = sum(lay.matmul_flops_per_token + lay.attn_flops_per_token_per_seq * seq for lay in g.layers)
    assert g.train_flops(tokens, seq) == 3 * forward * tokens
    matmul_params = sum(lay.matmul_flops_per_token for lay in g.layers) / 2
    assert g.train_flops(tokens, 1) == pytest.approx(6 * matmul_params * tokens, rel=1e-3)
    assert 0.9 < matmul_params / g.n_params < 1.0  # the embedding's lookup is no matmul
