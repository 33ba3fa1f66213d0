"""Mixtures of experts in the planner: a block's bytes are all its experts', its FLOPs and activations those of the
experts a token is routed to; the graph from a config and the graph captured from the HF model agree."""

import re

import pytest
import torch

from megatrain.capture import capture
from megatrain.cli import main
from megatrain.planner.graph import CLAMPED_GATE_PASSES, from_config, moe_of, preset

TINY = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=128)
FAMILIES = {  # every MoE layout the planner reads: dense layers mixed in, shared experts, biases, latent attention
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      head_dim=16, mlp_only_layers=[1]),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    # its top-k under its own name, moe_topk (transformers maps num_experts_per_tok to it), and shared experts
    "hunyuan_v1_moe": dict(intermediate_size=32, num_experts=4, moe_topk=2, head_dim=16),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, head_dim=16),
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4,
                        n_group=1, topk_group=1),  # MLA: as many key/value heads as query heads
    # hybrid: gated delta-net blocks (a recurrence in place of attention) and gated attention, experts everywhere
    "qwen3_next": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=32, head_dim=16, linear_key_head_dim=16,
                       linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "full_attention", "linear_attention"]),
}
COST_FIELDS = ("kind", "params", "inactive_params", "matmul_flops_per_token", "attn_flops_per_token_per_seq",
               "act_bytes_per_token", "work_bytes_per_token", "saved_bytes_per_token", "route_bytes_per_token",
               "scan_flops_per_token", "attn_bwd_bytes_per_token", "grad_add_params")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_captured_graph_of_a_moe_model_is_the_config_graph(family):
    """Parameters counted from the HF model's own modules (built on the meta device; DeepSeek's router buffer
    rebuilt from the model's config) equal the config formulas layer by layer, and so do the costs: a MoE block's
    FLOPs use its top-k experts, the router and the shared experts only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**TINY, **FAMILIES[family]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    cap = capture(model)
    captured = cap.graph
    formula = from_config(cfg.to_dict(), act_dtype_bytes=4)  # capture's default compute dtype: fp32
    assert [tuple(getattr(lay, f) for f in COST_FIELDS) for lay in captured.layers] == \
        [tuple(getattr(lay, f) for f in COST_FIELDS) for lay in formula.layers]
    # the blocks' persistent float buffers (DeepSeek's router bias) are the capture's frozen parameters
    held = sum(b.numel() for n, b in model.named_buffers() if n in cap.model_param_names)
    assert (held > 0) == (family == "deepseek_v3")
    assert captured.n_params == sum(p.numel() for p in model.parameters()) + held
    moe = moe_of(cfg.to_dict())
    blocks = [lay for lay in formula.layers if lay.kind == "block"]
    assert [i for i, lay in enumerate(blocks) if lay.inactive_params] == sorted(moe.layers)
    # an MoE block's matmuls: attention and the router, plus top-k of the experts (and shared ones), not all E
    one = blocks[sorted(moe.layers)[0]]
    assert one.matmul_flops_per_token < 2 * (one.params - one.inactive_params) + 1


def test_a_moe_blocks_compute_time_adds_its_routing_bytes_at_the_routing_rate():
    """OLMoE's shape: k x (7 H + 3 I) x 2 B a token a forward; a recomputing backward 1 + 1.5 forwards of it, a saved
    one 1.5; at the H200 spec's routing rate, after the op's matmuls and attention. Dense blocks: none."""
    import dataclasses

    from megatrain.ir import Op, OpKind, ScheduleConfig, Stream
    from megatrain.planner.cost import compute_seconds
    from megatrain.planner.graph import LayerGraph
    from megatrain.planner.hardware import PRESETS as HW

    g = preset("olmoe-1b-7b")
    block = g[1]
    assert block.route_bytes_per_token == 8 * (7 * 2048 + 3 * 1024) * 2 == 278_528
    assert all(lay.route_bytes_per_token == 0 for lay in preset("qwen2.5-1.5b").layers)
    # GPT-OSS's biased experts and clamped gate: CLAMPED_GATE_PASSES more passes of the expert width a pair
    assert preset("gpt-oss-120b")[1].route_bytes_per_token == 4 * (7 * 2880 + (3 + CLAMPED_GATE_PASSES) * 2880) * 2
    bare = LayerGraph([dataclasses.replace(lay, route_bytes_per_token=0) for lay in g.layers])
    spec = HW["h200"]
    for saved, passes in (((), 2.5), ((1,), 1.5)):
        cfg = ScheduleConfig(n_layers=len(g), mb_tokens=32768, seq_len=1024, saved_acts=saved)
        for kind, n in ((OpKind.FWD, 1.0), (OpKind.BWD, passes)):
            op = Op(0, kind, Stream.COMPUTE, step=0, layer=1, mb=0)
            extra = compute_seconds(g, cfg, spec, op) - compute_seconds(bare, cfg, spec, op)
            assert extra == pytest.approx(n * 278_528 * 32768 / spec.route_bytes_per_s, rel=1e-9)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_a_moe_blocks_backward_adds_its_grouped_experts_gradients_once_a_micro_batch(family):
    """The experts' grouped weights (each ``experts`` module's own parameters: no linears, so autograd returns their
    gradients for the executor to add into the fp32 slot) are a block's grad_add_params; a backward costs 12 bytes
    each at the device memory's rate whatever its tokens, so a step of more micro-batches pays it more often."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain.ir import Op, OpKind, ScheduleConfig, Stream
    from megatrain.planner.cost import GRAD_ADD_BYTES, compute_seconds
    from megatrain.planner.graph import LayerGraph
    from megatrain.planner.hardware import PRESETS as HW

    cfg = AutoConfig.for_model(family, **{**TINY, **FAMILIES[family]})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    own = [sum(p.numel() for name, mod in layer.named_modules() if name.split(".")[-1] == "experts"
               for p in mod.parameters(recurse=False)) for layer in model.model.layers]
    g = from_config(cfg.to_dict())
    assert [lay.grad_add_params for lay in g.layers if lay.kind == "block"] == own and any(own)
    assert all(lay.grad_add_params == 0 for lay in preset("qwen2.5-1.5b").layers)
    bare = LayerGraph([dataclasses.replace(lay, grad_add_params=0) for lay in g.layers])
    spec, i = HW["h200"], next(i for i, lay in enumerate(g.layers) if lay.grad_add_params)
    for tokens in (4096, 32768):
        sc = ScheduleConfig(n_layers=len(g), mb_tokens=tokens, seq_len=1024)
        for kind, n in ((OpKind.FWD, 0), (OpKind.BWD, g[i].grad_add_params * GRAD_ADD_BYTES)):
            op = Op(0, kind, Stream.COMPUTE, step=0, layer=i, mb=0)
            extra = compute_seconds(g, sc, spec, op) - compute_seconds(bare, sc, spec, op)
            assert extra == pytest.approx(n / spec.hbm_bytes_per_s, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name,total,active", [
    ("gpt-oss-120b", 116.83e9, 5.13e9 + 201088 * 2880),  # the model card's active count leaves the embedding out
    ("qwen3-235b-a22b", 235.09e9, 22.2e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9), ("mixtral-8x22b", 140.63e9, 39.16e9),
    ("olmoe-1b-7b", 6.92e9, 1.28e9)])
