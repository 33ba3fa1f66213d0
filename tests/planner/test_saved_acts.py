"""Planning saved activations: what they cost in device memory, what they save in compute, which layers qualify."""

import dataclasses

import pytest

from megatrain.ir import OpKind, ScheduleConfig
from megatrain.planner.cost import compute_flops, compute_traffic_nbytes, device_memory
from megatrain.planner.graph import PRESETS, from_config, preset
from megatrain.planner.hardware import PRESETS as HW
from megatrain.planner.passes import build_schedule
from megatrain.planner.choices import SAVED_FILL
from megatrain.planner.search import PlanError, plan, saved_act_layers, with_saved_acts
from megatrain.planner.simulate import bound, simulate
from megatrain.planner.verify import ScheduleError, verify

SPEC = HW["h200"]
G3 = from_config({**PRESETS["qwen2.5-3b"], "tie_word_embeddings": False}, name="qwen2.5-3b")


def config(graph, **kw):
    base = dict(n_layers=len(graph), n_mb=4, mb_tokens=16384, seq_len=1024, weight_slots=len(graph),
                clip=True, budget_bytes=SPEC.budget_bytes, gpu_opt=tuple(range(20)))
    return ScheduleConfig(**{**base, **kw})


def test_the_formula_is_what_the_h200_measured():
    """benchmarks/saved_tensors.py on the H200 with the Triton kernels: 70,201 / 87,625 / 151,673 bytes per
    token, lean 52,281 / 65,609 / 113,785 (the measurement rounds up)."""
    layers = [preset(p)[1] for p in ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")]
    assert [lay.saved_bytes(False) for lay in layers] == [70200, 87624, 151672]
    assert [lay.saved_bytes(True) for lay in layers] == [52280, 65608, 113784]


def test_auto_fills_the_free_memory_from_the_last_block_back():
    cfg = config(G3)
    saved = saved_act_layers(G3, cfg, "auto")
    blocks = [l for l in range(len(G3)) if G3[l].kind == "block"]
    assert saved == tuple(blocks[-len(saved):]) and 8 <= len(saved) < len(blocks)
    free = cfg.budget_bytes - device_memory(G3, build_schedule(G3, cfg)).total_nbytes
    per_layer = G3[blocks[-1]].saved_bytes_per_token * cfg.mb_tokens * cfg.n_mb
    assert len(saved) * per_layer <= SAVED_FILL * free < (len(saved) + 1) * per_layer
    s = build_schedule(G3, dataclasses.replace(cfg, saved_acts=saved))
    mem = device_memory(G3, s)
    assert mem.saved_nbytes == len(saved) * per_layer and mem.total_nbytes <= cfg.budget_bytes
    verify(s, G3, SPEC)
    assert simulate(s, G3, SPEC).peak_nbytes <= mem.total_nbytes


def test_a_saved_layer_costs_a_backward_without_the_recompute():
    cfg = config(G3, n_steps=1)
    plain = build_schedule(G3, cfg)
    saved = build_schedule(G3, dataclasses.replace(cfg, saved_acts=(30, 31)))
    lay, t = G3[30], cfg.mb_tokens
    mm, attn = lay.matmul_flops_per_token * t, lay.attn_flops_per_token_per_seq * cfg.seq_len * t  # one forward
    assert attn > 0
    for s, layers in ((plain, ()), (saved, (30, 31))):
        for op in s.ops:
            if op.kind is OpKind.FWD and op.layer == 30:
                assert compute_flops(G3, s.config, op) == pytest.approx(mm + attn)
            if op.kind is OpKind.BWD and op.layer == 30:
                # matmuls: backward 2 forwards, recompute 1; attention: backward 2.5, recompute 1
                want = 2 * mm + 2.5 * attn if op.layer in layers else 3 * mm + 3.5 * attn
                assert compute_flops(G3, s.config, op) == pytest.approx(want)
    # the compute-bound 3B step: each saved block takes one block forward per micro-batch off the bound, its
    # matmuls at the matmul rate and its attention at the attention rate
    one_block = cfg.n_mb * (mm / SPEC.matmul_flops_per_s + attn / SPEC.attn_flops_per_s)
    assert bound(plain, G3, SPEC).step_s - bound(saved, G3, SPEC).step_s == pytest.approx(2 * one_block, rel=1e-6)


def test_layers_that_cannot_keep_their_activations_are_refused():
    cfg = config(G3, n_steps=1, host_checkpoints=4)
    assert saved_act_layers(G3, cfg, 32) == tuple(range(5, 37))  # blocks 5..36 of 1..36
    with pytest.raises(PlanError, match="from 0 to 32.*4 checkpoints on the host"):
        saved_act_layers(G3, cfg, 33)
    for bad in ((0,), (38,), (37,), (3,), (30, 30)):  # embedding, head, final norm, a checkpoint on the host, twice
        with pytest.raises(ScheduleError, match="schedule rule 'saved'"):
            verify(build_schedule(G3, dataclasses.replace(cfg, saved_acts=bad)), G3)
    over = build_schedule(G3, dataclasses.replace(cfg, saved_acts=tuple(range(5, 37))))
    with pytest.raises(ScheduleError, match="schedule rule 'memory'.*saved activations"):
        verify(over, G3)


def test_a_fixed_count_is_planned_with_the_candidates_that_can_keep_it():
    """The search also tries every checkpoint on the host; a fixed count of saved layers rules those candidates
    out instead of failing the plan, and a count no candidate can keep is refused once."""
    g = from_config({**PRESETS["qwen2.5-3b"], "tie_word_embeddings": False, "num_hidden_layers": 8}, name="3b-8")
    p = plan(g, SPEC, 65536, 1024, n_mb=4, weight_slots="all", saved_acts=8)
    assert p.schedule.config.saved_acts == tuple(range(1, 9)) and p.schedule.config.host_checkpoints == 0
    assert any("checkpoints on the host" in why for _, why in p.tried)
    with pytest.raises(PlanError, match="from 0 to 8"):
        plan(g, SPEC, 65536, 1024, n_mb=4, saved_acts=9)


def test_saved_layers_keep_less_only_where_the_memory_buys_something():
    """Lean saved layers (ScheduleConfig.saved_lean) recompute the MLP's product in the backward: chosen by "auto"
    only when it keeps more layers, and for a count only when keeping everything does not fit."""
    cfg = config(G3)
    blocks = [l for l in range(len(G3)) if G3[l].kind == "block"]
    tight = with_saved_acts(G3, cfg, "auto")  # 3B at 65,536 tokens: not every block fits either way
    full = saved_act_layers(G3, cfg, "auto")
    assert tight.saved_lean and len(tight.saved_acts) > len(full)
    lean_bytes, full_bytes = (G3[blocks[-1]].saved_bytes(lean) for lean in (True, False))
    assert full_bytes - lean_bytes == 2 * 11008  # the product, bf16, per token
    mem = device_memory(G3, build_schedule(G3, tight))
    assert mem.saved_nbytes == len(tight.saved_acts) * lean_bytes * cfg.mb_tokens * cfg.n_mb
    assert mem.total_nbytes <= cfg.budget_bytes
    # few tokens: every block fits keeping everything, so nothing is recomputed in the backward
    small = config(G3, n_mb=1, mb_tokens=2048)
    roomy = with_saved_acts(G3, small, "auto")
    assert roomy.saved_acts == tuple(blocks) and not roomy.saved_lean
    # a count: kept in full where that fits, lean where only that fits
    assert not with_saved_acts(G3, cfg, 4).saved_lean
    n = len(tight.saved_acts)
    assert len(full) < n and with_saved_acts(G3, cfg, n).saved_lean
    assert with_saved_acts(G3, cfg, 0) == dataclasses.replace(cfg, saved_acts=(), saved_lean=False)


def test_a_lean_saved_layer_costs_its_recompute_in_traffic_and_is_written_only_when_set():
    cfg = config(G3, n_steps=1, saved_acts=(35, 36))
    lean = dataclasses.replace(cfg, saved_lean=True)
    s = build_schedule(G3, lean)
    for op in s.ops:
        if op.kind is OpKind.BWD:
            extra = compute_traffic_nbytes(G3, lean, op) - compute_traffic_nbytes(G3, cfg, op)
            want = 3 * 2 * 11008 * cfg.mb_tokens if op.layer in (35, 36) else 0  # gate, up read; product written
            assert extra == want
    verify(s, G3, SPEC)
    assert "saved_lean" not in cfg.to_dict() and lean.to_dict()["saved_lean"] is True
    assert ScheduleConfig.from_dict(lean.to_dict()) == lean
