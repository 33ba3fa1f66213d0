"""The peer benchmark's harness on the CPU: megatrain and FSDP2 train the same tiny model on the same data."""

import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_megatrain_and_fsdp2_report_the_same_losses_accumulating_two_micro_batches(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "peers", "run.py"), "--preset", "tiny", "--tokens", "512",
           "--seq", "64", "--mb", "2", "--steps", "3", "--systems", "megatrain", "fsdp2", "--timeout", "300",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "table-tiny-512.json").read_text())
    assert [(r["system"], r["n_mb"]) for r in rows] == [("megatrain", 2), ("fsdp2-cpu-offload", 2)], rows
    assert not any(r.get("error") for r in rows), rows
    ref = rows[-1]["losses"]
    assert all(len(r["losses"]) == 3 for r in rows)
    # megatrain computes in fp32 on the CPU, FSDP2 in bf16, each accumulating two micro-batches (FSDP2 on the
    # device): the same model and data agree to bf16 rounding (one micro-batch against several: the parity tests)
    for r in rows:
        for a, b in zip(r["losses"], ref):
            assert abs(a - b) <= 5e-4 * abs(b), (r["system"], r["n_mb"], r["losses"], ref)
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["median_step_s"] == statistics.median(r["step_times_s"][1:]), r
    summary = json.loads((tmp_path / "summary-tiny-512.json").read_text())
    fastest = {name: max((r for r in rows if r["system"] == name), key=lambda r: r["tokens_per_s"])
               for name in ("megatrain", "fsdp2-cpu-offload")}
    assert summary["best"] == {name: {"n_mb": r["n_mb"], "tokens_per_s": r["tokens_per_s"],
                                      "median_step_s": r["median_step_s"]} for name, r in fastest.items()}
    ours, peer = fastest["megatrain"], fastest["fsdp2-cpu-offload"]
    assert summary["megatrain_over"] == {"fsdp2-cpu-offload": ours["tokens_per_s"] / peer["tokens_per_s"]}
    assert summary["megatrain_over_median"] == {"fsdp2-cpu-offload": peer["median_step_s"] / ours["median_step_s"]}
    assert "megatrain / fsdp2-cpu-offload:" in proc.stdout
