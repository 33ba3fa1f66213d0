"""What a step's ops wait for of the step issued just before them, as dependencies the verifier checks.

A run issues one schedule per step without a device-wide sync between them: the steps overlap (the next step's
forward runs under the update pass of the one before). :func:`carried_deps` says, for each op of the next step,
which ops of the step before it must follow:

- **slots** (weight, gradient, optimizer and kept-gradient slots, host gradient buffers: buffers that outlive a
  step): every op of the next step that touches a slot up to and including its first write there follows the step
  before's accesses of that slot since its last write there (the later accesses in the next step follow that first
  write by the step's own dependencies, which the verifier checks);
- **weights**: the first load of a layer's weights (each queue's) follows the step before's update of that layer:
  for a load from the host, its last STORE_OPT (master and bf16 shadow), else its last OPT (on the host, or on the
  device, which left the weights a compute-stream load copies; after a set-up, its KEEP_W);
- **optimizer state**: the first LOAD_OPT of a layer follows the step before's update of that layer likewise (the
  stream issuer copies each row once the same row is stored, which the simulator models as well; its later parts
  follow it on their queue).

:func:`join` puts two steps into one schedule with these as ordinary dependencies; ``verify`` on it checks the pair
with every rule it checks across the steps of one schedule. The API verifies the pairs a run issues back to back
(the plan's set-up, where it has one, then its step's schedule, then the step's again) and gives the runtime these
dependencies; any other pair (an evaluation in between, another plan) the stream issuer fences.
"""

from __future__ import annotations

from dataclasses import replace

from megatrain.ir import OUTLIVING_POOLS, SLOT_POOL, Carried, LayerGraph, Op, OpKind, Schedule, Stream, contents_of


def _buffers(op: Op):
    return [(role, (SLOT_POOL[role], idx)) for role, idx in op.slots if SLOT_POOL[role] in OUTLIVING_POOLS]


def carried_deps(prev: Schedule, nxt: Schedule, graph: LayerGraph) -> Carried:
    """Per op of ``nxt`` (by id), the ops of ``prev`` it must follow when ``nxt`` is issued right after ``prev``."""
    out: list[set[int]] = [set() for _ in nxt.ops]
    since_write: dict[tuple[str, int], list[int]] = {}  # buffer -> prev's accesses since its last write
    last_opt: dict[int, int] = {}  # layer -> prev's last OPT of it (one part's: they run in order on one queue)
    last_store: dict[int, int] = {}  # layer -> prev's last STORE_OPT of it (which follows every part's OPT)
    kept: set[int] = set()  # layers whose last such op in prev is a set-up's KEEP_W (no update of their state)
    contents = contents_of(prev, graph)
    for op in prev.ops:
        writes = contents(op)[1]
        for role, key in _buffers(op):
            if role in writes:
                since_write[key] = [op.id]
            else:
                since_write.setdefault(key, []).append(op.id)
        if op.kind in (OpKind.OPT, OpKind.KEEP_W, OpKind.CHECK):  # (a set-up's KEEP_W: the weights a device update
            # would leave; the CHECK of an update made before the guard, after it on its queue, ends it)
            last_opt[op.layer] = op.id
            (kept.add if op.kind is OpKind.KEEP_W else kept.discard)(op.layer)
        elif op.kind is OpKind.STORE_OPT:
            last_store[op.layer] = op.id
    written: set[tuple[str, int]] = set()
    loaded: set[tuple[int, Stream]] = set()
    loaded_state: set[tuple[int, Stream]] = set()
    contents = contents_of(nxt, graph)
    for op in nxt.ops:
        writes = contents(op)[1]
        for role, key in _buffers(op):
            if key not in written:
                out[op.id].update(since_write.get(key, ()))
        written.update(key for role, key in _buffers(op) if role in writes)
        if op.kind is OpKind.LOAD_W and (graph.owner(op.layer), op.stream) not in loaded:
            o = graph.owner(op.layer)
            loaded.add((o, op.stream))
            # (a copy of the weights a device update left on the device waits for that update alone)
            out[op.id].update(_last_update(o, last_opt, last_store if op.stream is Stream.H2D else {}))
        elif op.kind is OpKind.LOAD_OPT and (op.layer, op.stream) not in loaded_state:  # (its later parts follow
            # it on its queue)
            loaded_state.add((op.layer, op.stream))
            out[op.id].update(_last_update(op.layer, {} if op.layer in kept else last_opt, last_store))
    return tuple(tuple(sorted(d)) for d in out)


def _last_update(layer: int, last_opt: dict[int, int], last_store: dict[int, int]) -> tuple[int, ...]:
    """The op of the step before that ends ``layer``'s update: its last STORE_OPT where there is one, else its last
    OPT (none: not updated)."""
    last = last_store.get(layer, last_opt.get(layer))
    return () if last is None else (last,)


def join(prev: Schedule, nxt: Schedule, carried: Carried) -> Schedule:
    """``prev`` then ``nxt`` as one schedule of their steps (``nxt``'s after ``prev``'s, its ops after ``prev``'s,
    each with its ``carried`` dependencies on ``prev``'s ops): what the verifier and the simulator take for the
    two issued back to back. The configuration is ``prev``'s (steps of one plan), or, after a set-up
    (``ScheduleConfig.setup``), which is no step of its own, ``nxt``'s: the set-up's ops are its first step's
    first."""
    n, steps = len(prev.ops), 0 if prev.config.setup else prev.config.n_steps
    ops = list(prev.ops) + [Op(op.id + n, op.kind, op.stream, op.step + steps, op.layer, op.mb, op.slots,
                               (*carried[op.id], *(d + n for d in op.deps))) for op in nxt.ops]
    cfg = replace(nxt.config if prev.config.setup else prev.config, n_steps=steps + nxt.config.n_steps)
    return Schedule(tuple(ops), cfg, prev.provenance + (f"join: {len(nxt.ops)} ops of a next step, "
                                                        f"{sum(map(len, carried))} dependencies on the step before",))


def unroll(setup: Schedule | None, step: Schedule, graph: LayerGraph, n_steps: int) -> Schedule:
    """A run's first ``n_steps`` steps as the runtime issues them -- the ``setup`` (None: the plan has none), then
    ``step`` again and again -- as one schedule, each joined with what it carries over from the one before: what
    the simulator times for a run and the verifier checks."""
    s = step if setup is None else join(setup, step, carried_deps(setup, step, graph))
    last = None  # (the carried dependencies of the step before, the first op id of the step they point into)
    for _ in range(n_steps - 1):
        begin = len(s.ops) - len(step.ops)  # the last step's first op
        if last is None:
            carried = carried_deps(s, step, graph)
        else:  # the steps are one schedule again: a step carries from the one before what the one before carried
            off, begin_before = len(step.ops), last[1]
            carried = tuple(tuple([d + off if d >= begin_before else d for d in deps]) if deps else deps
                            for deps in last[0])
        last = (carried, begin)
        s = join(s, step, carried)
    return s
