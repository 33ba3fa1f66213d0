"""The schedule IR: pure data, no torch.

A :class:`Schedule` is a program-ordered tuple of :class:`Op`. Each op runs on one :class:`Stream`; ops of one stream
run in program order; ``deps`` name earlier ops (by id) of any stream that must finish first. An op's ``slots`` name
the device buffers it touches, each with a role:

======  =============================================================================
role    meaning
======  =============================================================================
``w``   weight slot holding the layer's weights (read)
``g``   gradient slot the layer accumulates its fp32 gradient into (read + write)
``x``   activation slot holding the layer's input checkpoint; BWD/LOSS overwrite it in
        place with the gradient of that input
``y``   activation slot FWD writes the layer's output into
``dy``  activation slot holding the gradient of the layer's output (read)
``a``   activation slot a SAVE_ACT reads or a LOAD_ACT writes
``o``   optimizer slot holding a device-updated layer's master weights, moments and gradient
``k``   kept-gradient slot: a NORM copies a complete gradient there (in the host buffers' dtype) from its
        gradient slot, which is then free; the layer's STORE_G in the update pass reads it
``h``   host gradient buffer (pinned host memory): a STORE_G to the host writes the layer's gradient into it,
        the layer's host OPT reads it
======  =============================================================================

Text form of one op (one line, parsed back by :meth:`Op.from_str`)::

    12 BWD s0 L3 m1 @compute w1 x4 dy7 g0 <- 9,11
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from megatrain.planner.graph import Layer

FORMAT_VERSION = 1


class OpKind(str, enum.Enum):
    LOAD_IN = "LOAD_IN"  # h2d: one micro-batch's inputs (token ids, labels, positions, the mask where it has padding
    # or the offsets of its packed documents) -> the device, first on the copy stream in its step; layer 0, ``mb`` it
    LOAD_W = "LOAD_W"  # h2d: host weights of a layer -> weight slot; compute (a layer updated on the device): the
    # weights its device update of the step before (or the set-up's KEEP_W) left on the device -> weight slot
    KEEP_W = "KEEP_W"  # h2d, in a set-up (ScheduleConfig.setup): a device-updated layer's host weights -> the device
    # buffer its device updates keep its new weights in, which the steady step's compute-stream LOAD_W copies
    FWD = "FWD"  # compute: forward of (layer, mb), no autograd graph kept (a layer in saved_acts keeps its saved
    # activations, without the weights, for its BWD)
    LOSS = "LOSS"  # compute: forward + backward of the head+loss layer for one mb
    EVAL = "EVAL"  # compute: forward of the head+loss layer for one mb, the loss alone (an evaluation schedule)
    BWD = "BWD"  # compute: recompute forward from the checkpoint (not for a layer in saved_acts), back-propagate,
    # accumulate grads
    SAVE_ACT = "SAVE_ACT"  # d2h: checkpoint -> host
    LOAD_ACT = "LOAD_ACT"  # h2d: host checkpoint -> activation slot
    STORE_G = "STORE_G"  # d2h: gradient slot -> a host gradient buffer, for the layer that owns the weights (a
    # tied layer's part is added to its owner's on the device; the owner's store sends the sum); compute (a layer
    # updated on the device): gradient slot -> the gradient row of the layer's optimizer slot
    NORM = "NORM"  # compute: the L2 norm of each of a layer's parameters' gradients, and the gradient copied from
    # its gradient slot into a kept-gradient slot, for a layer whose gradient stays on the device until the update
    # pass (ScheduleConfig.grad_kept)
    OPT = "OPT"  # cpu: AdamW on the layer's host block; compute: AdamW on the block in an optimizer slot
    LOAD_OPT = "LOAD_OPT"  # h2d: the layer's master weights and moments -> optimizer slot (a layer of split_opt:
    # one part of them, ``mb`` its index, with the part's gradient from its host buffer unless kept on the device)
    STORE_OPT = "STORE_OPT"  # d2h: updated master and moments -> the layer's host block (split_opt: one part, and
    # the part's new weights in bf16 into the host's shadow where there is one)
    LOSS_OUT = "LOSS_OUT"  # d2h: the step's per-micro-batch loss sums to the host, right after its last LOSS (or
    # EVAL), which it follows with every other; layer: the head's
    GUARD = "GUARD"  # compute: the step's guard, once per training step before its first OPT, which every OPT
    # follows: the global gradient norm (with clipping, after every gradient's norms), the step's loss, the factor
    # updates scale gradients by (the clip factor; NaN where the norm or the loss is not finite: no update), and
    # their copy to the host (d2h, for host updates and the step's result). Layer 0 (it belongs to none)


class Stream(str, enum.Enum):
    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    CPU = "cpu"


STREAM_ORDER = (Stream.COMPUTE, Stream.H2D, Stream.D2H, Stream.CPU)

# Which stream each kind may run on.
KIND_STREAMS: dict[OpKind, tuple[Stream, ...]] = {
    OpKind.LOAD_IN: (Stream.H2D,),
    OpKind.LOAD_W: (Stream.H2D, Stream.COMPUTE),
    OpKind.KEEP_W: (Stream.H2D,),
    OpKind.FWD: (Stream.COMPUTE,),
    OpKind.LOSS: (Stream.COMPUTE,),
    OpKind.EVAL: (Stream.COMPUTE,),
    OpKind.BWD: (Stream.COMPUTE,),
    OpKind.SAVE_ACT: (Stream.D2H,),
    OpKind.LOAD_ACT: (Stream.H2D,),
    OpKind.STORE_G: (Stream.D2H, Stream.COMPUTE),
    OpKind.NORM: (Stream.COMPUTE,),
    OpKind.OPT: (Stream.CPU, Stream.COMPUTE),
    OpKind.LOAD_OPT: (Stream.H2D,),
    OpKind.STORE_OPT: (Stream.D2H,),
    OpKind.GUARD: (Stream.COMPUTE,),
    OpKind.LOSS_OUT: (Stream.D2H,),
}

ROLES = ("w", "g", "x", "y", "dy", "a", "o", "k", "h")
SLOT_POOL = {"w": "w", "g": "g", "x": "a", "y": "a", "dy": "a", "a": "a", "o": "o", "k": "k", "h": "h"}  # its pool

_OP_RE = re.compile(
    r"^(?P<id>\d+) (?P<kind>[A-Z_]+) s(?P<step>\d+) L(?P<layer>\d+)(?: m(?P<mb>\d+))? @(?P<stream>[a-z0-9]+)"
    r"(?P<slots>(?: [a-z]+\d+)*)(?: <- (?P<deps>\d+(?:,\d+)*))?$"
)
_SLOT_RE = re.compile(r"^([a-z]+)(\d+)$")


class IRError(ValueError):
    """A malformed op, schedule text or JSON."""


@dataclass(frozen=True)
class Op:
    id: int
    kind: OpKind
    stream: Stream
    step: int
    layer: int
    mb: int | None = None
    slots: tuple[tuple[str, int], ...] = ()  # (role, slot index) in the order the kind lists them
    deps: tuple[int, ...] = ()

    def slot(self, role: str) -> int | None:
        for r, i in self.slots:
            if r == role:
                return i
        return None

    def __str__(self) -> str:
        parts = [str(self.id), self.kind.value, f"s{self.step}", f"L{self.layer}"]
        if self.mb is not None:
            parts.append(f"m{self.mb}")
        parts.append(f"@{self.stream.value}")
        parts += [f"{r}{i}" for r, i in self.slots]
        if self.deps:
            parts.append("<- " + ",".join(map(str, self.deps)))
        return " ".join(parts)

    @classmethod
    def from_str(cls, text: str) -> "Op":
        m = _OP_RE.match(text.strip())
        if m is None:
            raise IRError(f"not an op: {text!r}")
        try:
            kind = OpKind(m["kind"])
            stream = Stream(m["stream"])
        except ValueError as e:
            raise IRError(f"not an op: {text!r} ({e})") from None
        slots = []
        for tok in m["slots"].split():
            role, idx = _SLOT_RE.match(tok).groups()
            if role not in ROLES:
                raise IRError(f"unknown slot role {role!r} in {text!r}")
            slots.append((role, int(idx)))
        deps = tuple(int(d) for d in m["deps"].split(",")) if m["deps"] else ()
        return cls(
            id=int(m["id"]),
            kind=kind,
            stream=stream,
            step=int(m["step"]),
            layer=int(m["layer"]),
            mb=int(m["mb"]) if m["mb"] is not None else None,
            slots=tuple(slots),
            deps=deps,
        )

    def to_dict(self) -> dict:
        d = {"id": self.id, "kind": self.kind.value, "stream": self.stream.value, "step": self.step, "layer": self.layer}
        if self.mb is not None:
            d["mb"] = self.mb
        if self.slots:
            d["slots"] = [[r, i] for r, i in self.slots]
        if self.deps:
            d["deps"] = list(self.deps)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Op":
        try:
            return cls(
                id=int(d["id"]),
                kind=OpKind(d["kind"]),
                stream=Stream(d["stream"]),
                step=int(d["step"]),
                layer=int(d["layer"]),
                mb=int(d["mb"]) if d.get("mb") is not None else None,
                slots=tuple((str(r), int(i)) for r, i in d.get("slots", ())),
                deps=tuple(int(x) for x in d.get("deps", ())),
            )
        except (KeyError, ValueError, TypeError) as e:
            raise IRError(f"not an op: {d!r} ({e})") from None


TUPLE_KEYS = ("gpu_opt", "saved_acts", "resident_opt", "grad_kept", "split_opt")  # ScheduleConfig's layer sets
# ScheduleConfig fields written only where they differ from these defaults (older schedules read back the same)
QUIET_DEFAULTS = {"saved_lean": False, "train": True, "setup": False, "write_back": False, "grad_host_bytes": 4,
                  "host_grad_slots": 2, "host_grad_part": 0, "seq_tile": 0, "opt_part": 0,
                  "gemm_workspace_bytes": 0}


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


def slot_contents(op: Op, owner: Callable[[int], int], n_mb: int,
                  shared: Callable[[int], bool] = lambda layer: False,
                  resident: Callable[[int], bool] = lambda layer: False,
                  kept: Callable[[int], bool] = lambda layer: False) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(reads, writes): slot role -> the content an op expects to find / leaves behind.

    Contents: ``("W", step, owner layer)`` weights; ``("A", step, layer, mb)`` the checkpoint at a layer's input;
    ``("dA", step, layer, mb)`` its gradient; ``("G", step, layer, k)`` a layer's gradient summed over k mbs;
    ``("S", step, layer)`` a layer's master weights and moments in an optimizer slot, ``("SG", step, layer)`` the
    same with the step's gradient, ``("U", step, layer)`` after its device update; ``("HG", step, layer)`` a
    layer's gradient in a host buffer (``("HG", step, layer, part)`` one part of it:
    ``ScheduleConfig.host_grad_part``), ``("K", step, layer)`` in a kept-gradient slot (``kept(layer)``: the layer
    is in ``grad_kept``).
    ``owner(layer)`` is the layer whose weights ``layer`` reads (itself unless tied); ``shared(layer)``: another layer
    reads this owner's weights (a tied head), whose gradient part reaches the optimizer slot first, as
    ``("SG", step, owner, "part")``; the owner's own part completes it. ``resident(layer)``: the layer's state stays
    in its slot between steps (``ScheduleConfig.resident_opt``): what a step finds there, loaded or left by the
    step before, is ``("U", step - 1, layer)``.
    """
    st, l, j = op.step, op.layer, op.mb
    w = ("W", st, owner(l))
    k = op.kind
    if k is OpKind.LOAD_W:
        return {}, {"w": w}
    if k is OpKind.KEEP_W:  # (the kept weights are no slot: cost.device_memory counts them; verify orders them)
        return {}, {}
    if k is OpKind.FWD:
        reads = {"w": w}
        if l > 0:
            reads["x"] = ("A", st, l, j)
        return reads, {"y": ("A", st, l + 1, j)}
    if k in (OpKind.BWD, OpKind.LOSS):
        reads, writes = {"w": w}, {"g": ("G", st, l, j + 1)}
        if j > 0:
            reads["g"] = ("G", st, l, j)
        if k is OpKind.LOSS or l > 0:
            reads["x"], writes["x"] = ("A", st, l, j), ("dA", st, l, j)
        if k is OpKind.BWD:
            reads["dy"] = ("dA", st, l + 1, j)
        return reads, writes
    if k is OpKind.EVAL:
        return {"w": w, "x": ("A", st, l, j)}, {}
    if k is OpKind.SAVE_ACT:
        return {"a": ("A", st, l, j)}, {}
    if k is OpKind.LOAD_ACT:
        return {}, {"a": ("A", st, l, j)}
    if k is OpKind.STORE_G and op.stream is Stream.COMPUTE:  # into the optimizer slot its LOAD_OPT filled
        o = owner(l)
        state = ("U", st - 1, o) if resident(o) else ("S", st, o)
        if o != l:  # a tied layer's part: first into the slot
            return {"g": ("G", st, l, n_mb), "o": state}, {"o": ("SG", st, o, "part")}
        before = ("SG", st, o, "part") if shared(o) else state
        return {"g": ("G", st, l, n_mb), "o": before}, {"o": ("SG", st, o)}
    hg = ("HG", st, l) if j is None else ("HG", st, l, j)  # a host buffer's content: a gradient, or a part of one
    if k is OpKind.STORE_G and kept(l):  # from its kept-gradient slot, in the update pass
        return {"k": ("K", st, l)}, {"h": hg}
    if k is OpKind.STORE_G:  # to a host buffer; a tied layer's part is added to its owner's on the device
        return {"g": ("G", st, l, n_mb)}, ({} if owner(l) != l else {"h": ("HG", st, l)})
    if k is OpKind.NORM:
        return {"g": ("G", st, l, n_mb)}, {"k": ("K", st, l)}
    if k is OpKind.OPT and op.stream is Stream.CPU:
        return {"h": hg}, {}
    if split_part(op):
        return _split_contents(op, kept(l))
    if k is OpKind.LOAD_OPT:
        return {}, {"o": ("U", st - 1, l) if resident(l) else ("S", st, l)}
    if k is OpKind.OPT and op.stream is Stream.COMPUTE:
        return {"o": ("SG", st, l)}, {"o": ("U", st, l)}
    if k is OpKind.STORE_OPT:  # (a resident state's: written back, as the step before left it)
        return {"o": ("U", st - 1 if resident(l) else st, l)}, {}
    return {}, {}


