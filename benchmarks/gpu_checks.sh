#!/usr/bin/env bash
# The GPU machine's checks and measurements in one run, results under $1 (default gpu-results/):
#   1. the GPU-marked tests (streaming executor, device updates, bf16 wire, 100M parity, kernels in bf16);
#   2. the kernel benchmark;
#   3. streamed throughput of Qwen2.5-1.5B (16,384 tokens) and 7B (32,768) with every update on the host and with
#      every 3rd / 2nd layer updated on the GPU, clipping on and off; 1.5B with 1 and 2 micro-batches (with traces).
# Each stage has its own time limit so a hang still leaves the others' results. Run from the repository root:
#   PYTHONUNBUFFERED=1 PYTHONPATH=. bash benchmarks/gpu_checks.sh /tmp/out
set -uo pipefail
out="${1:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-.}"
stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    echo "== $name (limit ${secs}s): $*"
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? ($(tail -n 1 "$out/$name.log"))"
}
stage tests 240 python3 -m pytest -q tests/gpu tests/kernels
stage kernels 150 python3 benchmarks/kernels.py --json "$out/kernels.json"
for clip in "" "--no-clip"; do
    tag=${clip:+noclip}
    stage "tp-1.5b${tag:+-$tag}" 150 python3 benchmarks/throughput.py --preset qwen2.5-1.5b --batch 16 --mb 4 \
        --slots 3 --steps 3 $clip --json "$out/tp-1.5b${tag:+-$tag}.json"
    for k in 3 2; do
        stage "tp-1.5b${tag:+-$tag}-gpuopt$k" 150 python3 benchmarks/throughput.py --preset qwen2.5-1.5b --batch 16 \
            --mb 4 --slots 3 --steps 3 $clip --gpu-opt-every "$k" --json "$out/tp-1.5b${tag:+-$tag}-gpuopt$k.json"
    done
done
# fewer, larger micro-batches: at 4 x 4,096 tokens the 1.5B backward ran at ~300 TFLOPS, maybe bound by the host
# issuing on the order of a hundred kernels per (layer, micro-batch) rather than by the GPU
for mb in 1 2; do
    stage "tp-1.5b-mb$mb" 150 python3 benchmarks/throughput.py --preset qwen2.5-1.5b --batch 16 --mb "$mb" --slots 3 \
        --steps 3 --trace "$out/trace-1.5b-mb$mb" --json "$out/tp-1.5b-mb$mb.json"
done
stage tp-7b-gpuopt3 240 python3 benchmarks/throughput.py --preset qwen2.5-7b --batch 32 --mb 4 --slots 3 \
    --steps 3 --no-clip --gpu-opt-every 3 --json "$out/tp-7b-gpuopt3.json"
stage tp-7b-clip-auto 240 python3 benchmarks/throughput.py --preset qwen2.5-7b --batch 32 --mb 4 --slots 3 \
    --steps 3 --gpu-opt-every auto --json "$out/tp-7b-clip-auto.json"
grep -H "tokens/s" "$out"/tp-*.log