def test_moe_presets_have_their_published_sizes(name, total, active):
    g = preset(name)
    assert g.n_params == pytest.approx(total, rel=2e-3)
    assert g.active_params == pytest.approx(active, rel=1e-2)
    # FLOPs per token follow the active parameters: 2 per matmul weight (the embedding is a lookup)
    matmul = sum(lay.matmul_flops_per_token for lay in g.layers) / 2
    assert matmul == pytest.approx(g.active_params - g[0].params, rel=1e-3)


def test_plan_of_the_olmoe_shape_counts_every_expert_and_computes_the_routed_ones(tmp_path, capsys):
    shape = __import__("pathlib").Path(__file__).resolve().parents[2] / "tests" / "data" / "olmoe-1b-7b.json"
    assert main(["plan", "--config", str(shape), "--tokens", "32768", "--seq", "1024", "--hardware", "h200",
                 "--mb", "4", "--slots", "3", "--wire", "fp32", "--host-checkpoints", "0", "--gpu-opt-every", "0",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "19 layers, 6.919B params (1.282B active per token: the N of 6NT)" in out
    tps = int(re.search(r"^predicted .*\(([\d,]+) tokens/s", out, re.M).group(1).replace(",", ""))
    assert tps < 60_000  # the dense reading (0.575B params) predicted 126,404


def test_gpt_oss_120b_on_one_h200_with_1536_gib_needs_bf16_host_gradients(tmp_path, capsys):
    """On paper, with the host-lean store: fp32 host gradients do not fit 1,536 GiB (refused with the bytes), bf16
    ones do, and the plan says where they live and what a parameter costs the host."""
    argv = ["plan", "--preset", "gpt-oss-120b", "--tokens", "32768", "--seq", "4096", "--hardware", "h200",
            "--host-gib", "1536", "--mb", "4", "--slots", "3", "--wire", "fp32", "--host-checkpoints", "0",
            "--gpu-opt-every", "0", "--split-opt", "0", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(r"no plan fits: host memory 1[67]\d\d\.\d\d GiB > 1528\.00 GiB \(the least any of \d+ "
                     r"candidate plans needs; gradients on the host in bf16 .* need less; the host has 1536\.00 GiB, "
                     r"of which a plan leaves 8\.00 GiB free\)", err), err
    assert main(argv + ["--grad-host-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    host = re.search(r"^host .* of 1536 GiB less 8\.0 left free: fits; ([\d.]+) bytes per parameter all in", out, re.M)
    assert host and float(host.group(1)) < 14
    assert re.search(r"^gradients .*\(bf16\)", out, re.M)


def test_a_host_too_small_before_any_gradient_buffer_gets_no_bf16_gradient_hint(tmp_path, capsys):
    """GPT-OSS-120B within 24 GiB of the device and 1,500 GiB of host: fp32 weights on the wire need more device than
    that, and bf16 ones a host shadow that, with the store, is over the host before any gradient buffer; the
    refusal says so, and does not send the user to bf16 gradients, which fit no better."""
    argv = ["plan", "--preset", "gpt-oss-120b", "--tokens", "32768", "--seq", "4096", "--hardware", "h200",
            "--host-gib", "1500", "--gpu-gib", "24", "--out", str(tmp_path)]
    least = []
    for extra in ([], ["--grad-host-dtype", "bf16"]):
        assert main(argv + extra) == 2
        err = capsys.readouterr().err
        m = re.search(r"no plan fits: host memory (1\d{3}\.\d\d) GiB > 1492\.00 GiB \(the least any of \d+ candidate "
                      r"plans needs before any gradient buffer: the store, the bf16 shadow", err)
        assert m and "need less" not in err, err
        least.append(m.group(1))
    assert least[0] == least[1]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_gated_delta_net_blocks_cost_a_recurrence_not_attention(family):
    """Hybrid blocks: a gated delta net's block has no attention FLOPs (nothing grows with the sequence) but its
    recurrence's, at the scan rate; a softmax-attention block the opposite; the config formula's parameters are
    the HF model's (Qwen3.5 splits the projections Qwen3-Next fuses)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain.ir import OpKind, ScheduleConfig
    from megatrain.planner import cost
    from megatrain.planner.passes import build_schedule
    from megatrain.planner.hardware import PRESETS

    kw = FAMILIES["qwen3_next"] if family == "qwen3_next" else {
        k: v for k, v in FAMILIES["qwen3_next"].items() if k.startswith("linear") or k in ("layer_types", "head_dim",
                                                                                           "intermediate_size")}
    cfg = AutoConfig.for_model(family, **{**TINY, **kw})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    graph = from_config(cfg.to_dict())
    assert graph.n_params == sum(p.numel() for p in model.parameters())
    blocks = [lay for lay in graph.layers if lay.kind == "block"]
    assert [lay.scan_flops_per_token > 0 for lay in blocks] == [True, False, True]
    assert [lay.attn_flops_per_token_per_seq > 0 for lay in blocks] == [False, True, False]
    # per value head: 6KV + 3CV + 5CK with K = 16, V = 32, C = 64
    assert blocks[0].scan_flops_per_token == 4 * (6 * 16 * 32 + 3 * 64 * 32 + 5 * 64 * 16)
    sc = ScheduleConfig(n_layers=len(graph), seq_len=256, mb_tokens=256)
    bwd = next(op for op in build_schedule(graph, sc).ops if op.kind is OpKind.BWD and op.layer == 1)
    spec = PRESETS["h200"]
    slower = cost.compute_seconds(graph, sc, spec.__class__(**{**spec.__dict__, "scan_flops_per_s": 1e12}), bwd)
    assert slower - cost.compute_seconds(graph, sc, spec, bwd) == pytest.approx(
        cost.scan_flops(graph, sc, bwd) * (1 / 1e12 - 1 / (spec.scan_flops_per_s or spec.matmul_flops_per_s)))
