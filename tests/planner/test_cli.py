import re
from pathlib import Path

import pytest

from megatrain.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def test_plan_cli_matches_the_hand_derived_bound_in_the_docs(tmp_path, capsys):
    assert main(["plan", "--preset", "qwen2.5-7b", "--tokens", "32768", "--seq", "1024", "--hardware", "h200",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    doc_line = re.search(r"^bound .*$", DOCS.read_text(), re.M).group(0)
    cli_line = re.search(r"^bound .*$", out, re.M).group(0)
    assert cli_line == doc_line
    hand = float(re.search(r"\*\*Bound = ([\d.]+) s/step", DOCS.read_text()).group(1))
    assert f"bound      {hand:.3f} s/step (cpu-bound" in out
    for name in ("plan.png", "plan.trace.json", "schedule.txt", "schedule.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cli_trace_has_every_op(tmp_path, capsys):
    import json

    from megatrain.ir import Schedule

    assert main(["plan", "--preset", "qwen2.5-0.5b", "--tokens", "8192", "--seq", "1024", "--steps", "1",
                 "--out", str(tmp_path)]) == 0
    s = Schedule.from_text((tmp_path / "schedule.txt").read_text())
    trace = json.loads((tmp_path / "plan.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(s.ops)
    assert {e["args"]["op"] for e in spans} == {str(op) for op in s.ops}


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "qwen2.5-72b"], "does not fit host memory"),
    (["--budget-gib", "1"], "too small for one layer"),
    (["--tokens", "1000"], "multiple of the sequence length"),
    (["--preset", "gpt-5"], "unknown model preset"),
    (["--mb", "5"], "cannot split 32 sequences evenly"),
])
def test_plan_cli_refuses_with_one_clear_message(tmp_path, capsys, argv, msg):
    assert main(["plan", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()  # refused before anything was written
