"""Mixture-of-experts models streamed on the CPU train as plain PyTorch trains them: routed experts, shared
experts, dense layers mixed in, expert biases, latent attention (the HF decoder layer is the template)."""

import copy

import pytest
import torch

from megatrain.capture import grouped_experts

from ..planner.test_moe import FAMILIES, TINY
from .models import VOCAB, compile_cpu, state_model
from .test_parity import OPT, batches, check, reference_train


def moe_model(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **{**TINY, "vocab_size": VOCAB, **FAMILIES[family]})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_family_matches_plain_pytorch(family):
    """3 steps x 3 micro-batches with clipping active, untied; the router's auxiliary loss off (the configs'
    default: HF adds it only where output_router_logits is set). Every weight within 1e-5 of plain PyTorch's but
    the k-projection biases where a family has them: their gradient is analytically zero (softmax ignores a
    constant added to every key's score), so what reaches them is rounding noise, which AdamW's first steps turn
    into lr-sized moves in either run alike but not the same (the dense families' test says the same of tied
    heads)."""
    model = moe_model(family)
    assert not getattr(model.config, "output_router_logits", False)
    ref = copy.deepcopy(model)
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms,
          skip=lambda name: name.endswith("k_proj.bias"))


AUX_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]  # those whose HF loss has the router term


@pytest.mark.parametrize("family", AUX_FAMILIES)
def test_router_aux_loss_matches_hf(family):
    """With ``output_router_logits`` set, HF adds ``router_aux_loss_coef x`` its load-balancing loss (over every
    MoE layer's router logits of the forward, padding weighted out) to the loss: the streamed run adds the same
    (each micro-batch's, a third of the step's loss each) and trains as plain PyTorch with HF's loss does -- a
    saved layer and a recomputed one, 3 steps x 3 micro-batches, clipping active. The coefficient is large enough
    that without the term the weights would differ (checked)."""
    model = moe_model(family)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1, saved_acts=1)
    assert sm.captured.router_aux is not None and sm.captured.router_aux.coef == 0.5
    assert sm.schedule_for(6, 12).config.saved_acts
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms,
          skip=lambda name: name.endswith("k_proj.bias"))
    plain.config.output_router_logits = False  # the same training without the router term: other weights
    plain_losses, _ = reference_train(plain, data, n_mb=3)
    assert abs(plain_losses[0] - ref_losses[0]) > 1e-3
    routers = [n for n in sm.state_dict() if any(k in n for k in ("gate.weight", "router.weight"))]
    assert routers and any(not torch.allclose(sm.state_dict()[n], plain.get_parameter(n), atol=1e-6)
                           for n in routers)


def test_a_family_without_a_router_loss_trains_as_hf_with_output_router_logits():
    """DeepSeek-V3's HF loss has no router term even with output_router_logits set: none is added."""
    model = moe_model("deepseek_v3")
    model.config.output_router_logits = True
    sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3)
    assert sm.captured.router_aux is None


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_an_hf_checkpoint_with_each_expert_stored_apart_loads(family, tmp_path):
    """HF's save_pretrained writes each expert's matrices apart (experts.0.gate_proj.weight, ...; Mixtral's as
    block_sparse_moe.experts.0.w1.weight), the model holds them stacked (experts.gate_up_proj): the checkpoint loads
    into the store through transformers' conversion mapping for the family, one tensor at a time, every weight
    equal to the saved model's."""
    saved = moe_model(family)
    saved.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as sf:
        assert any(".experts.0." in k for k in sf.keys())  # the per-expert layout
    fresh = moe_model(family)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_()
    sm = compile_cpu(fresh, optim=OPT, checkpoint=tmp_path)
    sd = sm.state_dict()
    assert all(torch.equal(sd[n], p.detach()) for n, p in saved.named_parameters())


def test_a_checkpoint_missing_an_expert_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    moe_model("qwen3_moe").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts' tensors of 'model.layers.0.mlp.experts.gate_up_proj' .* for all 8 "
                                         r"experts \(15 tensors found\)"):
        compile_cpu(moe_model("qwen3_moe"), optim=OPT, checkpoint=tmp_path)


