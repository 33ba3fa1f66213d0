"""What a step carries over from the step issued before it (planner/carried.py), checked by verifying the two
steps joined into one schedule."""

import pytest

from dataclasses import replace

from megatrain.ir import OpKind, Schedule, Stream
from megatrain.planner.carried import carried_deps, join, unroll
from megatrain.planner.passes import build_schedule, setup_schedule
from megatrain.planner.verify import ScheduleError, verify

from .helpers import config, tiny_graph

G = tiny_graph(num_hidden_layers=4)


def _pair(**kw):
    """(the plan's set-up, its step)."""
    step = build_schedule(G, config(G, **kw))
    return setup_schedule(G, step), step


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
    _, steady = _pair(gpu_opt=(1, 2, 3), resident_opt=(1,), weight_slots=3)
    carried = carried_deps(steady, steady, G)
    verify(join(steady, steady, carried), G)
    for layer in (2, 3):  # state loaded and stored every step
        load = next(op for op in steady.ops if op.kind is OpKind.LOAD_OPT and op.layer == layer)
        store = next(op for op in steady.ops if op.kind is OpKind.STORE_OPT and op.layer == layer)
        assert store.id in carried[load.id]
        with pytest.raises(ScheduleError) as e:
            verify(join(steady, steady, _without(carried, load.id, store.id)), G)
        assert e.value.rule == "state-after-store"
    # the weights the device update of the step before left: copied on the compute stream after that update,
    # with no wait for the state's store to the host
    copy = next(op for op in steady.ops if op.kind is OpKind.LOAD_W and op.layer == 2)
    assert copy.stream is Stream.COMPUTE
    opt = next(op for op in steady.ops if op.kind is OpKind.OPT and op.layer == 2)
    assert opt.id in carried[copy.id]
    assert not any(steady.ops[d].kind is OpKind.STORE_OPT for d in carried[copy.id])


def test_the_set_up_puts_what_the_step_finds_on_the_device():
    """The set-up: a KEEP_W per device-updated layer, a LOAD_OPT per resident state into its home slot; the step's
    copies of kept weights wait for their KEEP_W, and its first users of a resident slot for that slot's load.
    Without the embedding copy's dependency, or without one of the set-up's ops, the joined pair does not verify."""
    setup, steady = _pair(gpu_opt=(0, 1, 2, 3), resident_opt=(1,), weight_slots=3)
    verify(setup, G)
    assert [(op.kind, op.layer) for op in setup.ops] == [(OpKind.KEEP_W, l) for l in range(4)] + [(OpKind.LOAD_OPT, 1)]
    assert not any(op.kind is OpKind.LOAD_OPT and op.layer == 1 for op in steady.ops)
    carried = carried_deps(setup, steady, G)
    joined = join(setup, steady, carried)
    assert joined.config == steady.config and joined.ops[:len(setup.ops)] == setup.ops  # no step of its own
    verify(joined, G)
    for layer in range(4):
        copy = next(op for op in steady.ops if op.kind is OpKind.LOAD_W and op.layer == layer)
        keep = next(op for op in setup.ops if op.kind is OpKind.KEEP_W and op.layer == layer)
        assert copy.stream is Stream.COMPUTE and carried[copy.id] == (keep.id,)
    # the embedding's copy is the step's first compute op: nothing but that dependency puts it after its KEEP_W
    # (the later layers' copies follow the forward, which follows the inputs, queued behind the set-up's copies)
    copy = next(op for op in steady.ops if op.kind is OpKind.LOAD_W and op.layer == 0)
    with pytest.raises(ScheduleError) as e:
        verify(join(setup, steady, _without(carried, copy.id, setup.ops[0].id)), G)
    assert e.value.rule == "kept-before-load"
    load = setup.ops[-1]
    user = next(op for op in steady.ops if op.slot("o") == load.slot("o"))
    assert carried[user.id] == (load.id,)
    # a set-up without the resident state's load, or without a layer's kept weights
    for drop, rule in ((load, "slot-content"), (setup.ops[2], "complete")):
        short = Schedule(tuple(replace(op, id=i) for i, op in enumerate(o for o in setup.ops if o is not drop)),
                         setup.config)
        with pytest.raises(ScheduleError) as e:
            verify(short, G)
        assert e.value.rule == "complete"
        with pytest.raises(ScheduleError) as e:
            verify(join(short, steady, carried_deps(short, steady, G)), G)
        assert e.value.rule == rule
    # joined the other way round (a step, then the set-up), the set-up's ops would come after the step's
    with pytest.raises(ScheduleError):
        verify(join(steady, setup, carried_deps(steady, setup, G)), G)


def test_split_parts_wait_once_per_layer_and_queue():
    _, steady = _pair(gpu_opt=(1,), split_opt=(2, 3), opt_part=2000, grad_kept=(2,))
    carried = carried_deps(steady, steady, G)
    verify(join(steady, steady, carried), G)
    for layer in (2, 3):
        loads = [op for op in steady.ops if op.kind is OpKind.LOAD_OPT and op.layer == layer]
        last_store = max(op.id for op in steady.ops if op.kind is OpKind.STORE_OPT and op.layer == layer)
        assert len(loads) > 1 and last_store in carried[loads[0].id]
        assert all(last_store not in carried[op.id] for op in loads[1:])


@pytest.mark.parametrize("kw", [{}, dict(gpu_opt=(1, 3), resident_opt=(1, 3)), dict(gpu_opt=(2,), split_opt=(1, 3),
                                                                                   opt_part=1000, weight_slots=3)])
def test_a_run_s_later_steps_carry_what_its_second_carried(kw):
    """unroll() computes what a step carries over from the one before for the first two joins and shifts the second's
    onto the later steps (the steps are the same schedule again): the same run as computing each join's anew."""
    setup, step = _pair(**kw)
    run = unroll(setup, step, G, 4)
    s = step if setup is None else join(setup, step, carried_deps(setup, step, G))
    for _ in range(3):
        s = join(s, step, carried_deps(s, step, G))
    assert run.ops == s.ops and run.config == s.config
