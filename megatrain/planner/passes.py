"""Passes that build the default plan. Each is a pure ``(Schedule, LayerGraph) -> Schedule`` with a verb name.

Order (see :func:`build_schedule`): compute ops -> checkpoint transfers -> gradient stores -> optimizer ops ->
weight slots (inserts the loads) -> activation slots -> gradient slots. Ops carry unique ids while passes insert;
:func:`finalize` renumbers them so that ``id == position`` and every dependency points backwards.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import replace

from megatrain.ir import LayerGraph, Op, OpKind, Schedule, ScheduleConfig, Stream, resident_slots
from megatrain.planner.carried import unroll
from megatrain.planner.checks import check_dropped, check_grad_kept, check_speculate, check_split_opt
from megatrain.planner.cost import defers_head_store
from megatrain.planner.op_edits import (CPU, D2H, H2D, C, Ids, add_deps, by_compute_key, compute_key, finalize,
                                        insert_after)
from megatrain.planner.slot_passes import (PREFETCH_LAYERS, assign_activation_slots, assign_grad_slots,
                                           assign_host_grad_slots, assign_opt_slots, assign_weight_slots)


def emit_compute(s: Schedule, graph: LayerGraph) -> Schedule:
    """Layer-major compute: each micro-batch's inputs to the device (LOAD_IN, h2d), FWD of layers 0..L-2 over all
    mbs, LOSS of the head per mb, BWD of L-2..0 (each behind the REFWD that makes its checkpoint again where the
    forward dropped it; a run of them made again from the kept one below it ahead of its top layer's BWD)."""
    cfg = s.config
    check_dropped(graph, cfg)
    L, M = len(graph), cfg.n_mb
    ops: list[Op] = []
    ids = Ids(s.ops)
    at: dict[tuple, int] = {}

    def emit(kind: OpKind, step: int, layer: int, mb: int, deps: tuple, stream: Stream = C) -> None:
        op = Op(ids(), kind, stream, step, layer, mb, deps=tuple(at[d] for d in deps if d in at))
        at[(kind, step, layer, mb)] = op.id
        ops.append(op)

    for st in range(cfg.n_steps):
        for j in range(M):  # the inputs first (the embedding reads the tokens, the head the labels)
            emit(OpKind.LOAD_IN, st, 0, j, (), H2D)
        for l in range(L - 1):
            for j in range(M):
                emit(OpKind.FWD, st, l, j, ((OpKind.FWD, st, l - 1, j), (OpKind.LOAD_IN, st, l, j)))
        head = OpKind.LOSS if cfg.train else OpKind.EVAL  # an evaluation: the loss, no backward
        for j in range(M):
            emit(head, st, L - 1, j, ((OpKind.FWD, st, L - 2, j), (OpKind.LOAD_IN, st, 0, j)))
        if not cfg.train:
            continue
        for l in range(L - 2, -1, -1):
            for j in range(M):
                up = (OpKind.LOSS if l + 1 == L - 1 else OpKind.BWD, st, l + 1, j)
                if cfg.dropped(l) and not cfg.dropped(l + 1):  # the top of a run of dropped checkpoints: the run
                    # made again from the kept one below it, a layer's forward at a time
                    k = l - 1
                    while cfg.dropped(k):
                        k -= 1
                    for m in range(k, l):
                        emit(OpKind.REFWD, st, m, j, ((OpKind.FWD, st, m, j), up, (OpKind.REFWD, st, m - 1, j)))
                remade = (OpKind.REFWD, st, l - 1, j)
                emit(OpKind.BWD, st, l, j, (up, (OpKind.FWD, st, l, j), remade))
    what = "" if cfg.train else " (an evaluation)"
    return s.with_ops(list(s.ops) + ops, f"emit_compute: {len(ops)} compute and input ops, {cfg.n_steps} step(s) x {M} mb{what}")


def add_checkpoint_transfers(s: Schedule, graph: LayerGraph) -> Schedule:
    """Offload the checkpoints at the input of layers 1..host_checkpoints (not those the forward drops): SAVE_ACT
    right after the FWD that made it; LOAD_ACT one layer ahead of its first reader in the backward (just before the
    backward of the layer above; where a run of dropped ones is above it, of the layer above the run, since the
    run's REFWDs read it first)."""
    cfg = s.config
    if cfg.host_checkpoints == 0:
        return s.with_ops(s.ops, "add_checkpoint_transfers: every checkpoint stays on the device")
    L, ids = len(graph), Ids(s.ops)
    ops = list(s.ops)
    idx = by_compute_key(ops)
    after: dict[int | None, list[Op]] = defaultdict(list)
    before: dict[int, list[Op]] = defaultdict(list)
    loaded: dict[tuple, int] = {}
    for st in range(cfg.n_steps):
        for l in cfg.offloaded():
            for j in range(cfg.n_mb):
                made = idx[(OpKind.FWD, st, l - 1, j)]
                save = Op(ids(), OpKind.SAVE_ACT, D2H, st, l, j, deps=(made.id,))
                after[made.id].append(save)
                load = Op(ids(), OpKind.LOAD_ACT, H2D, st, l, j, deps=(save.id,))
                a = l + 1  # ahead of the backward above it, or of the run of dropped ones above that it remakes
                while cfg.dropped(a):
                    a += 1
                above = idx[(OpKind.LOSS if a == L - 1 else OpKind.BWD, st, a, j)]
                before[above.id].append(load)
                loaded[(OpKind.BWD, st, l, j)] = loaded[(OpKind.REFWD, st, l, j)] = load.id
    out = []
    for op in ops:
        out.extend(before.get(op.id, ()))
        dep = loaded.get(compute_key(op))
        out.append(add_deps(op, (dep,)) if dep is not None else op)
        out.extend(after.get(op.id, ()))
    n = len(cfg.offloaded()) * cfg.n_mb * cfg.n_steps
    return s.with_ops(out, f"add_checkpoint_transfers: {n} checkpoints of layers 1..{cfg.host_checkpoints} via host")


def add_grad_stores(s: Schedule, graph: LayerGraph) -> Schedule:
    """STORE_G of each layer right after its last micro-batch's backward (a tied head stores into its owner): to
    the host (d2h), or, for a layer updated on the device, into its optimizer slot (a copy on the compute stream).
    The head's goes in right before the embedding's when ``cost.defers_head_store``. A layer in ``grad_kept``
    gets a NORM there instead; its store goes into the update pass (:func:`add_optimizer`)."""
    cfg = s.config
    ids, after = Ids(s.ops), defaultdict(list)
    last, head = cfg.n_mb - 1, len(graph) - 1
    on_gpu, kept = set(cfg.gpu_opt), set(cfg.grad_kept)
    check_grad_kept(graph, cfg)
    defer = defers_head_store(graph, cfg)
    held = {}  # step -> the head's deferred store
    for op in s.ops:
        if op.kind in (OpKind.BWD, OpKind.LOSS) and op.mb == last:
            if op.layer in kept:
                store = Op(ids(), OpKind.NORM, C, op.step, op.layer, deps=(op.id,))
            else:
                stream = C if graph.owner(op.layer) in on_gpu else D2H
                store = Op(ids(), OpKind.STORE_G, stream, op.step, op.layer, deps=(op.id,))
            if defer and op.layer == head:
                held[op.step] = store
                continue
            if op.layer == 0 and op.step in held:
                after[op.id].append(held.pop(op.step))
            after[op.id].append(store)
    n = sum(len(v) for v in after.values()) - len(kept) * cfg.n_steps
    where = "; the head's after the embedding's backward" if defer else ""
    if kept:
        where += f"; layers {sorted(kept)} keep theirs on the device (NORM)"
    return s.with_ops(insert_after(list(s.ops), after), f"add_grad_stores: {n} gradient stores{where}")


def add_optimizer(s: Schedule, graph: LayerGraph) -> Schedule:
    """One update per owning layer per step: OPT on the cpu stream, or, for the layers in ``gpu_opt``, LOAD_OPT
    (h2d) -> OPT (compute) -> STORE_OPT (d2h); for the layers in ``resident_opt``, OPT alone (the set-up loads
    their state: :func:`setup_schedule`).

    Every OPT follows the step's GUARD (the global norm, the loss, the clip factor; ``OpKind.GUARD``): with
    clipping after the step's last gradient norm, without it after its last LOSS; except the host updates of the
    layers in ``speculate``, each right after its gradient's store, with a CHECK after the guard that validates it
    (after the step's other updates: on a step that is not clipped it has nothing to do). clip: after the step's last
    STORE_G (the global norm needs every gradient), in layer order 0..L-1 so the next
    step's forward can start on the first layers while the rest update. Otherwise: as soon as the layer's gradients
    (its own and a tied layer's) are stored, overlapping the backward. A device update's LOAD_OPT (master weights
    and moments, which the step's gradients do not change) goes after the first backward op of the layer above, so
    it loads while the backward works its way down and the gradient can go straight into the optimizer slot; with
    clipping earlier (see below).
    """
    cfg = s.config
    if not cfg.train:
        return s.with_ops(s.ops, "add_optimizer: an evaluation updates nothing")
    ids, after = Ids(s.ops), defaultdict(list)
    stores = defaultdict(list)  # (step, owner) -> STORE_G ops
    last_store: dict[tuple[int, Stream], Op] = {}  # (step, stream) -> the step's last store on that stream
    first_bwd = {}  # (step, layer) -> the layer's first backward op (BWD or LOSS of micro-batch 0)
    first_fwd = {}  # (step, layer) -> the layer's first forward op
    norms = {}  # (step, layer) -> the NORM of a gradient kept on the device
    last_loss: dict[int, Op] = {}  # step -> its last LOSS
    for op in s.ops:
        if op.kind is OpKind.LOSS:
            last_loss[op.step] = op
        if op.kind is OpKind.STORE_G:
            stores[(op.step, graph.owner(op.layer))].append(op)
            last_store[(op.step, op.stream)] = op
        elif op.kind is OpKind.NORM:
            norms[(op.step, op.layer)] = op
            last_store[(op.step, op.stream)] = op
        elif op.kind in (OpKind.BWD, OpKind.LOSS) and op.mb == 0:
            first_bwd[(op.step, op.layer)] = op
        elif op.kind is OpKind.FWD:  # above the head: its LOAD_OPT goes after the step's last forward
            first_bwd[(op.step, len(graph))] = op
            first_fwd.setdefault((op.step, op.layer), op)
    on_gpu = set(cfg.gpu_opt)
    bad = sorted(l for l in on_gpu
                 if not 0 <= l < len(graph) or graph[l].tie is not None or len(graph.tied_to(l)) > 1
                 or graph[l].frozen)
    if bad:
        raise ValueError(f"gpu_opt layers {bad}: only layers that own their weights, shared with at most one other "
                         f"layer (a tied head), and have parameters to train can be updated on the device")
    split = set(cfg.split_opt)
    check_split_opt(graph, cfg)
    check_speculate(graph, cfg)
    spec = set(cfg.speculate)
    prev_split: dict[tuple[int, int], Op] = {}  # (layer, part) -> its STORE_OPT of the step before
    resident = set(cfg.resident_opt)
    if not resident <= on_gpu:
        raise ValueError(f"resident_opt layers {sorted(resident - on_gpu)} are not updated on the device (gpu_opt "
                         f"{list(cfg.gpu_opt)}): only a device update's state can stay on the device")
    pos = {op.id: i for i, op in enumerate(s.ops)}
    prev_store_opt: dict[int, Op] = {}  # layer -> its STORE_OPT of the step before (the host block it rewrites)
    loaded: dict[int, int] = {}  # id of a STORE_G into an optimizer slot -> the LOAD_OPT that fills the slot
    # the layer whose backward a device update's first gradient store follows (the layer above it: the first of
    # its layers the backward reaches, unless the head's store waits for the end of the backward); the backward
    # needs the states in this order (at a tie, the head's first)
    top = {l: max([l, *graph.tied_to(l)]) for l in on_gpu}
    head_owner = graph.owner(len(graph) - 1) if defers_head_store(graph, cfg) else None
    need = {l: 0 if l == head_owner else top[l] for l in on_gpu}
    backward_order = sorted(on_gpu, key=lambda l: (-need[l], -top[l]))
    # with clipping every device update's slot is in use until after the backward anyway, so its state loads as
    # early as the wire allows: in the order the backward needs it, once the forward has issued its last load of a
    # host-updated layer's weights (the other layers' weights stay on the device)
    host_read = [l for l in range(len(graph)) if graph.owner(l) not in on_gpu]
    early = max(max(host_read, default=0) - PREFETCH_LAYERS, 0)
    for st in range(cfg.n_steps):
        for l in backward_order:
            if l in resident:  # its state is in its slot (the set-up loaded it)
                continue
            prev = prev_store_opt.get(l)
            load = Op(ids(), OpKind.LOAD_OPT, H2D, st, l, deps=(prev.id,) if prev is not None else ())
            anchor = first_fwd[(st, early)] if cfg.clip else first_bwd[(st, need[l] + 1)]
            after[anchor.id].append(load)
            for store in stores[(st, l)]:  # the tied layer's part too
                loaded[store.id] = load.id
        owners = [l for l in range(len(graph)) if graph[l].tie is None]
        ends = [op for (step, _), op in last_store.items() if step == st]
        last = max(ends, key=lambda op: pos[op.id])
        if not cfg.clip:  # in the order their gradients are complete
            owners.sort(key=lambda l: pos[stores[(st, l)][-1].id])
        else:  # host updates in layer order (the next forward's); device updates, whose new weights stay on the
            # device, in the order the next backward loads their state back (backward_order)
            owners = [l for l in owners if l not in on_gpu] + backward_order
        # the kept gradients go to the host in update order, each ``host_grad_slots`` updates ahead of its own:
        # a store into a host buffer follows the update that read it before (see assign_host_grad_slots)
        # (a part at a time where the plan cuts them in parts: ScheduleConfig.host_grad_part)
        kept = [(l, p) for l in owners if l in cfg.grad_kept and l not in split
                for p in cfg.parts(l, graph[l].params)]
        kept_stores = {(l, p): Op(ids(), OpKind.STORE_G, D2H, st, l, p, deps=(norms[(st, l)].id,)) for l, p in kept}
        ahead = max(1, cfg.host_grad_slots)
        # the step's guard, before its first update: with clipping after every gradient's norms; without it, right
        # after the step's last LOSS (it needs the losses alone, and waiting there for a gradient store would hold
        # up the backward behind it on the compute stream)
        guard = Op(ids(), OpKind.GUARD, C, st, 0, deps=tuple(op.id for op in ends) if cfg.clip else ())
        after[(last if cfg.clip else last_loss[st]).id].append(guard)
        after[last.id].extend(kept_stores[u] for u in kept[:ahead])
        checks = []  # the CHECKs of the updates made before the guard: after every other update of the step
        for l in owners:
            anchor = last if cfg.clip else stores[(st, l)][-1]
            deps = (tuple(op.id for op in ends) if cfg.clip else tuple(o.id for o in stores[(st, l)])) + (guard.id,)
            if l in split:
                after[anchor.id].extend(_split_update(cfg, graph, st, l, ids, deps, stores[(st, l)], prev_split))
                continue
            if l in spec:  # as soon as its gradient is on the host, without the guard; checked after it
                opt = Op(ids(), OpKind.OPT, CPU, st, l, deps=tuple(o.id for o in stores[(st, l)]))
                after[stores[(st, l)][-1].id].append(opt)
                checks.append(Op(ids(), OpKind.CHECK, CPU, st, l, deps=(guard.id, opt.id)))
                continue
            if l not in on_gpu:
                for p in cfg.parts(l, graph[l].params):
                    own = (kept_stores[(l, p)].id,) if (l, p) in kept_stores else ()
                    after[anchor.id].append(Op(ids(), OpKind.OPT, CPU, st, l, p, deps=deps + own))
                    if (l, p) in kept_stores and kept.index((l, p)) + ahead < len(kept):
                        after[anchor.id].append(kept_stores[kept[kept.index((l, p)) + ahead]])
                continue
            opt = Op(ids(), OpKind.OPT, C, st, l, deps=deps)
            after[anchor.id].append(opt)
            if l not in resident:
                prev_store_opt[l] = Op(ids(), OpKind.STORE_OPT, D2H, st, l, deps=(opt.id,))
                after[anchor.id].append(prev_store_opt[l])
        after[last.id].extend(checks)
    mode = "after the step's last gradient, layer order (exact clipping)" if cfg.clip else "as gradients arrive"
    where = f"; on the device: layers {list(cfg.gpu_opt)}" if cfg.gpu_opt else ""
    if split:
        where += f"; split to the device, state streamed in parts: layers {list(cfg.split_opt)}"
    if resident:
        where += f", the state of {list(cfg.resident_opt)} staying there"
    if spec:
        where += f"; before the guard, checked after it: layers {list(cfg.speculate)}"
    ops = [add_deps(op, (loaded[op.id],)) if op.id in loaded else op for op in s.ops]
    return s.with_ops(insert_after(ops, after), f"add_optimizer: OPT {mode}{where}")


def _split_update(cfg: ScheduleConfig, graph: LayerGraph, st: int, l: int, ids: Ids, deps: tuple[int, ...],
                  stores: list[Op], prev: dict[tuple[int, int], Op]) -> list[Op]:
    """The ops of one split update (``ScheduleConfig.split_opt``) of layer ``l`` in step ``st``, part by part:
    LOAD_OPT (h2d: the part's state, and its gradient from the host buffer after the layer's STORE_G unless the
    gradient stays on the device), OPT (compute, after ``deps``: the step's gradient norms), STORE_OPT (d2h). A
    part's load follows its store by the step before (``prev``, updated here)."""
    out = []
    for p in cfg.split_parts(graph[l].params):
        before = prev.get((l, p))
        grads = () if l in cfg.grad_kept else tuple(op.id for op in stores)
        load = Op(ids(), OpKind.LOAD_OPT, H2D, st, l, p, deps=grads + ((before.id,) if before is not None else ()))
        opt = Op(ids(), OpKind.OPT, C, st, l, p, deps=deps + (load.id,))
        prev[(l, p)] = Op(ids(), OpKind.STORE_OPT, D2H, st, l, p, deps=(opt.id,))
        out += [load, opt, prev[(l, p)]]
    return out


def add_loss_copies(s: Schedule, graph: LayerGraph) -> Schedule:
    """LOSS_OUT (d2h) right after each step's last LOSS (or EVAL), following every one of them: the micro-batches'
    loss sums on their way to the host, ahead of the step's other copies out."""
    heads: dict[int, list[Op]] = defaultdict(list)
    for op in s.ops:
        if op.kind in (OpKind.LOSS, OpKind.EVAL):
            heads[op.step].append(op)
    ids = Ids(s.ops)
    after = {ops[-1].id: [Op(ids(), OpKind.LOSS_OUT, D2H, st, len(graph) - 1, deps=tuple(op.id for op in ops))]
             for st, ops in heads.items()}
    return s.with_ops(insert_after(list(s.ops), after), f"add_loss_copies: {len(after)} loss copies")


PASSES = (emit_compute, add_checkpoint_transfers, add_grad_stores, add_optimizer, assign_opt_slots,
          assign_weight_slots, assign_activation_slots, assign_grad_slots, assign_host_grad_slots, add_loss_copies)


def relabel_saved(s: Schedule, cfg: ScheduleConfig) -> Schedule:
    """``s`` under ``cfg``, a config that differs from its own in the saved activations alone (``saved_acts``,
    ``saved_lean``): the passes never read those (they change what the cost model charges an op, not which ops
    there are or their slots), so the ops are the ones :func:`build_schedule` would build for ``cfg``. Lets the
    search build one schedule per candidate and try saved-activation choices on it."""
    if replace(s.config, saved_acts=cfg.saved_acts, saved_lean=cfg.saved_lean) != cfg:
        raise ValueError("relabel_saved: the configs differ in more than the saved activations")
    return Schedule(s.ops, cfg, s.provenance)


def build_schedule(graph: LayerGraph, cfg: ScheduleConfig, *, verify_each: bool | None = None) -> Schedule:
    """Run every pass on an empty schedule: one step, as every step of a run is (the steady step: the
    device-updated layers' weights and resident states where the step before, or the set-up, left them). A schedule
    of several steps is what a run issues: the set-up (:func:`setup_schedule`, where there is one), then the step's
    schedule again and again, each joined with what it carries over from the one before
    (:mod:`megatrain.planner.carried`). With ``verify_each`` (default: env MEGATRAIN_VERIFY=1) the final schedule
    is checked by :func:`megatrain.planner.verify.verify` (intermediate ones lack slots by design)."""
    if cfg.n_layers != len(graph):
        raise ValueError(f"config is for {cfg.n_layers} layers, the graph has {len(graph)}")
    if cfg.n_steps == 1:
        s = Schedule((), cfg)
        for p in PASSES:
            s = p(s, graph)
        s = Schedule(tuple(finalize(list(s.ops))), cfg, s.provenance + (f"finalize: {len(s.ops)} ops",))
    else:
        s = repeat(graph, build_schedule(graph, replace(cfg, n_steps=1), verify_each=False), cfg.n_steps)
    if verify_each if verify_each is not None else os.environ.get("MEGATRAIN_VERIFY") == "1":
        from megatrain.planner.verify import verify

        verify(s, graph)
    return s


def repeat(graph: LayerGraph, step: Schedule, n_steps: int) -> Schedule:
    """The first ``n_steps`` steps of a run of the one-step ``step``: its set-up, then the step again and again, as
    :func:`build_schedule` makes them for a config of that many steps (a search decides on one step's schedule,
    then times the run)."""
    setup = setup_schedule(graph, step)
    run = unroll(setup, step, graph, n_steps)  # (its provenance: the set-up's or the step's, and the joins)
    return Schedule(run.ops, replace(step.config, n_steps=n_steps),
                    run.provenance if setup is None else step.provenance + run.provenance)


def setup_schedule(graph: LayerGraph, step: Schedule) -> Schedule | None:
    """What the steps of ``step``'s plan find on the device, from the host store: a KEEP_W (h2d) of each
    device-updated layer's weights, in the order the step's forward reads them, then a LOAD_OPT of each resident
    state into the optimizer slot the steps keep it in, in the order its backward updates them. None where the plan
    keeps nothing on the device (no device updates)."""
    cfg = step.config
    if not cfg.gpu_opt or not cfg.train:
        return None
    homes = resident_slots(step, graph.owner)
    order = {}  # layer -> its state's first reader in the step (a gradient store into it, in the backward)
    for op in step.ops:
        if op.slot("o") is not None:
            order.setdefault(graph.owner(op.layer), op.id)
    keep = [Op(0, OpKind.KEEP_W, H2D, 0, l) for l in sorted(cfg.gpu_opt)]
    load = [Op(0, OpKind.LOAD_OPT, H2D, 0, l, slots=(("o", homes[l]),)) for l in sorted(homes, key=order.__getitem__)]
    ops = [replace(op, id=i) for i, op in enumerate(keep + load)]
    setup = ScheduleConfig(n_layers=cfg.n_layers, gpu_opt=cfg.gpu_opt, resident_opt=cfg.resident_opt,
                           wire_bytes_per_param=cfg.wire_bytes_per_param, budget_bytes=cfg.budget_bytes, setup=True)
    return Schedule(tuple(ops), setup, (f"setup_schedule: {len(keep)} kept weights, {len(load)} resident states",))


def write_back_schedule(graph: LayerGraph, homes: dict[int, int]) -> Schedule:
    """The optimizer states kept on the device (``homes``: layer -> the optimizer slot it lives in) back to their
    host blocks: one STORE_OPT each on the d2h stream. The runtime runs it before the host store is read or saved
    and before a plan that keeps other states runs."""
    layers = tuple(sorted(homes))
    cfg = ScheduleConfig(n_layers=len(graph), gpu_opt=layers, resident_opt=layers, clip=False, write_back=True)
    ops = [Op(i, OpKind.STORE_OPT, D2H, 0, l, slots=(("o", homes[l]),)) for i, l in enumerate(layers)]
    return Schedule(tuple(ops), cfg, (f"write_back: {len(ops)} states kept on the device to the host",))
