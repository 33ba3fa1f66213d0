"""Launch-parameter sweep for the memory-bound kernels (RMSNorm, RoPE, SwiGLU) on the GPU; prints GB/s per setting.

    PYTHONPATH=. python3 benchmarks/sweep_kernels.py [--only swiglu]

SwiGLU is timed forward + backward at 32,768 x 18,944 against torch.compile of the same function, in one process.
"""

import os
import sys

import importlib

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernel_timings import copy_ceiling_gbs, timed  # noqa: E402

from megatrain.kernels.rmsnorm import rms_norm_backward, rms_norm_forward  # noqa: E402

BF = torch.bfloat16


def sweep_swiglu():
    """Forward + backward through autograd, as benchmarks/kernel_timings.py times it, for several launch settings (the
    module's defaults are set for each), against torch.compile of the eager function in the same process."""
    from kernel_timings import fwd_bwd, swiglu_eager  # noqa: E402

    mod = importlib.import_module("megatrain.kernels.swiglu")  # the package exports a function of that name

    N, F = 32768, 18944
    inputs = [torch.randn(N, F, device="cuda", dtype=BF, requires_grad=True) for _ in range(2)]
    grads = (torch.randn(N, F, device="cuda", dtype=BF),)
    nbytes = 8 * N * F * 2  # forward: read g, u, write y; backward: read dy, g, u, write dg, du
    base = timed(fwd_bwd(torch.compile(swiglu_eager), inputs, grads))
    print(f"swiglu torch.compile fwd+bwd: {base * 1e3:8.1f} us {nbytes / base / 1e6:6.0f} GB/s")
    default = (mod.BLOCK, mod.NUM_WARPS)
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), default):
        mod.BLOCK, mod.NUM_WARPS = block, warps
        ms = timed(fwd_bwd(mod.swiglu, inputs, grads))
        print(f"swiglu block={block:5d} warps={warps:2d}: {ms * 1e3:8.1f} us {nbytes / ms / 1e6:6.0f} GB/s "
              f"x{base / ms:.4f} vs compile")
    mod.BLOCK, mod.NUM_WARPS = default


def main():
    ceiling = copy_ceiling_gbs()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    if sys.argv[1:] == ["--only", "swiglu"]:
        return sweep_swiglu()
    N, H = 32768, 3584
    x = torch.randn(N, H, device="cuda", dtype=BF)
    w = torch.rand(H, device="cuda", dtype=BF) + 0.5
    dy = torch.randn_like(x)
    for nw in (4, 8, 16):
        ms = timed(lambda: rms_norm_forward(x, w, 1e-6, num_warps=nw), reps=20)
        print(f"rms fwd warps={nw:2d}: {ms * 1e3:7.1f} us {2 * N * H * 2 / ms / 1e6:6.0f} GB/s (read x, write y)")
    _, rstd = rms_norm_forward(x, w, 1e-6)
    for per_sm in (4, 8):
        for br in (2, 4):
            for nw in (8, 16):
                ms = timed(lambda: rms_norm_backward(dy, x, w, rstd, num_warps=nw, block_r=br,
                                                     programs_per_sm=per_sm), reps=10)
                print(f"rms bwd per_sm={per_sm:2d} rows={br} warps={nw:2d}: {ms * 1e3:7.1f} us "
                      f"{3 * N * H * 2 / ms / 1e6:6.0f} GB/s (read dy, x, write dx)")
    rope_mod = importlib.import_module("megatrain.kernels.rope")
    B, T, Hq, D = 32, 1024, 28, 128
    for layout in ("BHTD", "BTHD"):
        q = torch.randn(B, Hq, T, D, device="cuda", dtype=BF) if layout == "BHTD" else \
            torch.randn(B, T, Hq, D, device="cuda", dtype=BF).transpose(1, 2)
        pos = torch.arange(T, device="cuda")[None].expand(B, -1)
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
        cos, sin = emb.cos().to(BF), emb.sin().to(BF)
        for br, nw in ([(br, nw) for br in (8, 16, 32, 64, 128) for nw in (2, 4, 8)] if layout == "BHTD"
                       else [(16, 4), (32, 4), (64, 8)]):
            ms = timed(lambda: rope_mod._apply(q, cos, sin, False, block_r=br, num_warps=nw), reps=10)
            print(f"rope {layout} block_r={br:3d} warps={nw}: {ms * 1e3:7.1f} us "
                  f"{2 * q.numel() * 2 / ms / 1e6:6.0f} GB/s")


if __name__ == "__main__":
    main()
