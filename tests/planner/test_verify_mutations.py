"""Break a valid schedule in one way at a time: verify must name the broken rule."""

import dataclasses

import pytest

from megatrain.ir import Op, OpKind, Schedule, Stream, setup_ops
from megatrain.planner.cost import device_memory
from megatrain.planner.passes import build_schedule, write_back_schedule
from megatrain.planner.verify import ScheduleError, verify

from .helpers import config, renumber, tiny_graph

G = tiny_graph(num_hidden_layers=4)


def _schedule(**kw) -> Schedule:
    s = build_schedule(G, config(G, n_steps=2, n_mb=3, **kw))
    verify(s, G)
    return s


def _find(s: Schedule, kind: OpKind, **kw) -> Op:
    return next(op for op in s.ops if op.kind is kind and all(getattr(op, k) == v for k, v in kw.items()))


def _replace(s: Schedule, op: Op, **kw) -> Schedule:
    ops = list(s.ops)
    ops[op.id] = dataclasses.replace(op, **kw)
    return Schedule(tuple(ops), s.config, s.provenance)


def _broken(s: Schedule, rule: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as e:
        verify(s, G)
    assert e.value.rule == rule, str(e.value)
    return e.value


def test_dropping_a_write_after_read_dependency_is_caught():
    s = _schedule()
    # the first load that evicts something: it must wait for the evicted layer's last reader
    load = next(op for op in s.ops if op.kind is OpKind.LOAD_W and op.deps)
    err = _broken(_replace(s, load, deps=()), "slot-overwritten")
    assert str(load.id) in str(err) and "missing dependency" in str(err)


def test_dropping_a_read_after_write_dependency_is_caught():
    s = _schedule()
    fwd = _find(s, OpKind.FWD, step=0, layer=2, mb=0)
    load = next(s.ops[d] for d in fwd.deps if s.ops[d].kind is OpKind.LOAD_W)
    _broken(_replace(s, fwd, deps=tuple(d for d in fwd.deps if d != load.id)), "slot-ready")


def test_reusing_a_slot_before_its_last_reader_is_caught():
    s = _schedule(weight_slots=3)
    # load layer 2 into the slot that still holds layer 1, which FWD(layer 1) has yet to read
    load = _find(s, OpKind.LOAD_W, step=0, layer=2)
    held = _find(s, OpKind.LOAD_W, step=0, layer=1).slot("w")
    assert load.slot("w") != held
    _broken(_replace(s, load, slots=(("w", held),)), "slot-content")


def test_exceeding_the_memory_budget_is_caught():
    s = _schedule()
    err = _broken(Schedule(s.ops, dataclasses.replace(s.config, budget_bytes=100_000), s.provenance), "memory")
    assert "budget is 97.66 KiB" in str(err)
    # the budget is exact: one byte less than the schedule's slots and working set is refused, naming the pools
    need = device_memory(G, s).total_nbytes
    err = _broken(Schedule(s.ops, dataclasses.replace(s.config, budget_bytes=need - 1), s.provenance), "memory")
    assert "w: 2 slots" in str(err) and "working set" in str(err)
    verify(Schedule(s.ops, dataclasses.replace(s.config, budget_bytes=need), s.provenance), G)


def test_optimizing_a_layer_twice_is_caught():
    s = _schedule()
    opt = _find(s, OpKind.OPT, step=0, layer=1)
    twice = dataclasses.replace(opt, id=len(s.ops), deps=(opt.id,))
    err = _broken(Schedule(s.ops + (twice,), s.config, s.provenance), "once")
    assert "optimized twice" in str(err)


def test_storing_a_gradient_after_its_optimizer_is_caught():
    s = _schedule(clip=False)
    store = _find(s, OpKind.STORE_G, step=0, layer=2)
    opt = _find(s, OpKind.OPT, step=0, layer=2)
    ops = [dataclasses.replace(op, deps=tuple(d for d in op.deps if d != store.id)) for op in s.ops if op != store]
    at = next(i for i, op in enumerate(ops) if op.id == opt.id) + 1
    ops.insert(at, store)  # now the store comes after the optimizer that needs it
    _broken(renumber(s, ops), "store-before-opt")


def test_loading_weights_before_the_previous_steps_optimizer_is_caught():
    s = _schedule()
    load = _find(s, OpKind.LOAD_W, step=1, layer=0)
    opt = _find(s, OpKind.OPT, step=0, layer=0)
    _broken(_replace(s, load, deps=tuple(d for d in load.deps if d != opt.id)), "load-after-opt")


def test_a_forward_dependency_is_caught():
    s = _schedule()
    op = s.ops[5]
    _broken(_replace(s, op, deps=(len(s.ops) - 1,)), "acyclic")


def test_a_missing_backward_is_caught():
    s = _schedule()
    bwd = _find(s, OpKind.BWD, step=1, layer=0, mb=2)
    _broken(renumber(s, [op for op in s.ops if op != bwd]), "complete")


def test_error_names_the_op_in_text_form():
    s = _schedule()
    load = next(op for op in s.ops if op.kind is OpKind.LOAD_W and op.deps)
    with pytest.raises(ScheduleError) as e:
        verify(_replace(s, load, deps=()), G)
    assert "LOAD_W s0" in str(e.value)


# ---- updates on the device (gpu_opt): LOAD_OPT -> OPT on compute -> STORE_OPT --------------------------------
def _gpu_schedule(clip: bool = True) -> Schedule:
    return _schedule(gpu_opt=(1, 3), clip=clip)


def test_device_updates_build_and_verify_in_both_modes():
    for clip in (True, False):
        s = _gpu_schedule(clip)
        for st in range(2):
            for l in (1, 3):
                load, opt, store = (_find(s, k, step=st, layer=l) for k in
                                    (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT))
                assert opt.stream.value == "compute" and load.id < opt.id < store.id
        assert all(op.stream.value == "cpu" for op in s.ops if op.kind is OpKind.OPT and op.layer not in (1, 3))


def test_loading_weights_before_the_device_update_is_done_is_caught():
    """The next step loads a device-updated layer from the new weights its OPT left on the device: a device copy on
    the compute stream, after that OPT in stream order (not after the STORE_OPT that copies them to the host);
    the same load over the h2d stream without a dependency on the OPT is caught."""
    s = _gpu_schedule()
    load = _find(s, OpKind.LOAD_W, step=1, layer=1)
    opt = _find(s, OpKind.OPT, step=0, layer=1)
    assert opt.stream is Stream.COMPUTE and load.stream is Stream.COMPUTE and opt.id < load.id
    assert _find(s, OpKind.STORE_OPT, step=0, layer=1).id not in load.deps
    assert _find(s, OpKind.LOAD_W, step=1, layer=2).stream is Stream.H2D  # a host-updated layer: over the wire
    moved = _replace(s, load, stream=Stream.H2D, deps=tuple(d for d in load.deps if d != opt.id))
    err = _broken(moved, "load-after-opt")
    assert "OPT s0 L1 @compute" in str(err)


def test_reusing_an_optimizer_slot_too_early_is_caught():
    # one step (no later load implies the dependency), updates as gradients arrive: layer 3's update is back on
    # the host before the backward reaches layer 2, so layer 1's LOAD_OPT reuses its slot after its STORE_OPT
    s = build_schedule(G, config(G, n_steps=1, n_mb=3, gpu_opt=(1, 2, 3), clip=False))
    verify(s, G)
    reuse = _find(s, OpKind.LOAD_OPT, step=0, layer=1)
    assert reuse.slot("o") == _find(s, OpKind.LOAD_OPT, step=0, layer=3).slot("o")
    war = tuple(d for d in reuse.deps if s.ops[d].kind is not OpKind.STORE_OPT)
    _broken(_replace(s, reuse, deps=war), "slot-overwritten")


def test_a_guard_before_every_gradient_is_stored_is_caught():
    s = _gpu_schedule(clip=True)  # clipping: the updates need the global norm, so every gradient of the step
    guard = _find(s, OpKind.GUARD, step=0, layer=0)
    last_host_store = max(op.id for op in s.ops if op.kind is OpKind.STORE_G and op.step == 0
                          and op.stream is Stream.D2H)
    assert guard.deps == (last_host_store,)  # (the compute stream's gradients precede it in stream order)
    err = _broken(_replace(s, guard, deps=()), "store-before-guard")
    assert "needs every gradient norm and loss" in str(err)


def test_an_update_that_does_not_wait_for_the_guard_is_caught():
    s = _gpu_schedule(clip=True)
    guard = _find(s, OpKind.GUARD, step=0, layer=0)
    host_opt = next(op for op in s.ops if op.kind is OpKind.OPT and op.step == 0 and op.stream is Stream.CPU)
    assert guard.id in host_opt.deps
    _broken(_replace(s, host_opt, deps=tuple(d for d in host_opt.deps if d != guard.id)), "guard-before-opt")


@pytest.mark.parametrize("clip", [True, False])
def test_a_step_without_its_guard_or_with_two_is_caught(clip):
    s = _gpu_schedule(clip=clip)
    guard = _find(s, OpKind.GUARD, step=1, layer=0)
    assert clip or not guard.deps  # without clipping it follows the step's last LOSS alone
    _broken(renumber(s, [op for op in s.ops if op.id != guard.id]), "complete")
    twice = [op for op in s.ops]
    twice.insert(guard.id + 1, dataclasses.replace(guard, id=-1))
    _broken(renumber(s, twice), "once")


def test_a_forward_that_does_not_wait_for_its_inputs_is_caught():
    s = _schedule()
    load = _find(s, OpKind.LOAD_IN, step=1, mb=2)
    assert load.stream is Stream.H2D and load.layer == 0
    fwd = _find(s, OpKind.FWD, step=1, layer=0, mb=2)
    assert load.id in fwd.deps  # on another queue: the dependency is what orders them
    # the head reads the labels: it follows the load too (here also through the forward chain)
    assert load.id in _find(s, OpKind.LOSS, step=1, mb=2).deps
    # the input load issued behind the step's first weight load (which the embedding's first forward waits for,
    # so that wait no longer covers it), and the forward's dependency on it dropped
    weights = _find(s, OpKind.LOAD_W, step=1, layer=0)
    assert weights.id > load.id
    ops = [dataclasses.replace(op, deps=tuple(d for d in op.deps if d != load.id)) if op.id == fwd.id else op
           for op in s.ops if op.id != load.id]
    ops.insert(next(i for i, op in enumerate(ops) if op.id == weights.id) + 1, load)
    err = _broken(renumber(s, ops), "input-before-use")
    assert "mb 2's inputs" in str(err)


def test_a_step_without_an_input_load_or_with_two_is_caught():
    s = _schedule()
    load = _find(s, OpKind.LOAD_IN, step=0, mb=1)
    err = _broken(renumber(s, [op for op in s.ops if op.id != load.id]), "complete")
    assert "never loads the inputs of mb 1" in str(err)
    twice = list(s.ops)
    twice.insert(load.id + 1, dataclasses.replace(load, id=-1))
    _broken(renumber(s, twice), "once")
    _broken(_replace(s, load, layer=1), "kind")
    _broken(_replace(s, load, stream=Stream.COMPUTE), "stream")


def test_an_evaluation_loads_its_inputs_first_on_the_copy_stream():
    s = build_schedule(G, config(G, n_steps=1, n_mb=2, train=False))
    verify(s, G)
    loads = [op for op in s.ops if op.kind is OpKind.LOAD_IN]
    assert [(op.step, op.mb) for op in loads] == [(0, 0), (0, 1)]
    assert [op.id for op in loads] == [0, 1]  # before the first weight load
    assert all(loads[op.mb].id in op.deps for op in s.ops if op.kind is OpKind.EVAL)
    _broken(renumber(s, s.ops[1:]), "complete")


def test_storing_the_gradient_before_its_optimizer_slot_is_loaded_is_caught():
    # every layer's weights stay in a slot through the step: no weight load after the LOAD_OPT orders it either
    s = _schedule(gpu_opt=(1, 3), clip=False, weight_slots=len(G))
    store = next(op for op in s.ops if op.kind is OpKind.STORE_G and op.step == 0 and op.layer == 3)
    assert store.stream.value == "compute" and store.slot("o") is not None
    _broken(_replace(s, store, deps=()), "slot-write-order")


def test_a_device_updated_gradient_sent_to_the_host_is_caught():
    s = _gpu_schedule(clip=False)
    store = next(op for op in s.ops if op.kind is OpKind.STORE_G and op.step == 0 and op.layer == 3)
    _broken(_replace(s, store, stream=Stream.D2H), "stream")


def test_a_device_update_of_a_layer_not_in_gpu_opt_is_caught():
    s = _gpu_schedule()
    _broken(Schedule(s.ops, dataclasses.replace(s.config, gpu_opt=(1,)), s.provenance), "kind")


def test_gpu_opt_takes_owners_only():
    g = tiny_graph(num_hidden_layers=2, tie_word_embeddings=True)
    head = len(g) - 1
    with pytest.raises(ValueError, match=rf"gpu_opt layers \[{head}\]: only layers that own their weights"):
        build_schedule(g, config(g, gpu_opt=(head,)))


@pytest.mark.parametrize("clip", [True, False])
def test_a_tied_embedding_updated_on_the_device_collects_both_gradient_parts(clip):
    """The tied head's gradient part reaches the owner's optimizer slot first (copied), the embedding's own part
    last (added); the slot is loaded before the first part and the update waits for the last."""
    g = tiny_graph(num_hidden_layers=3, tie_word_embeddings=True)
    head = len(g) - 1
    s = build_schedule(g, config(g, n_steps=2, n_mb=2, gpu_opt=(0, 2), clip=clip))
    verify(s, g)
    for st in range(2):
        parts = [op for op in s.ops if op.kind is OpKind.STORE_G and op.step == st and g.owner(op.layer) == 0]
        assert [op.layer for op in parts] == [head, 0] and all(op.stream is Stream.COMPUTE for op in parts)
        load = _find(s, OpKind.LOAD_OPT, step=st, layer=0)
        assert {op.slot("o") for op in parts} == {load.slot("o")} and load.id < parts[0].id
        assert _find(s, OpKind.OPT, step=st, layer=0).id > parts[1].id
    first = next(op for op in s.ops if op.kind is OpKind.STORE_G and op.layer == head)
    with pytest.raises(ScheduleError) as e:
        verify(_replace(s, first, stream=Stream.D2H), g)
    assert e.value.rule == "stream" and "into its optimizer slot" in str(e.value)


@pytest.mark.parametrize("tied", [True, False])
def test_with_clipping_a_head_updated_on_the_device_stores_its_gradient_last(tied):
    """The head's gradient waits in its slot (one more gradient slot) until the embedding's backward, so the
    device updates load their states blocks first, top down, and the two largest last; the step before stores
    them in that order. Without clipping the head stores right after its LOSS."""
    g = tiny_graph(num_hidden_layers=3, tie_word_embeddings=tied)
    head = len(g) - 1
    owners = tuple(l for l in range(len(g)) if g[l].tie is None)
    order = list(range(head - 1, 0, -1)) + ([0] if tied else [head, 0])
    s = build_schedule(g, config(g, n_steps=2, n_mb=2, gpu_opt=owners, clip=True))
    verify(s, g)
    for st in range(2):
        of = lambda kind: [op.layer for op in s.ops if op.kind is kind and op.step == st]  # noqa: E731
        assert of(OpKind.STORE_G)[-2:] == [head, 0]
        assert of(OpKind.LOAD_OPT) == order and of(OpKind.STORE_OPT) == order
    assert max(op.slot("g") for op in s.ops if op.kind is OpKind.STORE_G) == s.config.grad_slots
    plain = build_schedule(g, config(g, n_steps=2, n_mb=2, gpu_opt=owners, clip=False))
    verify(plain, g)
    stores = [op for op in plain.ops if op.kind is OpKind.STORE_G and op.step == 0]
    assert stores[0].layer == head and max(op.slot("g") for op in plain.ops if op.kind is OpKind.STORE_G) < 2


def test_without_clipping_state_loads_alternate_two_optimizer_slots():
    """Each update is stored before the next one's state loads, in program order; with one slot each load would
    wait for the store before it. Two slots: a load waits only for the store of the update two before."""
    g = tiny_graph(num_hidden_layers=4)
    owners = tuple(l for l in range(1, len(g) - 1))
    s = build_schedule(g, config(g, n_steps=1, n_mb=2, gpu_opt=owners, clip=False))
    verify(s, g)
    loads = [op for op in s.ops if op.kind is OpKind.LOAD_OPT]
    assert [op.slot("o") for op in loads] == [k % 2 for k in range(len(loads))] and len(loads) >= 3
    stores = {op.layer: op.id for op in s.ops if op.kind is OpKind.STORE_OPT}
    assert stores[loads[0].layer] not in loads[1].deps and stores[loads[0].layer] in loads[2].deps


def test_a_resident_state_overwritten_or_missing_is_caught():
    """Layers 1 and 3 keep their optimizer state on the device between steps (resident_opt): the set-up loads it
    into a slot of its own, no step loads or stores it."""
    s = _schedule(gpu_opt=(1, 2, 3), resident_opt=(1, 3))  # the set-up, then two steps
    assert [(op.kind, op.layer) for op in setup_ops(s)] == [(OpKind.KEEP_W, 1), (OpKind.KEEP_W, 2),
                                                            (OpKind.KEEP_W, 3), (OpKind.LOAD_OPT, 3),
                                                            (OpKind.LOAD_OPT, 1)]
    step = build_schedule(G, config(G, n_mb=3, gpu_opt=(1, 2, 3), resident_opt=(1, 3)))
    verify(step, G)
    # a step expects layer 1's state in its own slot: layer 3's first gradient store goes into it
    home = _find(step, OpKind.STORE_G, step=0, layer=1).slot("o")
    store3 = _find(step, OpKind.STORE_G, step=0, layer=3)
    err = _broken(_replace(step, store3, slots=tuple((r, home if r == "o" else k) for r, k in store3.slots)),
                  "resident")
    assert "share optimizer slots" in str(err)
    # another layer's state loaded into that slot (layer 2's, which goes to the host and back each step), and
    # everything layer 2 does with it there: layer 1's store then finds layer 2's state
    ops = [dataclasses.replace(op, slots=tuple((r, home if r == "o" else k) for r, k in op.slots))
           if op.layer == 2 and any(r == "o" for r, _ in op.slots) else op for op in step.ops]
    err = _broken(Schedule(tuple(ops), step.config, step.provenance), "slot-content")
    assert "expecting ('U', -1, 1)" in str(err), str(err)
    # the set-up's load of layer 3's state is dropped: the step's store finds nothing in the slot
    load = _find(s, OpKind.LOAD_OPT, step=0, layer=3)
    err = _broken(renumber(s, [op for op in s.ops if op is not load]), "slot-content")
    assert "nothing loaded it" in str(err)
    # a resident state stored back to the host in a step (a STORE_OPT that the plan does not have)
    opt = _find(s, OpKind.OPT, step=1, layer=3)
    extra = Op(len(s.ops), OpKind.STORE_OPT, Stream.D2H, 1, 3, slots=(("o", opt.slot("o")),), deps=(opt.id,))
    _broken(Schedule(s.ops + (extra,), s.config, s.provenance), "kind")
    # ... or loaded by a step, as if its slot did not hold it
    extra = Op(len(s.ops), OpKind.LOAD_OPT, Stream.H2D, 1, 3, slots=(("o", opt.slot("o")),), deps=(opt.id,))
    err = _broken(Schedule(s.ops + (extra,), s.config, s.provenance), "complete")
    assert "step 1 has a LOAD_OPT of layer 3" in str(err)


def test_kept_weights_set_up_copied_and_rewritten_in_order():
    """The weights of device-updated layers: each KEEP_W of the set-up once, ahead of the step's ops; a step's copy
    of them before its own update rewrites them."""
    s = _schedule(gpu_opt=(0, 2), weight_slots=4)
    keep = _find(s, OpKind.KEEP_W, layer=2)
    # twice, or after the first op of the step
    _broken(Schedule(s.ops + (dataclasses.replace(keep, id=len(s.ops)),), s.config, s.provenance), "kind")
    moved = [op for op in s.ops if op is not keep]
    moved.insert(len(setup_ops(s)) + 1, keep)
    _broken(renumber(s, moved), "kind")
    # for a layer updated on the host, or none for a device-updated one
    _broken(_replace(s, keep, layer=1), "kind")
    err = _broken(renumber(s, [op for op in s.ops if op is not keep]), "complete")
    assert "not those of every device-updated layer" in str(err)
    # a copy of the weights step 0 reads, made after step 0's update of layer 2 rewrote them
    copy = _find(s, OpKind.LOAD_W, step=1, layer=2, stream=Stream.COMPUTE)
    assert copy.id > _find(s, OpKind.OPT, step=0, layer=2).id
    _broken(_replace(s, copy, step=0), "kept-overwritten")


# ---- gradient placements: host gradient buffers (h), gradients kept on the device (NORM, k) -----------------
def _kept_schedule(**kw) -> Schedule:
    # layers 1..3 (blocks) keep their gradient on the device; the tied embedding and head cannot
    return _schedule(grad_kept=(1, 2, 3), **kw)


def test_kept_gradients_build_and_verify():
    s = _kept_schedule()
    norms = [op for op in s.ops if op.kind is OpKind.NORM]
    assert sorted((op.step, op.layer) for op in norms) == [(st, l) for st in range(2) for l in (1, 2, 3)]
    for st in range(2):  # each kept gradient's store comes after its norm, in the update pass, before its update
        first_opt = min(op.id for op in s.ops if op.kind is OpKind.OPT and op.step == st)
        last_bwd = max(op.id for op in s.ops if op.kind is OpKind.BWD and op.step == st)
        for l in (1, 2, 3):
            store = _find(s, OpKind.STORE_G, step=st, layer=l)
            assert last_bwd < store.id and store.slot("k") is not None and store.slot("g") is None
            assert _find(s, OpKind.NORM, step=st, layer=l).id in store.deps
        assert sum(1 for op in s.ops if op.kind is OpKind.STORE_G and op.step == st and op.id < first_opt
                   and op.layer in (1, 2, 3)) == 2  # two host buffers ahead of the updates, no more
    # the embedding, block 4 and the final norm store theirs during the backward, each into a buffer of its own;
    # the three kept gradients take turns in two more (the third in the buffer the embedding's update read)
    assert len({op.slot("h") for op in s.ops if op.kind is OpKind.OPT}) == 5
    assert _find(s, OpKind.STORE_G, step=0, layer=3).slot("h") == _find(s, OpKind.OPT, step=0, layer=0).slot("h")


def test_a_missing_norm_is_caught():
    s = _kept_schedule()
    norm = _find(s, OpKind.NORM, step=0, layer=2)
    _broken(renumber(s, [op for op in s.ops if op.id != norm.id]), "complete")


def test_a_norm_of_a_layer_not_kept_is_caught():
    s = _kept_schedule()
    norm = _find(s, OpKind.NORM, step=0, layer=2)
    err = _broken(Schedule(s.ops, dataclasses.replace(s.config, grad_kept=(1, 3)), s.provenance), "kind")
    assert "does not stay on the device" in str(err) and str(norm.id) in str(err)


def test_an_update_before_every_norm_is_taken_is_caught():
    """The last norm (layer 1's) and its store moved after the step's guard and first update, which no longer wait
    for it."""
    s = _kept_schedule()
    opt = min((op for op in s.ops if op.kind is OpKind.OPT and op.step == 0), key=lambda op: op.id)
    norm = _find(s, OpKind.NORM, step=0, layer=1)
    store = _find(s, OpKind.STORE_G, step=0, layer=1)
    assert norm.id in opt.deps and norm.id in store.deps and store.id < opt.id
    early = dataclasses.replace(opt, deps=tuple(d for d in opt.deps if d != norm.id))
    ops = [early if op.id == opt.id else op for op in s.ops if op.id not in (norm.id, store.id)]
    at = next(i for i, op in enumerate(ops) if op.id == opt.id) + 1
    ops[at:at] = [norm, store]
    guard = _find(s, OpKind.GUARD, step=0, layer=0)
    ops = [op for op in ops if op.id != guard.id]
    ops.insert(next(i for i, op in enumerate(ops) if op.id == opt.id),
               dataclasses.replace(guard, deps=tuple(d for d in guard.deps if d != norm.id)))
    assert "needs every gradient norm" in str(_broken(renumber(s, ops), "store-before-guard"))


def test_a_kept_gradient_read_from_the_wrong_slot_is_caught():
    s = _kept_schedule()
    a, b = (_find(s, OpKind.STORE_G, step=0, layer=l) for l in (1, 2))
    _broken(_replace(s, a, slots=tuple(("k", b.slot("k")) if r == "k" else (r, i) for r, i in a.slots)),
            "slot-content")


def test_a_host_buffer_overwritten_before_its_update_read_it_is_caught():
    s = _kept_schedule()
    # the third kept store reuses the buffer of the first kept update: without that dependency it may overwrite
    # the gradient the update still reads
    store = _find(s, OpKind.STORE_G, step=0, layer=3)
    reader = next(s.ops[d] for d in store.deps if s.ops[d].kind is OpKind.OPT)
    assert reader.slot("h") == store.slot("h")
    err = _broken(_replace(s, store, deps=tuple(d for d in store.deps if d != reader.id)), "slot-overwritten")
    assert "missing dependency" in str(err)


def test_an_update_reading_another_layers_host_buffer_is_caught():
    s = _schedule()
    a, b = (_find(s, OpKind.OPT, step=0, layer=l) for l in (1, 2))
    _broken(_replace(s, a, slots=(("h", b.slot("h")),)), "slot-content")


def test_kept_gradients_take_only_layers_updated_on_the_host_without_ties():
    for bad in ((0,), (6,)):  # the tied embedding, the tied head
        with pytest.raises(ValueError, match="grad_kept"):
            build_schedule(G, config(G, n_mb=3, grad_kept=bad))
    with pytest.raises(ValueError, match="only with clipping"):
        build_schedule(G, config(G, n_mb=3, grad_kept=(1,), clip=False))
    with pytest.raises(ValueError, match="grad_kept"):
        build_schedule(G, config(G, n_mb=3, grad_kept=(1,), gpu_opt=(1,)))


def test_a_write_back_schedule_stores_each_resident_state_once_from_its_slot():
    s = write_back_schedule(G, {3: 1, 1: 0})
    verify(s, G)
    assert [(op.kind, op.stream, op.layer, op.slot("o")) for op in s.ops] == [
        (OpKind.STORE_OPT, Stream.D2H, 1, 0), (OpKind.STORE_OPT, Stream.D2H, 3, 1)]
    assert Schedule.from_text(s.to_text()) == s
    _broken(renumber(s, s.ops[:1]), "complete")
    _broken(renumber(s, [s.ops[0], s.ops[0], s.ops[1]]), "once")
    _broken(_replace(s, s.ops[1], layer=2), "kind")  # not kept on the device
    _broken(_replace(s, s.ops[1], kind=OpKind.LOAD_OPT, stream=Stream.H2D), "kind")
    _broken(_replace(s, s.ops[1], slots=(("o", 0),)), "slots")


@pytest.mark.parametrize("train", [True, False])
def test_a_loss_copy_before_the_last_loss_or_missing_or_twice_is_caught(train):
    s = _schedule() if train else build_schedule(G, config(G, n_steps=2, n_mb=3, train=False))
    head = OpKind.LOSS if train else OpKind.EVAL
    out = _find(s, OpKind.LOSS_OUT, step=1)
    last = _find(s, head, step=1, mb=2)
    assert out.stream is Stream.D2H and out.layer == len(G) - 1 and out.id == last.id + 1 and last.id in out.deps
    err = _broken(_replace(s, out, deps=tuple(d for d in out.deps if d != last.id)), "loss-before-copy")
    assert f"'{last}'" in str(err)
    _broken(renumber(s, [op for op in s.ops if op.id != out.id]), "complete")
    twice = list(s.ops)
    twice.insert(out.id + 1, dataclasses.replace(out, id=-1))
    _broken(renumber(s, twice), "once")
