"""The simulator and the bound against timings worked out by hand."""

import dataclasses

import pytest

from megatrain.ir import OpKind
from megatrain.planner.graph import Layer, LayerGraph
from megatrain.planner.hardware import PRESETS
from megatrain.planner.passes import build_schedule
from megatrain.planner.simulate import bound, simulate

from .helpers import config

# Round numbers: 1 GB/s each way, 1.5 GB/s both at once, 1 GFLOP/s, 1 M params/s of Adam.
SPEC = dataclasses.replace(PRESETS["h200"], h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex_bytes_per_s=1.5e9,
                           matmul_flops_per_s=1e9, hbm_bytes_per_s=1e15, cpu_adam_params_per_s=1e6,
                           cpu_cast_params_per_s=1e30)


def two_layer_graph():
    # embedding: 1e6 params, no FLOPs; head: 1e6 params, 1e3 FLOP/token forward
    return LayerGraph([
        Layer(name="embed", kind="embedding", template="e", params=1_000_000, act_bytes_per_token=2),
        Layer(name="head", kind="head", template="h", params=1_000_000, matmul_flops_per_token=1e3),
    ])


def test_two_layer_step_by_hand():
    g = two_layer_graph()
    s = build_schedule(g, config(g, n_mb=1, mb_tokens=1000, wire_bytes_per_param=2, clip=False))
    tl = simulate(s, g, SPEC)
    t = {(op.kind, op.layer): (a, b) for op, a, b in zip(s.ops, tl.start_s, tl.end_s)}
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
