"""`megatrain train`: the default job and its inputs."""

import json
import math
import os
import re

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
    # each step says whether the clip factor (threshold 1.0) scaled it, and the summary the share of such steps
    clipped = [r["grad_norm"] > 1.0 for r in lines]
    assert [r["clipped"] for r in lines] == clipped and summary["clipped_steps"] == sum(clipped)
    assert summary["clip_rate"] == pytest.approx(sum(clipped) / 300)
    assert f"{sum(clipped)} of 300 steps clipped" in printed
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
    (["--data", "/nonexistent.txt"], "data /nonexistent.txt is neither a file, a directory, nor a dataset in the "
                                     "local HF cache"),
    (["--batch", "5", "--mb", "2"], "batch (5) must be a multiple of mb (2)"),
    (["--warmup", "400"], "warmup (400) < steps (300)"),
    (["--model", "/nonexistent"], "neither tiny-llama, a preset, nor a directory with config.json"),
    (["--seq", "1"], "seq must be at least 2"),
    (["--vocab", "10"], "vocab must be at least 259"),
    (["--lr", "-1"], "lr must be a finite number > 0, got -1.0"),
    (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["--clip", "nan"], "clip must be a finite number > 0, or null for no clipping, got nan"),
    (["--device", "tpu"], "device 'tpu' is not a device name torch knows"),
    (["--model", "qwen2.5-72b"], "host memory: the host store of this model needs 812.56 GiB (72.706B parameters "
                                 "x 12 bytes"),
    (["--schedule", "polynomial"], "schedule must be one of cosine_with_min_lr, cosine, linear, constant, "
                                   "warmup_stable_decay, got 'polynomial'"),
    (["--schedule", "linear", "--min-lr", "1e-4"], "the linear schedule has none"),
    (["--betas", "0.9"], "betas must be two numbers separated by a comma"),
    (["--betas", "0.9,1.5"], "betas must be two numbers in [0, 1)"),
    (["--freeze", "transformer.*"], "freeze: 'transformer.*' matches no parameter of the model (names look like"),
    (["--freeze", "model.*,lm_head.*"], "matches every parameter of the model: nothing would train"),
    (["--tensorboard"], "report_to: tensorboard needs the tensorboard package, which is not installed"),
    (["--report-to", "wandb"], "report_to: wandb needs the wandb package, which is not installed (pip install "
                                 "'megatrain[wandb]')"),
    (["--report-to", "comet"], "report_to: unknown tracker 'comet' (choose from tensorboard, wandb, mlflow"),
    (["--hardware", "/nonexistent.json"], "hardware spec file /nonexistent.json does not exist"),
    (["--hardware", "h300"], "unknown hardware 'h300'; presets: h200, cpu, h100, or a JSON file path"),
])
def test_bad_input_is_refused_with_one_message(tmp_path, capsys, monkeypatch, argv, msg):
    import megatrain.compiler

    monkeypatch.setattr(megatrain.compiler, "available_host_bytes", lambda: 64 << 30)  # any machine's answer
    if "--tensorboard" in argv or "--report-to" in argv:  # as on a machine without these packages
        import importlib.util

        find = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda n, *a: None if n in ("tensorboard", "wandb") else find(n, *a))
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
    assert f"{data} record 2: field 'text' must be a string, got None" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--data", str(empty), "--out", str(tmp_path / "r")]) == 2
    assert f"data directory {empty} holds no .arrow/.csv/.json/.jsonl/.parquet/.txt file" in capsys.readouterr().err


