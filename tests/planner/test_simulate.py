"""The simulator and the bound against timings worked out by hand."""

import dataclasses

import pytest

from megatrain.ir import OpKind, Stream
from megatrain.planner.cost import duration_s
from megatrain.planner.graph import Layer, LayerGraph
from megatrain.planner.hardware import PRESETS, HardwareSpec
from megatrain.planner.passes import build_schedule
from megatrain.planner.simulate import bound, simulate

from .helpers import config

# Round numbers: 1 GB/s each way, 1.5 GB/s both at once, 1 GFLOP/s, 1 M params/s of Adam, no issue floors.
SPEC = dataclasses.replace(PRESETS["h200"], h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
                           matmul_flops_per_s=1e9, hbm_bytes_per_s=1e15, cpu_adam_params_per_s=1e6,
                           cpu_cast_params_per_s=1e30, fwd_issue_s=0.0, bwd_issue_s=0.0, cpu_h2d_slowdown=0.0,
                           cpu_d2h_slowdown=0.0, cpu_adam_master_params_per_s=0.0)


def two_layer_graph():
    # embedding: 1e6 params, no FLOPs; head: 1e6 params, 1e3 FLOP/token forward
    return LayerGraph([
        Layer(name="embed", kind="embedding", template="e", params=1_000_000, act_bytes_per_token=2),
        Layer(name="head", kind="head", template="h", params=1_000_000, matmul_flops_per_token=1e3),
    ])


def _two_layer_times(spec):
    """The unclipped one-step schedule of the two-layer graph, simulated: (graph, schedule, timeline, (kind, layer)
    -> (start, end))."""
    g = two_layer_graph()
    s = build_schedule(g, config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2, clip=False))
    tl = simulate(s, g, spec)
    return g, s, tl, {(op.kind, op.layer): (a, b) for op, a, b in zip(s.ops, tl.start_s, tl.end_s)}


def test_two_layer_step_by_hand():
    g, s, tl, t = _two_layer_times(SPEC)
    # both loads on h2d: 2 MB each at 1 GB/s
    assert t[(OpKind.LOAD_W, 0)] == pytest.approx((0.0, 0.002))
    assert t[(OpKind.LOAD_W, 1)] == pytest.approx((0.002, 0.004))
    # LOSS: 3 x 1e3 FLOP x 1000 tokens at 1 GFLOP/s = 3 ms, after the head's weights arrive
    assert t[(OpKind.LOSS, 1)] == pytest.approx((0.004, 0.007))
    # head gradient: 4 MB d2h alone = 4 ms; embedding backward has no FLOPs (0 s) and follows the LOSS
    assert t[(OpKind.STORE_G, 1)] == pytest.approx((0.007, 0.011))
    assert t[(OpKind.BWD, 0)][1] == pytest.approx(0.007)
    # embedding gradient waits for the d2h stream: 0.011 .. 0.015
    assert t[(OpKind.STORE_G, 0)] == pytest.approx((0.011, 0.015))
    # OPT: 1e6 params at 1e6/s = 1 s each, on one cpu stream
    assert t[(OpKind.OPT, 1)] == pytest.approx((0.011, 1.011))
    assert t[(OpKind.OPT, 0)] == pytest.approx((1.011, 2.011))
    b = bound(s, g, SPEC)
    assert b.busy_s["cpu"] == pytest.approx(2.0) and b.limiter == "cpu"
    assert b.busy_s["pcie"] == pytest.approx(12e6 / 1.5e9)
    assert b.critical_path_s == pytest.approx(2.011)
    assert tl.makespan_s == pytest.approx(b.makespan_s)
    from megatrain.planner.critical import critical_path

    # along it: the inputs (no time), both weight loads, the LOSS, the head's gradient out, then the two updates on
    # the one cpu stream
    cp = critical_path(s, g, SPEC)
    assert cp.length_s == pytest.approx(2.011)
    assert [(op.kind, op.layer) for op in cp.ops] == [(OpKind.LOAD_IN, 0), (OpKind.LOAD_W, 0), (OpKind.LOAD_W, 1),
                                                      (OpKind.LOSS, 1),
                                                      (OpKind.STORE_G, 1), (OpKind.OPT, 1), (OpKind.OPT, 0)]
    assert cp.by_stream_s == pytest.approx({"compute": 0.003, "h2d": 0.004, "d2h": 0.004, "cpu": 2.0})


