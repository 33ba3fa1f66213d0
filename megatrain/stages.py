"""The stages of a run (preparing, training, evaluating, exporting, saving the state): how long each took and the
most host memory the process held during it, for the run's summary and the journey benchmark."""

from __future__ import annotations

import contextlib
import time

from megatrain.runtime.memory.store import peak_rss_bytes

GiB = 1 << 30


class Stages:
    """``with stages("export"): ...`` adds the block's seconds to the stage's and takes the peak resident set
    during it (the kernel's high-water mark, restarted at the block's start; 0 where the system has none). A stage
    may run inside another (a save within training): the outer one's peak includes the inner one's."""

    def __init__(self):
        self.record: dict[str, dict] = {}
        self._open: list[list] = []  # [name, peak so far, start] of the stages running, outermost first

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self._open:  # the high-water mark restarts: what the outer stage reached so far is kept
            self._open[-1][1] = max(self._open[-1][1], peak_rss_bytes() or 0)
        peak_rss_bytes(reset=True)
        self._open.append([name, 0, time.perf_counter()])
        try:
            yield
        finally:
            _, peak, t0 = self._open.pop()
            peak = max(peak, peak_rss_bytes() or 0)
            r = self.record.setdefault(name, {"seconds": 0.0, "peak_rss_gib": 0.0, "times": 0})
            r["seconds"] += time.perf_counter() - t0
            r["peak_rss_gib"] = max(r["peak_rss_gib"], peak / GiB)
            r["times"] += 1
            if self._open:
                self._open[-1][1] = max(self._open[-1][1], peak)

    @property
    def peak_rss_gib(self) -> float:
        return max((r["peak_rss_gib"] for r in self.record.values()), default=0.0)
