"""`megatrain train`: the default job and its inputs."""

import json
import math

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
    (["--seq", "1"], "seq must be at least 2"),
    (["--vocab", "10"], "vocab must be at least 257"),
    (["--lr", "-1"], "lr must be positive, got -1.0"),
    (["--device", "tpu"], "device 'tpu' is not a device name torch knows"),
    (["--data", "/"], "data path / is a directory; give a .txt or .jsonl file"),
    (["--model", "qwen2.5-72b"], "host memory: the host store of this model needs 1083.41 GiB (72.706B parameters "
                                 "x 16 bytes"),
])
def test_bad_input_is_refused_with_one_message(tmp_path, capsys, monkeypatch, argv, msg):
    import megatrain.api

    monkeypatch.setattr(megatrain.api, "available_host_bytes", lambda: 64 << 30)  # any machine's answer
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


@pytest.mark.parametrize("text,msg", [
    ("lr: fast\n", "lr must be a number, got 'fast'"),
    ("mb: 2.5\n", "mb must be an integer, got 2.5"),
    ("steps: true\n", "steps must be an integer, got True"),
    ("model: [1, 2]\n", "model must be a string, got [1, 2]"),
    ("clip: high\n", "clip must be a number or null, got 'high'"),
    ("- steps\n", "expected a mapping of option names to values, got a list"),
    ("stepz: 3\n", "unknown keys ['stepz']"),
])
def test_config_file_values_are_checked(tmp_path, capsys, text, msg):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "a")]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_short_runs_get_a_short_warmup_and_config_keys_take_the_flags_spelling(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 3\nbatch: 4\nseq: 32\ngpu-opt-every: 0\nweight_decay: 0\n")  # int for a float
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warmup_steps"] == 0 and summary["config"]["warmup"] is None
    assert summary["config"]["gpu_opt_every"] == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["lr"] == pytest.approx(3e-3)  # no warmup: the first step at the peak rate


def test_bad_files_are_refused_and_the_run_directory_left_as_it_was(tmp_path, capsys):
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"ok \xff\xfe not text")
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    # a model directory whose weights file is cut short
    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--out", str(run)]) == 0
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (cut / f).write_bytes((run / f).read_bytes())
    (cut / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:1000])
    capsys.readouterr()
    for argv, msg in [
        (["--data", str(binary)], f"{binary} is not UTF-8 text (invalid start byte at byte 3)"),
        (["--model", str(cut)], f"{cut / 'model.safetensors'} is not a readable safetensors file"),
    ]:
        out = tmp_path / "new" / "run"
        assert main(["train", *argv, "--out", str(out)]) == 2
        assert msg in capsys.readouterr().err
        assert not out.exists()  # made for the run, removed again when it could not start
    assert main(["train", "--out", str(afile)]) == 2
    assert f"output path {afile} exists and is not a directory" in capsys.readouterr().err
    assert main(["train", "--out", str(afile / "sub")]) == 2
    assert f"output directory {afile / 'sub'} cannot be created (Not a directory)" in capsys.readouterr().err
    assert afile.read_text() == "keep me\n"


