"""Updates made before the step's guard (``ScheduleConfig.speculate``): the schedule the passes build verifies, and
each rule the verifier holds them to is named when a schedule breaks it; the simulator times the window in the
backward, the bound and the host memory know it, and the search's window follows the host memory and the rate of
clipped steps."""

import dataclasses

import pytest

from megatrain.ir import OpKind, Schedule, Stream, deferrable_opts
from megatrain.layout import KEPT_MASTER_BYTES as KEPT_BYTES
from megatrain.planner.cost import host_memory, speculation_redo_s
from megatrain.planner.hardware import PRESETS
from megatrain.planner.passes import build_schedule
from megatrain.planner.simulate import simulate
from megatrain.planner.speculation import speculate_eligible, speculation_set
from megatrain.planner.verify import ScheduleError, verify

from .helpers import config, renumber, tiny_graph

G = tiny_graph(num_hidden_layers=4)  # embedding 0 (tied to the head, 6), blocks 1..4, the final norm 5
SPEC = (4, 3)


def _schedule(**kw) -> Schedule:
    s = build_schedule(G, config(G, n_steps=2, n_mb=3, speculate=SPEC, **kw))
    verify(s, G)
    return s


def _find(s, kind, **kw):
    return next(op for op in s.ops if op.kind is kind and all(getattr(op, k) == v for k, v in kw.items()))


def _without_dep(s, op, dep):
    ops = list(s.ops)
    ops[op.id] = dataclasses.replace(op, deps=tuple(d for d in op.deps if d != dep.id))
    return Schedule(tuple(ops), s.config, s.provenance)


def _broken(s, rule):
    with pytest.raises(ScheduleError) as e:
        verify(s, G)
    assert e.value.rule == rule, str(e.value)


def test_the_window_updates_during_the_backward_and_checks_after_the_guard():
    s = _schedule()
    for st in range(2):
        guard = _find(s, OpKind.GUARD, step=st)
        for l in SPEC:
            opt, check = _find(s, OpKind.OPT, step=st, layer=l), _find(s, OpKind.CHECK, step=st, layer=l)
            assert opt.id < guard.id < check.id and opt.stream is check.stream is Stream.CPU
            assert check.slot("h") == opt.slot("h")  # the gradient stays until the check
        # the other host updates wait for the guard, and come before the checks on the host's queue
        others = [op for op in s.ops if op.kind is OpKind.OPT and op.step == st and op.layer not in SPEC]
        assert others and all(guard.id < op.id < min(c.id for c in s.ops if c.kind is OpKind.CHECK and c.step == st)
                              for op in others)


def test_a_check_before_the_guard_is_caught():
    s = _schedule()
    check, opt = _find(s, OpKind.CHECK, step=0, layer=4), _find(s, OpKind.OPT, step=0, layer=4)
    ops = [op for op in s.ops if op.id != check.id]
    at = ops.index(opt) + 1
    ops.insert(at, dataclasses.replace(check, deps=(opt.id,)))
    _broken(renumber(s, ops), "guard-before-check")


def test_a_next_load_before_the_check_is_caught():
    s = _schedule()
    load = _find(s, OpKind.LOAD_W, step=1, layer=4)
    check = _find(s, OpKind.CHECK, step=0, layer=4)
    assert check.id in load.deps
    _broken(_without_dep(s, load, check), "load-after-opt")


def test_an_update_before_its_gradient_is_stored_is_caught():
    s = _schedule()
    opt = _find(s, OpKind.OPT, step=0, layer=3)
    store = _find(s, OpKind.STORE_G, step=0, layer=3)
    _broken(_without_dep(s, opt, store), "store-before-opt")


def test_a_missing_check_or_one_of_a_layer_outside_the_window_is_caught():
    s = _schedule()
    check = _find(s, OpKind.CHECK, step=1, layer=3)
    _broken(renumber(s, [op for op in s.ops if op.id != check.id]), "complete")
    ops = list(s.ops)
    ops[check.id] = dataclasses.replace(check, layer=2)
    _broken(Schedule(tuple(ops), s.config, s.provenance), "kind")


