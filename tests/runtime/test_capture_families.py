"""Capture of models beyond the Llama family: blocks found by HF's conventions, code around the blocks that
branches on a tensor's rank or dtype (GPT-2, Falcon with ALiBi), values from the inputs used after the blocks
(GPT-2 and GPTBigCode reshape the final hidden state to the input's shape); and refusals that name the line."""

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import megatrain
from megatrain.capture import CaptureError, capture

from .models import VOCAB, TinyGPT, compile_cpu, gemma_model, hf_model, state_model, with_dropout, zamba2_model
from .test_parity import OPT, batches, check, reference_train


@pytest.mark.parametrize("family", ["gpt2", "gpt_bigcode", "falcon_alibi", "stablelm", "bloom", "nemotron",
                                    "nemotron_h", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid",
                                    "hunyuan_v1_moe", "gemma4_text", "gemma3n_text"])
def test_family_matches_plain_pytorch(family):
    """Untied over 3 steps; the tied head (these families' default) over one step: the streamed run sums the tied
    gradient's parts in another order than autograd (an ulp apart), which AdamW turns into an lr-sized step on the
    k-projection bias (an analytically zero gradient) after the first."""
    kw = with_dropout(family, 0.0) if family in ("gpt2", "gpt_bigcode", "falcon_alibi", "bloom") else {}
    # (the hybrids' heads are untied)
    untied = family in ("nemotron_h", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid")
    runs = ((False, 3),) if untied else ((True, 1), (False, 3))
    for tied, n_steps in runs:
        model = hf_model(family, tie_word_embeddings=tied, **kw)
        ref = copy.deepcopy(model)
        data = batches(n_steps=n_steps)
        ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # found by convention, not by the longest-list fallback
            sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1)
        assert bool(sm.captured.tied_names) == tied
        stats = [sm.train_step(*b) for b in data]
        check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def test_values_from_the_inputs_after_the_blocks_are_side_inputs():
    """GPT-2 reshapes the final hidden state to a shape taken from input_ids before the blocks: the embedding layer
    computes it and the norm layer takes it as a side input, instead of reading the embedding's weights."""
    cap = capture(hf_model("gpt2", **with_dropout("gpt2", 0.0)))
    norm = next(s for s in cap.segments if s.kind == "norm")
    assert norm.call_args and set(norm.call_args) <= set(cap.side_names)
    assert [r.model_name for r in norm.params] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]


def test_blocks_are_found_by_convention_not_by_the_longest_list():
    """StableLM with per-head q/k norms: each attention module holds a list of 4 norms, longer than the 3 blocks."""
    model = hf_model("stablelm")
    assert len(model.model.layers[0].self_attn.q_layernorm.norms) > len(model.model.layers)
    cap = capture(model)
    assert [s.name for s in cap.segments if s.kind == "block"] == [f"model.layers.{i}" for i in range(3)]
    cap = capture(hf_model("opt"))
    assert cap.segments[1].name == "model.decoder.layers.0"


def test_blocks_argument_and_the_fallback_that_names_its_list():
    class Deep(nn.Module):  # no HF conventions, blocks at a path no convention names, a longer decoy list
        def __init__(self):
            super().__init__()
            g = TinyGPT(tied=False)
            self.wte, self.wpe, self.ln_f, self.lm_head = g.wte, g.wpe, g.ln_f, g.lm_head
            self.decoy = nn.ModuleList(nn.LayerNorm(48) for _ in range(5))
            self.trunk = nn.Module()
            self.trunk.stack = g.blocks

        def forward(self, input_ids):
            x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
            for b in self.trunk.stack:
                x = b(x)
            for d in self.decoy:
                x = d(x)
            return self.lm_head(self.ln_f(x))

    with pytest.warns(UserWarning, match=r"taking the longest nn.ModuleList, 'decoy' \(5 x LayerNorm\).*blocks="):
        cap = capture(Deep())  # a wrong choice, which the warning names
    assert [s.name for s in cap.segments if s.kind == "block"] == [f"decoy.{i}" for i in range(5)]
    cap = capture(Deep(), blocks="trunk.stack")
    assert [s.name for s in cap.segments if s.kind == "block"] == ["trunk.stack.0", "trunk.stack.1", "trunk.stack.2"]
    model = Deep()
    assert capture(model, blocks=model.trunk.stack).segments[1].name == "trunk.stack.0"
    with pytest.raises(CaptureError, match=r"blocks='trunk.nothing': Deep has no such submodule.*'decoy'"):
        capture(Deep(), blocks="trunk.nothing")
    with pytest.raises(CaptureError, match=r"blocks='ln_f' is a LayerNorm, not a non-empty nn.ModuleList"):
        capture(Deep(), blocks="ln_f")
    sm = megatrain.compile(Deep(), device="cpu", blocks="trunk.stack", saved_acts=0)
    assert sm.train_step(batches(n_steps=1)[0][0]).loss > 0