def test_weight_slots_from_a_config_file_are_checked(tmp_path, capsys):
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("slots: 0\n")
    good.write_text("slots: all\nbatch: 4\nseq: 32\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "a")]) == 2
    assert "weight_slots must be an integer >= 1, 'all' or 'auto', got 0" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main(["train", "--config", str(good), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["config"]["slots"] == "all"


@pytest.mark.parametrize("text,msg", [
    ("lr: fast\n", "lr must be a number or null, got 'fast'"),
    ("mb: 2.5\n", "mb must be an integer or null, got 2.5"),
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
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (cut / f).write_bytes((run / f).read_bytes())
    (cut / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:1000])
    capsys.readouterr()
    for argv, msg in [
        (["--data", str(binary)], f"{binary} is not UTF-8 text (invalid start byte at byte 3, line 1)"),
        (["--model", str(cut)], f"{cut / 'model.safetensors'} is not a whole safetensors file"),
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
    assert main(["train", *common, "--out", str(tmp_path / "broken")]) == 130  # stopped at once
    monkeypatch.undo()
    broken = tmp_path / "broken"
    assert _state_step(broken) == 4  # the last save before
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
                       "batch, seq, vocab, seed, format, columns, packing, eval_split, streaming cannot change, and batch was "
                       "given"),
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


def _state_step(run):
    from megatrain.runtime.state import train_state

    return json.loads((train_state.find(run / "state") / "state.json").read_text())["step"]


def _files(d):
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_a_run_that_diverges_stops_without_applying_the_step_and_keeps_its_last_good_state(tmp_path, capsys):
    run = tmp_path / "run"
    common = ["--batch", "4", "--seq", "32", "--warmup", "0"]
    assert main(["train", "--steps", "2", *common, "--out", str(run)]) == 0
    good = _files(run / "state")
    capsys.readouterr()
    # a learning rate that makes the weights overflow within a few steps
    assert main(["train", "--resume", str(run), "--steps", "30", "--lr", "1e30", "--save-every", "1",
                 "--out", str(tmp_path / "blown")]) == 2
    err = capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "blown" / "metrics.jsonl").read_text().splitlines()]
    bad = lines[-1]
    assert bad["skipped"] and not all(map(math.isfinite, (bad["loss"], bad["grad_norm"]))), bad
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in lines[:-1])
    assert f"step {bad['step']}: " in err and "no update was applied, and the run stops" in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"megatrain train: step {bad['step']}")
    saved = _state_step(tmp_path / "blown") if lines[:-1] else 2
    assert saved == bad["step"] - 1 and f"The last training state saved is step {saved}'s" in err
    assert "(the weights this step started from)" in err
    assert not (tmp_path / "blown" / "model.safetensors").exists()
    assert _files(run / "state") == good  # the run resumed from: as it was
    # going on from the good state with another learning rate works
    assert main(["train", "--resume", str(run), "--steps", "4", "--lr", "1e-3", "--out", str(tmp_path / "ok")]) == 0


def test_skipping_non_finite_steps_goes_on_and_stops_after_too_many(tmp_path, capsys, monkeypatch):
    """--on-nonfinite skip: a step whose loss is not finite applies nothing, its batch is passed over and the run
    goes on; ten in a row stop it."""
    import megatrain.api

    real_step = megatrain.api.StreamedModel._train_step
    calls = []

    def poisoned(self, ids, *a, **k):  # the third step, and every one after the sixth, sees NaN embeddings
        calls.append(1)
        if len(calls) == 3 or len(calls) > 6:
            emb = self.store.master(0)
            kept = emb.clone()
            emb.fill_(float("nan"))
            try:
                return real_step(self, ids, *a, **k)
            finally:
                emb.copy_(kept)
        return real_step(self, ids, *a, **k)

    monkeypatch.setattr(megatrain.api.StreamedModel, "_train_step", poisoned)
    common = ["--batch", "4", "--seq", "32", "--warmup", "0", "--on-nonfinite", "skip"]
    assert main(["train", "--steps", "5", *common, "--out", str(tmp_path / "a")]) == 0
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 3, 4, 5] and [r.get("skipped", False) for r in lines] == [
        False, False, True, False, False, False]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["last_step"] == 5 and _state_step(tmp_path / "a") == 5
    assert "1 steps skipped (not finite)" in capsys.readouterr().out
    calls.clear()
    assert main(["train", "--steps", "20", *common, "--out", str(tmp_path / "b")]) == 2
    assert "10 steps in a row were skipped" in capsys.readouterr().err