def test_host_updates_slow_while_copies_run():
    """The step of test_two_layer_step_by_hand with the host's AdamW losing 25% of its rate while d2h copies run at
    their full rate (12.5% for h2d): the head's update starts under the embedding's 4 ms gradient store, doing
    3 ms of work in it, and ends 1 ms later; the chain between two clipped steps counts that share of the copies."""
    spec = dataclasses.replace(SPEC, cpu_h2d_slowdown=0.125, cpu_d2h_slowdown=0.25)
    g, _, _, t = _two_layer_times(spec)
    assert t[(OpKind.STORE_G, 0)] == pytest.approx((0.011, 0.015))
    assert t[(OpKind.OPT, 1)] == pytest.approx((0.011, 1.012))
    assert t[(OpKind.OPT, 0)] == pytest.approx((1.012, 2.012))
    two = build_schedule(g, config(g, n_steps=2, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2, clip=True))
    plain, slowed = bound(two, g, SPEC).chain, bound(two, g, spec).chain
    # between the backwards: both updates (2 s), the embedding's gradient store (4 ms of d2h) and the next
    # step's two weight loads (2 ms each of h2d)
    assert plain[1] == slowed[1] == "cpu"
    # (less 25% x 12.5% of the 4 ms the two directions could overlap: the host keeps 0.75 x 0.875 while both run)
    assert slowed[0] - plain[0] == pytest.approx(0.25 * 0.004 + 0.125 * 0.004 - 0.25 * 0.125 * 0.004)
    with pytest.raises(ValueError, match="below 1"):
        HardwareSpec.from_dict({**spec.to_dict(), "cpu_h2d_slowdown": 1.0})


def test_copies_slow_while_host_updates_run():
    """The step of test_two_layer_step_by_hand with each copy direction losing half its rate while the host's AdamW
    runs: the weight loads and the head's gradient store run before any update and keep their times; the embedding's
    4 MB gradient store runs wholly beside the head's update, at 0.5 GB/s: 8 ms instead of 4."""
    spec = dataclasses.replace(SPEC, h2d_cpu_slowdown=0.5, d2h_cpu_slowdown=0.5)
    _, _, _, t = _two_layer_times(spec)
    assert t[(OpKind.LOAD_W, 1)] == pytest.approx((0.002, 0.004))
    assert t[(OpKind.STORE_G, 1)] == pytest.approx((0.007, 0.011))
    assert t[(OpKind.OPT, 1)] == pytest.approx((0.011, 1.011))
    assert t[(OpKind.STORE_G, 0)] == pytest.approx((0.011, 0.019))
    assert t[(OpKind.OPT, 0)] == pytest.approx((1.011, 2.011))
    # only d2h slowed: the same; only h2d slowed: the store keeps its 4 ms
    assert _two_layer_times(dataclasses.replace(SPEC, d2h_cpu_slowdown=0.5))[3][(OpKind.STORE_G, 0)] == \
        pytest.approx((0.011, 0.019))
    assert _two_layer_times(dataclasses.replace(SPEC, h2d_cpu_slowdown=0.5))[3][(OpKind.STORE_G, 0)] == \
        pytest.approx((0.011, 0.015))
    for f in ("h2d_cpu_slowdown", "d2h_cpu_slowdown"):
        with pytest.raises(ValueError, match=f"{f} must be below 1"):
            HardwareSpec.from_dict({**spec.to_dict(), f: 1.0})
        with pytest.raises(ValueError, match=f"{f} must be a finite number >= 0"):
            HardwareSpec.from_dict({**spec.to_dict(), f: -0.1})
    assert HardwareSpec.from_dict(spec.to_dict()) == spec


def test_transfers_running_together_are_slowed():
    from megatrain.ir import Op, Schedule, Stream
    from megatrain.planner.simulate import simulate as sim

    g = two_layer_graph()
    # hand-made: one h2d and one d2h of 4 MB each, starting together
    cfg = config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=4)
    ops = (Op(0, OpKind.LOAD_W, Stream.H2D, 0, 0, slots=(("w", 0),)),
           Op(1, OpKind.STORE_G, Stream.D2H, 0, 1, slots=(("g", 0),)))
    tl = sim(Schedule(ops, cfg), g, SPEC)
    # together they move 8 MB at 1.5 GB/s: both end at 5.33 ms
    assert tl.end_s == pytest.approx([8e6 / 1.5e9, 8e6 / 1.5e9])


