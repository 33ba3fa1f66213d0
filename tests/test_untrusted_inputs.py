"""What a hostile or careless user hands megatrain: run directories whose files were edited, model directories with
code, inputs that would take the machine down, leftovers of killed runs. Each gets its one line, or the right
behaviour: never a traceback, a kill by the kernel or a silent wrong result."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0"]
DEAD = 2**22 + 12345  # a process id no process has (above the default pid_max)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run of the default model with its training state."""
    out = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def _one_line(capsys, want: str, code: int = 2, got: int | None = None) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("megatrain")]
    assert got == code and "Traceback" not in err and len(lines) == 1 and want in lines[0], (got, err)
    return lines[0]


def _state(run: Path) -> Path:
    from megatrain.runtime.state import train_state

    return train_state.find(run / "state")


def test_code_from_a_run_directory_never_runs(tmp_path, run, capsys):
    """run.json naming a model directory with code, and trust_remote_code true in it: export and resume refuse in
    one line naming the flag; the code never runs (its marker file never appears); a YAML file cannot allow it."""
    remote = tmp_path / "remote"
    remote.mkdir()
    cfg = json.loads((run / "config.json").read_text())
    marker = tmp_path / "ran"
    (remote / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "mine.MyConfig"}}))
    (remote / "mine.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (remote / f).write_bytes((run / f).read_bytes())
    copied = _copy(run, tmp_path / "copied")
    meta = json.loads((copied / "run.json").read_text())
    meta["config"].update(model=str(remote), trust_remote_code=True)
    (copied / "run.json").write_text(json.dumps(meta))
    want = "names Python code of its own in config.json (auto_map); megatrain runs no code from a model directory " \
           "unless asked: pass --trust-remote-code"
    capsys.readouterr()
    _one_line(capsys, want, got=main(["export", str(copied), str(tmp_path / "exported")]))
    _one_line(capsys, want, got=main(["train", "--resume", str(copied), "--steps", "3", "--out", str(tmp_path / "r")]))
    yaml = tmp_path / "c.yaml"
    yaml.write_text("trust_remote_code: true\n")
    _one_line(capsys, "'trust_remote_code' is a flag only (--trust-remote-code)",
              got=main(["train", "--config", str(yaml), "--out", str(tmp_path / "y")]))
    assert not marker.exists() and not (tmp_path / "exported").exists() and not (tmp_path / "r").exists()


def _edited(m: dict, edit) -> dict:
    m = json.loads(json.dumps(m))
    edit(m)
    return m


@pytest.mark.parametrize("name,edit,again,want", [
    ("step", lambda m: m.update(step=m["step"] + 1), False, "its contents do not match its checksum ('sha256')"),
    ("data order", lambda m: m["extra"]["data_order"].update(next=m["extra"]["data_order"]["next"] + 4), False,
     "its contents do not match its checksum"),
    ("a crc digit", lambda m: m["crc32"].update({"layer-00001.bin": m["crc32"]["layer-00001.bin"] ^ 1}), False,
     "its contents do not match its checksum"),
    ("optimizer steps past the step", lambda m: m.update(step=1), True,
     "took more optimizer steps (2) than the state's 1 steps (an inconsistent training state)"),
    ("a crc32 key deleted", lambda m: m["crc32"].pop("layer-00001.bin"), True,
     "'crc32' does not list one checksum per layer file"),
    ("a layer's name", lambda m: m["layers"]["1"].update(name="other"), True,
     "its layers do not match this model's (1 differ, e.g. layer 1: saved"),
    ("data order behind the steps", lambda m: m["extra"]["data_order"].update(next=0), True,
     "the data order saved is 0 batches of 4 rows into the data, fewer than the 2 steps the state took"),
])
def test_an_edited_manifest_is_refused_naming_what(tmp_path, run, capsys, name, edit, again, want):
    """Any edit to state.json is seen (its checksum); an edit with the checksum made again still meets each
    field's check."""
    from megatrain.runtime.state.state_dirs import manifest_bytes

    copied = _copy(run, tmp_path / "copied")
    path = _state(copied) / "state.json"
    m = _edited(json.loads(path.read_text()), edit)
    path.write_bytes(manifest_bytes(m) if again else json.dumps(m).encode())
    capsys.readouterr()
    _one_line(capsys, want, got=main(["train", "--resume", str(copied), "--steps", "3", "--out", str(tmp_path / "r")]))
    assert not (tmp_path / "r").exists()


def test_a_damaged_layer_file_is_named(tmp_path, run, capsys):
    copied = _copy(run, tmp_path / "copied")
    layer = _state(copied) / "layer-00001.bin"
    raw = bytearray(layer.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    layer.write_bytes(bytes(raw))
    capsys.readouterr()
    _one_line(capsys, "layer-00001.bin: checksum mismatch", got=main(["export", str(copied), str(tmp_path / "e")]))
    _one_line(capsys, "layer-00001.bin: checksum mismatch",
              got=main(["train", "--resume", str(copied), "--steps", "3", "--out", str(tmp_path / "r")]))


_CASES = """
import json, resource, sys, contextlib, io
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from pathlib import Path
from megatrain.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    Path('/proc/self/clear_refs').write_text('5')
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]
    out.append([rc, err.getvalue(), int(peak) / 2**20])
print(json.dumps(out))
"""


def _peaks_gib(argvs: list[list[str]], cwd: Path) -> list:
    """Each ``megatrain`` command line run in one process of its own under a 6 GiB address-space limit:
    [exit status, stderr, peak resident GiB during it] for each."""
    p = subprocess.run([sys.executable, "-c", _CASES, json.dumps(argvs)], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_inputs_that_would_take_the_machine_down_are_refused_in_bounded_memory(tmp_path):
    line = tmp_path / "one-line.jsonl"
    line.write_text(json.dumps({"text": "word " * (9 << 20)}) + "\n")  # a 45 MB record
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("prompt,completion\nHello,World\nHow,are,you\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "hello there"}\n{"text": "ok"\n{"text": "x"}\n')
    cases = [
        (["--data", str(line)], f"data file {line} line 1: a record (a line of JSON) of more than 32 MiB"),
        (["--seq", "1000000000"], "seq must be at most 16,777,216 tokens"),
        (["--vocab", "1000000000"], "vocab must be at most 1,048,576"),
        (["--seed", str(2**70)], "seed must be an integer from 0 to 2**63 - 1"),
        (["--batch", "100000000", "--mb", "1"], "a step of --batch 100,000,000 x --seq 128 tokens takes 381.5 GiB as "
                                                 "its input tensors alone"),
        (["--data", str(ragged)], f"data file {ragged} line 3: 3 cells, its header names 2 columns"),
        (["--data", str(empty)], f"data file {empty} is empty"),
        (["--data", str(broken)], f"data file {broken} line 2: not a JSON object (Expecting ',' delimiter at column 14)"),
    ]
    out = tmp_path / "out"
    got = _peaks_gib([["train", *argv, "--out", str(out)] for argv, _ in cases], tmp_path)
    for (argv, want), (rc, err, peak) in zip(cases, got):
        lines = [x for x in err.splitlines() if x.startswith("megatrain")]
        assert rc == 2 and len(lines) == 1 and want in lines[0] and "Traceback" not in err, (argv, err)
        if "not a JSON object" in want:  # (and no reader's own log line before it)
            assert err.strip().splitlines() == lines, err
        assert peak < 2.0, (argv, peak)
    assert not out.exists()


def test_signals_while_starting_and_preparing_stop_within_a_second(tmp_path):
    """SIGTERM at the command's first moments and while the data is tokenized: one line, exit 143, promptly, and
    no run directory left; SIGINT likewise, 130."""
    data = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "What is streamed? " * 20}, {"role": "assistant", "content": "Layers. " * 40}]
    data.write_text("\n".join(json.dumps({"messages": chat}) for _ in range(30000)) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    for sig, code, after in ((signal.SIGTERM, 143, 0.3), (signal.SIGTERM, 143, 4.0), (signal.SIGINT, 130, 4.0)):
        out = tmp_path / f"out-{sig.name}-{after}"
        p = subprocess.Popen([sys.executable, "-m", "megatrain", "train", "--data", str(data), *TINY, "--out",
                              str(out)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        time.sleep(after)
        assert p.poll() is None, "the run ended before the signal"
        t0 = time.perf_counter()
        p.send_signal(sig)
        err = p.communicate(timeout=60)[1]
        took = time.perf_counter() - t0
        lines = [x for x in err.splitlines() if x.startswith("megatrain")]
        assert p.returncode == code and "Traceback" not in err and lines and \
            f"stopped by {sig.name}" in lines[-1], (sig, after, err)
        assert took < 1.5, (sig, after, took)
        assert not out.exists() or not [f for f in out.iterdir() if f.name != ".lock"], list(out.iterdir())


def test_references_outside_a_model_directory_are_refused(tmp_path, run, capsys):
    model = tmp_path / "model"
    model.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / f).write_bytes((run / f).read_bytes())
    cfg = json.loads((run / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_file": "../elsewhere/tokenizer.json"}))
    capsys.readouterr()
    _one_line(capsys, "tokenizer_config.json: tokenizer_file names '../elsewhere/tokenizer.json', a file outside",
              got=main(["train", "--model", str(model), *TINY, "--out", str(tmp_path / "o")]))
    # a safetensors index naming a shard beside the directory (which exists there, so only the confinement stops it)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "other").mkdir()
    (model / "model.safetensors").rename(tmp_path / "other" / "model.safetensors")
    from safetensors import safe_open

    with safe_open(tmp_path / "other" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "../other/model.safetensors" for n in names}}))
    _one_line(capsys, "its weight_map names '../other/model.safetensors', which is not a file in",
              got=main(["train", "--model", str(model), *TINY, "--out", str(tmp_path / "o2")]))


def test_leftovers_of_killed_runs_are_removed_on_the_next_start(tmp_path, run, capsys):
    """A superseded state the pointer no longer names (a kill between the pointer's move and the delete) and the
    temporary files of killed writes go at the next resume or export; the current state is what is resumed."""
    import shutil

    copied = _copy(run, tmp_path / "copied")
    current = _state(copied)
    old = current.parent / "step-00000001"
    shutil.copytree(current, old)
    junk = [copied / f".model.safetensors.tmp-{DEAD}", copied / f".summary.json.tmp-{DEAD}"]
    for f in junk:
        f.write_bytes(b"half")
    (copied / f".tokenizer-{DEAD}").mkdir()
    mine = copied / f".config.json.tmp-{os.getpid()}"  # a live process's: kept
    mine.write_bytes(b"in progress")
    assert main(["export", str(copied), str(tmp_path / "e")]) == 0
    assert not any(f.exists() for f in junk) and not (copied / f".tokenizer-{DEAD}").exists() and mine.exists()
    assert main(["train", "--resume", str(copied), "--steps", "3", "--out", str(tmp_path / "r")]) == 0
    assert not old.exists() and current.exists()
    assert "resuming" in capsys.readouterr().out


def test_resuming_a_run_that_is_training_is_refused(tmp_path, run, capsys):
    import fcntl

    copied = _copy(run, tmp_path / "copied")
    fd = os.open(copied / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, b"4242", 0)
        capsys.readouterr()
        _one_line(capsys, f"cannot resume from {copied}: a megatrain train (process 4242) is training into it now",
                  got=main(["train", "--resume", str(copied), "--steps", "3", "--out", str(tmp_path / "r")]))
    finally:
        os.close(fd)


def test_more_one_liners(tmp_path, run, capsys):
    bad = tmp_path / "h7"
    bad.mkdir()
    cfg = json.loads((run / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 7}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).write_bytes((run / f).read_bytes())
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(json.dumps({"text": "some words here"}) + "\n")
    (mixed / "b.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    capsys.readouterr()
    for argv, want in [
        (["train", "--model", str(bad), *TINY], "config.json is not a model config transformers reads (ValueError: "
                                                "The hidden size (7) is not a multiple of the number of attention "
                                                "heads (4).)"),
        (["train", "--data", str(mixed), *TINY], "its files hold records of other fields (a.jsonl: ['text'], "
                                                  "b.jsonl: ['completion', 'prompt'])"),
        (["plan", "--config", str(tmp_path / "missing.json")], "missing.json does not exist"),
    ]:
        _one_line(capsys, want, got=main([*argv, "--out", str(tmp_path / "o")]))
