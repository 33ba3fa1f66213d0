#!/usr/bin/env bash
# The GPU machine's checks and measurements, results under $1 (default gpu-results/). $2 picks a part:
#   tests   the GPU-marked tests (streaming executor, device updates, bf16 wire, 100M parity, kernels in bf16);
#   kernels the RoPE rows of the kernel benchmark;
#   1.5b    Qwen2.5-1.5B at 16,384 tokens, one model, several plans: every update on the host vs device updates
#           (auto / every untied layer), 3 weight slots vs one per layer, clipping on and off, 4 vs 1 micro-batches,
#           steps separated by a device sync or ordered by events; with traces;
#   7b      Qwen2.5-7B at 32,768 tokens likewise (fewer variants: the model takes a minute to build);
#   syncs   where a steady step makes the host wait for the device (Qwen2.5-0.5B);
#   profile torch.profiler over one 1.5B step: host time by operator;
#   lean    the host-lean store: Qwen2.5-7B, Llama-3.1-8B and Gemma-2-9B shapes at 32,768 tokens with clipping,
#           fp32 gradients and an fp32 wire (12 host bytes per parameter and the gradient buffers), 1 + 3 timed steps;
#           each with a host budget of about 12.4 bytes per parameter, which keeps the gradients on the GPU;
#   budget  device budgets (--gpu-gib, the allocator capped to it): Qwen2.5-7B at 32,768 tokens with clipping at 24,
#           48 and 80 GiB and Qwen2.5-1.5B at 16,384 tokens at 24 GiB (stages budget-<model>-<GiB>, one model each);
#   packing Qwen2.5-1.5B at 16,384 tokens on random tokens, then on packed chat-like rows (prompts not trained on,
#           each document attending to itself alone), then random again: what packing and masking cost;
#   moe     OLMoE-1B-7B shape at 32,768 tokens with clipping, one micro-batch then two (the rest of each plan
#           compile's: saved activations where the routing's cost makes them pay), then at a 24 GiB budget; the
#           Qwen3-30B-A3B shape cut to 12 blocks;
#   seq     Qwen2.5-7B's shape cut to 4 blocks with one 262,144-token sequence (untiled, 16,384- and 65,536-token
#           tiles) and one of 524,288 tokens (3 steps; the planner's device peak next to the measured one), and one of
#           515,072 with two checkpoints dropped and made again;
#   seq-whole the whole 7B shape at 524,288 tokens (one step, detached: below), then at 262,144;
#   adamw   the host AdamW rate for 7B-block-sized updates: main or worker thread, thread count, pinned or not, with
#           copies to and from the GPU running (benchmarks/host_adamw.py);
#   journey a checkpoint directory in, chat fine-tuning, the weights out (below; journey-7b, journey-1.5b apart);
#   all     all of them in turn (over ten minutes; not lean or budget: their models take calls of their own).
# Each stage has its own time limit so a hang still leaves the others' results. Run from the repository root:
#   PYTHONUNBUFFERED=1 PYTHONPATH=. bash benchmarks/gpu_checks.sh /tmp/out all
set -uo pipefail
out="${1:-gpu-results}"
part="${2:-all}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-.}"
stage() {  # stage NAME SECONDS CMD...
    local name=$1 secs=$2
    shift 2
    echo "== $name (limit ${secs}s): $*"
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? ($(tail -n 1 "$out/$name.log"))"
}
if [[ $part == tests || $part == all ]]; then
    stage tests 240 python3 -m pytest -q -s -o faulthandler_timeout=60 tests/gpu tests/kernels
fi
for m in qwen2.5-7b:240:--host-gib=88 llama-3-8b:270:--host-gib=93.5 gemma-2-9b:300:--host-gib=106; do
    IFS=: read -r preset secs extra <<< "$m"
    if [[ $part == lean || $part == "lean-$preset" ]]; then
        stage "lean-$preset" "$secs" python3 benchmarks/throughput.py --preset "$preset" --batch 32 --mb 4 \
            --slots 3 --gpu-opt-every auto --wire fp32 --steps 3 ${extra/=/ } --json "$out/lean-$preset.json"
    fi