def test_device_updates_shorten_a_host_bound_step():
    """Qwen2.5-7B at 32,768 tokens on a host whose AdamW runs at 2 G params/s is bound by that AdamW; updating every
    third layer on the GPU moves 24 bytes per parameter of those layers over PCIe instead and the simulated step
    gets shorter. With clipping the updates follow the backward: the bound is that chain (the backward, then the
    host update pass the next backward waits for), far above the cpu's share of the roofline, and it falls with
    the device updates too."""
    from megatrain.planner.graph import preset

    g = preset("qwen2.5-7b")
    spec = dataclasses.replace(PRESETS["h200"], cpu_adam_params_per_s=2e9,
                               cpu_adam_master_params_per_s=0.0)  # every host update in one pass
    eligible = [l for l in range(len(g)) if g[l].tie is None and not g.tied_to(l)]
    steps = {}
    for gpu_opt in ((), tuple(eligible[2::3])):
        cfg = dataclasses.replace(config(g, n_steps=3, n_mb=4, mb_tokens=8192, seq_len=1024, weight_slots=3,
                                         wire_bytes_per_param=4, budget_bytes=spec.budget_bytes), gpu_opt=gpu_opt)
        s = build_schedule(g, cfg)
        steps[bool(gpu_opt)] = (simulate(s, g, spec).steady_step_s, bound(s, g, spec))
    assert steps[False][1].limiter == "backward+cpu"
    assert steps[False][1].step_s > 1.5 * steps[False][1].roofline_s
    assert steps[True][1].step_s < steps[False][1].step_s
    assert steps[True][0] < 0.9 * steps[False][0]
    for simulated, b in steps.values():
        assert simulated >= b.step_s


def test_small_compute_ops_take_at_least_their_issue_time():
    """A compute op lasts at least the host time to issue it (the spec's floor), however few its FLOPs."""
    from megatrain.ir import Op, Stream
    from megatrain.planner.cost import duration_s

    g = two_layer_graph()
    cfg = config(g, n_mb=1, mb_tokens=1000)
    spec = dataclasses.replace(SPEC, fwd_issue_s=0.5, bwd_issue_s=2.0)
    loss = Op(0, OpKind.LOSS, Stream.COMPUTE, 0, 1, 0)
    bwd = Op(1, OpKind.BWD, Stream.COMPUTE, 0, 0, 0)
    assert duration_s(g, cfg, SPEC, loss) == pytest.approx(0.003)  # 3e6 FLOP at 1 GFLOP/s
    assert duration_s(g, cfg, spec, loss) == 0.5 and duration_s(g, cfg, spec, bwd) == 2.0
    fast = dataclasses.replace(spec, matmul_flops_per_s=1e3)  # now the FLOPs take longer than the floor
    assert duration_s(g, cfg, fast, loss) == pytest.approx(3e3)


def test_attention_is_charged_at_its_own_rate_with_a_backward_of_two_and_a_half_forwards():
    """A block with 1e3 matmul FLOP and 1 attention FLOP per token per token of sequence: at 500-token sequences
    its forward is 1e3 matmul + 500 attention FLOP per token; the backward recomputes the forward and then costs
    2 forwards of matmuls and 2.5 of attention; a saved layer's backward skips the recompute."""
    import dataclasses as dc

    from megatrain.ir import Op, Stream
    from megatrain.planner.cost import compute_flops, duration_s

    g = LayerGraph([
        Layer(name="embed", kind="embedding", template="e", params=10, act_bytes_per_token=2),
        Layer(name="block", kind="block", template="b", params=10, matmul_flops_per_token=1e3,
              attn_flops_per_token_per_seq=1.0, act_bytes_per_token=2, saved_bytes_per_token=2),
        Layer(name="head", kind="head", template="h", params=10, matmul_flops_per_token=1e3),
    ])
    cfg = config(g, n_mb=1, mb_tokens=1000, seq_len=500)
    spec = dc.replace(SPEC, attn_flops_per_s=0.5e9)  # attention at half the matmul rate
    fwd, bwd = Op(0, OpKind.FWD, Stream.COMPUTE, 0, 1, 0), Op(1, OpKind.BWD, Stream.COMPUTE, 0, 1, 0)
    assert compute_flops(g, cfg, fwd) == pytest.approx(1000 * (1e3 + 500))
    assert duration_s(g, cfg, spec, fwd) == pytest.approx(1000 * (1e3 / 1e9 + 500 / 0.5e9))  # 2 ms
    assert duration_s(g, cfg, spec, bwd) == pytest.approx(1000 * (3 * 1e3 / 1e9 + 3.5 * 500 / 0.5e9))
    saved = dc.replace(cfg, saved_acts=(1,))
    assert duration_s(g, saved, spec, bwd) == pytest.approx(1000 * (2 * 1e3 / 1e9 + 2.5 * 500 / 0.5e9))
    no_rate = dc.replace(spec, attn_flops_per_s=0.0)  # 0: attention at the matmul rate
    assert duration_s(g, cfg, no_rate, fwd) == pytest.approx(1000 * 1.5e3 / 1e9)


