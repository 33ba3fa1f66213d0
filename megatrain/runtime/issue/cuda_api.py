"""What the stream issuer asks of CUDA, in one place: streams, events, the current stream, pinned host memory.

:class:`~megatrain.runtime.issue.streams.StreamExecutor` and its timer use nothing of ``torch.cuda`` but this; the tests
hand the issuer a fake of the same shape that runs on the CPU and records what was issued on which stream after
which waits (tests/runtime/fake_cuda.py), so the issuer's ordering is checked without a GPU.
"""

from __future__ import annotations

import contextlib

import torch

from megatrain.runtime.memory.store import pinned_empty


class TorchCuda:
    """The real thing: ``torch.cuda``."""

    is_fake = False

    @staticmethod
    def new_stream():
        return torch.cuda.Stream()

    @staticmethod
    def new_event(timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    @staticmethod
    def use(stream):
        """A context in which work goes to ``stream``."""
        return torch.cuda.stream(stream)

    @staticmethod
    def current_stream():
        return torch.cuda.current_stream()

    @staticmethod
    def on_device(device: torch.device):
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @staticmethod
    def synchronize(device: torch.device) -> None:
        torch.cuda.synchronize(device)

    @staticmethod
    def record_stream(t: torch.Tensor, stream) -> None:
        """``t``, allocated on another stream, is in use on ``stream`` (the caching allocator keeps it until then)."""
        t.record_stream(stream)

    @staticmethod
    def pinned(shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @staticmethod
    def pinned_exact(shape, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory of exactly the size asked (the caching allocator of :meth:`pinned` rounds a
        block up to a power of two: a 56 MiB checkpoint takes 64 MiB, a 3.5 GiB one 4 GiB)."""
        return pinned_empty(*shape, dtype=dtype)

    @staticmethod
    def pin(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()


TORCH_CUDA = TorchCuda()
