"""Blocks' MLPs over tiles of the tokens on the GPU (streaming executor, bf16): the same training as untiled within
bf16, with a smaller peak of device memory."""

import copy

import pytest
import torch

import megatrain

from ..runtime.models import hf_config

pytestmark = pytest.mark.gpu


def test_tiled_mlps_on_the_gpu_train_as_untiled_in_less_memory():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # attention through SDPA's flash kernel: eager attention's 8,192 x 8,192 scores would set the peak, not the MLP
    model = AutoModelForCausalLM.from_config(
        hf_config("qwen2", hidden_size=256, intermediate_size=4096, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=3, vocab_size=512, max_position_embeddings=8192), attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 512, (1, 8192), generator=g) for _ in range(2)]
    results = {}
    for tile in (0, 1024):
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", n_mb=1, weight_slots=2, saved_acts=0,
                               seq_tile=tile, optim=megatrain.OptimConfig(lr=1e-4))
        assert sm.schedule_for(1, 8192).config.seq_tile == tile
        first = sm.train_step(data[0])  # planned and warm
        sm.wait()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        second = sm.train_step(data[1])
        sm.wait()
        results[tile] = ([first.loss, second.loss], [first.grad_norm, second.grad_norm],
                         torch.cuda.max_memory_allocated() - base)
        del sm
    (l0, n0, p0), (l1, n1, p1) = results[0], results[1024]
    # the gradients through their global norm (each step's, before clipping), the losses: equal within bf16 (the
    # weights after AdamW are not compared: its first steps move a weight by +-lr whatever its gradient's size, so
    # bf16 noise in a near-zero gradient flips a move; the CPU tests compare the gradients bit for bit in fp32)
    assert l1 == pytest.approx(l0, rel=1e-2) and n1 == pytest.approx(n0, rel=2e-2), (l0, l1, n0, n1)
    # the MLP's intermediate (3 x 4,096 bf16 values a token) for 1,024 of the 8,192 tokens
    assert p1 < p0 - 3 * 4096 * 2 * 8192 // 2, (p0, p1)
