"""verify(schedule, graph, spec): every invariant of the schedule, or a ScheduleError naming the op and the rule.

Happens-before is decided with one vector clock per op over the issue queues (the four streams, and the split
updates' own queues beside the GPU streams): an op happens after everything its dependencies and its issue
predecessors happen after. Slot rules are checked against it, so a schedule that verifies
is correct for every timing the streams can produce.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from megatrain.ir import (FORWARDS, KIND_STREAMS, QUEUES, SLOT_POOL, Op, OpKind, Schedule, Stream, contents_of,
                          initial_contents, issue_preds, queue_of, resident_slots, setup_ops)
from megatrain.planner.checks import check_dropped, check_grad_kept, check_speculate, check_split_opt
from megatrain.planner.cost import POOLS, device_memory, fmt_bytes, grad_slot_count, host_memory
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec

EVALUATION_KINDS = (OpKind.LOAD_IN, OpKind.LOAD_W, OpKind.FWD, OpKind.EVAL, OpKind.LOSS_OUT)  # what an evaluation schedule holds


class ScheduleError(ValueError):
    def __init__(self, rule: str, op: Op | None, message: str):
        self.rule, self.op = rule, op
        where = f" at op '{op}'" if op is not None else ""
        super().__init__(f"schedule rule '{rule}' broken{where}: {message}")


class HappensBefore:
    """Vector clocks: ``hb(a, b)`` is true when op a finishes before op b starts in every execution. One clock entry
    per issue queue (:data:`~megatrain.ir.QUEUES`): an op follows its dependencies and :func:`~megatrain.ir.issue_preds`
    (the op before it on its queue; on a split queue also the latest op of its stream's own queue)."""

    def __init__(self, ops: tuple[Op, ...]):
        n_queues = len(QUEUES)
        q_index = {q: i for i, q in enumerate(QUEUES)}
        self.pos = [0] * len(ops)  # position of each op within its queue
        self.sid = [q_index[queue_of(op)] for op in ops]
        self.vc: list[list[int]] = []
        count = [0] * n_queues
        for op, implicit in zip(ops, issue_preds(ops)):
            s = self.sid[op.id]
            clock = [-1] * n_queues
            for d in (*implicit, *op.deps):
                dv = self.vc[d]
                for k in range(n_queues):
                    if dv[k] > clock[k]:
                        clock[k] = dv[k]
            self.pos[op.id] = count[s]
            clock[s] = count[s]
            count[s] += 1
            self.vc.append(clock)

    def __call__(self, a: int, b: int) -> bool:
        return a == b or self.vc[b][self.sid[a]] >= self.pos[a]


def _check_shape(s: Schedule, graph: LayerGraph) -> None:
    cfg = s.config
    L = len(graph)
    contents = contents_of(s, graph)
    if cfg.n_layers != L:
        raise ScheduleError("graph", None, f"schedule is for {cfg.n_layers} layers, the graph has {L}")
    cannot = [l for l in cfg.saved_acts if not (cfg.host_checkpoints < l < L - 1 and graph[l].saved_bytes_per_token)]
    if cannot or len(set(cfg.saved_acts)) != len(cfg.saved_acts):
        raise ScheduleError("saved", None, f"saved_acts {list(cfg.saved_acts)}: each layer at most once, and only "
                                           f"layers between the first and the head whose saved bytes are known "
                                           f"and whose checkpoint stays on the device (layers above "
                                           f"{cfg.host_checkpoints}; not {cannot})")
    resident = cfg.resident_opt
    if len(set(resident)) != len(resident) or not set(resident) <= set(cfg.gpu_opt):
        raise ScheduleError("resident", None, f"resident_opt {list(resident)}: each layer at most once, and only "
                                              f"layers updated on the device (gpu_opt {list(cfg.gpu_opt)})")
    for rule, check in (("grad-kept", check_grad_kept), ("split", check_split_opt), ("speculate", check_speculate),
                        ("dropped", check_dropped)):
        try:
            check(graph, cfg)
        except ValueError as e:
            raise ScheduleError(rule, None, str(e)) from None
    if cfg.grad_host_bytes not in (2, 4) or cfg.host_grad_slots < 1:
        raise ScheduleError("config", None, f"grad_host_bytes must be 4 (fp32) or 2 (bf16) and host_grad_slots at "
                                            f"least 1, got {cfg.grad_host_bytes} and {cfg.host_grad_slots}")
    homes = resident_slots(s, graph.owner)
    if len(set(homes.values())) != len(homes):
        raise ScheduleError("resident", None, f"resident layers share optimizer slots: {homes}")
    for i, op in enumerate(s.ops):
        if op.id != i:
            raise ScheduleError("ids", op, f"op at position {i} has id {op.id}")
        for d in op.deps:
            if not 0 <= d < i:
                raise ScheduleError("acyclic", op, f"dependency {d} does not point to an earlier op")
        if op.stream not in KIND_STREAMS[op.kind]:
            raise ScheduleError("stream", op, f"{op.kind.value} cannot run on stream {op.stream.value}")
        if not (0 <= op.step < cfg.n_steps and 0 <= op.layer < L):
            raise ScheduleError("range", op, f"step or layer out of range ({cfg.n_steps} steps, {L} layers)")
        has_mb = op.kind in (*FORWARDS, OpKind.BWD, OpKind.LOSS, OpKind.EVAL, OpKind.SAVE_ACT, OpKind.LOAD_ACT,
                             OpKind.LOAD_IN)
        parts = cfg.parts(op.layer, graph[op.layer].params)
        split = op.layer in cfg.split_opt
        if split and op.kind in (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT):
            if op.mb not in cfg.split_parts(graph.weight_params(op.layer)):
                raise ScheduleError("range", op, f"layer {op.layer}'s split update runs in parts "
                                                 f"{cfg.split_parts(graph.weight_params(op.layer))}, not {op.mb}")
        elif op.kind is OpKind.STORE_G and op.stream is Stream.D2H or op.kind is OpKind.OPT and op.stream is Stream.CPU:
            if op.mb not in parts:  # a gradient kept on the device goes to the host in parts
                raise ScheduleError("range", op, f"layer {op.layer}'s gradient passes through the host in parts "
                                                 f"{parts}, not {op.mb}")
        elif has_mb != (op.mb is not None) or (has_mb and not 0 <= op.mb < cfg.n_mb):
            raise ScheduleError("range", op, f"micro-batch must be in 0..{cfg.n_mb - 1} for {op.kind.value}")
        if op.kind in (*FORWARDS, OpKind.BWD) and op.layer == L - 1:
            raise ScheduleError("kind", op, "the head+loss layer runs as LOSS (or EVAL), not FWD/BWD")
        if op.kind is OpKind.REFWD and not cfg.dropped(op.layer + 1):
            raise ScheduleError("kind", op, f"the forward keeps layer {op.layer + 1}'s checkpoint: none to make again")
        if op.kind in (OpKind.SAVE_ACT, OpKind.LOAD_ACT) and cfg.dropped(op.layer):
            raise ScheduleError("kind", op, f"the forward drops layer {op.layer}'s checkpoint (dropped_checkpoints)")
        if op.kind is OpKind.LOAD_IN and op.layer != 0:
            raise ScheduleError("kind", op, "a micro-batch's inputs load as layer 0's (the embedding reads them)")
        if op.kind in (OpKind.LOSS, OpKind.EVAL, OpKind.LOSS_OUT) and op.layer != L - 1:
            raise ScheduleError("kind", op, f"{op.kind.value} runs only on the last (head) layer")
        if (op.kind is OpKind.EVAL) if cfg.train else op.kind not in EVALUATION_KINDS:
            raise ScheduleError("kind", op, f"{op.kind.value} has no place in "
                                            f"{'a training' if cfg.train else 'an evaluation'} schedule")
        if op.kind in (OpKind.SAVE_ACT, OpKind.LOAD_ACT) and not 1 <= op.layer <= cfg.host_checkpoints:
            raise ScheduleError("kind", op, f"only checkpoints of layers 1..{cfg.host_checkpoints} go to host")
        if op.kind is OpKind.CHECK and op.layer not in cfg.speculate:
            raise ScheduleError("kind", op, f"layer {op.layer}'s update waits for the guard (speculate "
                                            f"{list(cfg.speculate)}): there is nothing to check")
        if op.kind is OpKind.OPT and graph[op.layer].tie is not None:
            raise ScheduleError("kind", op, f"layer {op.layer} has no weights of its own to optimize")
        on_gpu = op.layer in cfg.gpu_opt or split
        if op.kind is OpKind.OPT and on_gpu != (op.stream is Stream.COMPUTE):
            where = "on the device (gpu_opt, split_opt)" if on_gpu else "on the host"
            raise ScheduleError("kind", op, f"layer {op.layer} is updated {where}, not on {op.stream.value}")
        if op.kind in (OpKind.LOAD_OPT, OpKind.STORE_OPT) and not on_gpu:
            raise ScheduleError("kind", op, f"layer {op.layer} is not updated on the device (gpu_opt, split_opt)")
        if op.kind is OpKind.STORE_OPT and op.layer in resident:
            raise ScheduleError("kind", op, f"layer {op.layer}'s state stays on the device (resident_opt)")
        if op.kind is OpKind.KEEP_W and (op.layer not in cfg.gpu_opt or op.step != 0 or op.mb is not None):
            raise ScheduleError("kind", op, f"a KEEP_W sets up the weights of a layer updated on the device (gpu_opt "
                                            f"{list(cfg.gpu_opt)}) before its first step's forward: step 0, no mb")
        if op.kind is OpKind.NORM and op.layer not in cfg.grad_kept:
            raise ScheduleError("kind", op, f"layer {op.layer}'s gradient does not stay on the device (grad_kept "
                                            f"{list(cfg.grad_kept)}): its store takes its norms")
        if op.kind is OpKind.STORE_G and (graph.owner(op.layer) in cfg.gpu_opt) != (op.stream is Stream.COMPUTE):
            want = "into its optimizer slot (compute)" if graph.owner(op.layer) in cfg.gpu_opt else "to the host (d2h)"
            raise ScheduleError("stream", op, f"layer {op.layer}'s gradient goes {want}, not on {op.stream.value}")
        reads, writes = contents(op)
        want = sorted(set(reads) | set(writes))
        have = sorted(r for r, _ in op.slots)
        if want != have:
            raise ScheduleError("slots", op, f"{op.kind.value} needs slot roles {want}, has {have}")
        for role, idx in op.slots:
            limit = {"w": cfg.weight_slots, "g": grad_slot_count(graph, cfg)}.get(SLOT_POOL[role])
            if idx < 0 or (limit is not None and idx >= limit):
                raise ScheduleError("slots", op, f"{role}{idx} is outside the {limit} configured slots")


def _check_counts(s: Schedule, graph: LayerGraph, hb: HappensBefore) -> None:
    cfg = s.config
    L = len(graph)
    setup = {op.id for op in setup_ops(s)}
    late = next((op for op in s.ops if op.kind is OpKind.KEEP_W and op.id not in setup), None)
    if late is not None:
        raise ScheduleError("kind", late, "a KEEP_W belongs to a set-up, ahead of every op of the first step")
    have = {s.ops[i].layer for i in setup if s.ops[i].kind is OpKind.KEEP_W}
    if setup and have != set(cfg.gpu_opt):  # a set-up joined to the first step: all the steps keep on the device
        raise ScheduleError("complete", None, f"the set-up keeps the weights of layers {sorted(have)} on the "
                                              f"device, not those of every device-updated layer {list(cfg.gpu_opt)}")
    seen: dict[tuple, Op] = {}
    for op in s.ops:
        if op.kind in (OpKind.LOAD_W, OpKind.LOAD_ACT):
            continue
        key = (op.kind, op.step, op.layer, op.mb)
        if key in seen:
            what = "optimized" if op.kind is OpKind.OPT else "scheduled"
            raise ScheduleError("once", op, f"{op.kind.value} of layer {op.layer} {what} twice (first: '{seen[key]}')")
        seen[key] = op
    head = OpKind.LOSS if cfg.train else OpKind.EVAL
    for st in range(cfg.n_steps):  # each micro-batch's inputs, loaded before the embedding and the loss read them
        for j in range(cfg.n_mb):
            load = seen.get((OpKind.LOAD_IN, st, 0, j))
            if load is None:
                raise ScheduleError("complete", None, f"step {st} never loads the inputs of mb {j} (LOAD_IN)")
            for user in (seen.get((OpKind.FWD, st, 0, j)), seen.get((head, st, L - 1, j))):
                if user is not None and not hb(load.id, user.id):
                    raise ScheduleError("input-before-use", user, f"it reads mb {j}'s inputs, which '{load}' may "
                                                                  f"not have loaded")
        out = seen.get((OpKind.LOSS_OUT, st, L - 1, None))
        if out is None:
            raise ScheduleError("complete", None, f"step {st} never copies its loss sums to the host (LOSS_OUT)")
        for j in range(cfg.n_mb):
            loss = seen.get((head, st, L - 1, j))
            if loss is not None and not hb(loss.id, out.id):
                raise ScheduleError("loss-before-copy", out, f"it copies every micro-batch's loss sum: '{loss}' may "
                                                             f"not have made its own")
    if not cfg.train:  # an evaluation: each layer's forward of each micro-batch, the head's as EVAL
        for st in range(cfg.n_steps):
            for l in range(L):
                for j in range(cfg.n_mb):
                    k = OpKind.EVAL if l == L - 1 else OpKind.FWD
                    if (k, st, l, j) not in seen:
                        raise ScheduleError("complete", None, f"step {st} has no {k.value} of layer {l} mb {j}")
        return
    for st in range(cfg.n_steps):
        for l in range(L):
            for j in range(cfg.n_mb):
                kinds = (OpKind.LOSS,) if l == L - 1 else (OpKind.FWD, OpKind.BWD)
                for k in kinds:
                    if (k, st, l, j) not in seen:
                        raise ScheduleError("complete", None, f"step {st} has no {k.value} of layer {l} mb {j}")
                if l < L - 1 and not hb(seen[(OpKind.FWD, st, l, j)].id, seen[(OpKind.BWD, st, l, j)].id):
                    raise ScheduleError("fwd-before-bwd", seen[(OpKind.BWD, st, l, j)], "its FWD may not have run")
                remade = seen.get((OpKind.REFWD, st, l - 1, j)) if cfg.dropped(l) else None
                if cfg.dropped(l) and (remade is None or not hb(remade.id, seen[(OpKind.BWD, st, l, j)].id)):
                    raise ScheduleError("remade-before-bwd", seen[(OpKind.BWD, st, l, j)], "the forward dropped its "
                                        "checkpoint, which no REFWD of the layer below makes again before it")
            parts = cfg.parts(l, graph[l].params) if l not in cfg.gpu_opt else [None]
            split = l in cfg.split_opt
            for p in parts if not (split and l in cfg.grad_kept) else ():  # (a split update reads it there)
                if (OpKind.STORE_G, st, l, p) not in seen:
                    raise ScheduleError("complete", None, f"step {st} never stores the gradient of layer {l}"
                                                          + (f" (part {p})" if p is not None else ""))
            if l in cfg.grad_kept and (OpKind.NORM, st, l, None) not in seen:
                raise ScheduleError("complete", None, f"step {st} never takes the norms of layer {l}'s gradient, "
                                                      f"which stays on the device (grad_kept)")
            for p in (cfg.split_parts(graph.weight_params(l)) if split else parts) if graph[l].tie is None else ():
                for k in (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT) if split else (OpKind.OPT,):
                    if (k, st, l, p) not in seen:
                        what = f"has no {k.value} of" if split else "never optimizes"
                        raise ScheduleError("complete", None, f"step {st} {what} layer {l}"
                                                              + (f" (part {p})" if p is not None else ""))
            if l in cfg.speculate and (OpKind.CHECK, st, l, None) not in seen:
                raise ScheduleError("complete", None, f"step {st} never checks the update of layer {l} made before "
                                                      f"its guard (speculate)")
            if l in cfg.gpu_opt:
                stays = l in cfg.resident_opt
                for k, want in ((OpKind.LOAD_OPT, not stays), (OpKind.STORE_OPT, not stays)):
                    op = seen.get((k, st, l, None))
                    if stays and op is not None and op.id in setup:  # loaded by a set-up joined to the step
                        continue
                    if (op is not None) != want:
                        why = (f"layer {l}'s state stays on the device: a set-up loads it, no step loads or stores "
                               f"it" if stays else f"layer {l} is updated on the device")
                        raise ScheduleError("complete", op,
                                            f"step {st} {'has no' if want else 'has a'} {k.value} of layer {l} ({why})")
        # where each gradient's norms are taken: its NORM where it stays on the device, else its store
        stores = [op for op in s.ops if op.step == st and (
            op.kind is OpKind.NORM or op.kind is OpKind.STORE_G and op.layer not in cfg.grad_kept)]
        own = [op for op in s.ops if op.kind is OpKind.STORE_G and op.step == st]
        guard = seen.get((OpKind.GUARD, st, 0, None))
        if guard is None:
            raise ScheduleError("complete", None, f"step {st} has no GUARD (the global norm and clip factor its "
                                                  f"updates wait for)")
        # the guard reads every gradient's norms with clipping, and every micro-batch's loss
        losses = [op for op in s.ops if op.step == st and op.kind is OpKind.LOSS]
        for g in (stores if cfg.clip else []) + losses:
            if not hb(g.id, guard.id):
                raise ScheduleError("store-before-guard", guard, f"the step's guard needs every "
                                                                 f"{'gradient norm and ' if cfg.clip else ''}loss: "
                                                                 f"'{g}' may not have finished")
        for check in (op for op in s.ops if op.step == st and op.kind is OpKind.CHECK):
            opt = seen[(OpKind.OPT, st, check.layer, None)]
            for before, rule in ((guard, "guard-before-check"), (opt, "opt-before-check")):
                if not hb(before.id, check.id):
                    raise ScheduleError(rule, check, f"it validates the update '{opt}' by the step's clip factor, "
                                                     f"and '{before}' may not have finished")
        readers = (op for op in s.ops if op.step == st and op.kind is OpKind.OPT)
        for opt in readers:
            if opt.layer not in cfg.speculate and not hb(guard.id, opt.id):
                raise ScheduleError("guard-before-opt", opt, f"it scales its gradient by the step's clip factor, "
                                                             f"which '{guard}' may not have formed")
            for g in own:  # (of a gradient in parts, the store of the part it updates)
                if graph.owner(g.layer) == opt.layer and g.mb in (None, opt.mb) and not hb(g.id, opt.id):
                    raise ScheduleError("store-before-opt", opt, f"it updates weights whose gradient '{g}' may not "
                                                                 f"have finished")
    for op in s.ops:
        if op.kind is OpKind.LOAD_W and op.stream is Stream.COMPUTE:  # a copy of the weights kept on the device:
            # after the set-up put them there (where one is joined to the step), before the step's update rewrites
            # them
            o = graph.owner(op.layer)
            keep = seen.get((OpKind.KEEP_W, 0, o, None))
            if op.step == 0 and keep is not None and not hb(keep.id, op.id):
                raise ScheduleError("kept-before-load", op, f"copies weights '{keep}' may not have put on the device")
            opt = seen.get((OpKind.OPT, op.step, o, None))
            if opt is not None and not hb(op.id, opt.id):
                raise ScheduleError("kept-overwritten", opt, f"rewrites the weights kept on the device while '{op}' "
                                                             f"may still copy them")
        if op.kind is OpKind.LOAD_W and op.step > 0:
            o = graph.owner(op.layer)
            # (on the device, its new weights stay there; in parts, every part's update; a split update's, every
            # part's store to the host)
            last = ((OpKind.STORE_OPT, p) for p in cfg.split_parts(graph.weight_params(o))) if o in cfg.split_opt \
                else [(OpKind.CHECK, None)] if o in cfg.speculate \
                else ((OpKind.OPT, p) for p in cfg.parts(o, graph[o].params))
            for opt in (seen[(k, op.step - 1, o, p)] for k, p in last):
                if not hb(opt.id, op.id):
                    raise ScheduleError("load-after-opt", op,
                                        f"loads weights before '{opt}' of the previous step updated them")
        if op.kind is OpKind.LOAD_OPT and op.step > 0:  # the host block (its part) as the step before stored it
            store = seen.get((OpKind.STORE_OPT, op.step - 1, op.layer, op.mb))
            if store is not None and not hb(store.id, op.id):
                raise ScheduleError("state-after-store", op, f"loads the optimizer state before '{store}' of the "
                                                             f"previous step stored it")


def _check_slots(s: Schedule, graph: LayerGraph, hb: HappensBefore) -> None:
    writers: dict[tuple[str, int], list[Op]] = defaultdict(list)  # (pool, slot) -> writers in program order
    tags: dict[int, tuple[dict, dict]] = {}
    initial = initial_contents(s, resident_slots(s, graph.owner))
    contents = contents_of(s, graph)
    for op in s.ops:
        tags[op.id] = contents(op)
        for role, idx in op.slots:
            if role in tags[op.id][1]:
                writers[(SLOT_POOL[role], idx)].append(op)
    written_tag = {}  # (op id, pool, slot) -> tag
    for op in s.ops:
        for role, idx in op.slots:
            if role in tags[op.id][1]:
                written_tag[(op.id, SLOT_POOL[role], idx)] = tags[op.id][1][role]
    writer_ids = defaultdict(list, {key: [w.id for w in ws] for key, ws in writers.items()})
    for ws in writers.values():
        for a, b in zip(ws, ws[1:]):
            if a.id != b.id and not hb(a.id, b.id):
                raise ScheduleError("slot-write-order", b, f"writes a slot '{a}' may still be writing")
    for op in s.ops:
        reads = tags[op.id][0]
        for role, idx in op.slots:
            if role not in reads:
                continue
            key = (SLOT_POOL[role], idx)
            ws = writers[key]
            at = bisect.bisect_left(writer_ids[key], op.id)  # writers before `op`: ws[:at]
            if at == 0:  # what the slot holds before the schedule: a resident state (left by a step or a set-up)
                if initial.get(key) != reads[role]:
                    have = f"it starts with {initial[key]}" if key in initial else "nothing loaded it before"
                    raise ScheduleError("slot-content", op, f"reads {role}{idx} expecting {reads[role]}: {have}")
                w = None
            else:
                w = ws[at - 1]
                got = written_tag[(w.id, *key)]
                if got != reads[role]:
                    raise ScheduleError("slot-content", op, f"reads {role}{idx} expecting {reads[role]}, but its "
                                                            f"latest load is {got} by '{w}'")
            if w is not None and not hb(w.id, op.id):
                raise ScheduleError("slot-ready", op, f"reads {role}{idx} before '{w}' is sure to have filled it")
            at = bisect.bisect_right(writer_ids[key], op.id)
            nxt = ws[at] if at < len(ws) else None
            if nxt is not None and not hb(op.id, nxt.id):
                raise ScheduleError("slot-overwritten", nxt,
                                    f"overwrites {role}{idx} while '{op}' may still read it (missing dependency)")


def _check_setup(s: Schedule, graph: LayerGraph, spec: HardwareSpec | None) -> None:
    """A set-up (``ScheduleConfig.setup``): on the h2d stream, one KEEP_W per device-updated layer and one LOAD_OPT
    per resident state into its optimizer slot (each in a slot of its own), nothing else, and within the budget."""
    cfg = s.config
    seen: dict[tuple, Op] = {}
    for i, op in enumerate(s.ops):
        if op.id != i or op.deps:
            raise ScheduleError("ids", op, f"op at position {i} has id {op.id} and dependencies {op.deps}")
        want = cfg.gpu_opt if op.kind is OpKind.KEEP_W else cfg.resident_opt if op.kind is OpKind.LOAD_OPT else ()
        if op.stream is not Stream.H2D or op.step != 0 or op.mb is not None or op.layer not in want:
            raise ScheduleError("kind", op, f"a set-up holds one KEEP_W (h2d) per layer updated on the device (gpu_opt "
                                            f"{list(cfg.gpu_opt)}) and one LOAD_OPT per resident state (resident_opt "
                                            f"{list(cfg.resident_opt)})")
        if (op.kind, op.layer) in seen:
            raise ScheduleError("once", op, f"{op.kind.value} of layer {op.layer} twice in the set-up")
        if [r for r, _ in op.slots] != (["o"] if op.kind is OpKind.LOAD_OPT else []):
            raise ScheduleError("slots", op, "a state loads into its optimizer slot; kept weights take no slot")
        seen[(op.kind, op.layer)] = op
    for kind, layers in ((OpKind.KEEP_W, cfg.gpu_opt), (OpKind.LOAD_OPT, cfg.resident_opt)):
        missing = sorted(l for l in layers if (kind, l) not in seen)
        if missing:
            raise ScheduleError("complete", None, f"the set-up has no {kind.value} of layers {missing}")
    slots = [op.slot("o") for op in s.ops if op.kind is OpKind.LOAD_OPT]
    if len(set(slots)) != len(slots):
        raise ScheduleError("slots", None, f"two states set up in one slot ({slots})")
    check_memory(s, graph, spec)


def _check_write_back(s: Schedule, graph: LayerGraph) -> None:
    """A write-back schedule (``ScheduleConfig.write_back``): one STORE_OPT on the d2h stream per resident state,
    from its slot, nothing else."""
    cfg = s.config
    seen: dict[int, Op] = {}
    for i, op in enumerate(s.ops):
        if op.id != i:
            raise ScheduleError("ids", op, f"op at position {i} has id {op.id}")
        if op.kind is not OpKind.STORE_OPT or op.stream is not Stream.D2H or op.step != 0 or op.mb is not None:
            raise ScheduleError("kind", op, "a write-back schedule holds one STORE_OPT (d2h) per resident state")
        if op.layer not in cfg.resident_opt:
            raise ScheduleError("kind", op, f"layer {op.layer}'s state is not kept on the device (resident_opt "
                                            f"{list(cfg.resident_opt)})")
        if op.layer in seen:
            raise ScheduleError("once", op, f"layer {op.layer}'s state written back twice")
        if [r for r, _ in op.slots] != ["o"]:
            raise ScheduleError("slots", op, "a state is written back from its optimizer slot")
        seen[op.layer] = op
    missing = sorted(set(cfg.resident_opt) - set(seen))
    if missing:
        raise ScheduleError("complete", None, f"the states of layers {missing} are not written back")
    slots = [op.slot("o") for op in s.ops]
    if len(set(slots)) != len(slots):
        raise ScheduleError("slots", None, f"two states written back from one slot ({slots})")


def verify(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec | None = None) -> None:
    """Raise :class:`ScheduleError` at the first broken invariant; return None when the schedule is sound."""
    if schedule.config.write_back:
        return _check_write_back(schedule, graph)
    if schedule.config.setup:
        return _check_setup(schedule, graph, spec)
    _check_shape(schedule, graph)
    check_memory(schedule, graph, spec)
    hb = HappensBefore(schedule.ops)
    _check_counts(schedule, graph, hb)
    _check_slots(schedule, graph, hb)
    if spec is not None:
        host = sum(host_memory(graph, schedule).values())
        if host > spec.host_plan_bytes:
            raise ScheduleError("host-memory", None, f"needs {fmt_bytes(host)} of host memory, a plan on "
                                f"{spec.name} may take {fmt_bytes(spec.host_plan_bytes)} (of its "
                                f"{fmt_bytes(spec.host_bytes)}, {fmt_bytes(spec.host_margin)} left free)")


def check_memory(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec | None = None) -> None:
    """The device-memory rule of :func:`verify` alone (cheap: no walk over the dependencies)."""
    cfg = schedule.config
    mem = device_memory(graph, schedule)
    if mem.total_nbytes > cfg.budget_bytes:
        parts = ", ".join(f"{p}: {mem.slot_count[p]} slots, {fmt_bytes(mem.pool_nbytes[p])}" for p in POOLS)
        raise ScheduleError("memory", None, f"needs {fmt_bytes(mem.total_nbytes)} on the device ({parts}, working "
                            f"set {fmt_bytes(mem.workspace_nbytes)}, kept weights {fmt_bytes(mem.kept_nbytes)}, saved "
                            f"activations {fmt_bytes(mem.saved_nbytes)}, cuBLAS workspaces "
                            f"{fmt_bytes(mem.gemm_nbytes)}, allocator rounding {fmt_bytes(mem.slack_nbytes)}"
                            + (f", values blocks hand on {fmt_bytes(mem.carry_nbytes)}" if mem.carry_nbytes else "")
                            + (f", wire stage {fmt_bytes(mem.stage_nbytes)}" if mem.stage_nbytes else "") + "), "
                            f"budget is {fmt_bytes(cfg.budget_bytes)}")
    if spec is not None and cfg.budget_bytes > spec.gpu_bytes:
        raise ScheduleError("memory", None, f"budget {fmt_bytes(cfg.budget_bytes)} exceeds the {spec.name}'s "
                            f"{fmt_bytes(spec.gpu_bytes)}")
