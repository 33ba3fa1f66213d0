"""The model as the planner and the runtime both see it: a chain of :class:`Layer` (the numbers the planner needs of
each) in execution order, with which layer owns the weights a tied layer uses."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

# micro-batches of this many tokens or more run the attention's backward one key/value head's group of query heads
# at a time where the flash kernel takes it (capture.packed_attention): the kernel's own buffers (an fp32 query-
# gradient accumulator, the key/value gradients expanded to every query head) are then a group's, not the layer's
# (14.0 GiB against 4.6 for a block of Qwen2.5-7B's shape at 524,288 tokens)
GROUPED_ATTN_TOKENS = 131072


@dataclass(frozen=True, kw_only=True)
class Layer:
    name: str  # e.g. "embed", "block.3", "norm", "head"
    kind: str  # "embedding" | "block" | "norm" | "head"
    template: str  # layers with equal template keys share one weightless template
    params: int  # parameters this layer owns (0 for a head tied to the embedding)
    tie: int | None = None  # index of the layer whose weights this layer uses (tied head), else None
    matmul_flops_per_token: float = 0.0  # forward FLOPs per token that do not depend on sequence length
    attn_flops_per_token_per_seq: float = 0.0  # forward attention FLOPs per token per token of sequence length
    act_bytes_per_token: int = 0  # bytes per token of this layer's output (the next layer's checkpoint)
    work_bytes_per_token: int = 0  # bytes per token of activations the forward builds for backward
    logit_bytes_per_token: int = 0  # head only: bytes of one token's fp32 logits row
    # head only: bytes of one token's logits row in the compute dtype (the fused loss's chunks); 0: fp32, as above
    loss_logit_bytes_per_token: int = 0
    # bytes per token of what the forward saves for backward (activations only; the weights it saves are views of
    # the weight slot, found again there by the BWD): what a layer in ScheduleConfig.saved_acts keeps on the
    # device from its FWD to its BWD. 0: the layer's backward always recomputes
    saved_bytes_per_token: int = 0
    # the same when the plan has saved layers keep less (ScheduleConfig.saved_lean): products that are cheap to
    # form again (the kernel MLP's silu(gate) * up) are recomputed in the backward instead. 0: no such variant
    lean_saved_bytes_per_token: int = 0
    # of ``params``, those a token's compute does not touch: a mixture-of-experts block's experts beyond its top-k
    # (on average over tokens); 0 for a dense layer
    inactive_params: int = 0
    # every parameter the layer owns is frozen (requires_grad=False): never updated, so the host keeps its master
    # weights alone, no Adam moments (4 bytes per parameter instead of 12), and no plan updates it on the device
    frozen: bool = False
    # of work_bytes_per_token, the share a tiled forward holds for one tile of tokens at a time (a dense block's MLP:
    # gate, up and their product; ScheduleConfig.seq_tile), and the FLOPs per token of that part's forward, which a
    # tiled backward runs once more (each tile recomputed ahead of its backward) unless the layer's recompute leaves
    # its last projection out (unread_flops_per_token: the tiles then formed in the backward alone). 0: not tiled
    tile_work_bytes_per_token: int = 0
    tile_flops_per_token: float = 0.0
    # some of the layer's parameters are frozen: the first ``trainable`` elements of its weights are the ones that
    # train (capture lays them out first) and only they have Adam moments; None: all of them train (or none, frozen)
    trainable: int | None = None
    # a mixture-of-experts block: bytes per token one forward moves routing its tokens to their experts and back,
    # beyond the experts' GEMMs -- per routed copy of a token (top-k of them) the hidden-wide rows gathered by
    # expert, weighted and summed back per token (7 row reads and writes) and the gate / up rows the activation reads
    # and writes (3 of the expert's width). 0: a dense layer
    route_bytes_per_token: int = 0
    # of ``params``, those whose weight gradient autograd returns in the compute dtype for the executor to add into
    # the layer's fp32 gradient slot after each backward (a mixture of experts' routed experts, held as grouped
    # weights; the linears write theirs into the slot from their GEMM): cost.GRAD_ADD_BYTES each a backward. 0: none
    grad_add_params: int = 0
    # forward FLOPs per token a recomputing backward leaves out: the projection whose result only the block's
    # closing residual sum reads (a dense block's MLP down projection, :data:`UNREAD_PROJECTION`), which the
    # backward needs the input and weights of, not the product (runtime.layers.grad_sink.outputs_unread). 0: none
    unread_flops_per_token: float = 0.0
    # bytes per token the fused attention kernel's backward allocates inside itself, beyond its inputs and the
    # gradients it returns: the flash kernel's fp32 accumulator of the query gradient and, where keys and values
    # have fewer heads than queries, their gradients expanded to every query head before the sum (in the compute
    # dtype). 0: a layer without attention
    attn_bwd_bytes_per_token: int = 0
    # the same where the backward runs one key/value head's group of query heads at a time (micro-batches of
    # GROUPED_ATTN_TOKENS tokens or more, capture.packed_attention): one group's buffers and the group's gradients
    # before they are copied into the whole ones
    attn_bwd_group_bytes_per_token: int = 0
    # bytes per token of what the block hands the next besides its hidden state (GLM-MoE-DSA's top-k indices:
    # capture's Segment.carries), on the device from its forward to the end of the step's backward. 0: none
    carry_bytes_per_token: int = 0
    # forward FLOPs per token of a linear-attention layer's recurrence (the gated delta rule's chunk-local products,
    # triangular solves and its scan over chunks: ``planner.hybrid.delta_rule_costs``), linear in the tokens and run
    # at ``HardwareSpec.scan_flops_per_s``. 0: none
    scan_flops_per_token: float = 0.0
    # bytes per token of the recurrence's working set, formed for at most layout.DELTA_PIECE_TOKENS tokens at a time
    # (kernels.delta_rule), in its forward and again in its backward. 0: none
    scan_piece_bytes_per_token: int = 0

    @property
    def moment_params(self) -> int:
        """Elements of the layer's weights that have Adam moments on the host: those that train."""
        return 0 if self.frozen else self.params if self.trainable is None else self.trainable

    def saved_bytes(self, lean: bool) -> int:
        """Bytes per token this layer keeps as a saved layer, lean (``ScheduleConfig.saved_lean``) or not."""
        return self.lean_saved_bytes_per_token if lean and self.lean_saved_bytes_per_token else \
            self.saved_bytes_per_token

    def attn_bwd_bytes(self, tokens: int) -> int:
        """Bytes the attention kernel's backward holds inside itself for a micro-batch of ``tokens`` tokens."""
        grouped = tokens >= GROUPED_ATTN_TOKENS and self.attn_bwd_group_bytes_per_token
        return (self.attn_bwd_group_bytes_per_token if grouped else self.attn_bwd_bytes_per_token) * tokens

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token at ``seq_len`` (causal attention: keys average seq_len / 2)."""
        return self.matmul_flops_per_token + self.attn_flops_per_token_per_seq * seq_len + self.scan_flops_per_token


class LayerGraph:
    """A chain of :class:`Layer` in execution order, kept as a networkx DiGraph (node i -> node i+1)."""

    def __init__(self, layers: list[Layer], name: str = "model"):
        if len(layers) < 2:
            raise ValueError(f"a layer graph needs at least 2 layers (a first layer and a head), got {len(layers)}")
        if layers[-1].kind != "head":
            raise ValueError(f"the last layer must be the head+loss layer, got kind {layers[-1].kind!r}")
        for i, lay in enumerate(layers):
            if lay.tie is not None and not (0 <= lay.tie < i and layers[lay.tie].tie is None):
                raise ValueError(f"layer {i} ({lay.name}) ties to layer {lay.tie}, which is not an earlier owner")
            if lay.params < 0 or (lay.tie is None and lay.params == 0):
                raise ValueError(f"layer {i} ({lay.name}) has {lay.params} parameters and no tie")
        self.name = name
        self.layers: tuple[Layer, ...] = tuple(layers)
        self.g = nx.DiGraph()
        for i, lay in enumerate(layers):
            self.g.add_node(i, layer=lay)
        nx.add_path(self.g, range(len(layers)))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> Layer:
        return self.layers[i]

    def tied_to(self, i: int) -> list[int]:
        """Layers that use layer i's weights."""
        return [j for j, lay in enumerate(self.layers) if lay.tie == i]

    def owner(self, i: int) -> int:
        """Index of the layer whose host block holds layer i's weights."""
        tie = self.layers[i].tie
        return i if tie is None else tie

    def weight_params(self, i: int) -> int:
        """Parameters layer i reads (its own, or its owner's when tied)."""
        return self.layers[self.owner(i)].params

    def largest_weights(self) -> int:
        """Parameters of the largest weights any layer reads."""
        return max(self.weight_params(i) for i in range(len(self)))

    @property
    def n_params(self) -> int:
        return sum(lay.params for lay in self.layers)

    @property
    def active_params(self) -> int:
        """Parameters one token's compute uses (a mixture of experts' top-k share of its experts): the N of 6NT."""
        return self.n_params - sum(lay.inactive_params for lay in self.layers)

    @property
    def is_moe(self) -> bool:
        return any(lay.inactive_params for lay in self.layers)

    def train_flops(self, tokens: int, seq_len: int) -> float:
        """Model FLOPs of a training step over ``tokens`` tokens in sequences of ``seq_len``: forward and backward
        (twice the forward), not counting recomputation -- what model FLOPs utilization divides by time."""
        return 3.0 * tokens * sum(lay.flops_per_token(seq_len) for lay in self.layers)

    def templates(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, lay in enumerate(self.layers):
            out.setdefault(lay.template, []).append(i)
        return out
