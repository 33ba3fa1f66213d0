"""benchmarks/throughput.py on the CPU (the smoke mode) and benchmarks/sim_accuracy.py on the recorded H200 runs."""

import json
import math
import os
import re
import subprocess
import sys

from megatrain.layout import WIRE_STAGE_PARAMS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, **kw)
    return proc


def test_throughput_variants_run_on_one_model_and_report_each_plan(tmp_path):
    """Plan variants in turn on one model, and --data chat: rows packed from chat-like documents, the prompts not
    trained on, beside random tokens on the same model (the packing check of the GPU machine); one run of the
    script (each costs a process's start)."""
    out = tmp_path / "tp.json"
    proc = run([os.path.join(ROOT, "benchmarks", "throughput.py"), "--preset", "tiny", "--device", "cpu",
                "--no-kernels", "--batch", "4", "--seq", "64", "--mb", "2", "--steps", "2",
                "--variant", "gpu_opt=1,slots=all", "--variant", "clip=0,mb=1,stage=0", "--variant", "data=chat",
                "--variant", "data=pairs", "--variant", "wire=bf16", "--json", str(out)])
    rows = json.loads(out.read_text())
    # the bf16 wire needs bf16 compute (fp32 on the CPU): that variant fails alone, the exit status says so
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED" in proc.stdout and "needs bf16 compute" in rows[-1]["error"]
    ok, chat, pairs = rows[:3], rows[3], rows[4]
    assert [(r["n_mb"], r["clip"], r["weight_slots"]) for r in ok] == [(2, True, 2), (2, True, 5), (1, False, 2)]
    assert ok[0]["gpu_opt"] == [] and ok[1]["gpu_opt"] == [0, 1, 2, 3, 4]  # every layer: none shares weights
    # the fp32 wire's staging buffer as each run had it set (0: torch's copy_; on the CPU it is never allocated)
    assert [r["stage_params"] for r in ok] == [WIRE_STAGE_PARAMS, WIRE_STAGE_PARAMS, 0]
    for r in ok:
        # a warm-up step, two timed ones and a cool-down step after them
        assert r["tokens_per_step"] == 256 and r["step_s"] > 0 and len(r["losses"]) == 4
        assert r["cooldown_steps"] == 1
        # the plan's device figures beside the allocator's peaks (none on the CPU)
        assert r["planned_gpu_reserved_gib"] >= r["planned_gpu_peak_gib"] > 0 and r["gpu_reserved_peak_gib"] == 0
        # the steady mean runs from the warm-up step's end to the last timed step's end; the drained one on to the
        # end of everything issued, the cool-down step included
        gaps = r["step_times_between_ends_s"]
        assert len(gaps) == 2 and abs(r["step_s"] - sum(gaps) / 2) < 1e-6
        assert r["drained_step_s"] * 3 >= r["step_s"] * 2
        assert r["data"] == "random" and r["trained_tokens_per_step"] is None
    # the variants train one model in turn: each starts where the one before stopped
    losses = [x for r in ok for x in r["losses"]]
    assert all(0 < x < 10 for x in losses) and losses[-1] < losses[0]
    assert chat["data"] == "chat" and all(0 < t < 256 for t in chat["trained_tokens_per_step"])
    assert all(0 < x < 10 for x in chat["losses"]) and chat["tokens_per_step"] == 256
    # DPO steps after a reference pass of the weights they start from: the first step's loss is -log sigmoid(0)
    assert pairs["data"] == "pairs" and pairs["reference_s"] > 0 and pairs["tokens_per_step"] == 256
    assert abs(pairs["losses"][0] - math.log(2)) < 1e-5 and pairs["losses"][-1] < pairs["losses"][0]
    assert pairs["trained_tokens_per_step"] == [4 * 48] * 4  # 4 rows: 2 pairs, a completion of 48 tokens a row
    assert set(pairs["dpo_metrics"]) >= {"rewards/chosen", "rewards/margins", "rewards/accuracies"}
    # each record keeps what its simulation ran on: sim_accuracy.py rebuilds each run's plan from it and simulates
    # the step the run recorded
    again = tmp_path / "sim.json"
    proc = run([os.path.join(ROOT, "benchmarks", "sim_accuracy.py"), str(out), "--hardware", "recorded",
                "--json", str(again)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    sims = [r["simulated_s"] for r in json.loads(again.read_text())]
    assert sims == [r["simulated_steady_step_s"] for r in rows[:5]], proc.stdout


def test_sim_accuracy_reads_the_recorded_runs():
    results = os.path.join(ROOT, "docs", "results")
    files = sorted(os.path.join(results, f) for f in os.listdir(results) if re.search(r"throughput-.*-1b317cd", f))
    # those runs updated the host's layers in one pass (before moments followed the update pass)
    proc = run([os.path.join(ROOT, "benchmarks", "sim_accuracy.py"), *files, "--set", "cpu_adam_master_params_per_s=0"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [l for l in proc.stdout.splitlines() if l.startswith("qwen2.5-")]
    assert len(rows) == 12
    m = re.search(r"(\d+) of 12 within 15%; mean \|sim/measured - 1\| = ([\d.]+)", proc.stdout)
    # (docs/benchmark-history.md quotes these)
    assert m and int(m.group(1)) == 6 and float(m.group(2)) == 0.16, proc.stdout


def test_sim_accuracy_leaves_out_the_early_last_interval_of_runs_before_the_cool_down_step():
    results = os.path.join(ROOT, "docs", "results")
    before, after = (os.path.join(results, f"2026-12-03-h200-budget-7b-24-{t}.json")
                     for t in ("a2835e9-lease2", "cooldown-79adde3"))
    proc = run([os.path.join(ROOT, "benchmarks", "sim_accuracy.py"), before, after])
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = [float(l.split()[6]) for l in proc.stdout.splitlines() if l.startswith("qwen2.5-")]
    old, new = (json.load(open(p)) for p in (before, after))
    gaps = old["step_times_between_ends_s"]
    assert "cooldown_steps" not in old and gaps[-1] < min(gaps[:-1])  # the last one ended early
    assert measured == [round(sum(gaps[:-1]) / (len(gaps) - 1), 3), round(new["step_s"], 3)]


def test_sim_accuracy_models_the_skip_for_runs_recorded_before_its_field():
    """--unread-skipped: a run of the commit that brought the down projection's skip (recorded before the field
    saying so) simulated without that GEMM, shorter than with the full recompute, by about the skip's 0.2 s."""
    rec = os.path.join(ROOT, "docs", "results", "2026-12-03-h200-budget-7b-24-unread.json")
    assert "unread_skipped" not in json.load(open(rec))
    sims = []
    for flag in ([], ["--unread-skipped"]):
        proc = run([os.path.join(ROOT, "benchmarks", "sim_accuracy.py"), rec, *flag])
        assert proc.returncode == 0, proc.stderr[-2000:]
        sims += [float(l.split()[7]) for l in proc.stdout.splitlines() if l.startswith("qwen2.5-")]
    full, skipped = sims
    assert 0.1 < full - skipped < 0.3, sims


def test_memory_by_op_reports_the_ops_above_the_plan(tmp_path, capsys):
    """--memory-by-op's report: every op's bytes as JSON, and the ops whose most allocated bytes passed the plan's
    total, the largest first; refused where there is no CUDA allocator to read."""
    from benchmarks.throughput import write_memory_by_op

    gib = 1 << 30
    ops = [("(before the step)", 1 * gib, 5 * gib, 6 * gib), ("LOAD_W L2", 2 * gib, 7 * gib, 8 * gib),
           ("BWD L3 m0", 3 * gib, 9 * gib, 10 * gib), ("FWD L4 m1", 2 * gib, 6 * gib, 10 * gib)]
    # the allocator's snapshot after the op with the most allocated after it: live blocks by the innermost frame in
    # megatrain's code (else the innermost; none recorded: before recording); freed blocks left out
    frame = lambda f, line, name: {"filename": f, "line": line, "name": name}  # noqa: E731
    fit = [frame("/x/torch/nn/functional.py", 9, "linear"), frame("/r/megatrain/runtime/memory/device.py", 70, "fit")]
    snapshot = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": 2 * gib, "frames": fit},
        {"state": "active_allocated", "size": gib // 2, "history": [{"frames": fit[1:]}]},
        {"state": "inactive", "size": 4 * gib, "frames": fit},
        {"state": "active_allocated", "size": gib, "frames": [frame("/r/megatrain/runtime/layers/probe.py", 35, "_measure")]},
        {"state": "active_allocated", "size": gib // 4, "frames": []}]}]}
    write_memory_by_op(str(tmp_path / "m.json"), ops, planned_reserved=6 * gib + 1, planned_peak=4 * gib,
                       budget=8 * gib, held={"op": "BWD L3 m0", "bytes": 3 * gib, "snapshot": snapshot})
    rec = json.loads((tmp_path / "m.json").read_text())
    assert [o["op"] for o in rec["ops"]] == [o for o, *_ in ops] and rec["ops"][2]["most"] == 9 * gib
    assert [o["most_reserved"] for o in rec["ops"]] == [r for *_, r in ops]
    assert rec["held_after"] == "BWD L3 m0" and rec["held_blocks"] == [
        {"where": "runtime/memory/device.py:70 fit", "bytes": 2.5 * gib, "blocks": 2},
        {"where": "runtime/layers/probe.py:35 _measure", "bytes": gib, "blocks": 1},
        {"where": "(allocated before recording)", "bytes": gib // 4, "blocks": 1}]
    out = capsys.readouterr().out
    assert "the most allocated 9.00 GiB at 'BWD L3 m0'" in out and "2 ops above the plan" in out
    listed = out.strip().splitlines()[1:3]
    assert [line.split("GiB  ")[1] for line in listed] == ["BWD L3 m0", "LOAD_W L2"]  # FWD L4 m1: within the plan
    assert "held after 'BWD L3 m0' (3.00 GiB)" in out and "2.50 GiB      2 blocks  runtime/memory/device.py:70 fit" in out
    proc = run([os.path.join(ROOT, "benchmarks", "throughput.py"), "--preset", "tiny", "--device", "cpu",
                "--memory-by-op", str(tmp_path / "x.json")])
    assert proc.returncode == 2 and "--memory-by-op" in proc.stderr and "needs --device cuda" in proc.stderr
