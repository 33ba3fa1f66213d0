"""Updates split between the host and the device after the backward (``ScheduleConfig.split_opt``): each split
layer's state streams through the optimizer slots a part at a time; the verifier catches each missing link."""

import dataclasses

import pytest

from megatrain.ir import OpKind, Schedule, deferrable_opts, op_params
from megatrain.planner.cost import (OPT_IN_BYTES, OPT_MASTER_BYTES, OPT_OUT_BYTES, OPT_SLOT_BYTES, device_memory,
                                    duration_s, transfer_nbytes)
from megatrain.planner.graph import preset
from megatrain.planner.hardware import PRESETS
from megatrain.planner.passes import build_schedule
from megatrain.planner.search import PlanError, plan, split_sets
from megatrain.planner.verify import ScheduleError, verify

from .helpers import config, renumber, tiny_graph

G = tiny_graph(num_hidden_layers=4)
PART = 5000


def _schedule(**kw) -> Schedule:
    kw = {"split_opt": (1, 3), "opt_part": PART, **kw}
    s = build_schedule(G, config(G, n_steps=2, n_mb=3, **kw))
    verify(s, G)
    return s


def _find(s: Schedule, kind: OpKind, **kw):
    return next(op for op in s.ops if op.kind is kind and all(getattr(op, k) == v for k, v in kw.items()))


