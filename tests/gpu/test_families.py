"""Every family the CPU parity tests train, streamed on CUDA (bf16 compute, fp32 masters, the stream issuer) against
the same model trained resident on the GPU in plain PyTorch: attention, scans and experts take the GPU's kernels
here (flash attention, GPT-OSS's sinks on the flash path, grouped expert GEMMs), not the CPU's."""

import copy

import pytest
import torch

from megatrain.capture import packed_attention

from ..planner.test_moe import FAMILIES as MOE_FAMILIES
from ..runtime.models import (DROPOUT_FIELDS, FAMILIES, MORE_FAMILIES, STATE_CASES, VOCAB, hf_model, state_model,
                              with_dropout)
from ..runtime.test_moe_parity import moe_model
from .test_gpu_parity import LR, resident_reference, streamed

pytestmark = pytest.mark.gpu

STEPS = 2
EVERY = sorted({*FAMILIES, *MORE_FAMILIES, *MOE_FAMILIES, *STATE_CASES})


def _model(family: str):
    if family in STATE_CASES:  # blocks that hand state on, take per-layer inputs or share a block
        return state_model(family)
    if family in MOE_FAMILIES:
        return moe_model(family)
    return hf_model(family, **(with_dropout(family, 0.0) if family in DROPOUT_FIELDS else {}))


def _batches(T: int = 64, B: int = 8):
    """Rows without padding (the case the flash kernels take, GPT-OSS's included)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (B, T), generator=g)
        out.append((ids, torch.ones_like(ids), ids.clone()))
    return out


@pytest.mark.parametrize("family", EVERY)
def test_family_streams_on_cuda_as_it_trains_resident(family, monkeypatch):
    model, data = _model(family), _batches()
    ref_losses, ref = resident_reference(copy.deepcopy(model), data)
    calls = []
    flash = packed_attention._flash
    monkeypatch.setattr(packed_attention, "_flash", lambda *a: calls.append(a[-1] is not None) or flash(*a))
    losses, got = streamed(copy.deepcopy(model), data)
    if family in packed_attention.SINK_FAMILIES:
        assert calls and all(calls)  # every attention took the flash kernel with its sinks
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    for n, p in ref.items():
        assert float((got[n] - p).abs().max()) <= 2 * LR * STEPS + 1e-6, n
