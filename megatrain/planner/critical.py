"""The critical path of a schedule as a networkx DAG: which ops, on which resources, bound its makespan.

The bound (:func:`megatrain.planner.simulate.bound`) takes the critical path's length in one pass over the ops in
program order, on plain lists (it runs for every candidate plan the search weighs). This module builds the same
ordering as a graph of events -- each op's start and end, an edge from start to end weighted with the op's
modelled duration, an edge from an op's end to the start of every op that depends on it or follows it in issue
order (``ir.issue_preds``), and, for a state load that may follow its layer's store of the step before a row behind
(``simulate.same_state``), an edge from the store's start weighted with one row of it and one from the store's end
to the load's end -- and asks networkx for the longest weighted path: its length is the bound's critical path
(tests check that they agree), and its ops say where the time goes (``megatrain plan`` prints the split by
resource). Run once per plan shown, not inside the search.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from megatrain.ir import Op, Schedule, Stream, deferrable_opts, issue_preds
from megatrain.layout import OPT_STATE_ROWS
from megatrain.planner.cost import duration_s
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.simulate import same_state


@dataclass(frozen=True)
class CriticalPath:
    length_s: float
    ops: tuple[Op, ...]  # the ops along it, in order (each op's duration counted where the path runs through it)
    by_stream_s: dict[str, float]  # the path's seconds inside ops, by the stream they run on

    def text(self) -> str:
        parts = ", ".join(f"{s} {v:.3f}" for s, v in sorted(self.by_stream_s.items(), key=lambda kv: -kv[1]) if v)
        return f"{self.length_s:.3f} s through {len(self.ops)} ops ({parts})"


def event_dag(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec) -> nx.DiGraph:
    """Nodes ("s", id) and ("e", id) for each op's start and end; edge weights in seconds."""
    g = nx.DiGraph()
    row = 1.0 / OPT_STATE_ROWS
    ops = schedule.ops
    cfg, deferred = schedule.config, deferrable_opts(schedule)
    for op, implicit in zip(ops, issue_preds(ops)):
        d = duration_s(graph, cfg, spec, op, deferred)
        g.add_edge(("s", op.id), ("e", op.id), weight=d, op=op.id)
        preds = set(op.deps) | set(implicit)
        for x in preds:
            if x in op.deps and same_state(op, ops[x]):  # after the store's first row; ends after the store
                g.add_edge(("s", x), ("s", op.id), weight=row * duration_s(graph, cfg, spec, ops[x], deferred))
                g.add_edge(("e", x), ("e", op.id), weight=0.0)
            else:
                g.add_edge(("e", x), ("s", op.id), weight=0.0)
    return g


def critical_path(schedule: Schedule, graph: LayerGraph, spec: HardwareSpec) -> CriticalPath:
    """The longest weighted path through :func:`event_dag`: its length (the bound's ``critical_path_s``), its ops
    and their seconds by stream."""
    if not schedule.ops:
        return CriticalPath(0.0, (), {})
    g = event_dag(schedule, graph, spec)
    path = nx.dag_longest_path(g, weight="weight", default_weight=0.0)
    ops, by_stream, length = [], dict.fromkeys((s.value for s in Stream), 0.0), 0.0
    for u, v in zip(path, path[1:]):
        w = g.edges[u, v]["weight"]
        length += w
        op_id = g.edges[u, v].get("op")
        if op_id is not None:
            op = schedule.ops[op_id]
            ops.append(op)
            by_stream[op.stream.value] += w
    return CriticalPath(length, tuple(ops), by_stream)
