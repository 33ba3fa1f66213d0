"""--report-to: W&B (offline) and MLflow (its SQLite store) get, through their own clients, the numbers metrics.jsonl
has, at the same steps; the run's config and summary go with them."""

import glob
import json
import struct

import pytest

from megatrain.cli import main
from megatrain.trackers import scalars


def _wandb_records(path: str) -> list:
    """The records of a W&B run file (a LevelDB-style log: 32 KiB blocks of records, each with a 7-byte header of
    checksum, length and kind, a record longer than a block's rest split into first / middle / last pieces)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, part, out = open(path, "rb").read(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n, kind) == (0, 0):  # a block's padding
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last piece
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


def test_wandb_and_mlflow_get_each_steps_metrics(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    pytest.importorskip("mlflow", reason="the test extra installs mlflow-skinny")
    pytest.importorskip("alembic", reason="the test extra installs sqlalchemy and alembic")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "tracked")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--steps", "3", "--batch", "4", "--seq", "32", "--warmup", "0", "--eval-split", "0.01",
                 "--eval-every", "2", "--report-to", "wandb,mlflow", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval_loss" in r]
    assert len(steps) == 3 and evals and not (out / "tensorboard").exists()
    summary = json.loads((out / "summary.json").read_text())

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("megatrain").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["steps"] == "3" and run.data.params["report_to"] == "wandb,mlflow"
    for key, recs in (("train/loss", steps), ("train/lr", steps), ("train/grad_norm", steps),
                      ("train/host_rss_gib", steps), ("eval/eval_loss", evals)):
        history = dict(sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)))
        assert list(history) == [r["step"] for r in recs], key
        assert list(history.values()) == pytest.approx([r[key.split("/")[1]] for r in recs], rel=1e-12), key
    assert run.data.metrics["summary/tokens_per_s"] == pytest.approx(summary["tokens_per_s"])

    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = _wandb_records(path)
    rows: dict[int, dict] = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = rows.setdefault(rec.history.step.num, {})
            row.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    for r in lines:
        want = scalars(r)
        assert {k: rows[r["step"]][k] for k in want} == pytest.approx(want, rel=1e-12), r["step"]
    runs = [rec.run for rec in records if rec.WhichOneof("record_type") == "run"]
    assert runs and runs[0].project == "tracked" and runs[0].display_name == "run"
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["steps"] == 3 and config["seq"] == 32
    last = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "summary":
            last.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.summary.update})
    assert last["tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    assert any(rec.WhichOneof("record_type") == "exit" for rec in records)  # the run was finished