def op_contents(schedule: "Schedule", graph, op: Op) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """:func:`slot_contents` of ``op`` in ``schedule`` over ``graph`` (a LayerGraph: its owners, tied layers, and
    the schedule's resident states and kept gradients)."""
    cfg = schedule.config
    return slot_contents(op, graph.owner, cfg.n_mb, lambda layer: bool(graph.tied_to(layer)),
                         set(cfg.resident_opt).__contains__, set(cfg.grad_kept).__contains__)


def split_part(op: Op) -> bool:
    """Whether ``op`` is one part of a split update (``ScheduleConfig.split_opt``): a LOAD_OPT, OPT or STORE_OPT
    with a part index (``mb``)."""
    return op.mb is not None and op.kind in (OpKind.LOAD_OPT, OpKind.OPT, OpKind.STORE_OPT)


Queue = tuple[Stream, bool]
# the queues ops are issued on: each stream's, then the split updates' own on the GPU streams
QUEUES: tuple[Queue, ...] = tuple((s, False) for s in STREAM_ORDER) + tuple(
    (s, True) for s in STREAM_ORDER if s is not Stream.CPU)


def queue_of(op: Op) -> Queue:
    """The queue ``op`` is issued on: its stream's, or for a split update's GPU op a queue of its own beside it
    (the stream issuer's split queues), which runs the split ops in program order after what the stream's own
    queue issued before each of them, while the stream's later ops do not wait for them."""
    return op.stream, op.stream is not Stream.CPU and split_part(op)


