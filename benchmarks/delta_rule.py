"""The gated delta rule of a linear-attention block (Qwen3-Next's heads by default) on the GPU, forward + backward:
the kernels' chunked rule (kernels.delta_rule) against transformers' torch loop on the same inputs; milliseconds,
peak memory above the inputs, the largest difference of output and gradients between the two, and the rate in the
planner's FLOP count (planner.hybrid.delta_rule_costs, a backward SCAN_BWD_PASSES forwards: the figure
HardwareSpec.scan_flops_per_s is). One JSON line per shape.

    PYTHONPATH=. python3 benchmarks/delta_rule.py --tokens 32768 --seqs 1024 4096
"""

import argparse
import json

import torch

from megatrain.kernels import delta_rule
from megatrain.planner.cost import SCAN_BWD_PASSES
from megatrain.planner.hybrid import delta_rule_costs


def _inputs(b: int, t: int, heads: int, dk: int, dv: int, seed: int = 0):
    """q, k, v, beta in bf16 and the decay in fp32, as the block computes them (keys already repeated to the value
    heads, as transformers' older layers hand them over)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    return [r(b, t, heads, dk).bfloat16(), r(b, t, heads, dk).bfloat16(), r(b, t, heads, dv).bfloat16(),
            -torch.nn.functional.softplus(r(b, t, heads)), torch.sigmoid(r(b, t, heads)).bfloat16()]


def _run(fn, ins, dout):
    xs = [x.detach().requires_grad_() for x in ins]
    out, _ = fn(*xs, use_qk_l2norm_in_kernel=True)
    out.backward(dout)
    return [out.float()] + [x.grad.float() for x in xs]


def _time(fn, ins, dout, reps: int) -> tuple[float, int]:
    _run(fn, ins, dout)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        _run(fn, ins, dout)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, default=32, help="value heads (the keys' repeated to them)")
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true", help="time the kernels alone")
    args = ap.parse_args()
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    for t in args.seqs:
        b = args.tokens // t
        ins = _inputs(b, t, args.heads, args.dk, args.dv)
        dout = torch.randn(b, t, args.heads, args.dv, device="cuda").bfloat16()
        ms, peak = _time(delta_rule.chunk_gated_delta_rule, ins, dout, args.reps)
        flops = delta_rule_costs(args.heads, args.dk, args.dv)[0] * b * t * (1 + SCAN_BWD_PASSES)
        row = dict(tokens=b * t, seq=t, heads=args.heads, dk=args.dk, dv=args.dv, kernels_ms=round(ms, 2),
                   kernels_peak_gib=round(peak / 2**30, 2), planner_tflops=round(flops / ms / 1e9, 1),
                   device=torch.cuda.get_device_name())
        if not args.no_reference:
            ref_ms, ref_peak = _time(hf.torch_chunk_gated_delta_rule, ins, dout, max(1, args.reps // 2))
            got, want = _run(delta_rule.chunk_gated_delta_rule, ins, dout), _run(hf.torch_chunk_gated_delta_rule,
                                                                                 ins, dout)
            row.update(torch_ms=round(ref_ms, 2), torch_peak_gib=round(ref_peak / 2**30, 2),
                       speedup=round(ref_ms / ms, 2),
                       max_rel_diff=[float((a - w).abs().max() / w.abs().max()) for a, w in zip(got, want)])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
