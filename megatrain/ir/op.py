"""One op of a schedule: its kind, stream, step, layer, micro-batch, slots (with their roles) and dependencies, with
a one-line text form that parses back (:meth:`Op.from_str`) and JSON."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

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
    REFWD = "REFWD"  # compute: the forward of (layer, mb) again in the backward, from its checkpoint and without
    # autograd, to make the checkpoint of layer + 1 the forward dropped (ScheduleConfig.dropped_checkpoints) just
    # ahead of that layer's BWD
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
    CHECK = "CHECK"  # cpu: validates the layer's update made before the step's GUARD (ScheduleConfig.speculate)
    # with a clip factor of 1: where the step's factor is not 1 the masters that update rewrote go back and the
    # update is made again with the factor (none where the step must not update); its moments follow (reading the
    # gradient in its host buffer)
    GUARD = "GUARD"  # compute: the step's guard, once per training step before its first OPT, which every OPT
    # follows: the global gradient norm (with clipping, after every gradient's norms), the step's loss, the factor
    # updates scale gradients by (the clip factor; NaN where the norm or the loss is not finite: no update), and
    # their copy to the host (d2h, for host updates and the step's result). Layer 0 (it belongs to none)


FORWARDS = (OpKind.FWD, OpKind.REFWD)  # the kinds that run a layer's forward without autograd


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
    OpKind.REFWD: (Stream.COMPUTE,),
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
    OpKind.CHECK: (Stream.CPU,),
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
