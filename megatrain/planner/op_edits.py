"""What the passes share to edit a schedule's ops: fresh ids, an op with fields changed or dependencies added, ops
inserted after others, the final numbering (``id == position``, every dependency pointing backwards)."""

from __future__ import annotations

from typing import Iterable

from megatrain.ir import LayerGraph, Op, OpKind, Stream, queue_of

C, H2D, D2H, CPU = Stream.COMPUTE, Stream.H2D, Stream.D2H, Stream.CPU


class Ids:
    """Fresh ids above every id of a schedule."""

    def __init__(self, ops: Iterable[Op]):
        self.next = max((op.id for op in ops), default=-1) + 1

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def edit(op: Op, **kw) -> Op:
    g = kw.get  # positional, with no dict of every field: the passes make hundreds of thousands of ops a search
    return Op(g("id", op.id), g("kind", op.kind), g("stream", op.stream), g("step", op.step), g("layer", op.layer),
              g("mb", op.mb), g("slots", op.slots), g("deps", op.deps))


def add_deps(op: Op, deps: Iterable[int]) -> Op:
    return edit(op, deps=tuple(dict.fromkeys((*op.deps, *deps))))


def insert_after(ops: list[Op], after: dict[int | None, list[Op]]) -> list[Op]:
    """``ops`` with ``after[id]`` placed right after op ``id`` (``after[None]``: at the front), in list order."""
    out = list(after.get(None, ()))
    for op in ops:
        out.append(op)
        out.extend(after.get(op.id, ()))
    return out


def finalize(ops: list[Op]) -> list[Op]:
    """Renumber so ``id == position``; drop duplicate deps and deps implied by issue order (an earlier op on the same
    queue, or, for an op on a split queue, on its stream's own queue: ``ir.issue_preds``)."""
    new_id = {op.id: i for i, op in enumerate(ops)}
    queues = [queue_of(op) for op in ops]
    out = []
    for i, op in enumerate(ops):
        same = (queues[i], (op.stream, False))
        deps = sorted({j for j in map(new_id.__getitem__, op.deps) if queues[j] not in same})
        bad = [d for d in deps if d >= i]
        if bad:
            raise AssertionError(f"pass produced a forward dependency: op {op} on {bad}")
        out.append(edit(op, id=i, deps=tuple(deps)))
    return out


def compute_key(op: Op) -> tuple:
    return (op.kind, op.step, op.layer, op.mb)


def by_compute_key(ops: list[Op]) -> dict[tuple, Op]:
    return {compute_key(op): op for op in ops}


def opt_owner(graph: LayerGraph, op: Op) -> int | None:
    """The layer whose optimizer slot ``op`` uses (a tied head's gradient goes to its owner's), or None."""
    if op.kind in (OpKind.LOAD_OPT, OpKind.STORE_OPT) or (op.kind in (OpKind.OPT, OpKind.STORE_G) and op.stream is C):
        return graph.owner(op.layer)
    return None
