"""A mixture-of-experts block's experts on the GPU against rows per expert: forward and forward + backward
milliseconds of ``capture.grouped_experts`` (the path the captured model runs) for a preset's expert shape, the
grouped GEMMs alone, and the achieved rate on the experts' FLOPs; one JSON line per row count. With ``--profile R``
the kernels of one forward + backward at R rows per expert, largest first.

    PYTHONPATH=. python3 benchmarks/moe_experts.py --preset gpt-oss-120b --rows 32 64 128 256 512 1024

Routing is uniform at random (each token's k experts distinct), so every expert gets about the given rows.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.kernel_timings import timed
from megatrain.capture import grouped_experts

BF = torch.bfloat16


def experts_module(preset: str) -> tuple[torch.nn.Module, int, int]:
    """The preset's first MoE block's experts on the GPU in bf16 (weights ~N(0, 0.02)), its expert count and k."""
    from transformers import AutoModelForCausalLM

    from benchmarks.peers.common import hf_config
    cfg = hf_config(preset, 1024, layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    grouped_experts.enable(model)
    mods = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    if not mods:
        raise SystemExit(f"{preset}: no mixture-of-experts block")
    experts = mods[0].to_empty(device="cuda").to(BF)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return experts, n_exp, cfg.num_experts_per_tok


def expert_params(experts: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in experts.named_parameters() if not n.endswith("_bias"))


def routing(tokens: int, n_exp: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.rand(tokens, n_exp, device="cuda", generator=g).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, device="cuda", generator=g).softmax(-1).to(BF)
    return index, weights


def gemms_only(experts, x: torch.Tensor, offs: torch.Tensor, backward: bool):
    """The two grouped GEMMs of the experts on already sorted rows (no gathers, bias, gate or sums)."""
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    up = up if experts.is_transposed else up.transpose(-2, -1)
    down = experts.down_proj if experts.is_transposed else experts.down_proj.transpose(-2, -1)
    mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

    def run():
        h = mm(x, up, offs=offs)
        y = mm(h[..., :down.shape[-2]].contiguous(), down, offs=offs)
        if backward:  # (each call's gradients fresh, as the full path's below)
            experts.zero_grad(set_to_none=True)
            x.grad = None
            y.backward(torch.ones_like(y))
        return y
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024],
                    help="rows per expert (tokens = rows x experts / k)")
    ap.add_argument("--profile", type=int, default=None, help="rows per expert of one profiled forward + backward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    experts, n_exp, k = experts_module(args.preset)
    p = expert_params(experts)
    hidden = experts.gate_up_proj.shape[1 if experts.is_transposed else 2] if experts.has_gate else \
        experts.up_proj.shape[1 if experts.is_transposed else 2]
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for rows in args.rows:
        tokens = rows * n_exp // k
        index, weights = routing(tokens, n_exp, k, g)
        x = torch.randn(tokens, hidden, device="cuda", dtype=BF, generator=g, requires_grad=True)
        run = functools.partial(grouped_experts.forward, experts, x, index, weights)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=BF, generator=g)

        def fwd_bwd():
            experts.zero_grad(set_to_none=True)
            x.grad = None
            run().backward(dy)
        with torch.no_grad():
            fwd_ms = timed(run, warmup=2, reps=5, batches=3)
        step_ms = timed(fwd_bwd, warmup=2, reps=5, batches=3)
        pairs = torch.randn(tokens * k, hidden, device="cuda", dtype=BF, generator=g, requires_grad=True)
        offs = torch.arange(1, n_exp + 1, device="cuda", dtype=torch.int32) * rows
        with torch.no_grad():
            gemm_fwd_ms = timed(gemms_only(experts, pairs, offs, False), warmup=2, reps=5, batches=3)
        gemm_step_ms = timed(gemms_only(experts, pairs, offs, True), warmup=2, reps=5, batches=3)
        flops = 2 * tokens * k * p / n_exp  # one forward: each routed pair through one expert's weights
        res = {"preset": args.preset, "rows_per_expert": rows, "tokens": tokens, "experts": n_exp, "k": k,
               "expert_params": p, "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms, "gemm_fwd_ms": gemm_fwd_ms,
               "gemm_fwd_bwd_ms": gemm_step_ms, "fwd_tflops": flops / fwd_ms / 1e9,
               "fwd_bwd_tflops": 3 * flops / step_ms / 1e9, "gemm_fwd_tflops": flops / gemm_fwd_ms / 1e9,
               "gemm_fwd_bwd_tflops": 3 * flops / gemm_step_ms / 1e9}
        print(json.dumps(res), flush=True)
        out.append(res)
        del x, pairs, dy
        experts.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    if args.profile:
        tokens = args.profile * n_exp // k
        index, weights = routing(tokens, n_exp, k, g)
        x = torch.randn(tokens, hidden, device="cuda", dtype=BF, generator=g, requires_grad=True)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=BF, generator=g)
        for _ in range(2):
            grouped_experts.forward(experts, x, index, weights).backward(dy)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            grouped_experts.forward(experts, x, index, weights).backward(dy)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
