"""Cost model: bytes and seconds of each op, slot sizes, device and host memory of a plan.

Every op's duration is a roofline of its own (FLOPs at the matmul rate vs. bytes at the memory or copy rate);
transfers are given at the rate of their direction alone; the simulator slows them when both directions run.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir import FORWARDS, POOLS, Op, OpKind, Schedule, ScheduleConfig, Stream, op_params, slot_params
from megatrain.layout import (DELTA_PIECE_TOKENS, GRAD_BYTES, HOST_UPDATE_CHUNK, IO_CHUNK_BYTES, KEPT_MASTER_BYTES,
                              LOSS_CHUNK_TOKENS, block_bytes, fmt_bytes, store_bytes, wire_stage_bytes)
from megatrain.planner.graph import LOSS_LOGITS_PER_CHUNK, LayerGraph
from megatrain.planner.hardware import HardwareSpec

# host memory a process holds besides the store, its buffers and checkpoints (CUDA context, libraries, Python): peak
# RSS less the planned figure, 1.59-1.66 GiB in six H200 runs of 1.8B-7.6B models (benchmark-history, lean store)
PROCESS_HOST_BYTES = int(1.7 * (1 << 30))
# host memory the stages of a run besides its steps take beyond the store, the largest of them (one at a time):
# loading a checkpoint (a chunk), saving or loading a state (none), exporting (a chunk read and its cast), each
# measured within it on a 291M-parameter store (tests/runtime/test_host_memory.py)
STAGE_HOST_BYTES = 2 * IO_CHUNK_BYTES
OPT_IN_BYTES = 12  # LOAD_OPT: master and moments (the gradient comes from the gradient slot on the device)
OPT_SLOT_BYTES = 16  # an optimizer slot: master, moments and gradient, fp32
OPT_OUT_BYTES = 12  # STORE_OPT: master and moments
OPT_MASTER_BYTES = 4  # STORE_OPT of a split update whose moments the host computes after the update pass
OPT_DEVICE_BYTES = 28  # AdamW on the device: reads 16, writes 12 bytes per parameter
COMPUTE_BYTES = 2  # bf16 weights on the device; a device-updated layer keeps its new weights so, for the next step
# threads that run a training step's GEMMs, each with a cuBLAS workspace of its own on the compute stream: the
# issuing thread (forwards, recomputes) and autograd's device thread (backwards); an evaluation runs forwards only
GEMM_THREADS = 2
# torch's caching allocator serves a request of 1 MiB or more from a cached free block up to this much larger (it
# splits off only a larger remainder), and counts the whole block as allocated: each such buffer a plan holds for
# long (a slot, a kept weight) may take this much beyond its count. Measured on the H200: six slots of a 1 GiB
# plan each took 1008 KiB more than asked for (5.9 MiB in all), which put the run 0.3 MiB over its budget
ALLOC_SLACK_BYTES = 1 << 20


def checkpoint_nbytes(graph: LayerGraph, cfg: ScheduleConfig, layer: int) -> int:
    """Bytes of one micro-batch's checkpoint at the input of ``layer`` (the output of ``layer - 1``)."""
    return graph[layer - 1].act_bytes_per_token * cfg.mb_tokens


def slot_nbytes(graph: LayerGraph, cfg: ScheduleConfig) -> dict[str, int]:
    """Size of one slot of each pool: weights (wire dtype), fp32 gradients, activations."""
    n = len(graph)
    return {
        "w": max(graph.weight_params(i) for i in range(n)) * cfg.wire_bytes_per_param,
        "g": max(graph.weight_params(i) for i in range(n)) * GRAD_BYTES,
        "a": max(checkpoint_nbytes(graph, cfg, i) for i in range(1, n)),
        "o": max([graph[l].params for l in cfg.gpu_opt] + [split_part_params(graph, cfg, l) for l in cfg.split_opt],
                 default=0) * OPT_SLOT_BYTES,
        "k": max((graph[l].params for l in cfg.grad_kept), default=0) * cfg.grad_host_bytes,
    }


def split_part_params(graph: LayerGraph, cfg: ScheduleConfig, layer: int) -> int:
    """Parameters of the largest part of a split update of ``layer`` (``ScheduleConfig.opt_part``)."""
    n = graph.weight_params(layer)
    return min(n, cfg.opt_part) if cfg.opt_part else n


