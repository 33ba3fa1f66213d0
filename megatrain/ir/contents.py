"""What each op reads and writes in its slots (the contents the verifier and the runtime check), the queues ops are
issued on, and what a schedule expects on the device before its first op."""

from __future__ import annotations

from typing import Callable, Iterable

from megatrain.ir.op import STREAM_ORDER, Op, OpKind, Stream
from megatrain.ir.schedule import Schedule

OUTLIVING_POOLS = ("w", "g", "o", "k", "h")  # allocated once and rewritten every step (activations are fresh tensors)

Carried = tuple[tuple[int, ...], ...]  # per op of a step issued after another, the ids of the other's ops it follows

def slot_contents(op: Op, owner: Callable[[int], int], n_mb: int,
                  shared: Callable[[int], bool] = lambda layer: False,
                  resident: Callable[[int], bool] = lambda layer: False,
                  kept: Callable[[int], bool] = lambda layer: False) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(reads, writes): slot role -> the content an op expects to find / leaves behind.

    Contents: ``("W", step, owner layer)`` weights; ``("A", step, layer, mb)`` the checkpoint at a layer's input;
    ``("dA", step, layer, mb)`` its gradient; ``("G", step, layer, k)`` a layer's gradient summed over k mbs;
    ``("S", step, layer)`` a layer's master weights and moments in an optimizer slot, ``("SG", step, layer)`` the
    same with the step's gradient, ``("U", step, layer)`` after its device update; ``("HG", step, layer)`` a
    layer's gradient in a host buffer (``("HG", step, layer, part)`` one part of it:
    ``ScheduleConfig.host_grad_part``), ``("K", step, layer)`` in a kept-gradient slot (``kept(layer)``: the layer
    is in ``grad_kept``).
    ``owner(layer)`` is the layer whose weights ``layer`` reads (itself unless tied); ``shared(layer)``: another layer
    reads this owner's weights (a tied head), whose gradient part reaches the optimizer slot first, as
    ``("SG", step, owner, "part")``; the owner's own part completes it. ``resident(layer)``: the layer's state stays
    in its slot between steps (``ScheduleConfig.resident_opt``): what a step finds there, loaded or left by the
    step before, is ``("U", step - 1, layer)``.
    """
    st, l, j = op.step, op.layer, op.mb
    w = ("W", st, owner(l))
    k = op.kind
    if k is OpKind.LOAD_W:
        return {}, {"w": w}
    if k is OpKind.KEEP_W:  # (the kept weights are no slot: cost.device_memory counts them; verify orders them)
        return {}, {}
    if k is OpKind.FWD or k is OpKind.REFWD:
        reads = {"w": w}
        if l > 0:
            reads["x"] = ("A", st, l, j)
        return reads, {"y": ("A", st, l + 1, j)}
    if k in (OpKind.BWD, OpKind.LOSS):
        reads, writes = {"w": w}, {"g": ("G", st, l, j + 1)}
        if j > 0:
            reads["g"] = ("G", st, l, j)
        if k is OpKind.LOSS or l > 0:
            reads["x"], writes["x"] = ("A", st, l, j), ("dA", st, l, j)
        if k is OpKind.BWD:
            reads["dy"] = ("dA", st, l + 1, j)
        return reads, writes
    if k is OpKind.EVAL:
        return {"w": w, "x": ("A", st, l, j)}, {}
    if k is OpKind.SAVE_ACT:
        return {"a": ("A", st, l, j)}, {}
    if k is OpKind.LOAD_ACT:
        return {}, {"a": ("A", st, l, j)}
    if k is OpKind.STORE_G and op.stream is Stream.COMPUTE:  # into the optimizer slot its LOAD_OPT filled
        o = owner(l)
        state = ("U", st - 1, o) if resident(o) else ("S", st, o)
        if o != l:  # a tied layer's part: first into the slot
            return {"g": ("G", st, l, n_mb), "o": state}, {"o": ("SG", st, o, "part")}
        before = ("SG", st, o, "part") if shared(o) else state
        return {"g": ("G", st, l, n_mb), "o": before}, {"o": ("SG", st, o)}
    hg = ("HG", st, l) if j is None else ("HG", st, l, j)  # a host buffer's content: a gradient, or a part of one
    if k is OpKind.STORE_G and kept(l):  # from its kept-gradient slot, in the update pass
        return {"k": ("K", st, l)}, {"h": hg}
    if k is OpKind.STORE_G:  # to a host buffer; a tied layer's part is added to its owner's on the device
        return {"g": ("G", st, l, n_mb)}, ({} if owner(l) != l else {"h": ("HG", st, l)})
    if k is OpKind.NORM:
        return {"g": ("G", st, l, n_mb)}, {"k": ("K", st, l)}
    if k is OpKind.OPT and op.stream is Stream.CPU or k is OpKind.CHECK:  # (a CHECK may make the update again)
        return {"h": hg}, {}
    if split_part(op):
        return _split_contents(op, kept(l))
    if k is OpKind.LOAD_OPT:
        return {}, {"o": ("U", st - 1, l) if resident(l) else ("S", st, l)}
    if k is OpKind.OPT and op.stream is Stream.COMPUTE:
        return {"o": ("SG", st, l)}, {"o": ("U", st, l)}
    if k is OpKind.STORE_OPT:  # (a resident state's: written back, as the step before left it)
        return {"o": ("U", st - 1 if resident(l) else st, l)}, {}
    return {}, {}


def op_contents(schedule: "Schedule", graph, op: Op) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """:func:`slot_contents` of ``op`` in ``schedule`` over ``graph`` (a LayerGraph: its owners, tied layers, and
    the schedule's resident states and kept gradients)."""
    return contents_of(schedule, graph)(op)


def contents_of(schedule: "Schedule", graph) -> Callable[[Op], tuple[dict[str, tuple], dict[str, tuple]]]:
    """:func:`op_contents` for the ops of ``schedule``, its sets made once (for passes over every op)."""
    cfg = schedule.config
    owner, n_mb, resident, kept = graph.owner, cfg.n_mb, set(cfg.resident_opt).__contains__, \
        set(cfg.grad_kept).__contains__
    shared = lambda layer: bool(graph.tied_to(layer))  # noqa: E731
    return lambda op: slot_contents(op, owner, n_mb, shared, resident, kept)


def split_part(op: Op) -> bool:
    """Whether ``op`` is one part of a split update (``ScheduleConfig.split_opt``): a LOAD_OPT, OPT or STORE_OPT
    with a part index (``mb``)."""
    return op.mb is not None and op.kind in _PARTED


_PARTED = (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT)


Queue = tuple[Stream, bool]
# the queues ops are issued on: each stream's, then the split updates' own on the GPU streams
QUEUES: tuple[Queue, ...] = tuple((s, False) for s in STREAM_ORDER) + tuple(
    (s, True) for s in STREAM_ORDER if s is not Stream.CPU)


def queue_of(op: Op) -> Queue:
    """The queue ``op`` is issued on: its stream's, or for a split update's GPU op a queue of its own beside it
    (the stream issuer's split queues), which runs the split ops in program order after what the stream's own
    queue issued before each of them, while the stream's later ops do not wait for them."""
    s = op.stream  # (split_part inline: called for every op of every schedule simulated)
    return s, s is not Stream.CPU and op.mb is not None and op.kind in _PARTED


def issue_preds(ops: Iterable[Op], queues: list[Queue] | None = None) -> list[tuple[int, ...]]:
    """Per op (by id, ``ops`` in program order), the ops the issue order alone makes it follow: the op before it on
    its queue and, for an op on a split queue, the latest op before it on its stream's own queue. With its
    dependencies, these are every op that must end before it starts. ``queues``: each op's :func:`queue_of`, where
    the caller has them."""
    last: dict[Queue, int] = {}
    out: list[tuple[int, ...]] = []
    for i, op in enumerate(ops):
        q = queue_of(op) if queues is None else queues[i]
        before = last.get(q)
        if q[1]:  # a split queue's op: also its stream's own queue's latest
            own = last.get((op.stream, False))
            out.append(tuple(sorted(p for p in (before, own) if p is not None)))
        else:
            out.append(() if before is None else (before,))
        last[q] = op.id
    return out


def _split_contents(op: Op, kept: bool) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """:func:`slot_contents` of one part of a split update (``ScheduleConfig.split_opt``): ``("S", step, layer,
    part)`` the part's state in an optimizer slot, ``("SG", ...)`` with its gradient (from the host buffer, loaded
    with the state; a kept gradient joins it in the OPT), ``("U", ...)`` updated."""
    st, l, j = op.step, op.layer, op.mb
    if op.kind is OpKind.LOAD_OPT:
        return ({}, {"o": ("S", st, l, j)}) if kept else ({"h": ("HG", st, l)}, {"o": ("SG", st, l, j)})
    if op.kind is OpKind.OPT:
        reads = {"o": ("S", st, l, j), "k": ("K", st, l)} if kept else {"o": ("SG", st, l, j)}
        return reads, {"o": ("U", st, l, j)}
    return {"o": ("U", st, l, j)}, {}


def resident_slots(schedule: Schedule, owner: Callable[[int], int]) -> dict[int, int]:
    """Each layer of ``resident_opt`` -> the optimizer slot its ops use (its state's home between steps)."""
    resident = set(schedule.config.resident_opt)
    out: dict[int, int] = {}
    for op in schedule.ops:
        o = owner(op.layer)
        if o in resident and o not in out:
            for role, idx in op.slots:
                if role == "o":
                    out[o] = idx
    return out


def setup_ops(schedule: Schedule) -> list[Op]:
    """The ops of a set-up (``ScheduleConfig.setup``), or of one joined to the schedule's first step
    (``carried.join``): its first ops, each a KEEP_W or a resident state's LOAD_OPT."""
    resident = schedule.config.resident_opt
    out = []
    for op in schedule.ops:
        if not (op.kind is OpKind.KEEP_W or op.kind is OpKind.LOAD_OPT and op.layer in resident):
            break
        out.append(op)
    return out


def initial_contents(schedule: Schedule, homes: dict[int, int]) -> dict[tuple[str, int], tuple]:
    """What a schedule expects in its slots before its first op: the state of each resident layer in its slot
    (``homes``: :func:`resident_slots`), as the step before (or a set-up) left it; a set-up, or a schedule that
    begins with one, expects nothing."""
    if schedule.config.setup or setup_ops(schedule):
        return {}
    return {("o", k): ("U", -1, l) for l, k in homes.items()}


def deferrable_opts(schedule: Schedule) -> frozenset[int]:
    """The host OPTs and CHECKs of ``schedule`` whose gradient buffer no later op of their step writes: their moments
    can be computed from it after the step's update pass (a buffer a kept gradient passes through in turn is written
    again in the pass); and the STORE_OPTs of every part of a split update whose parts' state loads all read the
    gradient from such a buffer (not one kept on the device): they can store the masters alone. None where the
    plan makes every update in one pass (``ScheduleConfig.defer_moments``)."""
    if not schedule.config.defer_moments:
        return frozenset()
    out, written = set(), set()
    step = None
    split_ok: dict[tuple[int, int], bool] = {}  # (step, split layer) -> every part's gradient from a buffer so
    for op in reversed(schedule.ops):
        if op.step != step:
            step, written = op.step, set()
        h = op.slot("h")
        if op.kind is OpKind.LOAD_OPT and op.mb is not None:  # a split update's part
            key = (op.step, op.layer)
            split_ok[key] = split_ok.get(key, True) and h is not None and h not in written
        if h is None:
            continue
        if op.kind is OpKind.STORE_G and op.stream is Stream.D2H:
            written.add(h)
        elif (op.kind is OpKind.CHECK and schedule.config.speculate_keeps == "masters"
              or op.kind is OpKind.OPT and op.stream is Stream.CPU
              and op.layer not in schedule.config.speculate) and h not in written:  # (an update made before the
            # guard that keeps the masters writes them alone anyway: its CHECK makes the moments; one that keeps
            # the state made them)
            out.add(op.id)
    out.update(op.id for op in schedule.ops if op.kind is OpKind.STORE_OPT and op.mb is not None
               and split_ok.get((op.step, op.layer), False))
    return frozenset(out)