def test_refusals_name_the_construct_and_the_line():
    """What torch.fx cannot trace is refused in our words, with the module and the source line, never as fx's own
    message."""

    class LoopsOverShape(TinyGPT):
        def forward(self, input_ids):
            x = self.wte(input_ids)
            for _ in x:  # iterates over the batch
                pass
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    class SizeBranch(TinyGPT):
        def forward(self, input_ids):
            x = self.wte(input_ids)
            if input_ids.shape[1] > 4:  # branches on a size: the graph must serve every length
                x = x * 2
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    for cls, line, what in ((LoopsOverShape, "for _ in x:", "a loop or an unpacking runs over a tensor"),
                            (SizeBranch, "if input_ids.shape[1] > 4:", "decides on a tensor's values or sizes")):
        with pytest.raises(CaptureError) as e:
            capture(cls())
        msg = str(e.value)
        assert f"in {cls.__name__}.forward at test_capture_families.py:" in msg and line in msg and what in msg
        for fx_words in ("Proxy", "symbolically traced", "TraceError"):
            assert fx_words not in msg


def test_a_branch_on_a_size_no_batch_changes_is_decided_at_capture():
    """A size read off a shape that is the same for every batch (Qwen3.5 lays its positions out as (4, b, T) and
    tests that 4), and two shapes compared that are equal for both example batches, decide their branches at
    capture time; the loss is the model's own. A size the batch sets stays
    refused (above), even where both example batches would take the same way."""

    class StaticBranch(TinyGPT):
        def forward(self, input_ids):
            x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
            grid = input_ids[None].expand(4, -1, -1)
            if grid.ndim == 3 and grid.shape[0] == 4:  # the same for every batch
                x = x * 2
            if grid[0].shape != input_ids.shape:  # two shapes of one batch (Gemma 3n's check): equal in every one
                x = x * 3
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    model = StaticBranch()
    ids = batches(n_steps=1)[0][0]
    with torch.no_grad():
        logits = model(ids)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    sm = compile_cpu(copy.deepcopy(model), optim=OPT)
    assert abs(sm.evaluate(ids).loss - float(want)) < 1e-5


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "falcon_alibi"])
def test_dtype_dependent_code_follows_the_compute_dtype(family):
    """The tracer answers a value's dtype from its example in the compute dtype, so code before the blocks that
    builds constants from it (Gemma's embedding scale as a bf16 tensor, Falcon's mask minimum) is traced for the
    dtype the runtime binds: bf16 training on the CPU matches fp32 to bf16's rounding."""
    data = batches(n_steps=1)[0]
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        sm = compile_cpu(hf_model(family), n_mb=2, compute_dtype=dtype)
        losses[dtype] = sm.train_step(*data).loss
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_a_scaled_embedding_built_on_meta_gets_its_scale(family, dtype):
    """HF's scaled embeddings keep their scale in a buffer, which a model built on the meta device holds no value
    in: the capture takes it from the number the module keeps beside it, so the model trains as one built with
    real buffers does (the same weights, the same loss; a scale of 1 or garbage would give another). In bf16 the
    trace casts the scale to bf16 as a constant, computed from the rebuilt buffer."""
    from transformers import AutoModelForCausalLM

    from .models import hf_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    on_meta = compile_cpu(meta, init_seed=0, compute_dtype=dtype)
    real = hf_model(family)
    real.load_state_dict(on_meta.state_dict())
    assert real.model.embed_tokens.embed_scale.item() == pytest.approx(64 ** 0.5)
    data = batches(n_steps=1)[0]
    assert on_meta.train_step(*data).loss == compile_cpu(real, compute_dtype=dtype).train_step(*data).loss


