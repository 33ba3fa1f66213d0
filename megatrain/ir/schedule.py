"""A schedule: the program-ordered ops and the planner's decisions for them (:class:`ScheduleConfig`), with a text
form and JSON that read back, and a table of its ops for errors and dumps."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from megatrain.ir.op import FORMAT_VERSION, STREAM_ORDER, IRError, Op, OpKind, Stream

if TYPE_CHECKING:
    from megatrain.ir.graph import Layer

TUPLE_KEYS = ("gpu_opt", "saved_acts", "resident_opt", "grad_kept", "split_opt", "speculate")  # ScheduleConfig's layer sets
# ScheduleConfig fields written only where they differ from these defaults (older schedules read back the same)
QUIET_DEFAULTS = {"saved_lean": False, "train": True, "setup": False, "write_back": False, "grad_host_bytes": 4,
                  "host_grad_slots": 2, "host_grad_part": 0, "seq_tile": 0, "opt_part": 0,
                  "gemm_workspace_bytes": 0, "defer_moments": True,
                  "speculate_keeps": "masters", "dropped_checkpoints": 0}


MAX_DROP_RUN = 3  # checkpoints dropped in a row at most: a run's backward holds as many made again at once


def droppable(n_layers: int) -> int:
    """The checkpoints a forward may drop in a graph of ``n_layers``: the inputs of layers 1..n_layers-3. Not the
    top block's (layer n_layers-2): the first backward reads it right after the head's loss, with nothing between
    that needs its memory (one micro-batch's stays in its slot), so making it again would be a block's forward
    for nothing."""
    return max(n_layers - 3, 0)


def max_dropped(n: int, run: int) -> int:
    """How many of ``n`` checkpoints runs of ``run`` between kept ones drop (the first one kept)."""
    return n - -(-n // (run + 1))


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The planner's decisions for one schedule; everything the runtime needs besides the layer graph."""

    n_layers: int  # layers of the graph, embedding and head included
    n_steps: int = 1  # optimizer steps the schedule spans (steps > 1 show the overlap between steps)
    n_mb: int = 1  # micro-batches per step
    mb_tokens: int = 1  # tokens in one micro-batch (= sequences per mb x seq_len)
    seq_len: int = 1  # tokens per sequence; attention cost depends on it
    weight_slots: int = 2  # device weight slots (2 = double buffering)
    grad_slots: int = 2  # device fp32 gradient slots
    wire_bytes_per_param: int = 2  # 2: bf16 shadow on host; 4: fp32 master, cast on the GPU
    host_checkpoints: int = 0  # checkpoints of layers 1..host_checkpoints are offloaded to host; the rest stay on GPU
    # checkpoints the forward drops, from the first blocks up: every other one (those at the input of layers 2, 4,
    # ..) where that drops this many, else runs of 2 or 3 between kept ones (``drop_run``); the backward makes each
    # run again from the checkpoint below it (a REFWD of each layer from there up) just ahead of the BWD of the
    # run's top layer. A forward more per micro-batch and checkpoint dropped, for that checkpoint's memory on the
    # host or the device outside the backward of its run (``dropped``)
    dropped_checkpoints: int = 0
    clip: bool = True  # exact global-norm clipping: every OPT waits for all of the step's gradients
    budget_bytes: int = 0  # device bytes the plan may use (slots + largest working set)
    # device bytes cuBLAS's workspaces take while the schedule runs (one per thread that runs its GEMMs:
    # cost.gemm_workspace_nbytes), counted within budget_bytes
    gemm_workspace_bytes: int = 0
    # layers updated on the device (LOAD_OPT, OPT on compute, STORE_OPT). Every step finds their weights on the
    # device, where the step before left them (or the set-up put them: ``setup``), and copies them from there
    gpu_opt: tuple[int, ...] = ()
    # layers whose forward keeps, on the device, every activation its backward needs (autograd's saved tensors,
    # weights excepted): their BWD back-propagates through them instead of recomputing the forward from the
    # checkpoint. Device memory for it: Layer.saved_bytes_per_token per token of every micro-batch, from the
    # layer's FWD to its BWD
    saved_acts: tuple[int, ...] = ()
    # saved layers keep less (Layer.lean_saved_bytes_per_token): cheap products are formed again in the backward
    saved_lean: bool = False
    # device-updated layers (a subset of gpu_opt) whose master weights and moments stay in an optimizer slot of
    # their own between steps: loaded by the set-up, never by a step, and never stored by a step (no state crosses
    # the bus); the runtime writes them back to the host store when the store is read or another plan runs
    resident_opt: tuple[int, ...] = ()
    # False: an evaluation: each micro-batch's forward and its loss (EVAL), no backward, no update
    train: bool = True
    # a set-up: what the steps of the plan with this gpu_opt and resident_opt find on the device, put there from
    # the host store: one KEEP_W per device-updated layer, one LOAD_OPT per resident state into the optimizer slot
    # the steps keep it in; nothing else, and no step of its own (joined to a step, its ops are that step's first).
    # A run issues it before its first step, and again after anything that took those copies away
    setup: bool = False
    # the states kept on the device (resident_opt, each in the optimizer slot the steady step keeps it in) written
    # back to their host blocks: one STORE_OPT each, nothing else (before the store is read or saved, or another
    # plan runs)
    write_back: bool = False
    # layers updated on the host whose gradient stays on the device until the update pass (with clipping): after
    # its backward a NORM takes its norms and moves it to a kept-gradient slot (in the host buffers' dtype), and it
    # goes to a host buffer just ahead of its update. Device memory until then instead of a host buffer for the
    # whole update pass
    grad_kept: tuple[int, ...] = ()
    grad_host_bytes: int = 4  # gradients leaving the gradient slots (host buffers, kept-gradient slots): 4 fp32, 2
    # bf16 (rounded on the device from the fp32 sum, after its norms are taken; the host update reads it back in
    # fp32)
    # host gradient buffers that take turns where gradients pass through on their way to an update (without
    # clipping, and the gradients of grad_kept): a store into one waits for the update that read it before
    host_grad_slots: int = 2
    # a gradient kept on the device passes through the host buffers in parts of this many elements (the last part
    # of a layer the rest), each part's STORE_G and OPT its own ops (``mb``: the part's index), so a host buffer is
    # one part, not the largest layer; 0: a layer at a time
    host_grad_part: int = 0
    # tokens per tile of the token-wise part of a recomputed layer (a dense block's MLP; the layer's
    # tile_work_bytes_per_token) in its forward and backward: its intermediate exists for one tile at a time, each
    # tile recomputed ahead of its backward; 0: whole micro-batches. Layers in saved_acts are not tiled
    seq_tile: int = 0
    # layers updated on the device in the update pass after the backward (with clipping), next to the host's
    # updates of the others: their gradient goes to a host buffer or stays on the device (grad_kept) like a host
    # update's, and their master weights and moments stream through the optimizer slots in parts of ``opt_part``
    # elements (the last part of a layer the rest; 0: a layer at a time), each part's LOAD_OPT, OPT (compute) and
    # STORE_OPT its own ops (``mb``: the part's index). No state stays on the device between steps, and the new
    # weights go back to the host (the next step's forward loads them as a host update's)
    split_opt: tuple[int, ...] = ()
    opt_part: int = 0
    # host-updated layers whose update starts before the step's global norm is known (with clipping): their OPT
    # runs as soon as their gradient is on the host, with a clip factor of 1, after keeping the master weights it
    # rewrites (the moments wait), and a CHECK after the step's GUARD validates it: where the factor is 1 nothing
    # more (the moments follow, as every host update's may), else the kept masters go back and the update is made
    # again with the step's factor (or not at all where the step must not update). Bit for bit what the update
    # after the GUARD leaves; host memory for the kept masters (4 bytes a parameter)
    speculate: tuple[int, ...] = ()
    # what an update made before the guard keeps to be undone: "masters" (above: the masters it rewrites, its moments
    # made by its CHECK, two passes over the layer), or "state": it writes its new masters and moments to a spare
    # block (one pass, as an update after the guard), which its CHECK makes the layer's where the step is not
    # clipped; the layer's block, untouched, is where a clipped step updates again. Host memory: the spare, 12 bytes
    # a parameter
    speculate_keeps: str = "masters"
    # with clipping, host updates whose gradient buffer no later op of the step writes make their moments after the
    # update pass, from that buffer (``ir.deferrable_opts``; the streaming executor): a shorter pass behind the
    # backward, a second pass the next step's stores into those buffers wait for. False: each update in one pass
    defer_moments: bool = True

    def drop_run(self) -> int:
        """The most checkpoints dropped in a row (``dropped_checkpoints``): the shortest run, up to
        :data:`MAX_DROP_RUN`, with that many checkpoints in the runs (each kept one followed by a run)."""
        n = droppable(self.n_layers)  # the inputs of layers 1..n
        return next((r for r in range(1, MAX_DROP_RUN) if self.dropped_checkpoints <= max_dropped(n, r)),
                    MAX_DROP_RUN)

    def dropped(self, layer: int) -> bool:
        """Whether the checkpoint at the input of ``layer`` is dropped after the forward and made again in the
        backward (``dropped_checkpoints``): layer 1's kept, then runs of ``drop_run`` dropped between kept ones,
        the first ``dropped_checkpoints`` of them dropped."""
        if not self.dropped_checkpoints or not 1 <= layer <= droppable(self.n_layers):
            return False
        r = self.drop_run()
        i, k = divmod(layer - 1, r + 1)
        return k != 0 and i * r + k - 1 < self.dropped_checkpoints

    def offloaded(self) -> list[int]:
        """The layers whose checkpoint goes to the host and back: 1..``host_checkpoints``, but those the forward
        drops (``dropped``)."""
        return [l for l in range(1, self.host_checkpoints + 1) if not self.dropped(l)]

    def tiled(self, layer: "Layer", index: int) -> bool:
        """Whether layer ``index`` (``layer``) runs its token-wise part over tiles in this schedule."""
        return bool(self.seq_tile) and layer.tile_work_bytes_per_token > 0 and index not in self.saved_acts \
            and self.seq_tile < self.mb_tokens

    def part_span(self, op: "Op", numel: int) -> tuple[int, int]:
        """The elements [lo, hi) of a layer's ``numel`` that ``op`` (a STORE_G, OPT, LOAD_OPT or STORE_OPT)
        handles: one part, or all."""
        if op.mb is None or op.kind not in (OpKind.STORE_G, OpKind.OPT, OpKind.LOAD_OPT, OpKind.STORE_OPT):
            return 0, numel
        size = (self.opt_part if op.layer in self.split_opt else self.host_grad_part) or numel
        lo = op.mb * size
        return lo, min(lo + size, numel)

    def split_parts(self, numel: int) -> list[int]:
        """The parts a split update of a ``numel``-element layer streams its state in (``mb`` of its ops)."""
        return list(range(max(1, -(-numel // self.opt_part)))) if self.opt_part else [0]

    def parts(self, layer: int, numel: int) -> list[int | None]:
        """The parts a ``numel``-element gradient of ``layer`` passes through the host buffers in (the ``mb`` of
        its STORE_G and OPT ops): [None] unless it is kept on the device for a host update and parts are in use."""
        if not self.host_grad_part or layer not in self.grad_kept or layer in self.split_opt:
            return [None]
        return list(range(max(1, -(-numel // self.host_grad_part))))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in TUPLE_KEYS:  # the keys appear only when used: older schedules read back the same
            if getattr(self, key):
                d[key] = list(getattr(self, key))
            else:
                del d[key]
        for key, default in QUIET_DEFAULTS.items():  # likewise
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ScheduleConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise IRError(f"unknown schedule config keys: {sorted(unknown)}")
        d = dict(d)
        for key in TUPLE_KEYS:
            if key in d:
                d[key] = tuple(int(x) for x in d[key])
        return cls(**d)


@dataclass(frozen=True)
class Schedule:
    ops: tuple[Op, ...]
    config: ScheduleConfig
    provenance: tuple[str, ...] = field(default=())

    def with_ops(self, ops: Iterable[Op], note: str) -> "Schedule":
        """A new schedule with ``ops`` and one more provenance line."""
        return Schedule(tuple(ops), self.config, self.provenance + (note,))

    def by_stream(self) -> dict[Stream, list[Op]]:
        out: dict[Stream, list[Op]] = {s: [] for s in STREAM_ORDER}
        for op in self.ops:
            out[op.stream].append(op)
        return out

    # ---- text form -------------------------------------------------------------------------------------------
    def to_text(self) -> str:
        lines = [f"# megatrain schedule v{FORMAT_VERSION}", "# config " + json.dumps(self.config.to_dict())]
        lines += [f"# pass {p}" for p in self.provenance]
        lines += [str(op) for op in self.ops]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = text.splitlines()
        if not lines or lines[0] != f"# megatrain schedule v{FORMAT_VERSION}":
            raise IRError(f"not a megatrain schedule v{FORMAT_VERSION} (first line {lines[:1]!r})")
        config = None
        provenance: list[str] = []
        ops: list[Op] = []
        for n, line in enumerate(lines[1:], start=2):
            if line.startswith("# config "):
                config = ScheduleConfig.from_dict(json.loads(line[len("# config ") :]))
            elif line.startswith("# pass "):
                provenance.append(line[len("# pass ") :])
            elif line.strip():
                try:
                    ops.append(Op.from_str(line))
                except IRError as e:
                    raise IRError(f"line {n}: {e}") from None
        if config is None:
            raise IRError("schedule text has no '# config' line")
        return cls(tuple(ops), config, tuple(provenance))

    # ---- JSON ------------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "format": "megatrain-schedule",
                "version": FORMAT_VERSION,
                "config": self.config.to_dict(),
                "provenance": list(self.provenance),
                "ops": [op.to_dict() for op in self.ops],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        d = json.loads(text)
        if d.get("format") != "megatrain-schedule" or d.get("version") != FORMAT_VERSION:
            raise IRError(f"not a megatrain schedule v{FORMAT_VERSION} JSON document")
        return cls(
            tuple(Op.from_dict(o) for o in d["ops"]),
            ScheduleConfig.from_dict(d["config"]),
            tuple(d.get("provenance", ())),
        )


def format_table(schedule: Schedule, start_s: list[float] | None = None, end_s: list[float] | None = None,
                 mark: int | None = None, context: int | None = None) -> str:
    """One row per op (with start/end in ms when given); ``mark`` flags one op with ``<-- HERE``; ``context``
    limits the rows to that many either side of the marked op."""
    ops = schedule.ops
    if mark is not None and context is not None:
        ops = ops[max(0, mark - context): mark + context + 1]
    timed = start_s is not None and end_s is not None
    head = f"{'id':>6s} {'stream':8s} " + (f"{'start_ms':>10s} {'end_ms':>10s}  " if timed else "") + "op"
    rows = [head]
    for op in ops:
        times = f"{start_s[op.id] * 1e3:10.3f} {end_s[op.id] * 1e3:10.3f}  " if timed else ""
        rows.append(f"{op.id:6d} {op.stream.value:8s} {times}{op}" + ("  <-- HERE" if op.id == mark else ""))
    return "\n".join(rows)