def slot_sizes(graph: LayerGraph, schedule: Schedule) -> dict[str, list[int]]:
    """Bytes of each slot of each pool the schedule uses, by slot index (:func:`slot_params` at each pool's bytes
    per parameter); activation slots are all the largest checkpoint. Host gradient buffers (``h``) included."""
    cfg = schedule.config
    # weight slots at the wire's bytes: with an fp32 wire the slots hold the compute dtype, and the other half stays
    # counted for the staging buffer and what a 24 GiB 7B plan was measured to take beyond its slots (counted at 2
    # bytes it reached 25.1 GiB allocated against 23.5 planned: docs/benchmark-history.md, "Weights sent as fp32")
    per_param = {"w": cfg.wire_bytes_per_param, "g": GRAD_BYTES, "o": OPT_SLOT_BYTES, "h": cfg.grad_host_bytes,
                 "k": cfg.grad_host_bytes}
    checkpoint = slot_nbytes(graph, cfg)["a"]
    return {p: [checkpoint if p == "a" else n * per_param[p] for n in sizes]
            for p, sizes in slot_params(graph, schedule).items()}


def saved_nbytes(graph: LayerGraph, cfg: ScheduleConfig, layer: int) -> int:
    """Device bytes one micro-batch's forward of ``layer`` keeps for its backward when the layer is in
    ``saved_acts`` (0 otherwise)."""
    return graph[layer].saved_bytes(cfg.saved_lean) * cfg.mb_tokens if layer in cfg.saved_acts else 0


def recomputes(cfg: ScheduleConfig, op: Op) -> bool:
    """Whether a BWD recomputes its layer's forward (every layer not in ``saved_acts``)."""
    return op.kind is OpKind.BWD and op.layer not in cfg.saved_acts