def test_the_window_takes_host_updates_with_clipping_alone():
    for bad in ((0,), (6,), (4, 4)):  # the tied embedding, the tied head, twice
        with pytest.raises(ValueError, match="speculate"):
            build_schedule(G, config(G, speculate=bad))
    for kw in (dict(clip=False), dict(gpu_opt=(4,)), dict(grad_kept=(4,)), dict(split_opt=(4,), opt_part=100)):
        with pytest.raises(ValueError, match="speculate"):
            build_schedule(G, config(G, speculate=(4,), **kw))
    s = build_schedule(G, config(G, speculate=(4,)))
    with pytest.raises(ScheduleError) as e:  # the verifier holds a schedule to the same
        verify(Schedule(s.ops, dataclasses.replace(s.config, gpu_opt=(4,)), s.provenance), G)
    assert e.value.rule in ("speculate", "kind")


# round numbers: the host's update pass is what bounds the step
HOST_BOUND = dataclasses.replace(PRESETS["h200"], cpu_adam_params_per_s=2e7, cpu_adam_master_params_per_s=2e7,
                                 cpu_cast_params_per_s=1e8)


def test_the_window_shortens_a_host_bound_step_and_costs_the_kept_masters():
    base = config(G, n_steps=3, n_mb=3, wire_bytes_per_param=4)
    without = build_schedule(G, base)
    with_ = build_schedule(G, dataclasses.replace(base, speculate=SPEC))
    a, b = simulate(without, G, HOST_BOUND), simulate(with_, G, HOST_BOUND)
    assert b.steady_step_s < a.steady_step_s
    # the window's updates come out of the pass after the norm: the step is at least that much shorter than the
    # pass alone would make it, less the copies of the masters run during the backward
    kept = sum(G.weight_params(l) for l in SPEC)
    assert host_memory(G, with_)["kept_masters"] == kept * KEPT_BYTES and "kept_masters" not in host_memory(G, without)
    assert speculation_redo_s(G, with_.config, HOST_BOUND) == pytest.approx(kept / 1e8 + kept / 2e7)


def test_the_window_follows_the_host_memory_left_and_the_rate_of_clipped_steps():
    cfg = config(G, n_mb=3, wire_bytes_per_param=4)
    able = speculate_eligible(G, cfg)
    assert able == [5, 4, 3, 2, 1]  # the last layers first: their gradients reach the host first
    spec = dataclasses.replace(HOST_BOUND, matmul_flops_per_s=1e6)  # a long backward: everything hides
    per = G.weight_params(4) * KEPT_BYTES
    assert speculation_set(G, cfg, spec, "auto", 10 * per, 0.1) == (5, 4, 3, 2, 1)
    assert speculation_set(G, cfg, spec, "auto", int(per * 2.5), 0.1) == (5, 4, 3)  # the host holds two blocks
    assert speculation_set(G, cfg, spec, "auto", 10 * per, 0.9) == ()  # nearly every step clipped: none pays
    assert speculation_set(G, cfg, spec, 3, 0, 0.9) == (5, 4, 3)  # a count is taken as asked


