"""Launch helpers shared by the kernels."""

from __future__ import annotations

import functools

import torch


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, last dim), contiguous in the last dim."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_for(n_rows: int, device: torch.device, per_sm: int | None = None) -> int:
    """Programs for a row-loop kernel that reduces across rows: a few per SM on a GPU (dW partials stay small),
    a handful in the CPU interpreter."""
    if device.type == "cuda":
        return max(1, min(n_rows, (per_sm or 8) * _sm_count(device.index or 0)))
    return max(1, min(n_rows, 4))
