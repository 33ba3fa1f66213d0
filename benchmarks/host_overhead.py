"""Host-side cost of megatrain's compute ops on the CPU: per-op time by kind for a tiny model (where the host's
Python and autograd work is all there is), a bare HF decoder layer for comparison, and the step time of a two-block
model at Qwen2.5-1.5B width with few tokens (where assembling weight gradients dominates).

    PYTHONPATH=. python benchmarks/host_overhead.py
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import megatrain


def qwen2(seed=0, **kw):
    cfg = AutoConfig.for_model(model_type="qwen2", max_position_embeddings=256, tie_word_embeddings=False, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def compiled(model, batch: tuple[int, int], warmup: int):
    """The model compiled for the CPU (4 micro-batches, no Triton kernels) after ``warmup`` steps on a random
    ``batch`` (sequences, tokens), and that batch."""
    sm = megatrain.compile(model, device="cpu", n_mb=4, kernels=False)
    ids = torch.randint(0, model.config.vocab_size, batch)
    for _ in range(warmup):
        sm.train_step(ids)
    return sm, ids


def mean_step_s(sm, ids, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        sm.train_step(ids)
    return (time.perf_counter() - t) / steps


def per_op(steps=5):
    m = qwen2(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128)
    sm, ids = compiled(m, (8, 32), warmup=3)
    total, count = collections.defaultdict(float), collections.Counter()

    @contextlib.contextmanager
    def timed(op):
        t = time.perf_counter()
        yield
        total[op.kind.value] += time.perf_counter() - t
        count[op.kind.value] += 1

    sm.executor.on_op = timed
    try:
        step = mean_step_s(sm, ids, steps)
    finally:
        sm.executor.on_op = None
    print(f"tiny Qwen2 (hidden 64, 8 layers, 4 micro-batches of 2 x 32 tokens): {step * 1e3:.1f} ms/step")
    for k in total:
        print(f"  {k:9s} {count[k] // steps:4d} per step, {total[k] / count[k] * 1e3:.3f} ms each")
    layer = m.model.layers[0]
    x = torch.randn(2, 32, 64, requires_grad=True)
    pe = m.model.rotary_emb(x, torch.arange(32)[None].expand(2, -1))

    def fwd_bwd():
        out = layer(x, position_embeddings=pe)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    for label, fn in (("forward", lambda: layer(x, position_embeddings=pe)), ("forward+backward", fwd_bwd)):
        with torch.set_grad_enabled(label != "forward"):
            for _ in range(5):
                fn()
            t = time.perf_counter()
            for _ in range(50):
                fn()
        print(f"  bare HF decoder layer {label}: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms")


def wide(steps=4):
    m = qwen2(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
              num_key_value_heads=2, vocab_size=512)
    sm, ids = compiled(m, (4, 16), warmup=2)
    print(f"two blocks at Qwen2.5-1.5B width, 4 micro-batches of 16 tokens: {mean_step_s(sm, ids, steps) * 1e3:.0f} "
          f"ms/step")

if __name__ == "__main__":
    torch.set_num_threads(2)
    per_op()
    wide()
