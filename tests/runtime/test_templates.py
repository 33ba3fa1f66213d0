"""Templates are shared and weightless, binding is zero-copy, and no autograd graph outlives a layer."""

import dataclasses

import pytest
import torch
from torch import nn

from megatrain.ir import OpKind, Schedule
from megatrain.capture import CaptureError, capture
from megatrain.runtime.issue.executor import ExecutionError
from megatrain.runtime.layers.templates import bind

from .models import TinyGPT, compile_cpu, hf_model, watch_steps


def test_decoder_blocks_share_one_weightless_template():
    cap = capture(hf_model("llama"))
    blocks = [s for s in cap.segments if s.kind == "block"]
    assert len(blocks) == 3 and all(s.template is blocks[0].template for s in blocks)
    assert all(p.is_meta for s in cap.segments for p in s.template.parameters())
    assert cap.graph.templates()[blocks[0].template_key] == [1, 2, 3]


def test_layers_that_differ_get_their_own_template():
    cap = capture(hf_model("gemma2"))  # alternating sliding-window and global attention
    keys = [s.template_key for s in cap.segments if s.kind == "block"]
    assert keys[0] == keys[2] != keys[1]


def test_binding_is_zero_copy():
    sm = compile_cpu(hf_model("qwen2"), n_mb=1)
    seg = sm.captured.segments[2]
    numel = max(sm.graph.weight_params(i) for i in range(len(sm.graph)))
    slot = torch.randn(numel)
    seen = {}
    hook = seg.template.self_attn.q_proj.register_forward_pre_hook(
        lambda mod, args: seen.update(w=mod.weight))  # returns None: leaves the input alone
    try:
        views = bind(seg, slot)
        x = torch.randn(1, 4, 64)
        side = {}
        _, side = sm.executor.runner.run(0, torch.randn(numel), (torch.zeros(1, 4, dtype=torch.long),
                                                                 torch.ones(1, 4, dtype=torch.long),
                                                                 torch.arange(4)[None]))
        sm.executor.runner.run(2, slot, x, side)
    finally:
        hook.remove()
    base = slot.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views.values())
    assert seen["w"].untyped_storage().data_ptr() == base  # the module computed with the slot's own memory
    ref = seg.params[[r.name for r in seg.params].index("self_attn.q_proj.weight")]
    assert seen["w"].data_ptr() == slot[ref.offset:].data_ptr()


def test_no_autograd_graph_outlives_a_layer():
    sm = compile_cpu(hf_model("llama"), n_mb=2, host_checkpoints=2)
    seen = watch_steps(sm)
    sm.train_step(torch.randint(0, 97, (4, 8)))
    assert len(seen) == len(sm.schedule_for(4, 8).ops)
    assert not any(live or kept for live, kept in seen)  # after every op, in every activation slot
    st, dev = sm.executor.st, sm.executor.dev
    assert not st.act and not st.saved  # and none outlives the step
    assert all(not w.requires_grad and w.grad is None for w in dev.w + dev.g)


def test_executor_refuses_a_slot_overwritten_too_early():
    sm = compile_cpu(hf_model("llama"), n_mb=2, weight_slots=3)
    s = sm.schedule_for(4, 8)
    # load layer 2 into the slot that layer 1 still has to be read from
    load = next(op for op in s.ops if op.kind is OpKind.LOAD_W and op.layer == 2)
    held = next(op for op in s.ops if op.kind is OpKind.LOAD_W and op.layer == 1).slot("w")
    ops = list(s.ops)
    ops[load.id] = dataclasses.replace(load, slots=(("w", held),))
    bad = Schedule(tuple(ops), s.config, s.provenance)
    # the cache key: shape, plan options, clipping; the plan's set-up (none: no device updates) and its step
    sm._schedules[(4, 8, sm.plan_options, True)] = (None, bad)
    with pytest.raises(ExecutionError) as e:
        sm.train_step(torch.randint(0, 97, (4, 8)))
    msg = str(e.value)
    assert f"loading w{held} with ('W', 0, 2) while" in msg and "still reads ('W', 0, 1)" in msg
    assert f"{load.id} LOAD_W s0 L2 @h2d w{held}" in msg and "<-- HERE" in msg


def test_unsupported_model_is_refused_with_what_was_not_understood():
    class NoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10)

        def forward(self, ids):
            return self.head(self.emb(ids))

    with pytest.raises(CaptureError, match="no nn.ModuleList of decoder blocks"):
        capture(NoBlocks())

    class Branchy(TinyGPT):
        def forward(self, input_ids):
            x = self.wte(input_ids)
            if x.sum() > 0:  # data-dependent control flow cannot be captured
                x = x * 2
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    with pytest.raises(CaptureError, match=r"in Branchy.forward at test_templates.py:\d+: `if x.sum\(\) > 0:.*"
                                           r"decides on a tensor's values or sizes"):
        capture(Branchy())


def test_memory_report_and_bad_batches():
    sm = compile_cpu(hf_model("llama"), n_mb=2)
    rep = sm.memory_report(4, 8)
    n = sum(p.numel() for p in hf_model("llama").parameters())
    assert rep["host.master"] == rep["host.exp_avg"] == rep["host.exp_avg_sq"] == 4 * n and "host.grad" not in rep
    assert rep["device.w_slots"] == 2 * 4 * max(sm.graph.weight_params(i) for i in range(len(sm.graph)))
    sm.train_step(torch.randint(0, 97, (4, 8)))
    assert sm.store.grads.nbytes == rep["host.gradients"] > 0  # the buffers the plan counts, allocated for its step
    with pytest.raises(ValueError, match="cannot be split into 2 micro-batches"):
        sm.train_step(torch.randint(0, 97, (3, 8)))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 97\)"):
        sm.train_step(torch.full((4, 8), 97))
    with pytest.raises(ValueError, match="no token to predict"):
        sm.train_step(torch.randint(0, 97, (4, 8)), labels=torch.full((4, 8), -100))
