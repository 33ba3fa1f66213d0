"""The host's deferred moments as the simulator times them.

With clipping the streaming executor leaves the moments of some updates for after the step's update pass
(``ir.deferrable_opts``: a host update whose gradient buffer no later op of its step writes, a speculated update's
CHECK, a split layer whose every part read its gradient from such a buffer). Its one update worker computes them,
in a pass of their own, once the step's updates (and the split layers' state loads) are done and before anything
a later step gives it; the first gradient store into each such buffer waits for them, and so do the next state
loads of a split layer. The IR has no op for that pass: :func:`plan_moments` says what it holds and what waits for
it, and :func:`~megatrain.planner.simulate.simulate` runs it on the host's queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.ir import Op, OpKind, Schedule, Stream, op_params
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec


@dataclass
class Moments:
    tasks: list[tuple[int, float, list[int]]] = field(default_factory=list)  # in the worker's order: (step,
    # seconds alone, ops that end before it starts)
    gate: dict[int, int] = field(default_factory=dict)  # op id -> the task it waits for

    def seconds(self, step: int) -> float:
        return sum(secs for k, secs, _ in self.tasks if k == step)

    def pseudo_op(self, task: int) -> Op:
        """A task as an op of the host's queue (id -1 - task: no op of the schedule)."""
        return Op(-1 - task, OpKind.CHECK, Stream.CPU, self.tasks[task][0], 0)


def plan_moments(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec, deferred: frozenset[int]) -> Moments:
    """The moments tasks of ``schedule`` and what waits for each (``deferred``: the ops ``ir.deferrable_opts``
    gives): one a deferred host update (or CHECK), one a split layer (its parts' params, after its parts' state
    loads), each step's the last deferred first, after the step's host ops; nothing where the spec has no rate for
    the pass or the plan does not clip."""
    out = Moments()
    cfg = schedule.config
    if not (spec.cpu_moments_params_per_s and spec.cpu_adam_master_params_per_s and cfg.clip):
        return out
    rate = spec.cpu_moments_params_per_s
    host_end: dict[int, int] = {}  # step -> its last host op
    loads: dict[tuple[int, object], list[Op]] = {}  # (step, ("L", split layer)) -> its parts' state loads
    params: dict[int, dict[object, int]] = {}  # step -> task key -> its parameters, in the order the step defers them
    for op in schedule.ops:
        if op.stream is Stream.CPU:
            host_end[op.step] = op.id
        if op.kind is OpKind.LOAD_OPT and op.mb is not None:
            loads.setdefault((op.step, _key(op)), []).append(op)
        if op.id in deferred:
            keys = params.setdefault(op.step, {})
            keys[_key(op)] = keys.get(_key(op), 0) + op_params(graph, cfg, op)
    names: dict[tuple[int, object], list[object]] = {}  # (step, task key) -> what waits for the task: the key and
    # for a split layer its host buffer (key: a host buffer, or ("L", split layer))
    for k, keys in params.items():
        for key in reversed(keys):  # the last deferred first
            parts = loads.get((k, key), [])
            names[(k, key)] = list(dict.fromkeys([key, *(op.slot("h") for op in parts)]))
            out.tasks.append((k, keys[key] / rate, ([host_end[k]] if k in host_end else []) + [op.id for op in parts]))
    task = {key: i for i, key in enumerate(names)}
    latest: dict[object, tuple[int, int]] = {}  # a name -> (step, task) of its latest task, as ops go by
    for op in schedule.ops:
        key = _key(op)
        if op.id in deferred:
            latest.update(dict.fromkeys(names[(op.step, key)], (op.step, task[(op.step, key)])))
        elif key in latest and latest[key][0] < op.step and (
                op.kind is OpKind.STORE_G and op.stream is Stream.D2H or op.kind is OpKind.LOAD_OPT):
            out.gate[op.id] = latest.pop(key)[1]
    return out


def _key(op: Op) -> object:
    """What a moments task is of: a split layer's parts' ("L", layer), any other op's host buffer."""
    return ("L", op.layer) if op.kind in (OpKind.STORE_OPT, OpKind.LOAD_OPT) and op.mb is not None else op.slot("h")