def _small_disk(monkeypatch, free: list[int]):
    """``shutil.disk_usage`` reporting ``free[0]`` bytes free (changed by the test as it goes)."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * free[0], 9 * free[0], free[0]))


def test_a_disk_too_small_for_the_state_is_said_before_training_and_the_weights_are_kept(tmp_path, capsys,
                                                                                        monkeypatch):
    """The end's state save does not fit the disk: the header says so, the weights are written first, then one line
    names the bytes needed and free and that no state was saved; the exit status is 2, nothing cut is left."""
    free = [5 << 20]  # the weights (3.8 MiB) fit, the state (11.5 MiB) does not
    _small_disk(monkeypatch, free)
    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--out", str(run)]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"saves: the weights 3\.8\d MiB, the training state 11\.\d\d MiB; the disk has 5\.00 MiB "
                     r"free, too little for the state: the save of it at the end will be refused after the weights are "
                     r"written;", out), out
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(r"megatrain train: step 2: no space left on the disk: the training state needs 11\.\d\d MiB "
                        r"and .*/run/state has 5\.00 MiB free \(the state saved before is removed only once the new "
                        r"one is complete\); it is not saved; the run stops after step 2, whose weights are in "
                        r".*/run/ \(from_pretrained reads them\); no training state was saved", line), line
    assert "Traceback" not in err
    assert (run / "model.safetensors").stat().st_size > 0 and not list((run / "state").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state_refused"].startswith("step 2: no space left") and summary["last_step"] == 2


def test_a_periodic_save_the_disk_cannot_take_stops_the_run_with_the_weights_and_the_state_before(tmp_path, capsys,
                                                                                                  monkeypatch):
    from megatrain import saving
    from megatrain.runtime.state import train_state

    monkeypatch.setattr(saving, "PROBE_FROM_BYTES", 0)  # the disk's rate measured, as for a state of a GB or more
    free = [1 << 40]
    _small_disk(monkeypatch, free)
    real, calls = train_state.save, []

    def save(*a, **k):  # the disk fills up (with something else) after the first save
        calls.append(k["step"])
        free[0] = (1 << 40) if len(calls) == 1 else 1 << 20
        return real(*a, **k)

    monkeypatch.setattr(train_state, "save", save)
    run = tmp_path / "run"
    assert main(["train", "--steps", "6", "--save-every", "2", "--batch", "4", "--seq", "32", "--out", str(run)]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"the training state 11\.\d\d MiB \(about \d+ s a save at the [\d.]+ GB/s this disk wrote"
                     r"(, \d+ steps' time: training stops while it is written)?\); the disk has 1024\.00 GiB free;",
                     out), out
    assert calls == [2, 4] and "Traceback" not in err
    assert re.search(r"megatrain train: step 4: no space left on the disk: .* it is not saved; the run stops after "
                     r"step 4, whose weights are in .*/run/ \(from_pretrained reads them\); the last training state "
                     r"saved is step 2's, in .*/run/state$", err.strip()), err
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4 and _state_step(run) == 2
    assert (run / "model.safetensors").stat().st_size > 0


def test_ctrl_c_finishes_the_step_saves_and_says_where(tmp_path):
    """SIGINT sent to a running `megatrain train`: the step in flight ends, the weights and the training state are
    saved, one line says where, the exit status is 130; the run goes on from there with --resume."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = ["train", "--steps", "100000", "--warmup", "0", "--batch", "4", "--seq", "32", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "megatrain.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "SIGINT after step" in stderr
    done = len(metrics.read_text().splitlines())
    assert f"stopped by SIGINT after step {done} of 100000" in stdout and f"--resume {out}" in stdout
    assert _state_step(out) == done and (out / "model.safetensors").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["last_step"] == done
    assert not (out / ".lock").exists()
    assert main(["train", "--resume", str(out), "--steps", str(done + 1), "--out", str(tmp_path / "more")]) == 0


