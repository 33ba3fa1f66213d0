"""How the model's state is laid out and moved: the constants the cost model (planner) and the runtime both read,
kept in one place so that a plan counts what the runtime allocates. Pure Python, no torch."""

# the host store: per layer one flat fp32 block of these rows (master weights, then the Adam moments of the
# elements that train); a device optimizer slot holds them and the step's gradient
STORE_ROWS = ("master", "exp_avg", "exp_avg_sq")
OPT_SLOT_ROWS = STORE_ROWS + ("grad",)
STORE_BYTES_PER_PARAM = 4 * len(STORE_ROWS)  # (gradients: host buffers the plan sizes)
GRAD_BYTES = 4  # gradients are accumulated in fp32 (on the host: ScheduleConfig.grad_host_bytes)
# LOAD_OPT and STORE_OPT copy the store's rows one at a time: a layer's load of the next step may start once the
# first row is stored
OPT_STATE_ROWS = len(STORE_ROWS)
HOST_UPDATE_CHUNK = 1 << 26  # elements a host update reads a bf16 gradient back into fp32 at a time (256 MiB)
# bytes a read or write of weights between the store and disk moves at a time (runtime.state.safetensors_stream)
IO_CHUNK_BYTES = 64 << 20
# fp32 weights bound for bf16 weight slots cross into the device through one fp32 staging buffer of this many elements,
# a part at a time, each copied and then cast on the load's stream (runtime.memory.device.DeviceState.load_cast): the
# part's size decides the share of the copy engine a load gets beside a split update's state loads (512 MiB measured
# best on the H200, docs/benchmark-history.md, "Weights sent as fp32")
WIRE_STAGE_PARAMS = 1 << 27
# an evaluation's logits are formed this many tokens at a time (fp32; runtime.ops.compute.evaluate)
LOSS_CHUNK_TOKENS = 1024
# tokens (over all rows) whose chunk-local gated delta rule algebra is formed at once (kernels.delta_rule): the rule
# runs over a micro-batch in pieces of whole chunks, so its working set is a piece's at any length
DELTA_PIECE_TOKENS = 8192
# decoder layers (by model type) that compute ``mlp(post_attention_layernorm(h))`` and use the norm's output for
# nothing else: the norm joins the MLP in its tiles (runtime.layers.tiling), so its output is not kept for the whole
# sequence either
NORM_WITH_MLP = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# the same decoder layers end with ``residual + mlp(...)``: nothing in the layer reads the MLP's output but the sum, so
# a backward that recomputes the forward need not form the MLP's last projection (its gradients need its input and
# weights alone). The projection, as a template path (checked on the device: runtime.layers.probe.unread_outputs_hold)
UNREAD_PROJECTION = "mlp.down_proj"


# an update made before the step's global norm (ScheduleConfig.speculate) keeps the fp32 masters it rewrites, or
# (speculate_keeps "state") writes the new state to a spare block the size of the layer's (block_bytes)
KEPT_MASTER_BYTES = 4


def block_bytes(layer) -> int:
    """Host bytes of ``layer``'s block of the store (a planner Layer): fp32 master weights and two Adam moments per
    parameter, moments only for the parameters that train (none in a layer frozen whole, ``Layer.frozen``;
    ``Layer.trainable`` of a layer frozen in part)."""
    return layer.params * 4 + layer.moment_params * (STORE_BYTES_PER_PARAM - 4)


def store_bytes(graph) -> int:
    """Host bytes of the store of ``graph`` (a LayerGraph): every layer's :func:`block_bytes`."""
    return sum(block_bytes(lay) for lay in graph.layers)


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (GiB, MiB, KiB)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def wire_stage_bytes(largest_params: int, wire_bytes: int) -> int:
    """Device bytes of the staging buffer an fp32 wire takes (``DeviceState._fit_stage``): the largest layer's
    weights in fp32, :data:`WIRE_STAGE_PARAMS` elements at most; none on a bf16 wire."""
    return 4 * min(largest_params, WIRE_STAGE_PARAMS) if wire_bytes == 4 else 0
