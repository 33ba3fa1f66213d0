"""Going on from a run directory: the config of the run to resume (what may change and what may not), and the
newest training state a run can go on from."""

from __future__ import annotations

import json
from pathlib import Path

from megatrain.rundir import RUN_FILE, STATE_DIR, holder, remove_leftovers
from megatrain.runtime.state import train_state
from megatrain.train_config import TrainConfig

# what decides the model and the data stream: a resumed run takes these from the run it goes on from
RESUME_FIXED = ("model", "data", "batch", "seq", "vocab", "seed", "format", "columns", "packing", "eval_split",
                "streaming")


def last_state(out: Path, cfg: TrainConfig) -> tuple[Path, int] | None:
    """(run directory, step) of the newest training state this run can go on from: its own, else the one it
    resumed from."""
    for run_dir in (out, *((Path(cfg.resume),) if cfg.resume else ())):
        try:
            d = train_state.find(run_dir / STATE_DIR)
            return run_dir, int(train_state.load_manifest(d / train_state.MANIFEST)["step"])
        except (ValueError, OSError, KeyError, TypeError):
            continue
    return None


def resume_config(run_dir: str, **overrides) -> TrainConfig:
    """The config of the run in ``run_dir``, to go on from the training state it saved, with ``overrides``:
    anything but what decides the model and the data stream (:data:`RESUME_FIXED`), e.g. more steps, another
    learning rate, another plan. What runs killed there left behind (partial saves, superseded states, temporary
    files) is removed. ``trust_remote_code`` comes from ``overrides`` alone, never from the run directory."""
    d = Path(run_dir)
    for need in (RUN_FILE, "tokenizer_config.json"):
        if not (d / need).is_file():
            raise ValueError(f"cannot resume from {d}: it holds no {need} (a run directory of megatrain train "
                             f"that saved its training state has one)")
    who = holder(d)
    if who is not None:
        raise ValueError(f"cannot resume from {d}: a megatrain train" + (f" (process {who})" if who else "")
                         + " is training into it now; resume once it has stopped")
    train_state.remove_stale(d / STATE_DIR)
    remove_leftovers(d)
    try:
        state = train_state.find(d / STATE_DIR)
    except ValueError as e:
        raise ValueError(f"cannot resume from {d}: {e}") from None
    fixed = [k for k in RESUME_FIXED if k in overrides]
    if fixed:
        raise ValueError(f"a resumed run trains the same model on the same data in the same order: "
                         f"{', '.join(RESUME_FIXED)} cannot change, and {', '.join(fixed)} was given")
    try:
        began = json.loads((d / RUN_FILE).read_text())["config"]
        began["warmup"] = TrainConfig(**began).warmup_steps  # as it was, whatever the steps become
        began["trust_remote_code"] = False  # a run directory is data: only this command line may allow code
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot resume from {d}: its {RUN_FILE} does not hold a config this megatrain reads "
                         f"({type(e).__name__}: {e})") from None
    cfg = TrainConfig(**{**began, "out": None, **overrides, "resume": str(d)})
    try:
        done = train_state.load_manifest(state / train_state.MANIFEST).get("step")
    except ValueError as e:
        raise ValueError(f"cannot resume from {d}: {e}") from None
    if isinstance(done, bool) or not isinstance(done, int) or done < 0:
        raise ValueError(f"cannot resume from {d}: {state / train_state.MANIFEST}: 'step' must be a count of steps "
                         f"(an integer >= 0), got {done!r}")
    if done >= cfg.steps:
        raise ValueError(f"{d} already took {done} of its {cfg.steps} steps: pass --steps N with N > {done} to go "
                         f"further")
    return cfg