done
for m in qwen2.5-7b:32:24 qwen2.5-7b:32:48 qwen2.5-7b:32:80 qwen2.5-1.5b:16:24; do
    IFS=: read -r preset batch gib <<< "$m"
    if [[ $part == budget || $part == "budget-$preset-$gib" ]]; then
        stage "budget-$preset-$gib" 280 python3 benchmarks/throughput.py --preset "$preset" --batch "$batch" --mb 4 \
            --slots 3 --gpu-opt-every auto --steps 3 --gpu-gib "$gib" --json "$out/budget-$preset-$gib.json"
    fi
done
if [[ $part == packing || $part == all ]]; then
    stage packing 240 python3 benchmarks/throughput.py --preset qwen2.5-1.5b --batch 16 --mb 4 --slots 3 \
        --gpu-opt-every auto --steps 5 --variant data=chat --variant data=random --json "$out/packing.json"
fi
if [[ $part == moe ]]; then
    stage moe-olmoe 300 python3 benchmarks/throughput.py --preset olmoe-1b-7b --batch 32 --mb 1 --slots 3 \
        --gpu-opt-every auto --steps 3 --variant mb=2 --json "$out/moe-olmoe.json"
    stage moe-olmoe-24 150 python3 benchmarks/throughput.py --preset olmoe-1b-7b --batch 32 --mb 1 --slots 3 \
        --gpu-opt-every auto --steps 3 --gpu-gib 24 --json "$out/moe-olmoe-24.json"
    stage moe-qwen3 150 python3 benchmarks/throughput.py --preset qwen3-30b-a3b --layers 12 --batch 32 --mb 1 \
        --slots 3 --gpu-opt-every auto --steps 3 --json "$out/moe-qwen3.json"
fi
if [[ $part == seq ]]; then
    stage seq-262k 270 python3 benchmarks/throughput.py --preset qwen2.5-7b --layers 4 --seq 262144 --batch 1 --mb 1 \
        --slots 3 --gpu-opt-every auto --steps 2 --seq-tile 0 --variant tile=16384 --variant tile=65536 \
        --json "$out/seq-262k.json"
    stage seq-524k 440 python3 benchmarks/throughput.py --preset qwen2.5-7b --layers 4 --seq 524288 --batch 1 --mb 1 \
        --slots 3 --gpu-opt-every auto --warmup 1 --steps 2 --json "$out/seq-524k.json"
    # a checkpoint dropped in the forward and made again (REFWD) at 515,072 tokens, every layer's op memory recorded
    stage seq-515k-dropped 300 python3 benchmarks/throughput.py --preset qwen2.5-7b --layers 4 --seq 515072 --batch 1 \
        --mb 1 --slots 2 --dropped-checkpoints 2 --gpu-opt-every auto --grad-host-dtype bf16 --warmup 0 --steps 1 \
        --cooldown 0 --memory-by-op "$out/seq-515k-dropped-memory.json" --json "$out/seq-515k-dropped.json"
fi
# seq-whole: the whole Qwen2.5-7B shape at one 524,288-token sequence (the search's plan: on the H200 fp32 host
# gradients and every checkpoint kept, on an H100 80GB 18 dropped; a step ~10 minutes and ~2 more to build and pin:
# past one 10-minute command, so start it detached, e.g. `setsid nohup bash benchmarks/gpu_checks.sh /tmp/out
# seq-whole > /tmp/out.log 2>&1 &`, and poll for its "== seq-whole-524k: exit" line); then the 262,144-token step as
# the search plans it. $SEQ_WHOLE_FLAGS goes to the 524,288-token run (e.g. "--dropped-checkpoints 3" for host
# margin: each drop costs about 0.75% of the step)
if [[ $part == seq-whole ]]; then
    stage seq-whole-524k 1500 python3 benchmarks/throughput.py --preset qwen2.5-7b --seq 524288 --batch 1 --mb 1 \
        --slots auto --gpu-opt-every auto ${SEQ_WHOLE_FLAGS:-} --warmup 0 --steps 1 --cooldown 0 \
        --memory-by-op "$out/seq-whole-524k-memory.json" --json "$out/seq-whole-524k.json"
    stage seq-whole-262k 900 python3 benchmarks/throughput.py --preset qwen2.5-7b --seq 262144 --batch 1 --mb 1 \
        --slots auto --gpu-opt-every auto --warmup 0 --steps 1 --cooldown 0 --json "$out/seq-whole-262k.json"