def test_a_simulation_given_up_only_once_its_steady_step_is_certainly_longer():
    from megatrain.planner.passes import repeat
    from megatrain.planner.simulate import Slower

    g = two_layer_graph()
    s = repeat(g, build_schedule(g, config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2)), 3)
    full = simulate(s, g, SPEC, curve=False)
    steady = full.steady_step_s  # about 2 s: the two host updates
    assert steady == pytest.approx(2.0, rel=0.05)
    # a limit at or above the steady step changes nothing
    same = simulate(s, g, SPEC, curve=False, give_up_s=steady)
    assert same.end_s == full.end_s
    with pytest.raises(Slower, match="steady step (over|at least)"):
        simulate(s, g, SPEC, curve=False, give_up_s=steady * 0.99)
    # two steps have no steady step to give up on: the limit is ignored
    two = repeat(g, build_schedule(g, config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2)), 2)
    assert simulate(two, g, SPEC, curve=False, give_up_s=1e-9).end_s == simulate(two, g, SPEC, curve=False).end_s


def test_a_simulation_of_the_steady_step_alone_stops_when_the_second_to_last_step_ends_with_its_seconds():
    from megatrain.planner.passes import repeat

    g = two_layer_graph()
    for steps in (3, 4):
        s = repeat(g, build_schedule(g, config(g, n_mb=2, mb_tokens=500, wire_bytes_per_param=2)), steps)
        full = simulate(s, g, SPEC, curve=False)
        short = simulate(s, g, SPEC, curve=False, steady_only=True)
        assert short.steady_step_s == full.steady_step_s
        ends = full.step_end_s()
        assert short.makespan_s == ends[-2] < full.makespan_s
        # the ops it holds are those that ended by then, with the times the whole simulation gives them
        times = {op.id: (a, b) for op, a, b in zip(full.ops, full.start_s, full.end_s)}
        assert 0 < len(short.ops) < len(full.ops)
        assert all(times[op.id] == (a, b) and b <= ends[-2] for op, a, b in zip(short.ops, short.start_s, short.end_s))
    with pytest.raises(ValueError, match="memory curve"):
        simulate(s, g, SPEC, steady_only=True)
    two = repeat(g, build_schedule(g, config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2)), 2)
    assert simulate(two, g, SPEC, curve=False, steady_only=True).end_s == simulate(two, g, SPEC, curve=False).end_s


def test_the_steady_step_is_never_under_a_steps_work_on_its_busiest_resource():
    """Three simulated steps can end closer together than the steady state keeps them where one resource has more
    work a step than that (a backlog of host work that grows from step to step): the steady step holds to the
    middle step's work on its busiest resource (planner.floor), here the host's two updates."""
    from megatrain.ir import Timeline
    from megatrain.planner.passes import repeat

    g = two_layer_graph()
    s = repeat(g, build_schedule(g, config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2)), 3)
    tl = simulate(s, g, SPEC, curve=False)
    host = sum(duration_s(g, s.config, SPEC, op) for op in s.ops if op.step == 1 and op.stream is Stream.CPU)
    assert tl.floor_s == pytest.approx(host) and host > 0 and tl.steady_step_s >= tl.floor_s
    ends = tl.step_end_s()
    squeezed = Timeline("simulated", tl.ops, tl.start_s, tl.end_s, n_steps=3, floor_s=(ends[1] - ends[0]) * 1.5)
    assert squeezed.steady_step_s == squeezed.floor_s
    assert Timeline.from_json(squeezed.to_json()).steady_step_s == squeezed.floor_s


def test_the_held_pools_are_in_use_from_the_start_and_activations_from_their_fill():
    # the runtime allocates the weight, gradient, optimizer and kept-gradient pools before the first op
    # (DeviceBuffers.fit) and holds them; an activation is a tensor of its own from the op that makes it
    from megatrain.planner.cost import slot_sizes

    g = LayerGraph([
        Layer(name="embed", kind="embedding", template="e", params=1_000_000, act_bytes_per_token=2),
        Layer(name="block", kind="block", template="b", params=2_000_000, matmul_flops_per_token=4e6,
              act_bytes_per_token=2),
        Layer(name="head", kind="head", template="h", params=1_000_000, matmul_flops_per_token=1e3),
    ])
    s = build_schedule(g, config(g, n_mb=2, mb_tokens=1000, wire_bytes_per_param=2, clip=True))
    tl = simulate(s, g, SPEC)
    size = slot_sizes(g, s)
    held = sum(sum(size[p]) for p in ("w", "g", "o", "k"))
    gemm = s.config.gemm_workspace_bytes
    assert held >= 2 * 2_000_000 * 2 + 4 * 2_000_000  # two weight slots at 2 B, a gradient slot at 4 B
    assert tl.memory[0] == (0.0, gemm + held)  # before any op ran: no activation, no working set
    assert tl.memory[-1][1] == gemm  # all of it given back at the end
    # never below the held pools while the step runs
    assert min(b for _, b in tl.memory[:-1]) == gemm + held
    first_fwd = min(a for op, a in zip(s.ops, tl.start_s) if op.kind is OpKind.FWD)
    assert all(b == gemm + held for t, b in tl.memory if t < first_fwd)