def _broken(s: Schedule, rule: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as e:
        verify(s, G)
    assert e.value.rule == rule, str(e.value)
    return e.value


@pytest.mark.parametrize("kept", [(), (1, 2, 3)])
def test_a_split_update_streams_its_state_in_parts_after_the_norm(kept):
    s = _schedule(grad_kept=kept)
    parts = -(-G.weight_params(1) // PART)
    assert parts >= 3
    for st in range(2):
        last_bwd = max(op.id for op in s.ops if op.kind is OpKind.BWD and op.step == st)
        for l in (1, 3):
            for p in range(parts):
                load, opt, store = (_find(s, k, step=st, layer=l, mb=p)
                                    for k in (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT))
                assert opt.stream.value == "compute" and load.id in opt.deps and opt.id in store.deps
                assert opt.id > last_bwd
                # the gradient: from the layer's host buffer with the state, or from its kept slot in the update
                assert (load.slot("h") is None) == (l in kept) and (opt.slot("k") is not None) == (l in kept)
                want = (OPT_IN_BYTES + (0 if l in kept else 4)) * (min(PART * (p + 1), G.weight_params(l)) - PART * p)
                assert transfer_nbytes(G, s.config, load) == want
        assert not any(op.kind is OpKind.OPT and op.step == st and op.layer in (1, 3) and op.mb is None for op in s.ops)
    # two optimizer slots of one part each, whatever the layers' size
    assert device_memory(G, s).slot_sizes["o"] == [PART * OPT_SLOT_BYTES] * 2


def test_a_split_layers_next_load_waits_for_its_last_part_stored():
    s = _schedule()
    parts = -(-G.weight_params(3) // PART)
    load = _find(s, OpKind.LOAD_W, step=1, layer=3)
    last = _find(s, OpKind.STORE_OPT, step=0, layer=3, mb=parts - 1)
    assert last.id in load.deps
    err = _broken(dataclasses.replace(s, ops=tuple(dataclasses.replace(op, deps=tuple(d for d in op.deps
                                                                                       if d != last.id))
                                                   if op.id == load.id else op for op in s.ops)),
                  "load-after-opt")
    assert "STORE_OPT s0 L3" in str(err)  # (the last part, or one the stream order stored before it)


def test_a_part_loaded_with_another_layers_gradient_is_caught():
    s = _schedule()
    load = _find(s, OpKind.LOAD_OPT, step=0, layer=1, mb=0)
    other = _find(s, OpKind.STORE_G, step=0, layer=3)
    assert _find(s, OpKind.STORE_G, step=0, layer=1).id in load.deps and other.slot("h") != load.slot("h")
    wrong = tuple(("h", other.slot("h")) if r == "h" else (r, i) for r, i in load.slots)
    err = _broken(dataclasses.replace(s, ops=tuple(dataclasses.replace(op, slots=wrong) if op.id == load.id else op
                                                   for op in s.ops)), "slot-content")
    assert "('HG', 0, 1)" in str(err)


def test_a_missing_part_is_caught():
    s = _schedule()
    gone = {_find(s, k, step=0, layer=1, mb=1).id for k in (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT)}
    err = _broken(renumber(s, [op for op in s.ops if op.id not in gone]), "complete")
    assert "layer 1 (part 1)" in str(err)


def test_an_update_on_a_part_that_does_not_exist_is_caught():
    s = _schedule()
    opt = _find(s, OpKind.OPT, step=0, layer=1, mb=0)
    _broken(Schedule(s.ops, dataclasses.replace(s.config, opt_part=G.weight_params(1) * 2), s.provenance), "range")
    assert opt.mb == 0


@pytest.mark.parametrize("bad", [dict(split_opt=(0,)), dict(split_opt=(6,)), dict(split_opt=(1, 1)),
                                 dict(split_opt=(2,), gpu_opt=(2,)), dict(split_opt=(2,), clip=False)])
def test_split_updates_take_only_untied_host_updated_layers_with_clipping(bad):
    with pytest.raises(ValueError, match="split_opt"):  # tied embedding (0) and head (6), twice, on the device
        build_schedule(G, config(G, n_mb=2, **bad))


def test_a_split_count_is_spread_and_checked():
    cfg = config(G, n_mb=2)
    assert split_sets(G, cfg, 2) == [(2, 4)]  # of the untied layers 1..5
    assert all(len(set(s)) == len(s) for s in split_sets(G, cfg, "auto"))
    with pytest.raises(PlanError, match="only 5 layers"):
        split_sets(G, cfg, 6)
    with pytest.raises(PlanError, match="needs clipping"):
        plan(G, PRESETS["h200"], 2048, 1024, clip=False, split_opt=2, n_mb=2, weight_slots=2, wire_bytes=2)


def test_split_updates_speed_up_a_7b_step_on_a_24_gib_budget():
    """On paper: Qwen2.5-7B at 32 x 1,024 tokens with 24 GiB of device memory updates most layers on the host
    after the backward; splitting a share of them to the GPU, their state over PCIe, shortens the step."""
    graph = preset("qwen2.5-7b")
    fixed = dict(budget_bytes=24 << 30, n_mb=4, weight_slots=3, wire_bytes=2, gpu_opt_every=0, grad_slots=2,
                 host_checkpoints=0)
    host_only = plan(graph, PRESETS["h200"], 32768, 1024, split_opt=0, **fixed)
    split = plan(graph, PRESETS["h200"], 32768, 1024, split_opt="auto", **fixed)
    assert not host_only.schedule.config.split_opt and split.schedule.config.split_opt
    assert split.timeline.steady_step_s < 0.9 * host_only.timeline.steady_step_s
    assert device_memory(graph, split.schedule).total_nbytes <= 24 << 30


def test_split_ops_run_on_queues_of_their_own():
    """As the stream issuer runs them: a split op follows what its stream's own queue issued before it, and the
    stream's later ops do not wait for it -- in the verifier's happens-before, the simulation and the bound."""
    from megatrain.ir import Op, Stream, issue_preds, queue_of
    from megatrain.planner.simulate import simulate, same_state
    from megatrain.planner.verify import HappensBefore

    split = Op(0, OpKind.LOAD_OPT, Stream.H2D, 0, 1, mb=0, slots=(("o", 0),))
    load = Op(1, OpKind.LOAD_W, Stream.H2D, 0, 2, slots=(("w", 0),))
    after = Op(2, OpKind.LOAD_OPT, Stream.H2D, 0, 3, mb=0, slots=(("o", 1),))
    assert queue_of(split) == (Stream.H2D, True) and queue_of(load) == (Stream.H2D, False)
    assert issue_preds((split, load, after)) == [(), (), (0, 1)]
    hb = HappensBefore((split, load, after))
    assert not hb(0, 1) and hb(1, 2) and hb(0, 2)
    # a host update stays on the one cpu queue, parts or not
    assert queue_of(Op(0, OpKind.OPT, Stream.CPU, 0, 1, mb=0)) == (Stream.CPU, False)

    s = _schedule()
    tl = simulate(s, G, PRESETS["h200"])
    preds = issue_preds(s.ops)
    for op in s.ops:
        for d in (*op.deps, *preds[op.id]):
            if not same_state(op, s.ops[d]):
                assert tl.start_s[op.id] >= tl.end_s[d] - 1e-12, (str(op), str(s.ops[d]))
    # the next step's weight loads go beside the split state loads issued before them
    overlaps = [(a, b) for a in s.ops for b in s.ops if a.id < b.id and a.kind is OpKind.LOAD_OPT and a.mb is not None
                and b.kind is OpKind.LOAD_W and b.stream is Stream.H2D and tl.start_s[b.id] < tl.end_s[a.id] - 1e-12]
    assert overlaps


def test_the_search_tries_split_counts_next_to_the_fastest():
    """The shares of split layers tried first are coarse (a quarter, a third, ... of them); the search then tries one
    layer more and one fewer around the fastest while that is faster. With a host AdamW 15% slower than the H200
    preset's, the 7B step at 24 GiB (no layer's state kept on the GPU, every checkpoint on the host) is fastest with
    a count none of the coarse shares gives, and the search finds it: no fixed count next to it plans a faster
    step."""
    graph = preset("qwen2.5-7b")
    h200 = PRESETS["h200"]
    slow = dataclasses.replace(h200, cpu_adam_params_per_s=0.85 * h200.cpu_adam_params_per_s,
                               cpu_adam_master_params_per_s=0.85 * h200.cpu_adam_master_params_per_s)
    fixed = dict(budget_bytes=24 << 30, n_mb=4, weight_slots=3, host_checkpoints=29, gpu_opt_every=0, grad_slots=2)
    best = plan(graph, slow, 32768, 1024, split_opt="auto", **fixed)
    n = len(best.schedule.config.split_opt)
    assert n not in {len(s) for s in split_sets(graph, best.schedule.config, "auto")}
    for k in (n - 1, n + 1):
        other = plan(graph, slow, 32768, 1024, split_opt=k, **fixed)
        assert best.timeline.steady_step_s <= other.timeline.steady_step_s, k


def test_the_cost_model_defers_what_the_executor_defers():
    """A split layer's parts store the masters alone, and a host update is timed as writing the masters alone,
    exactly where the schedule lets the streaming executor leave the moments for after the update pass
    (``ir.deferrable_opts``: the layer's host buffer is not written again in its step). Here the kept gradients pass
    through the buffers the first updates read (so those updates make their moments in the pass); with one of them
    put in the split layer's buffer instead, after its parts read it, the parts store master and moments."""
    spec = PRESETS["h200"]
    s = _schedule(split_opt=(1,), grad_kept=(2, 3, 4), wire_bytes_per_param=4)
    deferred = deferrable_opts(s)
    host = [op for op in s.ops if op.kind is OpKind.OPT and op.stream.value == "cpu"]
    for op in host:
        p = op_params(G, s.config, op)
        rate = spec.cpu_adam_master_params_per_s if op.id in deferred else spec.cpu_adam_params_per_s
        assert duration_s(G, s.config, spec, op, deferred) == pytest.approx(p / rate)
    assert {op.id in deferred for op in host} == {True, False}
    parts = [op for op in s.ops if op.kind is OpKind.STORE_OPT and op.layer == 1 and op.step == 0]
    split_h = _find(s, OpKind.LOAD_OPT, step=0, layer=1, mb=0).slot("h")
    for moved in (False, True):
        for op in parts:
            p = op_params(G, s.config, op)
            want = (OPT_OUT_BYTES if moved else OPT_MASTER_BYTES) * p
            assert transfer_nbytes(G, s.config, op, spec, deferred) == want
            assert duration_s(G, s.config, spec, op, deferred) == pytest.approx(want / spec.d2h_bytes_per_s)
        loads = max(op.id for op in s.ops if op.kind is OpKind.LOAD_OPT and op.layer == 1 and op.step == 0)
        late = next(op for op in s.ops if op.kind is OpKind.STORE_G and op.step == 0 and op.id > loads)
        s = dataclasses.replace(s, ops=tuple(dataclasses.replace(op, slots=tuple((r, split_h if r == "h" else k)
                                                                                  for r, k in op.slots))
                                             if op.id == late.id else op for op in s.ops))
        deferred = deferrable_opts(s)


def test_a_plan_that_splits_every_update_simulates_with_no_host_op_in_its_steps():
    """Every layer's update split to the device (the 1M-token plan's choice): the steps have deferred moments but
    no op on the host's queue, which the moments' plan took for granted (a KeyError on the step's last host op)."""
    from megatrain.planner.simulate import simulate

    g = tiny_graph(num_hidden_layers=4, tie_word_embeddings=False)
    s = build_schedule(g, config(g, n_steps=2, n_mb=3, split_opt=tuple(range(len(g))), opt_part=PART))
    verify(s, g)
    assert not [op for op in s.ops if op.stream.value == "cpu"] and deferrable_opts(s)
    assert simulate(s, g, PRESETS["h200"]).steady_step_s > 0