def test_a_second_run_into_the_same_directory_is_refused(tmp_path, capsys):
    from megatrain.rundir import RunDirectory

    out = tmp_path / "run"
    held = RunDirectory(out)  # another run, just started (nothing written yet)
    try:
        assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"output directory {out} is in use by another megatrain train (process {os.getpid()})" in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        held.close()
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0", "--out", str(out)]) == 0


def test_stop_signals_stop_after_the_step_and_a_second_one_at_once(monkeypatch):
    import signal

    from megatrain import rundir

    exits, discarded = [], []
    monkeypatch.setattr(rundir, "_exit", exits.append)  # (the process would end here)
    with rundir.StopSignals(lambda: discarded.append(True)) as s:
        os.kill(os.getpid(), signal.SIGTERM)  # before the steps begin: at once, what the run wrote discarded
        assert exits == [143] and discarded == [True] and s.requested is None
        s.begin_steps()
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.requested is signal.SIGTERM and s.exit_code == 143 and exits == [143]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _bad_tokenizer_dir(tmp_path):
    run = tmp_path / "good"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0", "--out", str(run)]) == 0
    model = tmp_path / "model"
    model.mkdir()
    for f in ("config.json", "model.safetensors"):
        (model / f).write_bytes((run / f).read_bytes())
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nope"}}')
    return run, model


