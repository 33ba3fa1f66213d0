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
        sm.train_step(data[0])  # planned and warm
        sm.wait()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = sm.train_step(data[1]).loss
        sm.wait()
        results[tile] = loss, torch.cuda.max_memory_allocated() - base, {n: t.clone() for n, t in
                                                                         sm.state_dict().items()}
        del sm
    (l0, p0, w0), (l1, p1, w1) = results[0], results[1024]
    assert l1 == pytest.approx(l0, rel=1e-2)
    # the MLP's intermediate (3 x 4,096 bf16 values a token) for 1,024 of the 8,192 tokens
    assert p1 < p0 - 3 * 4096 * 2 * 8192 // 2, (p0, p1)
    for n, a in w0.items():
        assert float((w1[n] - a).abs().max()) <= 3e-4, n
