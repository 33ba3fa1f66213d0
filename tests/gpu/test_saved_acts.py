"""Saved activations on the GPU (bf16, Triton kernels, streaming executor): the same training as recomputing, and
the bytes the planner counts are the bytes the device holds."""

import contextlib
import copy
import dataclasses

import pytest
import torch

import megatrain
from megatrain.ir import OpKind
from megatrain.planner.graph import block_saved_bytes

from ..runtime.models import hf_model
from ..runtime.test_parity import batches

pytestmark = pytest.mark.gpu


def small(family, **kw):
    return hf_model(family, hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4,
                    **kw)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("plan", [dict(n_mb=3, weight_slots=2, host_checkpoints=1, gpu_opt_every=0),
                                  dict(n_mb=2, weight_slots="all", gpu_opt_every=2)])
def test_saved_activations_train_as_recomputing_does(plan, lean, monkeypatch):
    """The backward of a saved layer runs the same kernels on the same activations as after a recompute:
    identical losses and weights, step after step (two weight slots: the weights were reloaded in between). Lean
    (forced here: the MLP's product formed again in the backward) too."""
    from megatrain.planner import search

    if lean:
        choose = search.with_saved_acts
        monkeypatch.setattr(search, "with_saved_acts", lambda *a: dataclasses.replace(
            choose(*a), saved_lean=bool(choose(*a).saved_acts)))
    model = small("qwen2", num_hidden_layers=4)
    data = batches(n_steps=3)
    runs = []
    for saved in (0, "auto"):
        opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=0.5)
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", optim=opt, saved_acts=saved, **plan)
        stats = [sm.train_step(*[t.cuda() for t in b]) for b in data]
        cfg = sm.schedule_for(6, 12).config
        assert cfg.saved_lean == (lean and bool(cfg.saved_acts))
        runs.append(([s.loss for s in stats], sm.state_dict(), cfg.saved_acts))
    (ref_losses, ref_sd, none), (losses, sd, saved) = runs
    # every block, less those whose checkpoint goes to the host
    assert none == () and saved == tuple(range(1 + plan.get("host_checkpoints", 0), 5))
    assert losses == ref_losses
    assert all(torch.equal(sd[n], ref_sd[n]) for n in sd)


@pytest.mark.parametrize("attn,lean", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_saved_bytes_measured_are_what_the_device_holds_and_near_the_formula(attn, lean, monkeypatch):
    """A Qwen2.5-3B-wide block (two of them) with the kernels: the bytes each saved forward leaves allocated equal
    the measurement the planner uses. With fused attention the formula `megatrain plan` uses without a model is
    that measurement (87,625 B/token on the H200, one byte of rounding; lean, the MLP's product not kept: 65,609);
    eager attention keeps its probabilities too (193,032 B/token at 1,024 tokens). The lean plan is forced here
    (the planner would not take it: everything fits)."""
    from megatrain.planner import search

    if lean:
        choose = search.with_saved_acts
        monkeypatch.setattr(search, "with_saved_acts", lambda *a: dataclasses.replace(choose(*a), saved_lean=True))
    from transformers import AutoModelForCausalLM

    from ..runtime.models import hf_config

    H, inter, heads, kv = 2048, 11008, 16, 2
    cfg = hf_config("qwen2", hidden_size=H, intermediate_size=inter, num_attention_heads=heads,
                    num_key_value_heads=kv, num_hidden_layers=2, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    sm = megatrain.compile(model, device="cuda", saved_acts=2, n_mb=1)
    B, T = 4, 1024
    per_token = sm.planning_graph(T)[1].saved_bytes(lean)
    formula = block_saved_bytes(H, H, kv * H // heads, inter, heads, 2, lean=lean)
    ex = sm.executor
    deltas = []

    @contextlib.contextmanager
    def measured_forward(op):  # around each saved forward: what it left allocated, its output aside
        if op.kind is not OpKind.FWD or op.layer not in ex.st.schedule.config.saved_acts:
            yield
            return
        before = torch.cuda.memory_allocated()
        yield
        deltas.append(torch.cuda.memory_allocated() - before - ex.st.act[op.slot("y")].untyped_storage().nbytes())

    ex.on_op = measured_forward
    sm.train_step(torch.randint(0, 97, (B, T), device="cuda"))
    assert sm.schedule_for(B, T).config.saved_lean == lean
    print(f"{attn}{' lean' if lean else ''}: saved bytes per token: measured {per_token}, formula {formula}; allocated per saved forward "
          f"{[d / (B * T) for d in deltas]}")
    assert len(deltas) == 2
    for d in deltas:
        assert d == pytest.approx(per_token * B * T, rel=0.02)
    if attn == "sdpa":
        assert formula == pytest.approx(per_token, rel=0.01)
    else:
        assert per_token > 0.8 * formula + 4 * heads * T  # and the fp32 probabilities at least