def issue_preds(ops: Iterable[Op]) -> list[tuple[int, ...]]:
    """Per op (by id, ``ops`` in program order), the ops the issue order alone makes it follow: the op before it on
    its queue and, for an op on a split queue, the latest op before it on its stream's own queue. With its
    dependencies, these are every op that must end before it starts."""
    last: dict[Queue, int] = {}
    out: list[tuple[int, ...]] = []
    for op in ops:
        q = queue_of(op)
        preds = [last[x] for x in {q, (op.stream, False)} if x in last]
        out.append(tuple(sorted(preds)))
        last[q] = op.id
    return out


def _split_contents(op: Op, kept: bool) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """:func:`slot_contents` of one part of a split update (``ScheduleConfig.split_opt``): ``("S", step, layer,
    part)`` the part's state in an optimizer slot, ``("SG", ...)`` with its gradient (from the host buffer, loaded
    with the state; a kept gradient joins it in the OPT), ``("U", ...)`` updated."""
    st, l, j = op.step, op.layer, op.mb
    if op.kind is OpKind.LOAD_OPT:
        return ({}, {"o": ("S", st, l, j)}) if kept else ({"h": ("HG", st, l)}, {"o": ("SG", st, l, j)})
    if op.kind is OpKind.OPT:
        reads = {"o": ("S", st, l, j), "k": ("K", st, l)} if kept else {"o": ("SG", st, l, j)}
        return reads, {"o": ("U", st, l, j)}
    return {"o": ("U", st, l, j)}, {}