@pytest.mark.parametrize("saved_acts", [0, 1])
def test_gemma4_blocks_that_reuse_keys_and_values_stored_by_earlier_blocks_train_as_plain_pytorch(saved_acts):
    """Gemma 4 with num_kv_shared_layers: its last blocks attend to the keys and values that the last earlier block
    of the same attention type stored in an object every block is handed. The blocks of a micro-batch share one
    (capture.shared_state.PerMicroBatch); the backward gives a reading block's gradient of them back to the block
    that stored them, and the planner counts them (two rows of k_proj's width a token, and their gradient). 3
    steps x 3 micro-batches, every backward recomputing and a layer keeping its activations."""
    model = gemma_model("gemma4_text", num_kv_shared_layers=2, hidden_size_per_layer_input=0)
    # the last two blocks reuse (transformers before 5.25 says so on the attention modules alone)
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, False, True, True]
    ref = copy.deepcopy(model)
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1, saved_acts=saved_acts)
    assert sm.captured.shared_state and bool(sm.schedule_for(6, 12).config.saved_acts) == bool(saved_acts)
    widths = [m.k_proj.out_features for m in model.model.layers[:2] for m in [m.self_attn]]
    assert [lay.carry_bytes_per_token for lay in sm.graph.layers[1:5]] == [16 * w for w in widths] + [0, 0]
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


@pytest.mark.parametrize("saved_acts", [0, 1])
@pytest.mark.parametrize("family,kw", [
    ("gemma4_text", dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)),
    ("gemma3n_text", dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, laurel_rank=4,
                          altup_num_inputs=2, num_kv_shared_layers=2)),
])
def test_gemma_per_layer_inputs_computed_before_the_blocks_take_their_gradient_back(family, kw, saved_acts):
    """Gemma 4 and Gemma 3n hand each block its slice of per-layer inputs, computed before the first block from two
    embeddings and a projection: a side input computed from parameters (Captured.grad_sides), whose gradient every
    block's backward gives back and the embedding layer's backward takes on (Gemma 3n's last blocks also reuse
    stored keys and values). The first step's weights as plain PyTorch's; the second step's gradient norm as plain
    PyTorch computes it at the streamed run's weights (over more steps the two runs part by the first step's
    rounding, which these models' growing gradients amplify: checked the same way, they agree)."""
    model = gemma_model(family, **kw)
    data = batches(n_steps=2)
    ref = copy.deepcopy(model)
    ref_losses, ref_norms = reference_train(ref, data[:1], n_mb=3)
    sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1,
                     saved_acts=saved_acts)
    assert len(sm.captured.grad_sides) == 4  # one slice a block
    assert sm.graph[0].carry_bytes_per_token == 2 * 4 * 8 * 4  # the slices and their gradients, fp32, a token
    assert sm.captured.shared_state == (family == "gemma3n_text")
    assert bool(sm.schedule_for(6, 12).config.saved_acts) == bool(saved_acts)
    stats = [sm.train_step(*data[0])]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    at = copy.deepcopy(model)
    at.load_state_dict(sm.state_dict())
    _, norms = reference_train(at, data[1:], n_mb=3, opt_cfg=dataclasses.replace(OPT, max_grad_norm=1e9))
    assert sm.train_step(*data[1]).grad_norm == pytest.approx(norms[0], rel=1e-6)


