"""Helpers over the traced graph that capture cuts into layers: a node's ancestors, a subgraph copied out as a
graph of its own, the parameters a graph reads, what depends on the blocks, and the words a refusal names a node
by."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from megatrain.capture.tracer import is_mask_builder


def ancestors(nodes, stop: set) -> list[torch.fx.Node]:
    """Every node ``nodes`` depend on (themselves included), not walking into ``stop``."""
    seen, todo = {}, list(nodes)
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen[n] = True
        todo.extend(n.all_input_nodes)
    return list(seen)


def subgraph(order: dict, nodes, inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> torch.fx.Graph:
    """A graph of ``nodes`` (copied in program order) taking ``inputs`` as placeholders and returning ``outputs``."""
    g = torch.fx.Graph()
    env = {n: g.placeholder(n.name if n.op == "placeholder" else f"in_{n.name}") for n in inputs}
    for n in sorted(nodes, key=order.__getitem__):
        if n not in env:
            env[n] = g.node_copy(n, lambda x: env[x])
    outs = [env[o] for o in outputs]
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    g.lint()
    return g


def node_params(gm: nn.Module, graph) -> list[str]:
    """Parameter names (qualified in ``gm``) a graph (or a list of its nodes) uses, in first-use order."""
    names = []
    for n in graph.nodes if isinstance(graph, torch.fx.Graph) else graph:
        if n.op == "get_attr":
            try:
                gm.get_parameter(n.target)
                names.append(n.target)
            except AttributeError:
                pass
        elif n.op == "call_module":
            names += [f"{n.target}.{pn}" for pn, _ in gm.get_submodule(n.target).named_parameters()]
    return list(dict.fromkeys(names))


def dependence(graph: torch.fx.Graph, block_set: set) -> tuple[set, set]:
    """(nodes that depend on a block's output, nodes that depend on the model's inputs)."""
    after, inputs = set(block_set), set()
    for n in graph.nodes:  # program order: a node's inputs come before it
        ins = n.all_input_nodes
        if n.op == "placeholder" or any(i in inputs for i in ins):
            inputs.add(n)
        if any(i in after for i in ins):
            after.add(n)
    return after, inputs


def named_arg(call: torch.fx.Node, arg: torch.fx.Node) -> str:
    """How ``call`` is given ``arg``, in words: the keyword it is passed by, if any, and the traced value's name."""
    for key, value in call.kwargs.items():
        found: list = []
        torch.fx.node.map_arg(value, found.append)
        if arg in found:
            return f"'{key}' ('{arg.name}')"
    return f"'{arg.name}'"


def source_block(node: torch.fx.Node, calls: list) -> str:
    """The block whose output ``node`` is computed from (the nearest one back along its inputs), in words."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop(0)
        if n in calls:
            return f"the output of block '{n.target[2:]}'"
        if n not in seen:
            seen.add(n)
            torch.fx.node.map_arg((n.args, n.kwargs), todo.append)
    return "an earlier block's output"


def only_mask_builders_read(graph: torch.fx.Graph, name: str) -> bool:
    """Whether the placeholder ``name`` is read only by HF mask builders recorded as leaf calls (see
    :func:`~megatrain.capture.tracer.leaf_function`)."""
    ph = next((n for n in graph.nodes if n.op == "placeholder" and n.name == name), None)
    if ph is None:
        return False
    return all(u.op == "call_function" and is_mask_builder(u.target) for u in ph.users)


_NO_GRAD_ATTRS = frozenset({"shape", "dtype", "device", "size", "dim", "ndim", "numel", "is_floating_point"})


def trained_ancestors(gm: nn.Module, node: torch.fx.Node, stop: set) -> list[str]:
    """The parameters ``node``'s value is differentiable in: its ancestors' parameters, not walking into ``stop``
    nor through what reads a tensor's metadata alone (its shape, dtype, device), HF's mask builders or rotary
    embeddings (whose outputs depend on their input's positions and dtype, not its values)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        if reads_metadata(n):
            continue
        if n.op == "call_function" and is_mask_builder(n.target):
            continue
        if n.op == "call_module" and type(gm.get_submodule(n.target)).__name__.endswith("RotaryEmbedding"):
            continue
        todo.extend(n.all_input_nodes)
    return node_params(gm, [n for n in seen])


def reads_metadata(n: torch.fx.Node) -> bool:
    """Whether ``n`` reads a tensor's shape, dtype or device, not its values."""
    return n.op in ("call_method", "call_function") and (n.target in _NO_GRAD_ATTRS or (
        getattr(n.target, "__name__", "") == "getattr" and bool(n.args[1:2]) and n.args[1] in _NO_GRAD_ATTRS))

