"""Layers that keep their forward's activations for the backward (ScheduleConfig.saved_acts) train exactly as
plain PyTorch does, and their backward does not run the forward again (fp32, CPU)."""

import copy
import dataclasses

import pytest
import torch

from .models import TinyGPT, compile_cpu, hf_model, watch_steps
from .test_parity import OPT, batches, check, reference_train


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])  # gemma2: tied head
def test_saved_activations_match_plain_pytorch(family):
    """Two weight slots for six layers: every block's weights are overwritten between its forward and its
    backward, so the weights the backward uses must be found again in the slot it reads."""
    model = hf_model(family)
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=1, saved_acts=2)
    assert sm.schedule_for(6, 12).config.saved_acts == (2, 3)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_saved_activations_with_device_updates_and_a_plain_module(clip):
    torch.manual_seed(0)
    model = TinyGPT(tied=False, layers=4)
    ref = copy.deepcopy(model)
    data = [(ids, torch.ones_like(ids), labels) for ids, _, labels in batches()]  # no attention mask: labels only
    opt = dataclasses.replace(OPT, max_grad_norm=clip)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, hf=False, opt_cfg=opt)
    sm = compile_cpu(model, optim=opt, n_mb=3, weight_slots=3, gpu_opt_every=2, saved_acts="auto")
    cfg = sm.schedule_for(6, 12).config
    assert cfg.saved_acts == (1, 2, 3, 4) and cfg.gpu_opt  # auto: every block fits the CPU budget
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats] if clip else None,
          ref_norms if clip else None)


@pytest.mark.parametrize("saved", [0, 3])
def test_a_saved_layer_runs_its_forward_once_per_micro_batch(saved):
    sm = compile_cpu(hf_model("llama"), n_mb=2, saved_acts=saved)
    blocks = (1, 2, 3)
    assert sm.schedule_for(4, 8).config.saved_acts == (blocks if saved else ())  # planned (and measured) first
    calls: dict[int, int] = {}
    run = sm.executor.runner.run

    def counting(i, *a, **k):
        calls[i] = calls.get(i, 0) + 1
        return run(i, *a, **k)

    sm.executor.runner.run = counting
    seen = watch_steps(sm)
    sm.train_step(torch.randint(0, 97, (4, 8)))
    # embedding and final norm recompute in their backward; the blocks only where not saved; the head's LOSS
    # runs once per micro-batch
    assert calls == {0: 4, **{b: 2 if saved else 4 for b in blocks}, 4: 4, 5: 2}
    assert not seen[-1][1]  # every kept graph was consumed by its backward and dropped
    assert max(len(kept) for _, kept in seen) == (6 if saved else 0)  # 3 blocks x 2 micro-batches at the turn
    assert not any(live for live, _ in seen)  # an activation between ops holds no graph


def test_saved_acts_option_is_checked():
    with pytest.raises(ValueError, match="saved_acts must be an integer >= 0.*or 'auto'"):
        compile_cpu(hf_model("llama"), saved_acts=-1)
    sm = compile_cpu(hf_model("llama"), saved_acts=4)
    with pytest.raises(ValueError, match="saved_acts must be 'auto' or a count of layers from 0 to 3"):
        sm.train_step(torch.randint(0, 97, (2, 8)))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_measured_saved_bytes_are_what_autograd_keeps_for_the_models_own_layer(impl):
    """The planner's saved bytes per token come from a measurement on the device; here they equal what autograd
    keeps for the unmodified HF decoder layer (activations only), at two sequence lengths: eager attention keeps
    its probabilities, so it keeps more per token at the longer one."""
    model = hf_model("llama")
    model.config._attn_implementation = impl
    sm = compile_cpu(copy.deepcopy(model), saved_acts="auto")
    got = {T: -(-sm.executor.measure_saved_bytes(1, T) // T) for T in (8, 16)}
    ref = {}
    for T in (8, 16):
        x = model.model.embed_tokens(torch.randint(0, 97, (1, T))).detach().requires_grad_()
        pos = torch.arange(T)[None]
        cos, sin = model.model.rotary_emb(x, pos)
        skip = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *model.parameters())}
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
        ref[T] = -(-sum(kept.values()) // T)
    assert got == ref
    assert (got[16] > got[8]) == (impl == "eager")
    plan_graph = sm.planning_graph(16)
    assert plan_graph[1].saved_bytes_per_token == got[16] and sm.graph[1].saved_bytes_per_token > 0


def test_the_saved_bytes_probe_leaves_nothing_alive(monkeypatch):
    """The probe runs a layer's forward with weights copied for it and never differentiates it: once it returns,
    the copies and everything the forward saved are freed (a graph that saves a node's output through a hook
    holds itself; on the H200 four probes kept 1.74 GiB of a 7B plan's 24 GiB). Weights copied to bf16 make the
    copies new tensors here as on the device; the count is the same as with the forward's tensors kept."""
    from torch.multiprocessing.reductions import StorageWeakRef

    sm = compile_cpu(hf_model("qwen2", tie_word_embeddings=False), saved_acts="auto")
    ex = sm.executor
    monkeypatch.setattr(ex.ctx, "dtype", torch.bfloat16)
    made = []
    to = torch.Tensor.to

    def watched(self, *a, **k):
        out = to(self, *a, **k)
        if out.untyped_storage().data_ptr() != self.untyped_storage().data_ptr():  # a copy, not the tensor itself
            made.append(StorageWeakRef(out.untyped_storage()))
        return out

    monkeypatch.setattr(torch.Tensor, "to", watched)
    nbytes = ex.measure_saved_bytes(1, 16)
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert nbytes > 0 and len(made) >= 2
    assert all(r.expired() for r in made)


def test_a_budget_larger_than_the_device_is_refused(monkeypatch):
    """Plans fill the budget (saved activations take what the rest leaves): a spec for a larger card than the one
    present is refused at compile, before anything is allocated, naming both sizes."""
    from megatrain import compiler
    from megatrain.planner.hardware import PRESETS

    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 2 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "an 80 GiB card")
    with pytest.raises(ValueError, match=r"'h200' plans for 135.10 GiB.*an 80 GiB card \(cuda:0\) has 72.00 GiB "
                                         r"available of 80.00 GiB"):
        compiler._check_device_memory(torch.device("cuda:0"), PRESETS["h200"])
    compiler._check_device_memory(torch.device("cuda:0"), dataclasses.replace(PRESETS["h200"], gpu_bytes=75 * GiB))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_saved_bytes_of_long_sequences_come_from_two_short_probes(impl, monkeypatch):
    """Beyond the probe lengths the planner's bytes per token are extrapolated from two short measurements; they
    equal a direct measurement at the long length (linear activations, quadratic eager probabilities)."""
    from megatrain import api

    model = hf_model("llama", max_position_embeddings=256)
    model.config._attn_implementation = impl
    sm = compile_cpu(model, saved_acts="auto")
    monkeypatch.setattr(api, "SAVED_PROBE_TOKENS", (16, 32))
    probed = sm.planning_graph(96)[1].saved_bytes_per_token
    direct = -(-sm.executor.measure_saved_bytes(1, 96) // 96)
    assert probed == direct
    calls = []
    measure = sm.executor.measure_saved_bytes
    sm.executor.measure_saved_bytes = lambda layer, t, lean=False: calls.append(t) or measure(layer, t, lean)
    sm.planning_graph(128)
    assert calls == [16, 32]  # no 128-token forward (and no lean variant to measure: no kernel MLP)
