"""fp32 weights into a bf16 weight slot on the GPU through the staging buffer: the bits of a direct cast, and no
fp32 temporary of the whole layer from the caching allocator (the head of a 7B model: 2 GiB)."""

import pytest
import torch

from megatrain.runtime.memory.device import DeviceState

pytestmark = pytest.mark.gpu


def test_a_staged_load_is_a_cast_and_allocates_no_layer_sized_temporary():
    dev = DeviceState(graph=None, store=None, device=torch.device("cuda"), dtype=torch.bfloat16,
                      quiesce=torch.cuda.synchronize)
    part = 1 << 24
    n = 3 * part + 12345  # four parts, the last short
    src = torch.randn(n, generator=torch.Generator().manual_seed(5)).pin_memory()
    dev.stage = torch.empty(part, dtype=torch.float32, device="cuda")
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(side):
        dev.load_cast(dst, src, non_blocking=True)
    side.synchronize()
    assert torch.cuda.max_memory_allocated() - before < n  # not even a bf16 layer's worth, let alone fp32's 4n
    want = src.to("cuda").to(torch.bfloat16)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    direct = torch.empty_like(dst)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    direct.copy_(src, non_blocking=True)  # what a load did before: an fp32 temporary of the layer
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before >= 4 * n
    assert torch.equal(direct, dst)