fi
# journey: a user's whole run from a checkpoint directory (benchmarks/journey.py): Qwen2.5-7B's shape at a 24 GiB
# budget (the state is larger than the disk: refused after the weights are written), then Qwen2.5-1.5B's with saves
# every 2 steps, killed after the step-4 save and resumed; the work directory ($JOURNEY_DIR) must be on a disk of 55 GB
# free, not a tmpfs (it would take host memory from the run)
if [[ $part == journey || $part == journey-7b ]]; then
    stage journey-7b 1200 python3 benchmarks/journey.py --shape qwen2.5-7b --steps 6 --batch 32 --seq 1024 \
        --gpu-gib 24 --work "${JOURNEY_DIR:-/var/tmp/megatrain-journey}" --json "$out/journey-7b.json"
fi
if [[ $part == journey || $part == journey-1.5b ]]; then
    stage journey-1.5b 1200 python3 benchmarks/journey.py --shape qwen2.5-1.5b --steps 6 --batch 32 --seq 1024 \
        --gpu-gib 24 --save-every 2 --kill-after-save 4 --work "${JOURNEY_DIR:-/var/tmp/megatrain-journey}" \
        --json "$out/journey-1.5b.json"
    rm -rf "${JOURNEY_DIR:-/var/tmp/megatrain-journey}"
fi
if [[ $part == adamw || $part == all ]]; then
    stage adamw 200 python3 benchmarks/host_adamw.py --json "$out/host-adamw.json"
fi
if [[ $part == kernels || $part == all ]]; then
    stage kernels-rope 90 python3 benchmarks/kernel_timings.py --only rope --json "$out/kernels-rope.json"
fi
if [[ $part == 1.5b || $part == all ]]; then
    # a slot per layer, the planner's set of device updates (auto) / every other layer (2) / none (0); steps ordered
    # by events only (the next forward runs under the device updates' STORE_OPT tail) or separated by a device-wide
    # sync (step_sync=1); 1 and 4 micro-batches; clipping on and off
    stage tp-1.5b 300 python3 benchmarks/throughput.py --preset qwen2.5-1.5b --batch 16 --mb 1 --slots all \
        --gpu-opt-every auto --steps 4 --variant step_sync=1 --variant gpu_opt=2 --variant mb=4 \
        --variant mb=4,step_sync=1 --variant clip=0 --variant mb=4,clip=0 --variant gpu_opt=0 \
        --trace "$out/trace-1.5b" --json "$out/tp-1.5b.json"
fi
if [[ $part == 7b || $part == all ]]; then
    stage tp-7b 200 python3 benchmarks/throughput.py --preset qwen2.5-7b --batch 32 --mb 4 --slots all --steps 3 \
        --gpu-opt-every auto --variant clip=0 --trace "$out/trace-7b" --json "$out/tp-7b.json"
fi
if [[ $part == syncs || $part == all ]]; then
    stage syncs 100 python3 benchmarks/find_syncs.py --preset qwen2.5-0.5b --batch 4
fi
if [[ $part == profile || $part == all ]]; then
    stage profile-1.5b 120 python3 benchmarks/profile_step.py --preset qwen2.5-1.5b --batch 16 --mb 4 --slots 3 \
        --gpu-opt-every auto
fi
grep -h -A12 "^qwen.*gpu_opt = layers" "$out"/tp-*.log 2>/dev/null