@pytest.mark.parametrize("saved_acts", [0, 1])
def test_glm_moe_dsa_whose_blocks_hand_the_next_their_top_k_indices_trains_as_plain_pytorch(saved_acts):
    """GLM-MoE-DSA's blocks return their sparse attention's top-k key indices with the hidden state, and the next
    block takes them (a "shared" block attends to those instead of choosing its own): each block's are kept for
    the next as a side input of the micro-batch until its backward (Segment.carries), and the planner counts them
    (int32, index_topk a token, on the device from the forward to the end of the step's backward). Every backward
    recomputing, and a layer keeping its activations; 3 steps x 3 micro-batches against plain PyTorch."""
    from megatrain.planner.cost import device_memory

    model = state_model("glm_moe_dsa")
    ref = copy.deepcopy(model)
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1, saved_acts=saved_acts)
    blocks = [seg for seg in sm.captured.segments if seg.kind == "block"]
    assert [len(seg.carries) for seg in blocks] == [1, 1, 1, 0]
    assert [sm.graph[seg.index].carry_bytes_per_token for seg in blocks] == [16, 16, 16, 0]
    schedule = sm.schedule_for(6, 12)
    assert bool(schedule.config.saved_acts) == bool(saved_acts)
    assert device_memory(sm.graph, schedule).carry_nbytes == 3 * 16 * 6 * 12
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def test_values_computed_from_an_earlier_block_are_refused_by_name():
    """A block that takes a value computed from the previous block's output (not one of its items, which it would
    carry) is refused in one line naming the argument and the block it comes from."""
    class Handing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, extra=None):
            return self.lin(x) + (0 if extra is None else extra), x.mean(-1, keepdim=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)
            self.layers = nn.ModuleList(Handing() for _ in range(3))

        def forward(self, input_ids):
            x, extra = self.embed(input_ids), None
            for layer in self.layers:
                x, extra = layer(x, extra=None if extra is None else extra * 2)
            return self.head(x)

    with pytest.raises(CaptureError) as e:
        capture(Model())
    msg = str(e.value)
    assert "\n" not in msg and "block 'layers.1' takes 'extra'" in msg, msg
    assert "computed from the output of block 'layers.0'" in msg, msg


@pytest.mark.parametrize("tied,adapters,saved_acts", [(True, True, 0), (False, False, 1)])
def test_zamba2_hybrid_layers_sharing_a_transformer_block_train_as_plain_pytorch(tied, adapters, saved_acts):
    """Zamba2's hybrid layers run one shared transformer block (its weights tied across them where the config ties
    weights, with an adapter per layer inside it) on the hidden state and the embeddings (a side input computed
    from parameters), then their own projection and Mamba-2 layer: each is cut into two layers
    (capture.split_blocks), the shared part a whole layer tied to the first one's, the hidden state and the
    transformer's output handed on side by side. 3 steps x 3 micro-batches against plain PyTorch."""
    from megatrain.capture.split_blocks import OwnPart, SharedPart

    model = zamba2_model(tied, adapters)
    shared = [m.shared_transformer.self_attn.q_proj.weight for m in model.model.layers[1::2]]
    assert (shared[0] is shared[1]) == tied
    ref = copy.deepcopy(model)
    data = batches(n_steps=3)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1, saved_acts=saved_acts)
    kinds = [type(seg.template) for seg in sm.captured.segments]
    assert kinds.count(SharedPart) == kinds.count(OwnPart) == 2
    assert sm.captured.grad_sides == ["clone"] and sm.graph[0].carry_bytes_per_token == 2 * 64 * 4  # embeddings
    assert [lay.tie for lay in sm.graph.layers[1:7]] == [None, None, None, None, 2 if tied else None, None]
    assert bool(sm.schedule_for(6, 12).config.saved_acts) == bool(saved_acts)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)



def test_a_side_input_computed_from_parameters_that_is_not_one_tensor_is_refused():
    """Blocks given a tuple computed from the embeddings (a split of a projection of them): its gradient could not
    be taken back, so capture says so in one line rather than train as if it were a constant."""

    class Taking(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, parts=None):
            return self.lin(x) + parts[0].sum(-1, keepdim=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)
            self.layers = nn.ModuleList(Taking() for _ in range(2))

        def forward(self, input_ids):
            x = self.embed(input_ids)
            parts = torch.split(self.proj(x), 8, dim=-1)
            for layer in self.layers:
                x = layer(x, parts=parts)
            return self.head(x)

    with pytest.raises(CaptureError) as e:
        capture(Model())
    msg = str(e.value)
    assert "\n" not in msg and "computed before the first block from parameters, which is not one tensor" in msg, msg
