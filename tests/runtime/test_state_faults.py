"""Training states survive crashes: a save killed at any filesystem operation leaves a state to go on from, equal
to the last save that completed; damaged files are named; what dead saves leave is cleaned up."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatrain
from megatrain.runtime.state import train_state

from .models import hf_model

OPT = megatrain.OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2, total_steps=8)


def _model():
    return megatrain.compile(hf_model("llama"), device="cpu", optim=OPT, n_mb=2)


def _state(sm):
    return {l: sm.store.block(l)[:3].clone() for l in sm.store.owners()}, sm.step


def _loaded(directory):
    """The state a new process would go on from: (blocks, step)."""
    sm = _model()
    sm.load_state(directory)
    return _state(sm)


def _equal(a, b):
    return a[1] == b[1] and all(torch.equal(a[0][l], b[0][l]) for l in a[0])


class _Crash(BaseException):
    """The process dies here: nothing after it runs, no clean-up either."""


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


DEAD = _dead_pid()


def _save_with_crash_at(sm, directory, k, monkeypatch):
    """Save, with the k-th filesystem operation of the save (counted from 0) killing the process before it
    happens; returns how many operations the save made (when it was not killed). The saving process has the
    number of one that has ended, as a killed one has by the next save."""
    count = [0]

    def guard(name, real):
        def op(*a, **kw):
            if count[0] == k:
                raise _Crash(name)
            count[0] += 1
            return real(*a, **kw)
        return op

    ts = train_state
    monkeypatch.setattr(ts.os, "replace", guard("replace", os.replace))
    monkeypatch.setattr(ts.os, "fsync", guard("fsync", os.fsync))
    monkeypatch.setattr(ts.Path, "rename", guard("rename", Path.rename))
    monkeypatch.setattr(ts.Path, "mkdir", guard("mkdir", Path.mkdir))
    monkeypatch.setattr(ts.shutil, "rmtree", guard("rmtree", shutil.rmtree))
    monkeypatch.setattr(ts.Path, "unlink", guard("unlink", Path.unlink))
    monkeypatch.setattr(ts, "open", guard("open", open), raising=False)
    monkeypatch.setattr(ts.os, "getpid", lambda: DEAD)
    try:
        sm.save_state(directory)
    except _Crash:
        pass
    finally:
        monkeypatch.undo()
    return count[0]


def test_a_save_killed_at_any_operation_leaves_the_last_completed_state(tmp_path, monkeypatch):
    sm = _model()
    data = [torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sm.train_step(data[0])
    base = tmp_path / "base"
    sm.save_state(base / "s")
    first = _state(sm)
    sm.train_step(data[1])
    second = _state(sm)
    n_ops = _save_with_crash_at(sm, tmp_path / "count" / "s", 10**9, monkeypatch)
    assert n_ops > 10  # every file written and synced, renames, the pointer, removals
    (tmp_path / "count").rename(tmp_path / "unused")
    seen = set()
    for k in range(n_ops + 1):
        d = tmp_path / f"k{k}"
        shutil.copytree(base, d)
        _save_with_crash_at(sm, d / "s", k, monkeypatch)
        got = _loaded(d / "s")
        assert _equal(got, first) or _equal(got, second), k
        seen.add("second" if _equal(got, second) else "first")
        sm2 = _model()  # and a later save there cleans up whatever the killed one left
        sm2.load_state(d / "s")
        sm2.save_state(d / "s")
        left = sorted(x.name for x in (d / "s").iterdir())
        assert len(left) == 2 and "LATEST" in left, (k, left)
    assert seen == {"first", "second"}  # crashes before and after the new state became current


def test_what_an_earlier_version_left_between_its_renames_is_found(tmp_path):
    """Saves before the pointer file renamed the old state away, then the new one into place: killed between the
    two, no state/ was left, only .state.old-PID and .state.partial-PID; the newest complete one is taken."""
    sm = _model()
    sm.train_step(torch.randint(0, 97, (4, 16)))
    d = sm.save_state(tmp_path / "tmp")
    old, partial = tmp_path / ".state.old-999999", tmp_path / ".state.partial-999999"
    shutil.copytree(d, old)
    shutil.copytree(d, partial)
    m = json.loads((partial / "state.json").read_text())
    (partial / "state.json").write_text(json.dumps({**m, "step": m["step"] + 1}))
    assert train_state.find(tmp_path / "state") == partial
    (partial / "state.json").unlink()  # killed before its manifest: incomplete
    assert train_state.find(tmp_path / "state") == old
    assert _equal(_loaded(tmp_path / "state"), _state(sm))
    sm.save_state(tmp_path / "state")  # a new save takes over and removes them (their process is gone)
    assert not old.exists() and not partial.exists()


def test_a_damaged_file_is_named_by_its_checksum(tmp_path):
    sm = _model()
    sm.train_step(torch.randint(0, 97, (4, 16)))
    d = sm.save_state(tmp_path / "s")
    f = d / "layer-00002.bin"
    raw = bytearray(f.read_bytes())
    raw[1000] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"layer-00002\.bin: checksum mismatch \(CRC-32 [0-9a-f]{8}, the manifest "
                                         r"says [0-9a-f]{8}\): the file was damaged after it was saved"):
        _model().load_state(tmp_path / "s")


def test_partial_saves_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    sm = _model()
    d = sm.save_state(tmp_path / "s")
    stale, live = tmp_path / "s" / f".partial-{DEAD}-1", tmp_path / "s" / f".partial-{os.getpid()}-99"
    stale.mkdir()
    (stale / "layer-00000.bin").write_bytes(b"x" * 100)
    live.mkdir()
    assert train_state.remove_stale(tmp_path / "s") == [stale]
    assert not stale.exists() and live.exists()
    assert train_state.find(tmp_path / "s") == d


@pytest.mark.parametrize("edit,msg", [
    (dict(step="3"), "'step' must be a count of steps (an integer >= 0), got '3'"),
    (dict(step=-7), "'step' must be a count of steps (an integer >= 0), got -7"),
    (dict(step=[1]), "'step' must be a count of steps (an integer >= 0), got [1]"),
    (dict(optimizer_steps={"0": 1}), "'optimizer_steps' must give a step count for each of the layers"),
    (dict(extra=[1]), "'extra' must be an object, got list"),
])
def test_a_hand_edited_manifest_is_refused_in_one_line(tmp_path, edit, msg):
    """Edited, a manifest no longer matches its checksum; edited with the checksum made again, each field is
    still checked."""
    from megatrain.runtime.state.state_dirs import manifest_bytes

    sm = _model()
    d = sm.save_state(tmp_path / "s")
    m = json.loads((d / "state.json").read_text())
    for data, why in ((json.dumps({**m, **edit}).encode(), "its contents do not match its checksum ('sha256'): the "
                                                           "manifest was edited or damaged after it was saved"),
                      (manifest_bytes({**m, **edit}), msg)):
        (d / "state.json").write_bytes(data)
        with pytest.raises(ValueError) as e:
            _model().load_state(tmp_path / "s")
        assert why in str(e.value) and "\n" not in str(e.value)


def test_saves_from_another_thread_while_steps_run_are_each_one_steps_state(tmp_path):
    """save_state() and train_step() take the model's lock: every state saved while another thread trains holds
    the weights and moments of exactly the step its manifest names (before the lock, most were torn)."""
    import threading

    sm = _model()
    snapshots = {0: _state(sm)[0]}
    saved, stop = [], threading.Event()

    def saver():
        i = 0
        while not stop.is_set():
            saved.append(sm.save_state(tmp_path / f"s{i}"))
            i += 1

    t = threading.Thread(target=saver)
    t.start()
    try:
        for i in range(6):
            sm.train_step(torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(i)))
            with sm._lock:
                snapshots[sm.step] = _state(sm)[0]
    finally:
        stop.set()
        t.join()
    assert len(saved) >= 2
    for d in saved:
        blocks, step = _loaded(d.parent)
        assert all(torch.equal(blocks[l], snapshots[step][l]) for l in blocks), (d, step)