def test_keeping_the_state_takes_one_update_pass_and_a_spare_block_of_host_memory():
    """``speculate_keeps`` "state": each update of the window is one whole update (into its spare block), not the
    masters' copy, the masters' pass and the moments' pass; the host holds a block of the layer's size for it
    (12 bytes a parameter), so the same host memory takes a third of the window."""
    base = config(G, n_steps=3, n_mb=3, wire_bytes_per_param=4, speculate=SPEC)
    masters, state = build_schedule(G, base), build_schedule(G, dataclasses.replace(base, speculate_keeps="state"))
    kept = sum(G.weight_params(l) for l in SPEC)
    assert host_memory(G, state)["spare_states"] == kept * 12 and "kept_masters" not in host_memory(G, state)
    # a clipped step makes the update again in the layer's block, untouched: one pass
    assert speculation_redo_s(G, state.config, HOST_BOUND) == pytest.approx(kept / 2e7)
    assert speculation_redo_s(G, masters.config, HOST_BOUND) == pytest.approx(kept / 1e8 + kept / 2e7)
    # its CHECK has no moments left to make: none is deferred to the moments' pass
    checks = {op.id for op in state.ops if op.kind is OpKind.CHECK}
    assert checks and not checks & deferrable_opts(state)
    assert checks <= deferrable_opts(masters) | {op.id for op in masters.ops if op.kind is OpKind.CHECK}
    # where the host's two passes cost more than one (the moments' pass at a third of the whole update's rate),
    # the step is shorter keeping the state
    slow = dataclasses.replace(HOST_BOUND, cpu_adam_params_per_s=2e7, cpu_adam_master_params_per_s=2e7,
                               cpu_moments_params_per_s=2e7 / 3)
    assert simulate(state, G, slow).steady_step_s < simulate(masters, G, slow).steady_step_s
    cfg = dataclasses.replace(config(G, n_mb=3, wire_bytes_per_param=4), speculate_keeps="state")
    spec = dataclasses.replace(HOST_BOUND, matmul_flops_per_s=1e6)
    room = 10 * G.weight_params(4) * KEPT_BYTES  # five layers' masters (above), fewer layers' whole blocks
    blocks = [G.weight_params(l) * 12 for l in (5, 4, 3, 2, 1)]
    fit = max(k for k in range(6) if sum(blocks[:k]) <= room)
    assert 0 < fit < 5 and speculation_set(G, cfg, spec, "auto", room, 0.1) == (5, 4, 3, 2, 1)[:fit]
    with pytest.raises(ValueError, match="speculate_keeps must be one of masters, state"):
        build_schedule(G, dataclasses.replace(base, speculate_keeps="both"))


def test_a_window_is_taken_only_where_it_is_simulated_well_ahead_of_none():
    """``search.worth_speculating``: the fastest plan with a window of updates before the norm goes behind the
    fastest without one (same host gradient dtype) unless SPECULATE_GAIN faster; and the search's own choice for
    the Qwen2.5-7B shape at 24 GiB on the h200 spec, whose window is simulated 1.4% ahead (an H100 measured it 6%
    behind), is the plan without it, saying so; a count asked for is kept."""
    from megatrain.ir import ScheduleConfig
    from megatrain.planner.graph import preset
    from megatrain.planner.hardware import hardware
    from megatrain.planner.request import PlanOptions
    from megatrain.planner.search import SPECULATE_GAIN, plan, worth_speculating

    spec_, none = ScheduleConfig(n_layers=7, speculate=(5, 4)), ScheduleConfig(n_layers=7)
    key = lambda s, bf16=False: (bf16, s, 0.0, 0, 1, 2, 0)  # noqa: E731 - rank's key: (bf16 grads, seconds, ..)
    near = 1.0 * (1 + SPECULATE_GAIN) - 1e-3
    outcomes = [(spec_, "", key(1.0), None, None), (none, "", key(near, True), None, None),
                (none, "", key(near), None, None), (none, "", key(1.2), None, None)]
    order, note = worth_speculating([0, 2, 3, 1], outcomes)
    assert order == [2, 3, 0, 1] and "not taken" in note
    outcomes[2] = (none, "", key(1.0 * (1 + SPECULATE_GAIN) + 1e-3), None, None)
    assert worth_speculating([0, 2, 3, 1], outcomes) == ([0, 2, 3, 1], None)
    assert worth_speculating([3, 0], outcomes) == ([3, 0], None)  # the first has no window: as it was

    kw = PlanOptions(n_mb="auto", weight_slots="auto", wire="auto").search_kwargs(1024, True)
    auto = plan(preset("qwen2.5-7b"), hardware("h200"), 32768, 1024, budget_bytes=24 << 30, **kw)
    assert not auto.schedule.config.speculate and "updates before the norm simulated" in auto.speculation_left
    asked = plan(preset("qwen2.5-7b"), hardware("h200"), 32768, 1024, budget_bytes=24 << 30, **{**kw, "speculate": 2})
    assert len(asked.schedule.config.speculate) == 2 and asked.speculation_left is None
