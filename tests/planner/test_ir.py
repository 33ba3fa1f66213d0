import pytest

from megatrain.ir import IRError, Op, OpKind, Schedule, Stream
from megatrain.planner.passes import build_schedule

from .helpers import config, tiny_graph


def test_op_text_is_one_line_and_parses_back():
    op = Op(12, OpKind.BWD, Stream.COMPUTE, 1, 3, 2, (("w", 1), ("x", 4), ("dy", 7), ("g", 0)), (9, 11))
    assert str(op) == "12 BWD s1 L3 m2 @compute w1 x4 dy7 g0 <- 9,11"
    assert Op.from_str(str(op)) == op
    bare = Op(0, OpKind.OPT, Stream.CPU, 0, 5)
    assert str(bare) == "0 OPT s0 L5 @cpu" and Op.from_str(str(bare)) == bare


@pytest.mark.parametrize("bad", ["", "12 BWD L3", "1 NOPE s0 L1 @compute", "1 FWD s0 L1 @gpu", "1 FWD s0 L1 @compute q3",
                                 "1 FWD s0 L1 @compute <- x"])
def test_malformed_op_text_is_refused(bad):
    with pytest.raises(IRError):
        Op.from_str(bad)


def test_schedule_text_and_json_round_trip():
    g = tiny_graph()
    s = build_schedule(g, config(g, n_steps=2, host_checkpoints=1))
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(s.to_json()) == s
    # the first step's passes, then the second step joined to it
    assert s.provenance[0].startswith("emit_compute") and s.provenance[-2].startswith("finalize")
    assert s.provenance[-1].startswith("join: ")


def test_schedule_text_without_header_is_refused():
    with pytest.raises(IRError, match="not a megatrain schedule"):
        Schedule.from_text("0 OPT s0 L0 @cpu\n")
