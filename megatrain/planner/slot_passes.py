"""The passes that give ops their slots: optimizer slots, weight slots (inserting the weight loads, up to
``PREFETCH_LAYERS`` layers ahead), activation, gradient, kept-gradient and host gradient buffers, each allocated
over the uses in program order. Pure ``(Schedule, LayerGraph) -> Schedule`` like the rest
(:mod:`megatrain.planner.passes`)."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable

from megatrain.ir import FORWARDS, LayerGraph, Op, OpKind, Schedule, ScheduleConfig
from megatrain.planner.cost import grad_slot_count, weights_kept
from megatrain.planner.op_edits import CPU, D2H, H2D, C, Ids, add_deps, edit, insert_after, opt_owner


def _opt_uses(graph: LayerGraph, resident: set[int]) -> Callable[[Op], list[tuple[str, tuple, bool]]]:
    def uses(op: Op) -> list[tuple[str, tuple, bool]]:
        o = opt_owner(graph, op)
        if o is None or o in resident:
            return []
        return [("o", (op.step, o, op.mb), op.kind is OpKind.LOAD_OPT)]  # (mb: a split update's part)

    return uses


def assign_opt_slots(s: Schedule, graph: LayerGraph) -> Schedule:
    """Optimizer slots for the device updates: one per update in flight (from its LOAD_OPT to its STORE_OPT), and
    at least two where there are two updates, so a state load never waits for the store of the update before it
    (in program order that store frees the only slot just before the next load: with one slot the updates of a
    step without clipping ran one after another, 0.026 s per pair of layers measured on the H200, where a step of
    a longer schedule, which finds the slots of the step before, alternates two)."""
    cfg = s.config
    if not cfg.gpu_opt and not cfg.split_opt:
        return s.with_ops(s.ops, "assign_opt_slots: every update on the host")
    # a resident layer's state has slot i (its place in resident_opt) for good; the others share the slots after
    own = {l: i for i, l in enumerate(cfg.resident_opt)}
    moving = len(cfg.gpu_opt) - len(own) + 2 * bool(cfg.split_opt)
    ops, n = _allocate(list(s.ops), _opt_uses(graph, set(own)), pool=min(2, moving))
    out = []
    for op in ops:
        o = opt_owner(graph, op)
        if o in own:
            op = edit(op, slots=op.slots + (("o", own[o]),))
        elif o is not None:
            op = edit(op, slots=tuple((r, k + len(own)) if r == "o" else (r, k) for r, k in op.slots))
        out.append(op)
    kept = f", {len(own)} of them holding a resident state" if own else ""
    return s.with_ops(out, f"assign_opt_slots: {n + len(own)} optimizer slots{kept}")


PREFETCH_LAYERS = 2  # how many layers ahead of its first reader a weight load may be issued


def assign_weight_slots(s: Schedule, graph: LayerGraph) -> Schedule:
    """Give each compute op a weight slot and insert the LOAD_W ops that fill them.

    A layer still resident is not loaded again (the turn from forward to backward). When a slot must be reused,
    the evicted content is the one needed farthest in the future (Belady), and its LOAD_W goes right after the
    last reader of what it evicts, so it prefetches as early as the slot allows — but no more than
    ``PREFETCH_LAYERS`` layers ahead of its first reader: a load waits for the layer's update of the step before,
    and issuing it far ahead (with a slot per layer, every load at the step's start) would hold back the compute
    ops behind it in program order. LOAD_W of step s+1 waits for the owner's OPT of step s (a device update's
    OPT leaves the new weights on the device: that load is a device copy, see ``cost.loads_from_device``).
    """
    cfg = s.config
    ops = list(s.ops)
    ids = Ids(ops)
    pos = {op.id: i for i, op in enumerate(ops)}
    # the op after which a layer's new weights can be loaded: its OPT (on the host, or on the device, which keeps
    # the new weights there for the next step's load)
    # (a split update's: its last STORE_OPT, which writes the new weights to the host)
    split = set(cfg.split_opt)
    opt_of = {(op.step, op.layer): op for op in ops
              if op.kind is OpKind.OPT or op.kind is OpKind.STORE_OPT and op.layer in split}
    computes = [op for op in ops if op.kind in (*FORWARDS, OpKind.BWD, OpKind.LOSS, OpKind.EVAL)]
    inputs = {op.step: op for op in ops if op.kind is OpKind.LOAD_IN}  # each step's last input load
    content = [(op.step, graph.owner(op.layer)) for op in computes]
    step_start: dict[int, int] = {}
    for i, op in enumerate(computes):
        step_start.setdefault(op.step, i)
    ahead = PREFETCH_LAYERS * cfg.n_mb  # compute ops a load may run ahead of its first reader
    next_use: list[float] = [float("inf")] * len(computes)  # position in `computes` of the next use of content
    seen: dict[tuple, int] = {}
    for i in range(len(computes) - 1, -1, -1):
        next_use[i] = seen.get(content[i], float("inf"))
        seen[content[i]] = i

    slots: list[tuple | None] = [None] * cfg.weight_slots  # content per slot
    upcoming: list[float] = [float("inf")] * cfg.weight_slots  # next use of each slot's content
    last_reader: list[Op | None] = [None] * cfg.weight_slots
    size = [0] * cfg.weight_slots  # parameters of the largest layer each slot has held
    loader: list[Op | None] = [None] * cfg.weight_slots
    after: dict[int | None, list[Op]] = defaultdict(list)
    prev_load_anchor = None
    new_ops: dict[int, Op] = {}
    n_loads = 0
    for i, op in enumerate(computes):
        c = content[i]
        deps: tuple[int, ...] = ()
        if c in slots:
            k = slots.index(c)
        else:
            empty = [k for k in range(cfg.weight_slots) if slots[k] is None]
            # Belady; among slots whose contents are needed equally late (none again this step: the next step's
            # weights are new ones), one already as large as the layer (a slot is sized for the largest layer it
            # holds), then the one its last reader freed first, so the load can start soonest and the slots take
            # turns instead of one slot's load waiting for the compute op just before it
            need = graph.weight_params(c[1])
            k = empty[0] if empty else max(range(cfg.weight_slots), key=lambda k: (
                upcoming[k], size[k] >= need, -pos[last_reader[k].id], -k))
            anchors = [a for a in (last_reader[k], prev_load_anchor) if a is not None]
            war = [last_reader[k].id] if last_reader[k] is not None else []
            opt = opt_of.get((c[0] - 1, c[1]))
            if opt is not None:
                anchors.append(opt)
            if i - ahead >= step_start[op.step]:
                anchors.append(computes[i - ahead])
            # (none: behind the step's input loads, which go first on the copy stream)
            anchor = max(anchors, key=lambda a: pos[a.id]) if anchors else inputs.get(op.step)
            # weights a device update of the step before left on the device: a device copy, on the compute stream
            # (in the h2d queue it would wait behind optimizer-state loads that wait for the wire)
            load = Op(ids(), OpKind.LOAD_W, C if weights_kept(cfg, c[1]) else H2D, op.step, op.layer, slots=(("w", k),),
                      deps=tuple(war) + ((opt.id,) if opt is not None else ()))
            after[anchor.id if anchor is not None else None].append(load)
            prev_load_anchor = anchor
            slots[k], loader[k] = c, load
            size[k] = max(size[k], graph.weight_params(c[1]))
            deps = (load.id,)
            n_loads += 1
        upcoming[k] = next_use[i]
        last_reader[k] = op
        new_ops[op.id] = add_deps(edit(op, slots=(("w", k),) + op.slots), deps)
    out = insert_after([new_ops.get(op.id, op) for op in ops], after)
    return s.with_ops(out, f"assign_weight_slots: {cfg.weight_slots} slots, {n_loads} loads")


# Activation buffers: A(step, layer, mb, copy) is the checkpoint at the input of `layer`; copy 0 is the one FWD made,
# copy 1 the one LOAD_ACT brought back, copy 2 the one a REFWD made again (a checkpoint the forward dropped).
# BWD/LOSS overwrite it in place with the input's gradient, which the backward of the layer below reads as `dy`.
def _activation_uses(cfg: ScheduleConfig, graph: LayerGraph) -> Callable[[Op], list[tuple[str, tuple, bool]]]:
    def copy(layer: int, backward: bool) -> int:
        if backward and cfg.dropped(layer):
            return 2
        return 1 if backward and 1 <= layer <= cfg.host_checkpoints else 0

    def uses(op: Op) -> list[tuple[str, tuple, bool]]:  # (role, buffer key, starts the buffer)
        st, l, j = op.step, op.layer, op.mb
        if op.kind is OpKind.FWD:
            out = [("x", (st, l, j, 0), False)] if l > 0 else []
            return out + [("y", (st, l + 1, j, 0), True)]
        if op.kind is OpKind.REFWD:
            out = [("x", (st, l, j, copy(l, True)), False)] if l > 0 else []
            return out + [("y", (st, l + 1, j, 2), True)]
        if op.kind is OpKind.SAVE_ACT:
            return [("a", (st, l, j, 0), False)]
        if op.kind is OpKind.LOAD_ACT:
            return [("a", (st, l, j, 1), True)]
        if op.kind in (OpKind.LOSS, OpKind.EVAL):
            return [("x", (st, l, j, 0), False)]
        if op.kind is OpKind.BWD:
            out = [("x", (st, l, j, copy(l, True)), False)] if l > 0 else []
            return out + [("dy", (st, l + 1, j, copy(l + 1, True)), False)]
        return []

    return uses


def _grad_uses(kept: set[int]) -> Callable[[Op], list[tuple[str, tuple, bool]]]:
    def uses(op: Op) -> list[tuple[str, tuple, bool]]:
        if op.kind in (OpKind.BWD, OpKind.LOSS):
            return [("g", (op.step, op.layer), op.mb == 0)]
        if op.kind is OpKind.NORM or op.kind is OpKind.STORE_G and op.layer not in kept:
            return [("g", (op.step, op.layer), False)]
        return []

    return uses


def _kept_uses(op: Op) -> list[tuple[str, tuple, bool]]:
    if op.kind is OpKind.NORM:
        return [("k", (op.step, op.layer), True)]
    if op.kind is OpKind.STORE_G or op.kind is OpKind.OPT and op.stream is C:  # (a split update's, in parts)
        return [("k", (op.step, op.layer), False)]
    return []


def _allocate(ops: list[Op], uses: Callable[[Op], list[tuple[str, tuple, bool]]], pool: int = 0,
              limit: int | None = None, affinity: Callable[[tuple], object] | None = None) -> tuple[list[Op], int]:
    """Program-order slot allocation. A buffer holds its slot from the op that starts it to its last user; the op
    that next starts a buffer in that slot depends on every user of the previous one (write-after-read).

    Free slots are reused first-freed-first (``pool`` slots are free at the start), so a new buffer waits on the
    readers that finished longest ago; a slot is added only when none is free. With ``affinity`` (buffer key ->
    class), a buffer takes the slot its class had last where that one is free (each layer's gradient in the same
    host buffer step after step, so buffers are sized for one layer each). Returns the ops and slots used.
    """
    last_of: dict[object, int] = {}  # affinity class -> the slot it had last
    all_uses = [uses(op) for op in ops]
    last_user: dict[tuple, int] = {}
    for op, u in zip(ops, all_uses):
        for _, key, _ in u:
            last_user[key] = op.id
    free: deque[int] = deque(range(pool))
    n_slots = pool
    slot_of: dict[tuple, int] = {}
    prev_users: dict[int, list[Op]] = defaultdict(list)  # slot -> users of the buffer it held last
    used = set()
    out = []
    for op, u in zip(ops, all_uses):
        if not u:
            out.append(op)
            continue
        roles, deps = [], []
        for role, key, starts in u:
            if starts:
                mine = last_of.get(affinity(key)) if affinity is not None else None
                if mine is not None and mine in free:
                    free.remove(mine)
                    k = mine
                elif free:
                    k = free.popleft()
                else:
                    k, n_slots = n_slots, n_slots + 1
                    if limit is not None and n_slots > limit:
                        raise AssertionError(f"{n_slots} slots needed, {limit} allowed")
                deps += [p.id for p in prev_users[k]]
                prev_users[k] = []
                slot_of[key] = k
                used.add(k)
                if affinity is not None:
                    last_of[affinity(key)] = k
            if key not in slot_of:
                raise AssertionError(f"op {op} uses buffer {key} before anything starts it")
            k = slot_of[key]
            prev_users[k].append(op)
            roles.append((role, k))
        for _, key, _ in u:
            if last_user[key] == op.id and key in slot_of:
                free.append(slot_of.pop(key))
        if deps:
            deps = tuple(dict.fromkeys((*op.deps, *(d for d in deps if d != op.id))))
        out.append(Op(op.id, op.kind, op.stream, op.step, op.layer, op.mb, op.slots + tuple(roles), deps or op.deps))
    return out, len(used)


def assign_activation_slots(s: Schedule, graph: LayerGraph) -> Schedule:
    ops, n = _allocate(list(s.ops), _activation_uses(s.config, graph))
    return s.with_ops(ops, f"assign_activation_slots: {n} activation slots")


def assign_grad_slots(s: Schedule, graph: LayerGraph) -> Schedule:
    """Gradient slots (``grad_slots``: the backward's fp32 sums), and a kept-gradient slot for each gradient that
    stays on the device until the update pass, from its NORM to its STORE_G."""
    k = grad_slot_count(graph, s.config)
    kept = set(s.config.grad_kept)
    ops, n = _allocate(list(s.ops), _grad_uses(kept), pool=k, limit=k)
    note = f"assign_grad_slots: {n} of {k} gradient slots"
    if kept:
        readers = (OpKind.NORM, OpKind.STORE_G, OpKind.OPT)  # (an OPT reading one: a split update's)
        kept_ops, m = _allocate([op for op in ops if op.kind in readers and op.layer in kept and op.stream is not CPU],
                                _kept_uses, affinity=lambda key: key[1])
        by_id = {op.id: op for op in kept_ops}
        ops = [by_id.get(op.id, op) for op in ops]
        note += f", {m} kept-gradient slots"
    return s.with_ops(ops, note)


def _host_grad_uses(graph: LayerGraph, kept: set[int]) -> Callable[[Op], list[tuple[str, tuple, bool]]]:
    def uses(op: Op) -> list[tuple[str, tuple, bool]]:
        if op.kind is OpKind.STORE_G and op.stream is D2H and graph.owner(op.layer) == op.layer:
            return [("h", (op.step, op.layer, op.mb), True)]
        if op.kind is OpKind.OPT and op.stream is CPU or op.kind is OpKind.CHECK:
            return [("h", (op.step, op.layer, op.mb), False)]
        if op.kind is OpKind.LOAD_OPT and op.mb is not None and op.layer not in kept:  # a split update's part
            return [("h", (op.step, op.layer, None), False)]
        return []

    return uses


def assign_host_grad_slots(s: Schedule, graph: LayerGraph) -> Schedule:
    """Host gradient buffers for the gradients that go to the host: each from its STORE_G to the OPT that reads
    it. With clipping a gradient stored during the backward holds its buffer until the update pass (one buffer per
    such layer); gradients that pass through (without clipping, or kept on the device until the update pass) take
    turns in ``host_grad_slots`` buffers."""
    cfg = s.config
    ops, n = _allocate(list(s.ops), _host_grad_uses(graph, set(cfg.grad_kept)), pool=cfg.host_grad_slots,
                       affinity=lambda key: key[1:])
    kind = "bf16" if cfg.grad_host_bytes == 2 else "fp32"
    return s.with_ops(ops, f"assign_host_grad_slots: {n} host gradient buffers ({kind})")
