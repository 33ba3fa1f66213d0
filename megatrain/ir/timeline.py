"""When each op of a schedule ran and the device memory over time: what the simulator predicts and what the runtime
records, in one format (one picture, one trace)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from megatrain.ir.op import STREAM_ORDER, Op


@dataclass
class Timeline:
    """When each op ran (seconds from the step's start) and device bytes in use over time.

    The simulator and the runtime's recorder both produce this, so the two can be drawn on one picture.
    """

    source: str  # "simulated" | "measured"
    ops: tuple[Op, ...]
    start_s: list[float]
    end_s: list[float]
    memory: list[tuple[float, int]] = field(default_factory=list)  # (t, device bytes in use) change points
    reserved_nbytes: int = 0  # device bytes allocated for slots + largest working set
    host_nbytes: int = 0
    n_steps: int = 1
    # the simulator's floor under the steady step (planner.floor: a middle step's work on its busiest resource);
    # 0 for a measured timeline
    floor_s: float = 0.0

    @property
    def makespan_s(self) -> float:
        return max(self.end_s, default=0.0)

    @property
    def step_s(self) -> float:
        """Average seconds per step over the whole schedule (includes filling the pipeline)."""
        return self.makespan_s / self.n_steps

    def step_end_s(self) -> list[float]:
        ends = [0.0] * self.n_steps
        for op, e in zip(self.ops, self.end_s):
            ends[op.step] = max(ends[op.step], e)
        return ends

    @property
    def steady_step_s(self) -> float:
        """Seconds per step in the steady state: between the ends of the first and the second-to-last step (the
        last step's tail runs with no next step sharing the streams, so it can end early); for two steps the
        seconds between their ends, for one the makespan; never under ``floor_s``."""
        ends = self.step_end_s()
        if len(ends) >= 3:
            return max((ends[-2] - ends[0]) / (len(ends) - 2), self.floor_s)
        return ends[-1] - ends[-2] if len(ends) == 2 else ends[-1]

    @property
    def peak_nbytes(self) -> int:
        return max((b for _, b in self.memory), default=0)

    def to_json(self) -> str:
        return json.dumps({"format": "megatrain-timeline", "source": self.source, "n_steps": self.n_steps,
                           "ops": [str(op) for op in self.ops], "start_s": self.start_s, "end_s": self.end_s,
                           "memory": self.memory, "reserved_nbytes": self.reserved_nbytes,
                           "host_nbytes": self.host_nbytes, "floor_s": self.floor_s})

    @classmethod
    def from_json(cls, text: str) -> "Timeline":
        d = json.loads(text)
        if d.get("format") != "megatrain-timeline":
            raise ValueError("not a megatrain timeline JSON document")
        return cls(source=d["source"], ops=tuple(Op.from_str(o) for o in d["ops"]), start_s=list(d["start_s"]),
                   end_s=list(d["end_s"]), memory=[tuple(m) for m in d.get("memory", [])],
                   reserved_nbytes=d.get("reserved_nbytes", 0), host_nbytes=d.get("host_nbytes", 0),
                   n_steps=d.get("n_steps", 1), floor_s=d.get("floor_s", 0.0))

    def busy_s(self) -> dict[str, float]:
        out = {s.value: 0.0 for s in STREAM_ORDER}
        for op, a, b in zip(self.ops, self.start_s, self.end_s):
            out[op.stream.value] += b - a
        return out
