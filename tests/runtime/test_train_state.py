"""Saving and loading the training state: a run stopped and resumed takes the same steps as one that never
stopped."""

import json

import pytest
import torch

import megatrain
from megatrain.runtime.state import train_state

from .models import VOCAB, hf_model

OPT = megatrain.OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2, total_steps=8)
PLANS = {"host": dict(), "device": dict(gpu_opt_every=1, resident_opt="auto")}


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (4, 16), generator=g) for _ in range(n)]


def _compile(plan, **kw):
    return megatrain.compile(hf_model("llama"), device="cpu", optim=OPT, n_mb=2, **PLANS[plan], **kw)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_stopped_and_resumed_equals_unbroken(tmp_path, plan):
    data = _batches(6)
    whole = _compile(plan)
    ref = [whole.train_step(b) for b in data]
    first = _compile(plan)
    for b in data[:3]:
        first.train_step(b)
    saved = first.save_state(tmp_path / "s", extra={"note": "three steps"})
    assert saved.parent == tmp_path / "s" and (tmp_path / "s" / "LATEST").read_text().strip() == saved.name
    # a new process would build the model on the meta device and compile it from the state
    with torch.device("meta"):
        meta = hf_model("llama")
    resumed = megatrain.compile(meta, device="cpu", optim=OPT, n_mb=2, state=tmp_path / "s", **PLANS[plan])
    assert resumed.step == 3
    rest = [resumed.train_step(b) for b in data[3:]]
    assert [(s.step, s.loss, s.lr, s.grad_norm) for s in rest] == [(s.step, s.loss, s.lr, s.grad_norm)
                                                                   for s in ref[3:]]
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for layer in whole.store.owners():  # the moments too
        assert torch.equal(whole.store.block(layer)[:3], resumed.store.block(layer)[:3])
    # the first model goes on from its own state after loading it back over later steps
    first.train_step(data[3])
    assert json.loads((saved / "state.json").read_text())["extra"] == {"note": "three steps"}
    assert first.load_state(tmp_path / "s") == {"note": "three steps"}
    assert [first.train_step(x).loss for x in data[3:]] == [s.loss for s in ref[3:]]


def test_saving_replaces_a_state_only_when_the_new_one_is_whole(tmp_path, monkeypatch):
    sm = _compile("host")
    sm.train_step(_batches(1)[0])
    d = sm.save_state(tmp_path / "s")
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    sm.train_step(_batches(2)[1])
    real_open = open

    def failing_open(path, mode="r", *a, **k):  # the disk fills up while the second layer is written
        if "layer-00001" in str(path) and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(train_state.NoSpace, match=r"no space left on the disk: the training state needs .* free \(the "
                       r"disk filled up while .*layer-00001.bin was written\); it is not saved"):
        sm.save_state(tmp_path / "s")
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before  # the old state, untouched
    assert sorted(x.name for x in (tmp_path / "s").iterdir()) == ["LATEST", d.name]  # and the partial one removed
    assert train_state.find(tmp_path / "s") == d
    other = tmp_path / "not-a-state"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a saved training state; it is left as it is"):
        sm.save_state(other)
    assert (other / "notes.txt").read_text() == "mine"


def test_a_bad_state_is_refused_before_the_store_changes(tmp_path):
    sm = _compile("host")
    sm.train_step(_batches(1)[0])
    d = sm.save_state(tmp_path / "s")
    other = megatrain.compile(hf_model("llama", intermediate_size=64), device="cpu", optim=OPT)
    with pytest.raises(ValueError, match=r"was saved from another model: \d+ parameters differ"):
        other.load_state(d)
    fresh = _compile("host")
    snapshot = {k: v.clone() for k, v in fresh.state_dict().items()}
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in d.iterdir():
        (cut / f.name).write_bytes(f.read_bytes())
    (cut / "layer-00002.bin").write_bytes((d / "layer-00002.bin").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"layer-00002\.bin: 100 bytes, the layer's state is [\d,]+ bytes"):
        fresh.load_state(cut)
    (cut / "layer-00002.bin").unlink()
    with pytest.raises(ValueError, match=r"layer-00002\.bin: missing"):
        fresh.load_state(cut)
    with pytest.raises(ValueError, match="is not a saved training state"):
        fresh.load_state(tmp_path)
    m = json.loads((d / "state.json").read_text())
    (cut / "state.json").write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(ValueError, match="training state version 99; this megatrain reads 2"):
        fresh.load_state(cut)
    assert all(torch.equal(v, snapshot[k]) for k, v in fresh.state_dict().items())
    assert fresh.step == 0
    with pytest.raises(ValueError, match="pass one of checkpoint=, init_seed= and state="):
        megatrain.compile(hf_model("llama"), device="cpu", init_seed=0, state=d)


def test_the_files_hold_master_and_moments_as_raw_fp32(tmp_path):
    sm = _compile("host")
    sm.train_step(_batches(1)[0])
    d = sm.save_state(tmp_path / "s")
    m = train_state.read_manifest(sm.captured, d)
    assert m["step"] == 1 and set(m["optimizer_steps"].values()) == {1}
    for key in m["layers"]:
        raw = torch.frombuffer(bytearray((d / f"layer-{int(key):05d}.bin").read_bytes()), dtype=torch.float32)
        assert torch.equal(raw.view(3, -1), sm.store.block(int(key))[:3])  # independent of the reader in load()


def test_a_tied_model_sending_bf16_resumes_exactly(tmp_path):
    """A head tied to the embedding (one block for both) and a bf16 wire (the host shadow made again from the
    loaded masters)."""
    from .models import TinyGPT

    def fresh():
        torch.manual_seed(0)
        return megatrain.compile(TinyGPT(tied=True), device="cpu", n_mb=2, optim=OPT, compute_dtype=torch.bfloat16,
                                 wire="bf16")

    data = _batches(6)
    whole = fresh()
    ref = [whole.train_step(b).loss for b in data]
    first = fresh()
    for b in data[:3]:
        first.train_step(b)
    first.save_state(tmp_path / "s")
    resumed = fresh()
    resumed.load_state(tmp_path / "s")
    assert [resumed.train_step(b).loss for b in data[3:]] == ref[3:]
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