def workspace_nbytes(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> int:
    """Transient device bytes a compute op allocates beyond the slots it names."""
    lay = graph[op.layer]
    t = cfg.mb_tokens
    work = lay.work_bytes_per_token * t + lay.scan_piece_bytes_per_token * min(t, DELTA_PIECE_TOKENS)
    if op.kind in (*FORWARDS, OpKind.BWD) and cfg.tiled(lay, op.layer):  # the tiled part for one tile at a time
        work -= lay.tile_work_bytes_per_token * (t - cfg.seq_tile)
    if op.kind in FORWARDS:
        return work
    if op.kind is OpKind.BWD:  # recomputed activations (unless saved) and their gradients, the attention
        # kernel's own buffers (Layer.attn_bwd_bytes), and the input's gradient, made while the input's checkpoint
        # is still held (the schedule writes it to that checkpoint's slot)
        dx = graph[op.layer - 1].act_bytes_per_token * t if op.layer else 0
        return (2 if recomputes(cfg, op) else 1) * work + lay.attn_bwd_bytes(t) + dx
    if op.kind is OpKind.LOSS:  # one chunk of the fused loss's logits (graph.LOSS_LOGITS_PER_CHUNK)
        return lay.work_bytes_per_token * t + loss_chunk_nbytes(lay, t)
    if op.kind is OpKind.EVAL:  # one chunk of fp32 logits
        return lay.work_bytes_per_token * t + min(t, LOSS_CHUNK_TOKENS) * lay.logit_bytes_per_token
    return 0


def loss_chunk_nbytes(lay, tokens: int) -> int:
    """Device bytes of one logits chunk of the fused loss over ``tokens`` tokens of the head ``lay``: rows of
    ``LOSS_LOGITS_PER_CHUNK // vocab`` tokens (at least one) in the compute dtype."""
    row = lay.loss_logit_bytes_per_token or lay.logit_bytes_per_token
    vocab = lay.logit_bytes_per_token // 4
    return min(tokens, max(1, LOSS_LOGITS_PER_CHUNK // max(1, vocab))) * row


def defers_head_store(graph: LayerGraph, cfg: ScheduleConfig) -> bool:
    """Whether the head's gradient waits in its gradient slot until the end of the backward (its STORE_G goes in
    right before the embedding's): with clipping, when the head's weights are updated on the device. The state
    loads then run in the order blocks first, the two largest layers (head, embedding) last, and so do the state
    stores of the step before: the next step's first load waits for the store of a block, not of the head (the
    store and load chains run a block apart, not a head apart). The held slot is one more gradient slot."""
    return cfg.clip and graph.owner(len(graph) - 1) in cfg.gpu_opt


def grad_slot_count(graph: LayerGraph, cfg: ScheduleConfig) -> int:
    """Gradient slots a schedule may use: ``grad_slots``, plus the head's while its store is deferred."""
    return cfg.grad_slots + defers_head_store(graph, cfg)


def tied_part(graph: LayerGraph, op: Op) -> bool:
    """A STORE_G to the host of a layer that reads another's weights (a tied head): its part of the owner's
    gradient is added to the owner's on the device, and the owner's store sends the sum."""
    return op.kind is OpKind.STORE_G and op.stream is Stream.D2H and graph.owner(op.layer) != op.layer


def weights_kept(cfg: ScheduleConfig, owner: int) -> bool:
    """Whether a step finds ``owner``'s weights on the device, left there by its device update of the step before
    (or by the set-up's KEEP_W)."""
    return owner in cfg.gpu_opt


def loads_from_device(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> bool:
    """A LOAD_W of weights a device update kept on the device (:func:`weights_kept`): a device copy, no PCIe
    bytes."""
    return op.kind is OpKind.LOAD_W and weights_kept(cfg, graph.owner(op.layer))


def transfer_nbytes(graph: LayerGraph, cfg: ScheduleConfig, op: Op, spec: HardwareSpec | None = None,
                    deferred: frozenset[int] | None = None) -> int:
    """Bytes an h2d/d2h op moves (0 for other ops); ``spec``: the hardware, where it decides what moves (a split
    update's store of a plan whose moments are deferred: :func:`defers_moments`, ``deferred`` as there)."""
    if op.kind is OpKind.LOAD_W:
        return 0 if loads_from_device(graph, cfg, op) else graph.weight_params(op.layer) * cfg.wire_bytes_per_param
    if op.kind is OpKind.KEEP_W:
        return graph.weight_params(op.layer) * cfg.wire_bytes_per_param
    if op.kind is OpKind.STORE_G:  # on the compute stream: a device copy into the optimizer slot
        return 0 if op.stream is Stream.COMPUTE or tied_part(graph, op) else \
            op_params(graph, cfg, op) * cfg.grad_host_bytes
    if op.kind is OpKind.LOAD_OPT:  # (a split update's part: with its gradient from the host buffer, if there)
        grad = cfg.grad_host_bytes if op.mb is not None and op.layer not in cfg.grad_kept else 0
        return op_params(graph, cfg, op) * (OPT_IN_BYTES + grad)
    if op.kind is OpKind.STORE_OPT:  # plus the refreshed bf16 shadow when that is what goes on the wire
        out = OPT_MASTER_BYTES if spec is not None and defers_moments(cfg, spec, op, deferred) else OPT_OUT_BYTES
        return op_params(graph, cfg, op) * (out + (2 if cfg.wire_bytes_per_param == 2 else 0))
    if op.kind in (OpKind.SAVE_ACT, OpKind.LOAD_ACT):
        return checkpoint_nbytes(graph, cfg, op.layer)
    return 0


def _passes(cfg: ScheduleConfig, op: Op) -> float:
    """A compute op's work in forward passes: forward 1; recompute + backward 3 (backward alone 2, for a layer in
    ``saved_acts``); loss = forward + backward 3; an evaluation's loss 1."""
    if op.kind is OpKind.BWD:
        return 3.0 if recomputes(cfg, op) else 2.0
    return {OpKind.FWD: 1.0, OpKind.REFWD: 1.0, OpKind.LOSS: 3.0, OpKind.EVAL: 1.0}.get(op.kind, 0.0)


# A fused attention's backward in forward passes: it forms the probabilities again and has five products to the
# forward's two (measured: docs/benchmark-history.md, "Long sequences").
ATTN_BWD_PASSES = 2.5


def _attn_passes(cfg: ScheduleConfig, op: Op) -> float:
    """A compute op's attention work in forward passes: forward 1; backward 2.5, and 1 more where it recomputes
    the forward."""
    if op.kind is OpKind.BWD:
        return ATTN_BWD_PASSES + (1.0 if recomputes(cfg, op) else 0.0)
    return 1.0 if op.kind in FORWARDS else 0.0


def matmul_and_attention_flops(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> tuple[float, float]:
    """A compute op's FLOPs: those of its matmuls (:func:`_passes` forward passes) and of its attention
    (:func:`_attn_passes`)."""
    lay = graph[op.layer]
    # a recompute leaves out the projection only the block's residual sum reads (Layer.unread_flops_per_token), and
    # tiled such an MLP costs no more (runtime.layers.tiling); a tiled one without it forms its tiles once more
    again = 0.0
    if op.kind is OpKind.BWD and cfg.tiled(lay, op.layer) and not lay.unread_flops_per_token:
        again = lay.tile_flops_per_token
    elif recomputes(cfg, op):
        again = -lay.unread_flops_per_token
    return ((_passes(cfg, op) * lay.matmul_flops_per_token + again) * cfg.mb_tokens,
            _attn_passes(cfg, op) * lay.attn_flops_per_token_per_seq * cfg.seq_len * cfg.mb_tokens)


def compute_flops(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> float:
    """FLOPs of a compute op: matmuls, attention and a linear-attention recurrence."""
    return sum(matmul_and_attention_flops(graph, cfg, op)) + scan_flops(graph, cfg, op)


# A mixture of experts' routing in a backward, in forwards' worth of its bytes: the gradients of the gathered,
# weighted and summed rows (each read and written as in the forward, the routing weights' gradient reading two
# more) and of the activation (its two inputs' gradients written)
ROUTE_BWD_PASSES = 1.5


def route_nbytes(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> float:
    """Bytes a compute op of a mixture-of-experts block moves routing tokens to experts (Layer.route_bytes_per_token
    a forward; a backward :data:`ROUTE_BWD_PASSES` of them, and one more where it recomputes the forward)."""
    per_token = graph[op.layer].route_bytes_per_token
    if not per_token or op.kind not in (*FORWARDS, OpKind.BWD, OpKind.EVAL):
        return 0.0
    passes = ROUTE_BWD_PASSES + (1.0 if recomputes(cfg, op) else 0.0) if op.kind is OpKind.BWD else 1.0
    return passes * per_token * cfg.mb_tokens


# A linear-attention recurrence's backward in forwards: it forms each piece's chunk-local algebra again and runs
# back through it, and the scan's backward has twice the forward's products (measured: 58 ms to an 18 ms forward,
# Qwen3-Next's heads at 32,768 tokens on the H100, docs/kernels.md)
SCAN_BWD_PASSES = 3.3


def scan_flops(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> float:
    """FLOPs of a compute op's linear-attention recurrence (Layer.scan_flops_per_token): a forward 1 pass, a backward
    :data:`SCAN_BWD_PASSES` and 1 more where it recomputes the forward."""
    per_token = graph[op.layer].scan_flops_per_token
    if not per_token or op.kind not in (*FORWARDS, OpKind.BWD, OpKind.EVAL):
        return 0.0
    passes = SCAN_BWD_PASSES + (1.0 if recomputes(cfg, op) else 0.0) if op.kind is OpKind.BWD else 1.0
    return passes * per_token * cfg.mb_tokens


GRAD_ADD_BYTES = 12  # a gradient in the compute dtype written, read, added to the fp32 slot (Layer.grad_add_params)


def compute_seconds(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec, op: Op) -> float:
    """A compute op's arithmetic time: its matmuls at the matmul rate, its attention at the attention rate, a
    linear-attention recurrence (:func:`scan_flops`) at the scan rate, and a mixture of experts' routing
    (:func:`route_nbytes`) at the routing rate and its experts' gradients' sum (Layer.grad_add_params) at the
    device memory's, after them (their kernels run between the GEMMs or after them, not under them)."""
    mm, attn = matmul_and_attention_flops(graph, cfg, op)
    route, scan = route_nbytes(graph, cfg, op), scan_flops(graph, cfg, op)
    return mm / spec.matmul_flops_per_s + attn / (spec.attn_flops_per_s or spec.matmul_flops_per_s) + \
        (route / (spec.route_bytes_per_s or spec.hbm_bytes_per_s) if route else 0.0) + \
        (graph[op.layer].grad_add_params * GRAD_ADD_BYTES if op.kind is OpKind.BWD else 0) / spec.hbm_bytes_per_s + \
        (scan / (spec.scan_flops_per_s or spec.matmul_flops_per_s) if scan else 0.0)


def compute_traffic_nbytes(graph: LayerGraph, cfg: ScheduleConfig, op: Op) -> float:
    """Device-memory bytes a compute op reads and writes, roughly (its activations, three times in backward)."""
    lay = graph[op.layer]
    per_token = lay.work_bytes_per_token + lay.act_bytes_per_token
    if op.kind in (OpKind.LOSS, OpKind.EVAL):  # logits written, read for the softmax (, gradient written)
        per_token += lay.logit_bytes_per_token
        return (3.0 if op.kind is OpKind.LOSS else 2.0) * per_token * cfg.mb_tokens
    traffic = _passes(cfg, op) * per_token * cfg.mb_tokens
    if cfg.saved_lean and op.kind is OpKind.BWD and op.layer in cfg.saved_acts:  # what it did not keep, formed
        # again from what it did: each byte written once, read from two inputs of its size
        traffic += 3 * (lay.saved_bytes_per_token - lay.saved_bytes(True)) * cfg.mb_tokens
    return traffic


def opt_seconds(cfg: ScheduleConfig, spec: HardwareSpec, p: int, deferred: bool = False) -> float:
    """Seconds of a host update of ``p`` parameters (a layer's, or one part of them); ``deferred``: one whose
    moments are left for later (:func:`defers_moments`)."""
    t = p / (spec.cpu_adam_master_params_per_s if deferred else spec.cpu_adam_params_per_s)
    if cfg.wire_bytes_per_param == 2:  # refresh the bf16 shadow that goes on the wire
        t += p / spec.cpu_cast_params_per_s
    if cfg.grad_host_bytes == 2:  # the bf16 gradient read back into fp32
        t += p / spec.cpu_cast_params_per_s
    return t


def duration_s(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec, op: Op,
               deferred: frozenset[int] | None = None) -> float:
    """Seconds ``op`` takes with its resource to itself (``deferred``: as :func:`defers_moments` takes it)."""
    k = op.kind
    if k in (*FORWARDS, OpKind.BWD, OpKind.LOSS, OpKind.EVAL):
        return max(compute_seconds(graph, cfg, spec, op),
                   compute_traffic_nbytes(graph, cfg, op) / spec.hbm_bytes_per_s,
                   spec.bwd_issue_s if k is OpKind.BWD else spec.fwd_issue_s)
    if k is OpKind.CHECK:  # on a step the clip factor leaves alone: the factor read, the moments made after the
        # update pass as a deferred update's are (not modelled; a clipped step's cost: speculation_redo_s)
        return 0.0
    if loads_from_device(graph, cfg, op) or k in (OpKind.GUARD, OpKind.LOAD_IN, OpKind.LOSS_OUT):
        # a device copy, a few scalars (the norms' norm, the factor, their copy out; the loss sums out), or a
        # micro-batch's inputs (at most 32 B a token: 16 MB for 512K tokens, a third of a millisecond on the wire):
        # not modelled
        return 0.0
    if k in (OpKind.LOAD_W, OpKind.KEEP_W, OpKind.LOAD_ACT, OpKind.LOAD_OPT):
        return transfer_nbytes(graph, cfg, op, spec, deferred) / spec.h2d_bytes_per_s
    if k is OpKind.STORE_G and op.stream is Stream.COMPUTE:  # read from the gradient slot, write the optimizer slot
        return graph.weight_params(op.layer) * 2 * GRAD_BYTES / spec.hbm_bytes_per_s
    if tied_part(graph, op):  # added to the owner's on the device, well under a millisecond: not modelled
        return 0.0
    if k is OpKind.NORM:  # the gradient read (twice: norms, copy), its copy written in the kept slot's dtype
        return graph.weight_params(op.layer) * (2 * GRAD_BYTES + cfg.grad_host_bytes) / spec.hbm_bytes_per_s
    if k in (OpKind.STORE_G, OpKind.SAVE_ACT, OpKind.STORE_OPT):
        return transfer_nbytes(graph, cfg, op, spec, deferred) / spec.d2h_bytes_per_s
    if k is OpKind.OPT and op.stream is Stream.COMPUTE:
        return max(op_params(graph, cfg, op) * OPT_DEVICE_BYTES / spec.hbm_bytes_per_s, spec.fwd_issue_s)
    if k is OpKind.OPT and op.layer in cfg.speculate:
        return early_update_s(cfg, spec, op_params(graph, cfg, op))
    if k is OpKind.OPT:
        return opt_seconds(cfg, spec, op_params(graph, cfg, op), defers_moments(cfg, spec, op, deferred))
    raise AssertionError(k)


def early_update_s(cfg: ScheduleConfig, spec: HardwareSpec, p: int) -> float:
    """Host seconds of an update of ``p`` parameters made before the guard (``speculate``): the masters kept (read
    4 bytes a parameter, write 4) and the new masters written alone, or (``speculate_keeps`` "state") one whole
    update into the spare. A clipped step's CHECK takes as long again (the update made again)."""
    return opt_seconds(cfg, spec, p) if cfg.speculate_keeps == "state" else \
        p / spec.cpu_cast_params_per_s + opt_seconds(cfg, spec, p, bool(spec.cpu_adam_master_params_per_s))


def speculation_redo_s(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec) -> float:
    """Host seconds a clipped step adds where updates were made before its guard (``speculate``)."""
    return early_update_s(cfg, spec, sum(graph.weight_params(l) for l in cfg.speculate))


def defers_moments(cfg: ScheduleConfig, spec: HardwareSpec, op: Op, deferred: frozenset[int] | None = None) -> bool:
    """Whether the host update ``op`` (or a split update part's store) writes the masters alone, the moments left
    for the host after the update pass (20 B a parameter while the GPU runs on: not modelled), with clipping where
    the spec gives that pass's rate: ``op`` is in ``deferred`` (``ir.deferrable_opts`` of its schedule, what the
    streaming executor defers); without it, its layer's gradient is not kept on the device."""
    if not (spec.cpu_adam_master_params_per_s and cfg.clip):
        return False
    if deferred is not None:
        return op.id in deferred
    if op.kind is OpKind.STORE_OPT and not (op.mb is not None and op.layer in cfg.split_opt):
        return False  # a whole-layer device update's state goes back in full
    return op.layer not in cfg.grad_kept


@dataclass(frozen=True)
class DeviceMemory:
    slot_sizes: dict[str, list[int]]  # bytes of each slot of each pool, by index
    workspace_nbytes: int  # the largest compute op's transient bytes
    kept_nbytes: int = 0  # new weights of the device-updated layers, kept for the next step's loads
    saved_nbytes: int = 0  # activations the layers in saved_acts keep for backward, all at once at the turn
    gemm_nbytes: int = 0  # cuBLAS's workspaces (ScheduleConfig.gemm_workspace_bytes)
    slack_nbytes: int = 0  # the caching allocator's rounding of the long-held buffers (ALLOC_SLACK_BYTES each)
    carry_nbytes: int = 0  # what blocks hand the next besides the hidden state, every micro-batch's at the turn
    stage_nbytes: int = 0  # an fp32 wire's staging buffer beyond the half of the weight slots counted for it

    @property
    def slot_count(self) -> dict[str, int]:
        return {p: len(self.slot_sizes[p]) for p in POOLS}

    @property
    def pool_nbytes(self) -> dict[str, int]:
        return {p: sum(self.slot_sizes[p]) for p in POOLS}

    @property
    def total_nbytes(self) -> int:
        return sum(self.pool_nbytes.values()) + self.workspace_nbytes + self.kept_nbytes + self.saved_nbytes + \
            self.gemm_nbytes + self.slack_nbytes + self.carry_nbytes + self.stage_nbytes


def device_memory(graph: LayerGraph, schedule: Schedule) -> DeviceMemory:
    """Device bytes the runtime allocates for ``schedule``: its slot pools, the largest working set, the weights
    device updates keep, the saved activations (every layer's forward ends before the first backward: all of
    them exist at once), cuBLAS's workspaces, and what the caching allocator may add to the long-held buffers
    (:data:`ALLOC_SLACK_BYTES` each, for the slots and kept weights of a MiB or more)."""
    cfg = schedule.config
    kinds = {(op.kind, op.layer): op for op in schedule.ops}  # (an op's working set is its kind's and layer's)
    work = max((workspace_nbytes(graph, cfg, op) for op in kinds.values()), default=0)
    kept = [graph[l].params * COMPUTE_BYTES for l in cfg.gpu_opt]  # one buffer per device-updated layer
    saved = sum(saved_nbytes(graph, cfg, l) for l in cfg.saved_acts) * cfg.n_mb
    sizes = slot_sizes(graph, schedule)
    slack = ALLOC_SLACK_BYTES * sum(n >= ALLOC_SLACK_BYTES for n in [n for p in POOLS for n in sizes[p]] + kept)
    carried = sum(lay.carry_bytes_per_token for lay in graph.layers) * cfg.mb_tokens * cfg.n_mb
    wire = cfg.wire_bytes_per_param
    stage = max(0, wire_stage_bytes(graph.largest_weights(), wire) - sum(sizes["w"]) * (wire - COMPUTE_BYTES) // wire)
    return DeviceMemory(sizes, work, sum(kept), saved, cfg.gemm_workspace_bytes, slack, carried, stage)


def gemm_workspace_nbytes(spec: HardwareSpec, train: bool = True) -> int:
    """Device bytes cuBLAS holds for the GEMMs of a schedule on ``spec``'s card: a workspace per thread that runs
    them (:data:`GEMM_THREADS` for a training step, one for an evaluation's forwards)."""
    return spec.gpu_gemm_workspace_bytes * (GEMM_THREADS if train else 1)


def host_memory(graph: LayerGraph, schedule: Schedule) -> dict[str, int]:
    """Host bytes by kind: the store (master weights and moments), the gradient buffers the schedule uses (and, for
    bf16 ones, the fp32 buffer an update reads one back into, :data:`HOST_UPDATE_CHUNK` elements at a time), the
    bf16 shadow, offloaded checkpoints."""
    cfg = schedule.config
    out = host_floor(graph, cfg)
    numels = slot_params(graph, schedule)["h"]
    out["gradients"] = sum(numels) * cfg.grad_host_bytes + (
        min(max(numels, default=0), HOST_UPDATE_CHUNK) * 4 if cfg.grad_host_bytes == 2 else 0)
    if cfg.speculate:  # the masters an update made before the guard rewrote, kept until its CHECK
        state = cfg.speculate_keeps == "state"
        out["spare_states" if state else "kept_masters"] = sum(
            block_bytes(graph[l]) if state else graph.weight_params(l) * KEPT_MASTER_BYTES for l in cfg.speculate)
    return out


def grad_placement(graph: LayerGraph, schedule: Schedule) -> str:
    """Where a schedule's gradients live between their backward and their update, in words."""
    cfg = schedule.config
    owners = [l for l in range(len(graph)) if graph[l].tie is None]
    on_gpu = [l for l in owners if l in cfg.gpu_opt]
    kept = list(cfg.grad_kept)
    to_host = [l for l in owners if l not in cfg.gpu_opt and l not in cfg.grad_kept]
    buffers = slot_sizes(graph, schedule)["h"]
    kind = "bf16" if cfg.grad_host_bytes == 2 else "fp32"

    def params(layers: list[int]) -> str:
        return f"{sum(graph[l].params for l in layers) / 1e9:.2f}B params"

    parts = []
    if on_gpu:
        parts.append(f"{len(on_gpu)} layers' ({params(on_gpu)}) into their optimizer slots on the device")
    if kept:
        split = [l for l in kept if l in cfg.split_opt]
        then = [f"{len(kept) - len(split)} through the host buffers in turn"] if len(split) < len(kept) else []
        then += [f"{len(split)} into their split updates' slots"] if split else []
        parts.append(f"{len(kept)} layers' ({params(kept)}) kept on the GPU until their update in {kind} "
                     f"({fmt_bytes(sum(slot_sizes(graph, schedule)['k']))} of kept-gradient slots), then "
                     + " and ".join(then))
    if to_host:
        when = "during the backward, held until the update pass" if cfg.clip else "as they are complete"
        parts.append(f"{len(to_host)} layers' ({params(to_host)}) to host buffers {when}")
    return "; ".join(parts) + f"; {len(buffers)} host buffers ({kind}), {fmt_bytes(sum(buffers))}"


def host_floor(graph: LayerGraph, cfg: ScheduleConfig) -> dict[str, int]:
    """The host bytes of :func:`host_memory` that do not depend on the ops: store, shadow, checkpoints, the
    process's own (:data:`PROCESS_HOST_BYTES`) and what the stages besides the steps take
    (:data:`STAGE_HOST_BYTES`)."""
    out = {"store": store_bytes(graph), "process": PROCESS_HOST_BYTES, "stages": STAGE_HOST_BYTES}
    if cfg.wire_bytes_per_param == 2:
        out["bf16_shadow"] = graph.n_params * 2
    out["checkpoints"] = sum(checkpoint_nbytes(graph, cfg, l) for l in cfg.offloaded()) * cfg.n_mb
    return out
