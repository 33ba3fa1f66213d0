"""Weight slots: one per layer loads each layer once per step; loads never run far ahead of their readers."""

import pytest

from megatrain.ir import OpKind
from megatrain.planner.passes import PREFETCH_LAYERS, build_schedule
from megatrain.planner.verify import verify

from .helpers import config, tiny_graph


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("clip", [True, False])
def test_a_slot_per_layer_loads_each_owner_once_per_step(tied, clip):
    g = tiny_graph(num_hidden_layers=6, tie_word_embeddings=tied)
    s = build_schedule(g, config(g, n_steps=3, n_mb=3, weight_slots=len(g), clip=clip))
    verify(s, g)
    owners = sorted({g.owner(l) for l in range(len(g))})
    for st in range(3):
        loads = sorted(op.layer for op in s.ops if op.kind is OpKind.LOAD_W and op.step == st)
        assert sorted(g.owner(l) for l in loads) == owners  # every owner once: the backward reloads nothing
    few = build_schedule(g, config(g, n_steps=3, n_mb=3, weight_slots=2, clip=clip))
    assert sum(op.kind is OpKind.LOAD_W for op in few.ops) > sum(op.kind is OpKind.LOAD_W for op in s.ops)


@pytest.mark.parametrize("slots", [2, 3, 5, 9])
def test_loads_go_at_most_two_layers_ahead_of_their_first_reader(slots):
    """With many slots nothing but this limit holds a load back: without it every load of the step would sit at its
    start in program order, and the thread issuing ops would wait in each for the layer's previous update before
    reaching the forward."""
    g = tiny_graph(num_hidden_layers=6, tie_word_embeddings=False)
    n_mb = 2
    s = build_schedule(g, config(g, n_steps=2, n_mb=n_mb, weight_slots=slots))
    verify(s, g)
    computes = [op for op in s.ops if op.kind in (OpKind.FWD, OpKind.BWD, OpKind.LOSS)]
    limit = PREFETCH_LAYERS * n_mb
    checked = 0
    for load in (op for op in s.ops if op.kind is OpKind.LOAD_W):
        step_ops = [i for i, op in enumerate(computes) if op.step == load.step]
        reader = next(i for i in step_ops if computes[i].id > load.id
                      and g.owner(computes[i].layer) == g.owner(load.layer))
        before = [i for i in step_ops if computes[i].id < load.id]  # the step's compute ops issued before the load
        between = reader - (before[-1] if before else step_ops[0] - 1) - 1
        if reader - step_ops[0] >= limit:  # a reader this far into the step: its load is held back
            assert between < limit, (str(load), str(computes[reader]))
            checked += 1
    assert checked
