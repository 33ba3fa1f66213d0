"""The experiment trackers a run reports to (``--report-to``): TensorBoard, Weights & Biases and MLflow, each through
its own client. Every tracker gets the same numbers as metrics.jsonl, under ``train/<name>`` and ``eval/<name>``,
at the step they belong to; W&B and MLflow also get the run's config at the start and its summary at the end."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

# name -> (the module its client imports, what to install)
TRACKERS = {
    "tensorboard": ("tensorboard", "pip install 'megatrain[tensorboard]'"),
    "wandb": ("wandb", "pip install 'megatrain[wandb]'"),
    "mlflow": ("mlflow", "pip install 'megatrain[mlflow]'"),
}


def parse(text: str) -> tuple[str, ...]:
    """``tensorboard,wandb`` -> ("tensorboard", "wandb"); "" or "none" -> (); an unknown name or a tracker whose
    package is not installed is refused in one line."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {n!r} (choose from {', '.join(TRACKERS)}, comma-separated, "
                             f"or none)")
        module, install = TRACKERS[n]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"report_to: {n} needs the {module} package, which is not installed ({install})")
        if n == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") and importlib.util.find_spec("alembic") is None:
            raise ValueError("report_to: mlflow without $MLFLOW_TRACKING_URI keeps its runs in <out>/mlflow.db, which "
                             "needs sqlalchemy and alembic (pip install 'megatrain[mlflow]')")
    return names


def scalars(rec: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers under the trackers' names: a step's as train/loss, ..., an evaluation's as
    eval/eval_loss, eval/seconds, ..."""
    group = "eval" if "eval_loss" in rec else "train"
    return {f"{group}/{k}": float(v) for k, v in rec.items()
            if k not in ("step", "skipped") and isinstance(v, (int, float))}


class _TensorBoard:
    def __init__(self, out: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(out / "tensorboard"))

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def finish(self, summary: dict) -> None:
        self.w.close()


class _WandB:
    """A run in the project $WANDB_PROJECT (default megatrain), named after the output directory, its files under
    it; $WANDB_MODE=offline keeps it on this machine (``wandb sync`` sends it later)."""

    def __init__(self, out: Path, config: dict):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "megatrain"), name=out.name, dir=str(out),
                              config=config)

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish()


class _MLflow:
    """A run in the experiment $MLFLOW_EXPERIMENT_NAME (default megatrain) at $MLFLOW_TRACKING_URI, or, without
    one, in an SQLite store <out>/mlflow.db (MLflow's own default store, kept with the run); the config as
    parameters, the summary's numbers as metrics summary/<name>."""

    def __init__(self, out: Path, config: dict):
        import logging

        from mlflow.tracking import MlflowClient

        for name in ("mlflow.store.db.utils", "alembic"):  # (a new store's table set-up, line by line)
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "megatrain")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=out.name).info.run_id
        from mlflow.entities import Param

        # (MLflow caps a parameter's value at 6,000 characters; a config's values are short)
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in config.items()])

    def log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = _millis()
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()
                                                    if math.isfinite(v)])

    def finish(self, summary: dict) -> None:
        from mlflow.entities import Metric

        now = _millis()
        last = [Metric(f"summary/{k}", float(v), now, 0) for k, v in summary.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if last:
            self.client.log_batch(self.run_id, metrics=last)
        self.client.set_terminated(self.run_id)


def _millis() -> int:
    import time

    return int(time.time() * 1000)


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class Trackers:
    """The trackers of one run (none: every call does nothing)."""

    def __init__(self, names: tuple[str, ...], out: Path, config: dict):
        self.open = [_CLASSES[n](out, config) for n in names]

    def log(self, rec: dict) -> None:
        if self.open:
            values = scalars(rec)
            for t in self.open:
                t.log(values, rec["step"])

    def finish(self, summary: dict | None = None) -> None:
        for t in self.open:
            t.finish(summary or {})
        self.open = []
