"""Capture: a causal-LM ``nn.Module`` -> LayerGraph + one weightless template per layer structure.

The model is traced with ``torch.fx`` with each decoder block (the modules of the model's block ``ModuleList``),
each rotary-embedding module and HF's attention-mask builders as leaves. The traced graph is cut into layers:

- layer 0, the *embedding*: everything that computes the first block's hidden-state input and the *side inputs*
  the blocks take (attention masks, rotary tables, position ids), from ``input_ids`` and ``attention_mask``;
- one layer per block call;
- a *norm* layer: what lies between the last block and the head (final norm, slicing);
- the *head* layer: the last module call that owns parameters, and what follows it (e.g. logit soft-capping).
  It returns logits; megatrain computes the loss.

Templates are GraphModules / modules over a copy of the model whose parameters are on the meta device, so they hold
no weights; calling one puts views of a flat weight buffer in place of its parameters for that call
(``runtime/layers/templates.py``). Blocks whose structure (class, parameter shapes, non-tensor attributes except
``layer_idx``) is equal share one. The user's model is only read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from megatrain.capture import documents, grouped_experts, packed_attention, split_blocks
from megatrain.capture.blocks import find_blocks, mlp_tileable, recurrence
from megatrain.capture.fx_graph import (ancestors, dependence, named_arg, node_params, only_mask_builders_read,
                                       reads_metadata, source_block, subgraph, trained_ancestors)
from megatrain.capture.meta import (block_buffers, block_buffers_as_parameters, materialize_meta_buffers, meta_copy,
                                    structural_copy)
from megatrain.capture.params import no_decay_names, router_aux_of
from megatrain.capture.shared_state import PerMicroBatch
from megatrain.capture.tracer import (EXAMPLE_BATCH, EXAMPLE_SEQ, CaptureError, Root, is_mask_builder, rebind_config,
                                      takes_positions, trace)
from megatrain.ir import Layer, LayerGraph
from megatrain.layout import NORM_WITH_MLP, UNREAD_PROJECTION
from megatrain.planner.graph import DecoderShape, carry_bytes, latent_attention, layer_costs, moe_block, moe_of
from megatrain.planner.hybrid import as_recurrence


@dataclass
class ParamRef:
    name: str  # name inside the template (the parameter a call binds to a view of the slot)
    model_name: str  # the parameter's name in the user's model state_dict
    offset: int  # element offset in the owner layer's flat block
    shape: tuple[int, ...]


@dataclass
class Segment:
    """One layer: how to call its template and which weights it binds."""

    index: int
    name: str
    kind: str  # embedding | block | norm | head
    template: nn.Module
    template_key: str
    params: list[ParamRef] = field(default_factory=list)  # views into the owner's flat block
    owner: int = 0  # layer whose host block holds the weights (itself unless tied)
    numel: int = 0  # elements of the owner's flat block this layer owns (0 when tied)
    call_args: Any = None  # blocks: fx args/kwargs structure, side inputs appear as node names; norm and head:
    # the names of the side inputs they take after the hidden state
    tuple_out: bool = False  # blocks return a tuple whose first item is the hidden state
    # blocks: the items of its output the next block takes besides the hidden state (GLM-MoE-DSA's top-k indices),
    # as (index in the output tuple, the side-input name the next block's call_args read it by)
    carries: list[tuple[int, str]] = field(default_factory=list)
    patches: list = field(default_factory=list)  # (module, name, value) set only while the template runs


@dataclass
class Captured:
    graph: LayerGraph
    segments: list[Segment]
    side_names: list[str]  # names of the side inputs the embedding layer returns after the hidden state (for the
    # blocks, and values computed from the inputs that the layers after them read)
    model_param_names: dict[str, tuple[int, int, tuple[int, ...]]]  # model name -> (owner layer, offset, shape)
    tied_names: dict[str, str]  # extra model names that alias another parameter (tied weights)
    hidden_size: int
    vocab_size: int
    # the embedding layer reads attention_mask only through HF's mask builders, which treat None as "no padding":
    # a batch without padding can pass None and skip their check of the mask's values (a device-to-host sync)
    mask_optional: bool = False
    frozen: frozenset[str] = frozenset()  # parameters with requires_grad=False: no gradient, never updated
    no_decay: frozenset[str] = frozenset()  # exempt from weight decay by the HF Trainer's rule (biases, norm weights)
    # the model takes position ids, and its mask builders keep documents packed into one row apart by them (see
    # tracer.PACKED): rows may hold several documents
    packs: bool = False
    # packed rows' attention runs over their documents' offsets (capture.packed_attention) where the runtime gives them
    varlen: bool = False
    docs_apart: bool = False  # the blocks' recurrences run packed rows' documents apart (capture.documents)
    # the router load-balancing loss HF adds to this mixture-of-experts model's loss (runtime.layers.router_aux), if any
    router_aux: object | None = None
    # side inputs of the blocks computed from parameters: their gradients from the blocks' backward go back through
    # the embedding layer's (runtime.ops.compute)
    grad_sides: list[str] = field(default_factory=list)
    # the blocks of a micro-batch share one object through which some reuse what others stored (Gemma's keys and
    # values: capture.shared_state.PerMicroBatch)
    shared_state: bool = False
    # the experts run through capture.grouped_experts (transformers' grouped_mm experts were the model's choice)
    grouped_experts: bool = False
    # where the model's attention holds a (heads, T, T) matrix of scores on the GPU (HF's eager attention, which this
    # family's variant needs: soft-capping, ...): one line saying so and what to set; None where a fused kernel runs
    unfused_attention: str | None = None


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module.get_submodule(path)``, or None where there is none."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _setting(cfg, key: str, default=None):
    """A config attribute, or ``default``; a config that keeps it per layer (Gemma 4's head_dim) and refuses a global
    read gives the value in its dict; a list of sizes, one a layer, its largest."""
    try:
        v = getattr(cfg, key, default)
    except Exception:  # noqa: BLE001 - transformers' error for a per-layer attribute
        v = cfg.to_dict().get(key, default)
    return max(v) if isinstance(v, (list, tuple)) and v else v  # (a size per layer: Gemma 3n's MLP widths)


def _floating(node: torch.fx.Node) -> bool:
    """Whether a traced value may take a gradient: not an integer or boolean tensor (by its example)."""
    example = node.meta.get("example")
    return not isinstance(example, torch.Tensor) or example.is_floating_point()


def _shares(call) -> bool:
    """Whether a block's call (args, kwargs) hands it the micro-batch's shared object."""
    found: list = []
    torch.fx.node.map_aggregate(call, lambda a: found.append(a) if isinstance(a, PerMicroBatch) else None)
    return bool(found)


def _structure_key(mod: nn.Module) -> str:
    parts = [type(mod).__qualname__]
    for name, sub in mod.named_modules():
        attrs = sorted((k, repr(v)) for k, v in vars(sub).items()
                       if not k.startswith("_") and k not in ("training", "layer_idx")
                       and isinstance(v, (int, float, str, bool, type(None), tuple)))
        parts.append(f"{name}:{type(sub).__qualname__}:{attrs}")
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in mod.named_parameters()]
    return f"{type(mod).__name__}-{hashlib.sha1('|'.join(parts).encode()).hexdigest()[:10]}"


def capture(model: nn.Module, *, compute_dtype: torch.dtype = torch.float32,
            blocks: str | nn.ModuleList | None = None) -> Captured:
    """Trace ``model`` and cut it into layers. ``compute_dtype``: the dtype the runtime binds weights in (the
    traced code's dtype-dependent branches and constants follow it); ``blocks``: the ModuleList of decoder blocks
    (or its path), where :func:`~megatrain.capture.blocks.find_blocks` would not find it. Raises
    :class:`CaptureError` naming what was not understood."""
    hf = hasattr(model, "config") and hasattr(model, "get_output_embeddings")
    if block_buffers(find_blocks(model, blocks)[1]):  # they become parameters of a copy: the caller's model is read
        if isinstance(blocks, nn.ModuleList):
            blocks = next((n for n, m in model.named_modules() if m is blocks), blocks)
        model = structural_copy(model)
        block_buffers_as_parameters(find_blocks(model, blocks)[1])
    if any(b.is_meta for b in model.buffers()):
        # built on the meta device: constants the trace computes from buffers (a scale cast to the compute dtype)
        # need their values, so a copy with its buffers rebuilt is traced
        if isinstance(blocks, nn.ModuleList):
            blocks = next((n for n, m in model.named_modules() if m is blocks), blocks)
        model = meta_copy(model)
        materialize_meta_buffers(model)
    blocks_name, block_list = find_blocks(model, blocks)
    # the router loss is the runtime's (runtime.layers.router_aux): the trace takes the forward without it (HF's would
    # compute it from router logits that the blocks, traced as leaves, do not record)
    routed = getattr(getattr(model, "config", None), "output_router_logits", False)
    if routed:
        model.config.output_router_logits = False
    try:
        traced = trace(model, block_list, blocks_name, hf, compute_dtype)
    finally:
        if routed:
            model.config.output_router_logits = True
    graph = traced.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    block_path = {f"m.{blocks_name}.{i}": i for i in range(len(block_list))}
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in block_path]
    if [block_path[n.target] for n in calls] != list(range(len(block_list))):
        raise CaptureError(f"{type(model).__name__}: the blocks of '{blocks_name}' are not each called once in order "
                           f"(calls: {[n.target for n in calls]}); pass compile(blocks='...') naming the decoder's")
    tuple_out = False
    for prev, cur in zip(calls, calls[1:]):
        h = cur.args[0] if cur.args else None
        if h is prev:
            continue
        if isinstance(h, torch.fx.Node) and h.target is operator.getitem and h.args == (prev, 0):
            tuple_out = True
            continue
        raise CaptureError(f"{type(model).__name__}: block '{cur.target[2:]}' does not take the previous block's "
                           f"output as its first argument (found {h}); only a chain of blocks can be streamed")
    h0 = calls[0].args[0] if calls[0].args else None
    if not isinstance(h0, torch.fx.Node):
        raise CaptureError(f"{type(model).__name__}: the first block takes no hidden-state argument")
    sides: dict[torch.fx.Node, None] = {}
    block_set = set(calls)
    if tuple_out:
        block_set |= {u for c in calls for u in c.users if u.target is operator.getitem}
    after_blocks, from_inputs = dependence(graph, block_set)
    carries: dict[int, list[tuple[int, str]]] = {}  # block -> (item of its output, name): what it hands the next
    for i, c in enumerate(calls):
        args: list[torch.fx.Node] = []
        torch.fx.node.map_arg((c.args[1:], c.kwargs), args.append)
        carried = [n for n in args if tuple_out and i and n.target is operator.getitem and n.args[0] is calls[i - 1]
                   and n.args[1] != 0]
        carries[i - 1] = [(n.args[1], n.name) for n in carried]
        args = [n for n in args if n not in carried]
        late_arg = next((n for n in args if n in after_blocks), None)
        if late_arg is not None:
            raise CaptureError(f"{type(model).__name__}: block '{c.target[2:]}' takes {named_arg(c, late_arg)}, "
                               f"computed from {source_block(late_arg, calls)}: state carried from block to block "
                               f"besides the hidden state, which layers streamed one at a time do not carry (the "
                               f"other inputs of the blocks must be computed before the first)")
        sides.update(dict.fromkeys(args))
    # side inputs computed from parameters (Gemma 4's per-layer inputs, Zamba2's embeddings): the blocks' backward
    # gives them a gradient, which the embedding's backward takes on to those parameters
    grad_sides = [n for n in sides if _floating(n) and trained_ancestors(traced, n, block_set)]
    odd = next((n for n in grad_sides if not isinstance(n.meta.get("example"), torch.Tensor)), None)
    if odd is not None:
        raise CaptureError(f"{type(model).__name__}: the blocks take '{odd.name}', computed before the first block "
                           f"from parameters, which is not one tensor: only a tensor side input takes its gradient "
                           f"back to them")
    # their bytes a token (the examples' sizes over the example batch's tokens), and their gradients'
    grad_side_bytes = 2 * sum(ex.numel() * ex.element_size() // (EXAMPLE_BATCH * EXAMPLE_SEQ) for n in grad_sides
                              if isinstance(ex := n.meta.get("example"), torch.Tensor))
    out_node = next(n for n in graph.nodes if n.op == "output")
    logits = out_node.args[0]
    last = calls[-1]
    h_last = next((u for u in last.users if u.target is operator.getitem), last) if tuple_out else last
    # what follows the blocks may use values computed from the inputs before them (GPT-2 and GPTBigCode reshape the
    # final hidden state to a shape taken from input_ids): the embedding layer computes those once per micro-batch
    # and passes them on as side inputs, as it does the blocks' masks; values from the parameters alone (a tied
    # weight read by the head) stay where they are used
    epi_all = ancestors([logits], stop={h_last})
    late = [n for n in sorted(epi_all, key=order.__getitem__) if n not in after_blocks and n in from_inputs
            and n not in sides and any(u in after_blocks for u in n.users)]
    epilogue = [n for n in ancestors([logits], stop={h_last, *late}) if n not in set(late)]
    for n in late:  # (GPT-2 reads only the shape of its embeddings' output after the blocks)
        trained = not all(reads_metadata(u) for u in n.users if u in epi_all) and \
            trained_ancestors(traced, n, block_set)
        if trained:
            raise CaptureError(f"{type(model).__name__}: the layers after the blocks take '{n.name}', computed before "
                               f"the first block from the parameters {trained[:3]}, whose gradient megatrain does "
                               f"not take back through them")
    if any(n.op == "placeholder" for n in epilogue):
        raise CaptureError(f"{type(model).__name__}: the head reads the model's inputs directly")
    meta_model = meta_copy(model)
    materialize_meta_buffers(meta_model)
    meta_root = Root(meta_model, hf)
    for n in graph.nodes:  # tensors the trace made constants (a dtype known while tracing makes torch.tensor(x,
        # dtype=...) a value): on the root the layers' graphs are built over
        if n.op == "get_attr" and "." not in n.target and not hasattr(meta_root, n.target):
            meta_root.register_buffer(n.target, getattr(traced, n.target))
    head_calls = [n for n in sorted(epilogue, key=order.__getitem__) if n.op == "call_module"
                  and any(True for _ in traced.get_submodule(n.target).parameters())]
    if not head_calls:
        raise CaptureError(f"{type(model).__name__}: no module with parameters after the last block (the lm head)")
    head = head_calls[-1]
    head_in = head.args[0]
    stop = {h_last, *late}
    norm_nodes = [n for n in ancestors([head_in], stop=stop)] if head_in is not h_last else []
    head_nodes = [n for n in epilogue if n not in set(norm_nodes)]

    segs: list[tuple[str, str, nn.Module, Any]] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    emb_nodes = set(ancestors([h0, *sides, *late], stop=block_set)) - set(placeholders)
    emb_graph = subgraph(order, emb_nodes, placeholders, [h0, *sides, *late])
    mask_optional = only_mask_builders_read(emb_graph, "attention_mask")
    segs.append(("embed", "embedding", torch.fx.GraphModule(meta_root, emb_graph), None))
    templates: dict[str, nn.Module] = {}
    block_of: list[int | None] = [None]  # per layer: the block it runs (part of: split_blocks)
    for i, c in enumerate(calls):
        blk = meta_model.get_submodule(f"{blocks_name}.{i}")
        for part in split_blocks.parts(blk) or [blk]:
            key = _structure_key(part)
            templates.setdefault(key, part)
            segs.append((f"{blocks_name}.{i}", "block", templates[key], (c.args[1:], c.kwargs)))
            block_of.append(i)

    def tail(nodes, x, out):  # a layer after the blocks: input x, the late side inputs it reads, output out
        reads = [n for n in late if any(u in set(nodes) for u in n.users)]
        gm = torch.fx.GraphModule(meta_root, subgraph(order, set(nodes), [x, *reads], [out]))
        return gm, [n.name for n in reads]

    if norm_nodes:
        norm_gm, norm_sides = tail(norm_nodes, h_last, head_in)
        if node_params(norm_gm, norm_gm.graph):
            segs.append(("norm", "norm", norm_gm, norm_sides))
        else:  # nothing to train between the blocks and the head: it runs as part of the head
            head_nodes, norm_nodes = epilogue, []
    segs.append(("head", "head", *tail(head_nodes, head_in if norm_nodes else h_last, logits)))
    captured = _assemble(model, blocks_name, segs, [n.name for n in (*sides, *late)], tuple_out,
                         torch.finfo(compute_dtype).bits // 8, carries, block_of, grad_side_bytes)
    captured.mask_optional = mask_optional
    captured.grad_sides = [n.name for n in grad_sides]
    captured.shared_state = any(_shares(seg.call_args) for seg in captured.segments if seg.kind == "block")
    builders = any(is_mask_builder(n.target) for n in emb_graph.nodes if n.op == "call_function")
    apart, changed = documents.keep_apart(model, captured.segments, emb_graph)
    captured.packs = mask_optional and takes_positions(model, hf) and builders and apart
    captured.docs_apart = captured.packs and changed
    switched = packed_attention.enable(meta_model)  # (a family with sinks takes the flash kernel packed or not)
    if switched:  # the mask builders were traced with the caller's config: they read the switched copy's instead
        for n in graph.nodes:
            if n.op == "call_function" and is_mask_builder(n.target):
                rebind_config(n.target, meta_model.config)
    captured.varlen = captured.packs and switched
    captured.unfused_attention = packed_attention.unfused(meta_model)
    captured.grouped_experts = grouped_experts.enable(meta_model)
    return captured


def _assemble(model: nn.Module, blocks_name: str, segs, side_names: list[str], tuple_out: bool,
              act_dtype_bytes: int, carries: dict[int, list[tuple[int, str]]], block_of: list,
              grad_side_bytes: int) -> Captured:
    canonical: dict[int, str] = {}
    tied_names: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            tied_names[name] = canonical[id(p)]
        else:
            canonical[id(p)] = name
    owner_of: dict[str, tuple[int, int]] = {}  # canonical model name -> (owner layer, offset)
    numel = []
    segments: list[Segment] = []
    layers: list[Layer] = []
    trainable: list[int] = []  # per layer: elements of its own weights that train (laid out first)
    cfg = getattr(model, "config", None)
    for idx, (name, kind, tmpl, call) in enumerate(segs):
        if kind == "block":
            pairs = [(pn, f"{name}.{pn}") for pn, _ in tmpl.named_parameters()]
        else:
            pairs = [(pn, pn[2:]) for pn in node_params(tmpl, tmpl.graph)]  # drop the "m." of the traced root
        # the parameters that train first, so that the Adam moments of a layer frozen in part cover a prefix of its
        # weights (Layer.trainable)
        pairs.sort(key=lambda pair: not model.get_parameter(pair[1]).requires_grad)
        refs, own, owners, trains = [], 0, set(), 0
        for tname, mname in pairs:
            p = model.get_parameter(mname)
            canon = canonical[id(p)]
            if canon not in owner_of:
                owner_of[canon] = (idx, own)
                own += p.numel()
                trains += p.numel() if p.requires_grad else 0
            owners.add(owner_of[canon][0])
            refs.append(ParamRef(tname, canon, owner_of[canon][1], tuple(p.shape)))
        if not refs:
            raise CaptureError(f"layer '{name}' has no parameters")
        if len(owners) > 1 or (own and owners != {idx}):
            raise CaptureError(f"layer '{name}' uses parameters of layers {sorted(owners)}: only a whole layer may be "
                               f"tied to one earlier layer")
        owner = owners.pop()
        numel.append(own)
        trainable.append(trains)
        key = _structure_key(tmpl) if kind == "block" else f"{kind}-{idx}"
        segments.append(Segment(idx, name, kind, tmpl, key, refs, owner, own, call))
    hidden = int(_setting(cfg, "hidden_size", 0) or max(r.shape[-1] for r in segments[0].params if len(r.shape) == 2))
    head_w = max((r for r in segments[-1].params if len(r.shape) == 2), key=lambda r: r.shape[0], default=None)
    vocab = int(_setting(cfg, "vocab_size", 0) or (head_w.shape[0] if head_w else 0))
    heads = _setting(cfg, "num_attention_heads", None)
    head_dim = (_setting(cfg, "head_dim", None) or hidden // heads) if heads else hidden
    shape = DecoderShape(hidden=hidden, q_dim=heads * head_dim if heads else hidden,
                         kv_dim=(_setting(cfg, "num_key_value_heads", None) or heads) * head_dim if heads else hidden,
                         inter=int(_setting(cfg, "intermediate_size", 0) or 4 * hidden), heads=heads or 1, vocab=vocab)
    cfg_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    if cfg_dict.get("num_hidden_layers", 0) is None:  # (a count a config class derives, e.g. Nemotron-H's)
        cfg_dict["num_hidden_layers"] = _setting(cfg, "num_hidden_layers", None)
    moe, mla = moe_of(cfg_dict), latent_attention(cfg_dict)
    if mla is not None:
        shape = dataclasses.replace(shape, q_dim=mla[0], kv_dim=mla[1])
    blocks_seen = 0
    for seg in segments:
        mat = sum(_numel(r.shape) for r in seg.params if len(r.shape) >= 2) if seg.kind != "embedding" else 0
        seg_shape, inactive, routed = shape, 0, None
        # the block's last layer (a block cut in two is two layers: split_blocks)
        last_part = seg.kind == "block" and (seg.index + 1 == len(block_of) or block_of[seg.index + 1] != block_of[
            seg.index])
        if seg.kind == "block":
            if moe is not None and blocks_seen in moe.layers:  # a token's matmuls use its top-k experts only
                mat += moe.top_k * 3 * hidden * moe.expert_inter - moe.expert_params(hidden)
                inactive, routed = moe.inactive_params(hidden), moe
                seg_shape = dataclasses.replace(shape, inter=moe_block(moe, hidden)[2])
            elif moe is not None:
                seg_shape = dataclasses.replace(shape, inter=moe.dense_inter)
            blocks_seen += last_part
        # a dense block's MLP may run over tiles of the tokens (runtime.layers.tiling) where its forward takes the
        # hidden states alone; not a mixture of experts' block
        mlp = getattr(seg.template, "mlp", None)
        tiles = moe is None and isinstance(mlp, nn.Module) and mlp_tileable(mlp)
        residual_mlp = tiles and cfg_dict.get("model_type") in NORM_WITH_MLP
        norm = residual_mlp and isinstance(getattr(seg.template, "post_attention_layernorm", None), nn.Module)
        costs = layer_costs(seg.kind, seg_shape, mat, act_dtype_bytes, tiles=tiles, tile_norm=norm, moe=routed,
                            unread_down=residual_mlp and isinstance(_submodule(seg.template, UNREAD_PROJECTION),
                                                                     nn.Linear),
                            grouped_attention=packed_attention.takes_flash(cfg))
        if seg.kind == "block" and mla is not None:
            costs["attn_flops_per_token_per_seq"] = float(mla[2])
        if seg.kind == "block" and (rec := recurrence(seg.template, act_dtype_bytes)) is not None:
            costs = as_recurrence(costs, *rec)  # a gated delta net instead of softmax attention
        seg.carries = carries.get(block_of[seg.index], []) if last_part else []
        costs["act_bytes_per_token"] *= getattr(seg.template, "width_factor", 1)
        carried = grad_side_bytes if seg.kind == "embedding" else 0  # side inputs the blocks give a gradient, and
        # that gradient
        if seg.carries:
            try:
                carried += carry_bytes(cfg_dict)
            except ValueError as e:
                raise CaptureError(f"block '{seg.name}': {e}") from None
        if seg.kind == "block" and _shares(seg.call_args):  # keys and values stored for later blocks, their gradient
            carried += 4 * act_dtype_bytes * sum(
                m.k_proj.out_features for m in seg.template.modules() if getattr(m, "store_full_length_kv", False))
        if carried:
            costs["carry_bytes_per_token"] = carried
        layers.append(Layer(name=seg.name, kind=seg.kind, template=seg.template_key, params=seg.numel,
                            tie=seg.owner if seg.owner != seg.index else None, inactive_params=inactive, **costs))
    # in the model's parameter order (a global gradient norm sums per-parameter norms in it, as
    # torch.nn.utils.clip_grad_norm_ does)
    names = {canon: (*owner_of[canon], tuple(model.get_parameter(canon).shape)) for canon in canonical.values()
             if canon in owner_of}
    missing = [n for n in canonical.values() if n not in owner_of]
    if missing:
        raise CaptureError(f"parameters never used by the traced forward: {missing[:5]}")
    graph = LayerGraph(layers, name=getattr(cfg, "model_type", None) or type(model).__name__)
    for seg in segments:
        seg.tuple_out = tuple_out and seg.kind == "block"
    frozen = frozenset(n for n in names if not model.get_parameter(n).requires_grad)
    if len(frozen) == len(names):
        raise CaptureError("every parameter of the model has requires_grad=False: there is nothing to train")
    if frozen:  # layers with nothing to update keep no optimizer state, those frozen in part keep some
        graph = LayerGraph([dataclasses.replace(lay, frozen=True) if lay.params and not trainable[i] else
                            dataclasses.replace(lay, trainable=trainable[i]) if trainable[i] < lay.params else lay
                            for i, lay in enumerate(graph.layers)], name=graph.name)
    return Captured(graph, segments, side_names, names, tied_names, hidden, vocab, frozen=frozen,
                    no_decay=frozenset(no_decay_names(model)) & frozenset(names),
                    router_aux=router_aux_of(model))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