def test_bad_inputs_are_one_line(tmp_path, capsys, monkeypatch):
    """Bad inputs, each refused with one line naming it (no traceback), the run directory removed."""
    run, model = _bad_tokenizer_dir(tmp_path)
    capsys.readouterr()
    bad_yaml, resume_yaml = tmp_path / "bad.yaml", tmp_path / "resume.yaml"
    bad_yaml.write_text("steps: [1\n")
    resume_yaml.write_text(f"resume: {run}\n")
    remote = tmp_path / "remote"
    remote.mkdir()
    cfg = json.loads((run / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "mine.MyConfig"}}))
    (remote / "mine.py").write_text("raise SystemExit('remote code ran')\n")
    big = tmp_path / "big.txt"
    big.write_text("words " * 1000)
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 100_000_000}))
    cases = [
        (["--config", str(bad_yaml)], f"{bad_yaml} is not valid YAML (line 2, column 1)"),
        (["--config", str(resume_yaml)], "'resume' is a flag only"),
        (["--model", str(model)], f"{model}: the tokenizer cannot be read"),
        (["--model", str(remote)], f"model {remote} names Python code of its own in config.json (auto_map); "
                                   f"megatrain runs no code from a model directory unless asked"),
        (["--model", str(huge)], "num_hidden_layers must be a positive integer of at most 4,096, got 100,000,000"),
    ]
    # a tiny machine: the step's inputs fit a quarter of it, the default corpus's rows of 64 tokens not half of it
    monkeypatch.setattr("megatrain.runtime.memory.store.available_host_bytes", lambda: 200_000)
    cases.append((["--data", str(big)], "big.txt: 0.00 GiB of data files would take about 0.0 GiB to prepare in "
                                        "memory (24 bytes per byte of data), more than half of the 0.0 GiB available: "
                                        "train with --streaming"))
    cases.append((["--seq", "64"], "the data as 3,130 rows of 64 tokens takes 0.0 GiB, more than half of the 0.0 GiB "
                                   "of memory available"))
    for argv, msg in cases:
        out = tmp_path / "out"
        assert main(["train", *argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not out.exists()
    monkeypatch.undo()


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 1e-3\nweight_decay: 1E-2\nsteps: 2\nbatch: 4\nseq: 32\nwarmup: 0\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 0
    c = json.loads((out / "summary.json").read_text())["config"]
    assert c["lr"] == 1e-3 and c["weight_decay"] == 1e-2


def test_damaged_resume_files_are_one_line(tmp_path, capsys, monkeypatch):
    from megatrain.runtime.state import train_state
    from megatrain.runtime.state.state_dirs import manifest_bytes

    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0", "--out", str(run)]) == 0
    state = train_state.find(run / "state")
    m = json.loads((state / "state.json").read_text())
    capsys.readouterr()
    for edit, msg in [
        (dict(step="3"), "'step' must be a count of steps (an integer >= 0), got '3'"),
        (dict(step=-7), "'step' must be a count of steps (an integer >= 0), got -7"),
        (dict(extra={"data_order": "not an order"}), "the data order is not one this megatrain reads"),
        (dict(extra={"data_order": {"seed": 0, "epoch": 0, "next": 1, "rows": 3}}),
         "the data order saved (3 rows, seed 0) is not this data's"),
    ]:
        (state / "state.json").write_bytes(manifest_bytes({**m, **edit}))  # (its checksum made again)
        assert main(["train", "--resume", str(run), "--steps", "3", "--out", str(tmp_path / "next")]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (edit, err)
    (state / "state.json").write_text(json.dumps(m))
    (run / "tokenizer.json").write_text("{")
    assert main(["train", "--resume", str(run), "--steps", "3", "--out", str(tmp_path / "next")]) == 2
    assert f"{run}: the tokenizer cannot be read" in capsys.readouterr().err


def test_a_disk_that_fills_up_while_writing_the_tokenizer_leaves_no_cut_file(tmp_path, capsys, monkeypatch):
    import tokenizers

    def full(self, path, *a, **k):
        with open(path, "w") as f:
            f.write('{"half": ')
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(tokenizers.Tokenizer, "save", full)
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out}: the tokenizer could not be written (No space left on device" in err and "Traceback" not in err
    assert not (out / "tokenizer.json").exists() and not list(out.glob(".tokenizer*"))


def test_without_matplotlib_a_run_writes_its_schedule_as_text(tmp_path, capsys, monkeypatch):
    """matplotlib is an extra: without it a run writes schedule.txt and no picture, and viz says what to install."""
    from megatrain.planner import dump

    monkeypatch.setattr(dump, "can_plot", lambda: False)
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0", "--out", str(out)]) == 0
    assert (out / "schedule.txt").stat().st_size > 0 and not (out / "schedule.png").exists()
    assert f"schedule {out}/schedule.txt" in capsys.readouterr().out
    assert main(["viz", "--out", str(tmp_path / "v")]) == 2
    assert "pictures need matplotlib: pip install 'megatrain[plot]'" in capsys.readouterr().err


def test_optimizer_options_metrics_and_tensorboard(tmp_path, capsys):
    """--schedule / --warmup / --betas / --freeze reach the run; each metrics line has the host memory (and on a GPU
    MFU and the GPU's peak), and --tensorboard writes the same numbers as events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    frozen = "model.embed_tokens.*,model.layers.0.*"
    runs = {}
    for lr in ("1e-3", "3e-3"):
        out = tmp_path / f"run-{lr}"
        assert main(["train", "--steps", "4", "--batch", "4", "--seq", "32", "--lr", lr, "--warmup", "1",
                     "--schedule", "linear", "--betas", "0.8,0.9", "--freeze", frozen, "--tensorboard",
                     "--out", str(out)]) == 0
        runs[lr] = out
    printed = capsys.readouterr().out
    assert "lr 0.003 (1 warmup steps from 0.003, then linear)" in printed and "parameters frozen" in printed
    out = runs["3e-3"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # linear after one warmup step: transformers' (steps - s) / (steps - warmup) at step s
    assert [r["lr"] for r in lines] == pytest.approx([3e-3, 3e-3, 3e-3 * 2 / 3, 3e-3 / 3])
    assert all(r["host_rss_gib"] > 0.1 and "mfu" not in r for r in lines)  # MFU on a GPU only (a measured spec)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["betas"] == "0.8,0.9" and summary["host_rss_peak_gib"] >= lines[-1]["host_rss_gib"]
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    assert [e.value for e in ea.Scalars("train/loss")] == pytest.approx([r["loss"] for r in lines], rel=1e-6)
    assert [e.step for e in ea.Scalars("train/host_rss_gib")] == [1, 2, 3, 4]
    # frozen parameters are the seed's in both runs; the others were trained at two rates and differ
    from fnmatch import fnmatchcase

    models = [AutoModelForCausalLM.from_pretrained(runs[lr]) for lr in ("1e-3", "3e-3")]
    a, b = (m.state_dict() for m in models)
    tied = models[0].config.tie_word_embeddings  # the head is the (frozen) embedding
    for n in a:
        expect_same = any(fnmatchcase(n, p) for p in frozen.split(",")) or (tied and n == "lm_head.weight")
        assert torch.equal(a[n], b[n]) == expect_same, n


def test_two_data_parallel_processes_train_as_one(tmp_path, capsys):
    """`megatrain train --gpus 2` on the CPU: torchrun with two gloo ranks, each training half of every batch in half
    of its micro-batches: the same losses and gradient norms as one process (to the order of the gradient sums),
    the same weights written, once, by rank 0 (an eval split run on the ranks' shares too)."""
    from safetensors.torch import load_file

    base = ["--steps", "3", "--batch", "4", "--mb", "2", "--seq", "64", "--device", "cpu", "--eval-split", "0.02"]
    assert main(["train", *base, "--out", str(tmp_path / "one")]) == 0
    assert main(["train", "--gpus", "2", *base, "--out", str(tmp_path / "two")]) == 0
    assert "2 data-parallel processes" in capsys.readouterr().err
    one, two = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    assert [r.get("step") for r in two] == [r.get("step") for r in one]
    for a, b in zip(one, two):
        # the first step's to the order of the sums; after it AdamW turns that order's ulps in near-zero gradients
        # into lr-sized moves (tests/runtime/test_parity.py), which the later steps' norms show most
        tol = 1e-6 if a.get("step") == 1 else 1e-3
        for k in ("loss", "grad_norm", "eval_loss"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=tol), (k, a, b)
        assert b.get("tokens", 0) == a.get("tokens", 0)  # every rank's trained tokens counted
    wa, wb = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    lr = json.loads((tmp_path / "one" / "summary.json").read_text())["config"]["lr"] or 3e-3
    for n, t in wa.items():  # AdamW moves each weight by up to lr a step: no weight a tenth of one step apart, and
        # on average a thousandth of that
        diff = (wb[n].float() - t.float()).abs()
        assert float(diff.max()) <= 0.1 * lr and float(diff.mean()) <= 1e-4 * lr, (n, float(diff.max()))
    assert (tmp_path / "two" / "state").is_dir()
    # a batch the processes cannot split evenly: one line, before any process starts
    assert main(["train", "--gpus", "2", *base, "--batch", "3", "--mb", "1", "--out", str(tmp_path / "x")]) == 2
    assert "2 data-parallel ranks: --batch (3) and --mb (1) must be multiples of 2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_data_too_small_for_the_run_is_warned_of(tmp_path, capsys):
    """A batch larger than the data's rows, or steps that go over the data more than ten times: one warning line
    each, naming the counts (the run goes on); a run within both says nothing."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"hello world number {i} with some words"}) for i in range(30)))
    base = ["train", "--data", str(data), "--seq", "32", "--vocab", "300"]
    for i, (extra, want) in enumerate([
            (["--steps", "2", "--batch", "16"], "--batch 16 is more than the data's 9 rows: each batch holds rows "
                                                "more than once (4 passes over the data in 2 steps)"),
            (["--steps", "12", "--batch", "8"], "12 steps of 8 rows go over the data's 9 rows 11 times (--epochs 3 "
                                                "is 4 steps)"),
            (["--steps", "2", "--batch", "4"], None)]):
        assert main([*base, *extra, "--out", str(tmp_path / str(i))]) == 0
        warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert warned == ([] if want is None else [f"megatrain train: warning: {want}"]), warned


def test_epochs_derive_the_steps_from_the_datas_rows(tmp_path, capsys):
    """--epochs N: the steps that go over the data's rows N times, rounded up (9 rows, 4 a step, 2 epochs: 5 steps),
    said in the run's first line; with --steps too, or with streamed data (no size before it is read), refused."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"hello world number {i} with some words"}) for i in range(30)))
    base = ["train", "--data", str(data), "--seq", "32", "--vocab", "300", "--batch", "4"]
    assert main([*base, "--epochs", "2", "--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "9 rows of 32" in printed and "5 steps (2 epochs) x 4 x 32 tokens" in printed
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["steps"] == summary["last_step"] == 5
    assert main([*base, "--epochs", "2", "--steps", "3", "--out", str(tmp_path / "b")]) == 2
    assert "give --steps (3) or --epochs (2), not both" in capsys.readouterr().err
    assert main([*base, "--epochs", "2", "--streaming", "--out", str(tmp_path / "c")]) == 2
    assert "--epochs needs the data's size" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_chat_template_file_renders_the_data_and_goes_with_the_export(tmp_path, capsys):
    """--chat-template FILE|NAME: the data rendered with it instead of the tokenizer's, the exported tokenizer
    carrying it; a missing file, one that does not render, or a named template whose tokens the vocabulary lacks is
    one line before anything is built."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                                       {"role": "assistant", "content": f"{i} said"}]})
                              for i in range(40)))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' of the template file\\n' + "
                        "m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ '<|im_start|>assistant of the template file\\n' }}{% endif %}")
    base = ["train", "--data", str(data), "--steps", "1", "--batch", "4", "--seq", "64", "--vocab", "300"]
    assert main([*base, "--chat-template", str(template), "--out", str(tmp_path / "a")]) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.chat_template == template.read_text()
    assert "of the template file" in tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    capsys.readouterr()
    assert main([*base, "--chat-template", str(tmp_path / "none.jinja"), "--out", str(tmp_path / "b")]) == 2
    assert "--chat-template" in capsys.readouterr().err and not (tmp_path / "b").exists()
    template.write_text("{% for m in messages %}{{ m['content'] }")
    assert main([*base, "--chat-template", str(template), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "the template does not render a conversation: TemplateSyntaxError" in err and len(err.splitlines()) == 1
    # by name: ChatML, whose tokens the built tokenizer has; Llama-3's header tokens it lacks
    from megatrain.data.tokenizer import CHATML

    assert main([*base, "--chat-template", "chatml", "--out", str(tmp_path / "d")]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "d").chat_template == CHATML
    capsys.readouterr()
    assert main([*base, "--chat-template", "llama3", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "--chat-template llama3: <|start_header_id|> is not one token of this tokenizer's vocabulary" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "e").exists()


def test_the_example_config_is_a_valid_run_config():
    """examples/chat-finetune.yaml: every key a TrainConfig field, every value of its type and range (the model and
    data paths are the user's to fill in)."""
    from pathlib import Path

    from megatrain.train_config import TrainConfig, load_yaml

    example = Path(__file__).parent.parent / "examples" / "chat-finetune.yaml"
    cfg = TrainConfig(**load_yaml(str(example)))
    cfg.check()
    assert cfg.epochs == 3 and cfg.optim_config().warmup_start == "first"  # (zero once model names weights)


@pytest.mark.parametrize("command", [[], ["train"], ["plan"], ["export"], ["viz"]])
def test_every_command_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatrain") and "--help" in out


def test_the_first_line_names_a_window_of_updates_before_the_norm(tmp_path, capsys):
    """``--speculate 2``: the run's first line says two layers update on the host before the step's global norm;
    without it, nothing of the kind."""
    for n in (2, 0):
        assert main(["train", "--out", str(tmp_path / f"s{n}"), "--steps", "1", "--speculate", str(n)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert ("2 updated on the host before the step's global norm" in first) == (n == 2), first