def resident_slots(schedule: Schedule, owner: Callable[[int], int]) -> dict[int, int]:
    """Each layer of ``resident_opt`` -> the optimizer slot its ops use (its state's home between steps)."""
    resident = set(schedule.config.resident_opt)
    out: dict[int, int] = {}
    for op in schedule.ops:
        o = owner(op.layer)
        if o in resident and o not in out:
            for role, idx in op.slots:
                if role == "o":
                    out[o] = idx
    return out


def setup_ops(schedule: Schedule) -> list[Op]:
    """The ops of a set-up (``ScheduleConfig.setup``), or of one joined to the schedule's first step
    (``carried.join``): its first ops, each a KEEP_W or a resident state's LOAD_OPT."""
    resident = schedule.config.resident_opt
    out = []
    for op in schedule.ops:
        if not (op.kind is OpKind.KEEP_W or op.kind is OpKind.LOAD_OPT and op.layer in resident):
            break
        out.append(op)
    return out


def initial_contents(schedule: Schedule, homes: dict[int, int]) -> dict[tuple[str, int], tuple]:
    """What a schedule expects in its slots before its first op: the state of each resident layer in its slot
    (``homes``: :func:`resident_slots`), as the step before (or a set-up) left it; a set-up, or a schedule that
    begins with one, expects nothing."""
    if schedule.config.setup or setup_ops(schedule):
        return {}
    return {("o", k): ("U", -1, l) for l, k in homes.items()}


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
