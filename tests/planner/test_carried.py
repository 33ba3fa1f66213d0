"""What a step carries over from the step issued before it (planner/carried.py), checked by verifying the two
steps joined into one schedule."""

from dataclasses import replace

import pytest

from megatrain.ir import OpKind, Stream
from megatrain.planner.carried import carried_deps, join
from megatrain.planner.passes import build_schedule
from megatrain.planner.verify import ScheduleError, verify

from .helpers import config, tiny_graph

G = tiny_graph(num_hidden_layers=4)


def _pair(**kw):
    cfg = config(G, **kw)
    first = build_schedule(G, cfg)
    steady = build_schedule(G, replace(cfg, continues=True))
    return first, steady


def _without(carried, op_id, dep):
    return tuple(tuple(d for d in deps if not (i == op_id and d == dep)) for i, deps in enumerate(carried))


def test_the_first_load_of_a_host_updated_layer_waits_for_its_update():
    s = build_schedule(G, config(G))
    carried = carried_deps(s, s, G)
    verify(join(s, s, carried), G)
    for layer in range(len(G)):
        if G[layer].tie is not None:
            continue
        loads = [op for op in s.ops if op.kind is OpKind.LOAD_W and G.owner(op.layer) == layer]
        opt = next(op for op in s.ops if op.kind is OpKind.OPT and op.layer == layer)
        assert opt.stream is Stream.CPU
        assert opt.id in carried[loads[0].id] and all(opt.id not in carried[op.id] for op in loads[1:])
        with pytest.raises(ScheduleError) as e:
            verify(join(s, s, _without(carried, loads[0].id, opt.id)), G)
        assert e.value.rule == "load-after-opt"


def test_a_kept_copy_waits_for_the_device_update_and_a_state_load_for_the_state_s_store():
    first, steady = _pair(gpu_opt=(1, 2, 3), resident_opt=(1,), weight_slots=3)
    for prev in (first, steady):
        carried = carried_deps(prev, steady, G)
        verify(join(prev, steady, carried), G)
        for layer in (2, 3):  # state loaded and stored every step
            load = next(op for op in steady.ops if op.kind is OpKind.LOAD_OPT and op.layer == layer)
            store = next(op for op in prev.ops if op.kind is OpKind.STORE_OPT and op.layer == layer)
            assert store.id in carried[load.id]
            with pytest.raises(ScheduleError) as e:
                verify(join(prev, steady, _without(carried, load.id, store.id)), G)
            assert e.value.rule == "state-after-store"
        # the weights the device update of the step before left: copied on the compute stream after that update,
        # with no wait for the state's store to the host
        copy = next(op for op in steady.ops if op.kind is OpKind.LOAD_W and op.layer == 2)
        assert copy.stream is Stream.COMPUTE
        opt = next(op for op in prev.ops if op.kind is OpKind.OPT and op.layer == 2)
        assert carried[copy.id] == (opt.id,) or opt.id in carried[copy.id]
        assert not any(prev.ops[d].kind is OpKind.STORE_OPT for d in carried[copy.id])


def test_a_resident_state_carries_no_load():
    first, steady = _pair(gpu_opt=(1, 2, 3), resident_opt=(1,), weight_slots=3)
    assert any(op.kind is OpKind.LOAD_OPT and op.layer == 1 for op in first.ops)
    assert not any(op.kind is OpKind.LOAD_OPT and op.layer == 1 for op in steady.ops)
    # the resident slot's first user in the steady step follows the step before's users of that slot
    carried = carried_deps(first, steady, G)
    slot = next(op.slot("o") for op in first.ops if op.kind is OpKind.OPT and op.layer == 1)
    user = next(op for op in steady.ops if op.slot("o") == slot)
    assert carried[user.id]
    assert all(slot in [i for r, i in first.ops[d].slots if r == "o"] for d in carried[user.id])
    # joined the other way round (the steady step first), the resident state would be missing its load
    with pytest.raises(ScheduleError):
        verify(join(steady, first, carried_deps(steady, first, G)), G)


def test_split_parts_wait_once_per_layer_and_queue():
    first, steady = _pair(gpu_opt=(1,), split_opt=(2, 3), opt_part=2000, grad_kept=(2,))
    carried = carried_deps(steady, steady, G)
    verify(join(steady, steady, carried), G)
    for layer in (2, 3):
        loads = [op for op in steady.ops if op.kind is OpKind.LOAD_OPT and op.layer == layer]
        last_store = max(op.id for op in steady.ops if op.kind is OpKind.STORE_OPT and op.layer == layer)
        assert len(loads) > 1 and last_store in carried[loads[0].id]
        assert all(last_store not in carried[op.id] for op in loads[1:])
