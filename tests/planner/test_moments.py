"""The host's deferred moments in the simulator (``planner.moments``): where each step's pass runs and what waits
for it, against the executor's rule (``ir.deferrable_opts``) and timings worked out from the spec's rates."""

import dataclasses

import pytest

from megatrain.ir import OpKind, Schedule, Stream, deferrable_opts, op_params
from megatrain.planner.hardware import PRESETS
from megatrain.planner.moments import plan_moments
from megatrain.planner.passes import build_schedule
from megatrain.planner.simulate import bound, simulate

from .helpers import config, tiny_graph

G = tiny_graph(num_hidden_layers=4)
SPEC = dataclasses.replace(PRESETS["h200"], cpu_h2d_slowdown=0.0, cpu_d2h_slowdown=0.0, h2d_cpu_slowdown=0.0,
                           d2h_cpu_slowdown=0.0)


def _schedule(**kw):
    return build_schedule(G, config(G, n_steps=3, wire_bytes_per_param=4, **kw))


@pytest.mark.parametrize("kw", [{}, {"split_opt": (1,), "opt_part": 5000}, {"grad_kept": (2, 3, 4)}])
def test_a_task_for_each_deferred_update_gates_the_next_store_into_its_buffer(kw):
    """One task a deferred update (a split layer: its parts together), the step's last deferred first, each after
    the step's host ops; the next gradient store into its buffer (and a split layer's next state load) waits for
    it, nothing else does."""
    s = _schedule(**kw)
    deferred = deferrable_opts(s)
    m = plan_moments(s, G, SPEC, deferred)
    for k in range(3):
        want = sum(op_params(G, s.config, op) for op in s.ops if op.id in deferred and op.step == k)
        assert want and m.seconds(k) == pytest.approx(want / SPEC.cpu_moments_params_per_s)
        last_host = max(op.id for op in s.ops if op.stream is Stream.CPU and op.step == k)
        tasks = [t for t in m.tasks if t[0] == k]
        assert all(last_host in after for _, _, after in tasks)
        assert len(tasks) == len({(op.layer if op.kind is OpKind.STORE_OPT else op.id) for op in s.ops
                                  if op.id in deferred and op.step == k})
    first = [op for op in s.ops if op.id in deferred and op.step == 0]
    assert [t[1] for t in m.tasks if t[0] == 0][0] == pytest.approx(  # the last deferred first
        sum(op_params(G, s.config, op) for op in first if op.layer == first[-1].layer
            and op.kind is first[-1].kind) / SPEC.cpu_moments_params_per_s)
    for k in range(2):
        for op in s.ops:
            if op.id in deferred and op.step == k and op.kind is not OpKind.STORE_OPT:
                store = next(o for o in s.ops if o.id > op.id and o.kind is OpKind.STORE_G
                             and o.stream is Stream.D2H and o.slot("h") == op.slot("h"))
                assert m.tasks[m.gate[store.id]][0] == k
            if op.id in deferred and op.kind is OpKind.STORE_OPT:  # a split layer's next state load (the rest of
                # its parts' loads follow it on their queue)
                load = next(o for o in s.ops if o.kind is OpKind.LOAD_OPT and o.layer == op.layer and o.step == k + 1)
                assert m.tasks[m.gate[load.id]][0] == k
    assert all(s.ops[i].kind in (OpKind.STORE_G, OpKind.LOAD_OPT) and i not in deferred for i in m.gate)


def test_no_pass_without_its_rate_or_clipping():
    s = _schedule()
    assert not plan_moments(s, G, dataclasses.replace(SPEC, cpu_moments_params_per_s=0.0), deferrable_opts(s)).tasks
    s = _schedule(clip=False)
    assert not plan_moments(s, G, SPEC, deferrable_opts(s)).tasks


@pytest.mark.parametrize("speculate", [(), (3, 4)])
def test_a_slow_pass_holds_back_the_next_steps_stores_by_its_length(speculate):
    """At a rate that makes the pass long, the next step's gated stores and its host ops start once the pass is
    done: after the step's last host update by the pass's seconds at least; the step grows by about the pass, and
    the bound's host work counts it (with updates made before the norm, the next step's come in its backward)."""
    s = _schedule(speculate=speculate)
    deferred = deferrable_opts(s)
    free = dataclasses.replace(SPEC, cpu_moments_params_per_s=0.0)
    slow = dataclasses.replace(SPEC, cpu_moments_params_per_s=SPEC.cpu_adam_params_per_s / 5000)
    m = plan_moments(s, G, slow, deferred)
    t = simulate(s, G, slow)
    last_host = max(e for op, e in zip(s.ops, t.end_s) if op.stream is Stream.CPU and op.step == 0)
    # the tasks of step 0 run one after another from its last host op: the i-th gated store no sooner than the
    # first i tasks' seconds after it, the next step's host ops after them all
    done = last_host
    for i, (k, secs, _) in enumerate(m.tasks):
        if k == 0:
            done += secs
            assert all(t.start_s[j] >= done * (1 - 1e-9) for j, g in m.gate.items() if g == i)
    assert all(t.start_s[op.id] >= done * (1 - 1e-9) for op in s.ops if op.stream is Stream.CPU and op.step == 1)
    base = simulate(s, G, free)
    assert t.steady_step_s > base.steady_step_s + 0.5 * m.seconds(1)
    assert bound(s, G, slow).busy_s["cpu"] == pytest.approx(bound(s, G, free).busy_s["cpu"]
                                                            + sum(secs for _, secs, _ in m.tasks))


def test_a_plan_that_makes_every_update_in_one_pass_defers_nothing():
    """``defer_moments=False``: no op the executor defers, no task, every host update timed at the one-pass rate."""
    s = build_schedule(G, config(G, n_steps=3, wire_bytes_per_param=4, defer_moments=False))
    assert not deferrable_opts(s) and not plan_moments(s, G, SPEC, deferrable_opts(s)).tasks
    assert "defer_moments" in s.to_text() and Schedule.from_text(s.to_text()).config.defer_moments is False
    assert "defer_moments" not in _schedule().to_text()