def test_a_deepseek_v3_checkpoint_with_its_per_layer_router_biases_trains_as_hf(tmp_path):
    """DeepSeek-V3's routers keep a bias buffer per layer (e_score_correction_bias, in the checkpoint) that picks
    the experts: capture makes it a frozen parameter of its block, so each layer binds its own through the shared
    template. A checkpoint whose layers' biases differ loads, and 2 steps train as HF's model does, the biases
    unchanged."""
    saved = moe_model("deepseek_v3")
    biases = [n for n, _ in saved.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) >= 2
    g = torch.Generator().manual_seed(3)
    for n in biases:  # large enough to change which experts are picked, and different in every layer
        saved.get_buffer(n).copy_(torch.randn(saved.get_buffer(n).shape, generator=g))
    saved.save_pretrained(tmp_path)
    ref = copy.deepcopy(saved)
    data = batches(n_steps=2)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(moe_model("deepseek_v3"), optim=OPT, n_mb=3, checkpoint=tmp_path)
    assert set(biases) <= sm.captured.frozen
    before = {n: sm.state_dict()[n].clone() for n in biases}
    assert all(torch.equal(before[n], saved.get_buffer(n)) for n in biases)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    assert all(torch.equal(sm.state_dict()[n], before[n]) for n in biases)
    same = copy.deepcopy(saved)  # one layer's biases in every layer (what one template's buffer would give)
    for n in biases:
        same.get_buffer(n).copy_(saved.get_buffer(biases[0]))
    assert abs(reference_train(same, data[:1], n_mb=3)[0][0] - ref_losses[0]) > 1e-4


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral"])
def test_grouped_expert_gemms_train_as_a_loop_over_experts(family):
    """The streamed templates compute the experts through grouped GEMMs (capture.grouped_experts in place of
    transformers' grouped_mm implementation, torch's grouped matmul: one call for all experts of a layer); the
    reference is the same model computing each expert in turn in plain PyTorch (the eager implementation, a loop
    over the experts that have tokens): 3 steps x 3 micro-batches with clipping agree to fp32 rounding, which the
    two sum in different orders and three Adam steps amplify (the weights within 2e-4 of each parameter's largest:
    up to 8.8e-5 measured on an AMD EPYC CPU, under 1e-5 on others). (GPT-OSS's loop orders its sums otherwise: its layers
    are checked one call at a time below and trained against transformers' grouped implementation in the family
    test above.)"""
    model = moe_model(family)
    ref = copy.deepcopy(model)
    ref.config._experts_implementation = "eager"
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3)
    impl = {m.config._experts_implementation for seg in sm.captured.segments for m in seg.template.modules()
            if type(m).__name__.endswith("Experts")}
    assert impl == {grouped_experts.NAME} and sm.captured.grouped_experts
    assert model.config._experts_implementation == "grouped_mm"  # the user's model is not switched
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms,
          skip=lambda name: name.endswith("k_proj.bias"), tol=2e-4)


@pytest.mark.parametrize("family,hidden", [("olmoe", 64), ("gpt_oss", 64), ("olmoe", 36)])
def test_grouped_experts_forward_and_backward_equal_the_loop(family, hidden):
    """capture.grouped_experts.forward against transformers' loop over experts for the same routing: output and
    the gradients of the states, the routing weights and every expert weight, in fp32. Width 36 takes the path for
    rows torch's grouped matmul cannot take (not 16-byte aligned): a loop over the experts' row ranges."""
    fam = {**FAMILIES[family], "hidden_size": hidden, "head_dim": 4} if hidden != 64 else FAMILIES[family]
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**TINY, "vocab_size": VOCAB, **fam}))
    experts = next(m for n, m in model.named_modules() if n.endswith("experts"))
    ref = copy.deepcopy(experts)
    ref.config = copy.deepcopy(ref.config)
    ref.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    for p, q in zip(experts.parameters(), ref.parameters()):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            q.copy_(p)
    n_tok, n_exp, k = 37, experts.num_experts, model.config.num_experts_per_tok
    x = torch.randn(n_tok, hidden, generator=g)
    index = torch.rand(n_tok, n_exp, generator=g).topk(k, dim=-1).indices
    w = torch.rand(n_tok, k, generator=g).softmax(-1)
    ins = [t.clone().requires_grad_() for t in (x, w)]
    ins_ref = [t.clone().requires_grad_() for t in (x, w)]
    out = grouped_experts.forward(experts, ins[0], index, ins[1])
    out_ref = ref(ins_ref[0], index, ins_ref[1])
    dy = torch.randn(out.shape, generator=g)
    out.backward(dy)
    out_ref.backward(dy)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    close(out, out_ref)
    for a, b in zip(ins, ins_ref):
        close(a.grad, b.grad)
    for (n, p), q in zip(experts.named_parameters(), ref.parameters()):
        close(p.grad, q.grad)


@pytest.mark.parametrize("saved_acts", [0, 1])
def test_deepseek_v32_whose_indexer_gets_no_gradient_trains_as_plain_pytorch(saved_acts):
    """DeepSeek-V3.2's sparse-attention indexer only picks the top-k keys (its forward runs under no_grad): autograd
    gives its weights no gradient, so torch.optim.AdamW leaves them alone (no weight decay either), and so does the
    streamed run. Every backward recomputing, and a layer keeping its activations; 3 steps x 3 micro-batches."""
    model = state_model("deepseek_v32")
    indexer = [n for n, _ in model.named_parameters() if ".indexer." in n]
    assert len(indexer) == 5 * model.config.num_hidden_layers
    ref = copy.deepcopy(model)
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    assert all(torch.equal(ref.get_parameter(n), model.get_parameter(n)) for n in indexer)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1, saved_acts=saved_acts)
    assert bool(sm.schedule_for(6, 12).config.saved_acts) == bool(saved_acts)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    sd = sm.state_dict()
    assert all(torch.equal(sd[n], model.get_parameter(n)) for n in indexer)
    assert set(sm.optimizer.parameter_steps()) == set(indexer)
