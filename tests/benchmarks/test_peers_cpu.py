"""The peer benchmark's harness on the CPU: megatrain and FSDP2 train the same tiny model on the same data."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_megatrain_and_fsdp2_report_the_same_losses(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "peers", "run.py"), "--preset", "tiny", "--tokens", "512",
           "--seq", "64", "--mb", "2", "--steps", "3", "--systems", "megatrain", "fsdp2", "--timeout", "300",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "table-tiny-512.json").read_text())
    assert [r["system"] for r in rows] == ["megatrain", "fsdp2-cpu-offload"], rows
    assert not any(r.get("error") for r in rows), rows
    mt, fs = (r["losses"] for r in rows)
    assert len(mt) == len(fs) == 3
    # megatrain computes in fp32 on the CPU, FSDP2 in bf16: the same model and data agree to bf16 rounding
    for a, b in zip(mt, fs):
        assert abs(a - b) <= 5e-4 * abs(b), (mt, fs)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