def test_a_run_stopped_and_resumed_takes_the_steps_of_one_that_never_stopped(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    import megatrain.api

    common = ["--steps", "6", "--batch", "4", "--seq", "32", "--save-every", "2"]
    assert main(["train", *common, "--out", str(tmp_path / "whole")]) == 0
    real_step = megatrain.api.StreamedModel.train_step

    def crash_at_step_6(self, *a, **k):  # the machine goes down during the sixth step
        if self.step == 5:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(megatrain.api.StreamedModel, "train_step", crash_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        main(["train", *common, "--out", str(tmp_path / "broken")])
    monkeypatch.undo()
    broken = tmp_path / "broken"
    assert json.loads((broken / "state" / "state.json").read_text())["step"] == 4  # the last save before
    assert main(["train", "--resume", str(broken), "--out", str(tmp_path / "resumed")]) == 0
    assert "resuming" in capsys.readouterr().out

    def metrics(run):
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    whole, resumed = metrics("whole"), metrics("resumed")
    assert [r["step"] for r in resumed] == [5, 6]
    keys = ("step", "loss", "lr", "grad_norm")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in whole[4:]]
    assert [r["step"] for r in metrics("broken")] == [1, 2, 3, 4, 5]  # what the broken run wrote stays
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # going further than the run planned: more steps, the schedule's warmup as it was
    assert main(["train", "--resume", str(tmp_path / "resumed"), "--steps", "8",
                 "--out", str(tmp_path / "longer")]) == 0
    assert [r["step"] for r in metrics("longer")] == [7, 8]
    assert json.loads((tmp_path / "longer" / "run.json").read_text())["config"]["warmup"] == 0


@pytest.mark.parametrize("argv,msg", [
    (["--batch", "8"], "a resumed run trains the same model on the same data in the same order: model, data, "
                       "batch, seq, vocab, seed cannot change, and batch was given"),
    (["--seed", "1", "--seq", "64"], "and seq, seed was given"),
    (["--config", "x.yaml"], "--resume goes on with the run's own config; --config cannot change it"),
    (["--steps", "2"], "already took 2 of its 2 steps: pass --steps N with N > 2"),
])
def test_resume_refusals(tmp_path, capsys, argv, msg):
    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), *argv, "--out", str(tmp_path / "next")]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "next").exists()
    assert main(["train", "--resume", str(run / "state"), "--out", str(tmp_path / "next")]) == 2
    assert "cannot resume from" in capsys.readouterr().err
    (run / "run.json").write_text('{"config": {"stepz": 3}}')
    assert main(["train", "--resume", str(run), "--steps", "5", "--out", str(tmp_path / "next")]) == 2
    assert "run.json does not hold a config this megatrain reads" in capsys.readouterr().err


def test_resume_refuses_other_data(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("some words about streaming layers through a device, " * 200)
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--steps", "3", "--batch", "4", "--seq", "32", "--save-every", "1",
                 "--out", str(run)]) == 0
    data.write_text("other words entirely, " * 300)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "4", "--out", str(tmp_path / "next")]) == 2
    assert f"{data} is not the data {run} was trained on" in capsys.readouterr().err


def test_a_run_that_diverges_stops_and_keeps_its_last_good_state(tmp_path, capsys):
    run = tmp_path / "run"
    common = ["--batch", "4", "--seq", "32", "--warmup", "0"]
    assert main(["train", "--steps", "2", *common, "--out", str(run)]) == 0
    good = {f.name: f.read_bytes() for f in (run / "state").iterdir()}
    capsys.readouterr()
    # a learning rate that makes the weights overflow within a few steps
    assert main(["train", "--resume", str(run), "--steps", "30", "--lr", "1e30", "--save-every", "1",
                 "--out", str(tmp_path / "blown")]) == 2
    err = capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "blown" / "metrics.jsonl").read_text().splitlines()]
    bad = lines[-1]
    assert not all(map(math.isfinite, (bad["loss"], bad["grad_norm"]))), bad
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in lines[:-1])
    assert f"step {bad['step']}: " in err and "stopped, and nothing more is saved" in err
    saved = json.loads((tmp_path / "blown" / "state" / "state.json").read_text())["step"] if lines[:-1] else None
    if saved is not None:
        assert saved == bad["step"] - 1 and f"The training state of step {saved} is in" in err
    assert not (tmp_path / "blown" / "model.safetensors").exists()
    assert {f.name: f.read_bytes() for f in (run / "state").iterdir()} == good  # the run resumed from: as it was
    # going on from the good state with another learning rate works
    assert main(["train", "--resume", str(run), "--steps", "4", "--lr", "1e-3", "--out", str(tmp_path / "ok")]) == 0


def test_a_disk_that_fills_up_while_saving_the_state_is_one_line_and_keeps_the_weights(tmp_path, capsys,
                                                                                        monkeypatch):
    from megatrain.runtime import train_state

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train_state, "save", full)
    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "megatrain train: [Errno 28] No space left on device" in err and "Traceback" not in err
    assert (run / "model.safetensors").stat().st_size > 0  # written before the state
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
