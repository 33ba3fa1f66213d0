"""A stand-in for ``megatrain.runtime.issue.cuda_api.TorchCuda`` that runs the stream issuer on the CPU.

Work runs when it is issued (so results are those of program order); what the fake keeps is what a GPU would
guarantee about order. Each stream has a vector clock (stream -> position): recording an event advances the
stream and stamps the event with the stream's clock; ``wait_event`` / ``wait_stream`` merge a clock into the
waiting stream's. The host's knowledge -- events it synchronized, a device-wide synchronize -- is one clock too,
merged into every stream at its next record (work issued after the host saw an event end cannot start before it;
one clock for all host threads over-approximates what each knows, so it can hide a missing wait between threads,
never invent one). ``happened(a, b)``: event ``a`` is done before event ``b`` on every timing the GPU may choose.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import torch


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: int):
        self.cuda, self.name = cuda, name
        self.clock: dict[int, int] = {}
        self.waited: list = []  # the events this stream was told to wait for, in order

    def _merge(self, clock: dict[int, int]) -> None:
        for k, v in clock.items():
            if v > self.clock.get(k, -1):
                self.clock[k] = v

    def wait_event(self, event: "FakeEvent") -> None:
        with self.cuda.lock:
            self.waited.append(event)
            if event.clock is not None:
                self._merge(event.clock)

    def wait_stream(self, other: "FakeStream") -> None:
        with self.cuda.lock:
            self._merge(other.clock)

    def advance(self) -> dict[int, int]:
        self._merge(self.cuda.host)
        self.clock[self.name] = self.clock.get(self.name, -1) + 1
        return dict(self.clock)


class FakeEvent:
    def __init__(self, cuda: "FakeCuda"):
        self.cuda = cuda
        self.clock: dict[int, int] | None = None
        self.stream: FakeStream | None = None
        self.t = 0.0
        self.synced = False

    def record(self, stream: FakeStream | None = None) -> None:
        with self.cuda.lock:
            self.stream = stream if stream is not None else self.cuda.current_stream()
            self.clock = self.stream.advance()
            self.after_waits = len(self.stream.waited)  # recorded after that many of its stream's waits
            self.t = time.perf_counter()

    def synchronize(self) -> None:
        with self.cuda.lock:
            assert self.clock is not None, "synchronizing an event never recorded"
            for k, v in self.clock.items():
                self.cuda.host[k] = max(self.cuda.host.get(k, -1), v)
            self.synced = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) * 1e3


class FakeCuda:
    is_fake = True

    def __init__(self):
        self.lock = threading.RLock()
        self.host: dict[int, int] = {}
        self._names = itertools.count()
        self.all_streams: list[FakeStream] = []
        self.default = self.new_stream()
        self._local = threading.local()

    def new_stream(self) -> FakeStream:
        s = FakeStream(self, next(self._names))
        self.all_streams.append(s)
        return s

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        prev = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = prev

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    def on_device(self, device):
        return contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        with self.lock:
            for s in self.all_streams:
                for k, v in s.clock.items():
                    self.host[k] = max(self.host.get(k, -1), v)

    def record_stream(self, t: torch.Tensor, stream) -> None:
        pass

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def pinned_exact(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def happened(a: FakeEvent, b: FakeEvent) -> bool:
        """Whether event ``a`` is done before event ``b`` fires, on every timing."""
        return b.clock.get(a.stream.name, -1) >= a.clock[a.stream.name]
