"""An activation goes at its last read: the executor holds exactly what the plan's memory model holds."""

import contextlib

import pytest

from megatrain.ir import SLOT_POOL, OpKind, op_contents

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches


def live_after_each_op(schedule, graph) -> list[set[int]]:
    """Per op, the activation slots whose content some later op of the step reads before anything writes them
    again: what may be held once the op is issued (from the IR's reads and writes of each op)."""
    live: set[int] = set()
    out = []
    for op in reversed(schedule.ops):
        out.append(set(live))
        reads, writes = op_contents(schedule, graph, op)
        for role, idx in op.slots:  # before the op: what it reads, not what it writes (unless it reads it too)
            if SLOT_POOL[role] == "a" and role in writes:
                live.discard(idx)
        for role, idx in op.slots:
            if SLOT_POOL[role] == "a" and role in reads:
                live.add(idx)
    return out[::-1]


@pytest.mark.parametrize("host_checkpoints,saved_acts,dropped", [(0, 0, 0), (2, 0, 0), (1, 1, 0), (2, 0, 1),
                                                                 (1, 0, 2)])
def test_the_executor_holds_the_activations_read_later_and_no_others(host_checkpoints, saved_acts, dropped):
    """(dropped: layer 2's checkpoint, or 2's and 3's, let go after the forward, held again from the REFWD that
    makes each to the BWD that reads it last)"""
    sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=host_checkpoints,
                     saved_acts=saved_acts, dropped_checkpoints=dropped)
    held = []

    @contextlib.contextmanager
    def before(op):
        held.append(set(sm.executor.st.act))  # (what the ops before it left)
        yield

    sm.executor.on_op = before
    ids, mask, labels = batches(n_steps=1)[0]
    sm.train_step(ids, mask, labels)
    schedule = sm.executor.st.schedule
    want = live_after_each_op(schedule, sm.graph)
    assert len(held) == len(schedule.ops)
    # before each op: what the ops before it left to be read later
    assert held[1:] == want[:-1]
    # the backward lets go of what it read: a checkpoint or gradient fewer after some of its ops
    assert any(len(b) < len(a) and op.kind is OpKind.BWD for op, a, b in zip(schedule.ops[1:], held[1:], held[2:]))
