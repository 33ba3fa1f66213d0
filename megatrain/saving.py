"""What a run of ``megatrain train`` writes besides its metrics: the trained weights (an HF model directory) and the
training state; how large they are, how long a save stops training, and whether the disk holds them; the weights of
a run's saved state written out again (``megatrain export``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

from megatrain.layout import fmt_bytes
from megatrain.rundir import STATE_DIR
from megatrain.runtime.state import train_state

# a state this large or larger gets the disk's write rate measured before training (a probe file of PROBE_BYTES),
# so the header can say how long each save stops training
PROBE_FROM_BYTES = 1 << 30
PROBE_BYTES = 256 << 20


def disk_write_rate(directory: Path, nbytes: int = PROBE_BYTES) -> float:
    """Bytes per second ``directory``'s disk takes a file of ``nbytes`` at, written and synced as a state's layer
    files are (the probe file is removed)."""
    from megatrain.rundir import flush_to_disk

    block = os.urandom(1 << 20)
    probe = directory / f".disk-probe-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        with open(probe, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            flush_to_disk(f)
        return max(1, nbytes >> 20) * len(block) / (time.perf_counter() - t0)
    finally:
        probe.unlink(missing_ok=True)


def weights_nbytes(sm, dtype) -> int:
    """Bytes of the exported weights in ``dtype``."""
    names = sm.captured.model_param_names
    return sum(math.prod(shape) for _, _, shape in names.values()) * dtype.itemsize


def outlook(sm, out: Path, step_s: float, weights: int) -> tuple[str, float | None]:
    """One sentence for the run's header on what the run writes at the end (and with ``--save-every`` on the way):
    the weights' and the state's size, the disk's free space (and where it cannot take them), and for a large state
    how long a save takes at the disk's measured rate and how many steps' time that is (``step_s``: the plan's
    predicted step). Also the rate (None where not measured)."""
    state = train_state.state_nbytes(sm.store)
    free = shutil.disk_usage(out).free
    rate = disk_write_rate(out, min(PROBE_BYTES, state)) if state >= PROBE_FROM_BYTES else None
    text = f"saves: the weights {fmt_bytes(weights)}, the training state {fmt_bytes(state)}"
    if rate is not None:
        save_s = state / rate
        text += f" (about {save_s:.0f} s a save at the {rate / 1e9:.2f} GB/s this disk wrote"
        text += (f", {save_s / step_s:.0f} steps' time: training stops while it is written)" if save_s > step_s
                 else ")")
    if weights + state > free:
        text += (f"; the disk has {fmt_bytes(free)} free, too little for "
                 + ("the state: the save of it at the end will be refused after the weights are written"
                    if weights <= free else "the weights or the state: both will be refused"))
    else:
        text += f"; the disk has {fmt_bytes(free)} free"
    return text, rate


def save_state(sm, batches, out: Path, say) -> float:
    """Save the training state with the data order, saying so (``say``: a one-line printer) before and after, with
    the time it took and the rate; returns the seconds. :class:`~megatrain.runtime.state.train_state.NoSpace` where the
    disk cannot take it (nothing changed)."""
    nbytes = train_state.state_nbytes(sm.store)
    say(f"step {sm.step}: saving the training state ({fmt_bytes(nbytes)}) to {out}/{STATE_DIR}/")
    t0 = time.perf_counter()
    sm.save_state(out / STATE_DIR, extra={"data_order": batches.state()})
    took = time.perf_counter() - t0
    say(f"step {sm.step}: training state saved in {took:.1f} s ({nbytes / max(took, 1e-9) / 1e9:.2f} GB/s)")
    return took


def save_weights(sm, model, tok, out: Path, dtype, stop_tokens: tuple[str, ...] = ()) -> float:
    """The trained weights as an HF model directory (megatrain.export) in ``dtype``: ``from_pretrained`` and
    ``AutoTokenizer`` read it unchanged; streamed from the store (megatrain.export.EXPORT_HOST_BYTES of memory).
    Returns the seconds it took."""
    from megatrain.export import export_pretrained

    t0 = time.perf_counter()
    sd = sm.state_dict()
    export_pretrained({n: sd[n] for n in sm.captured.model_param_names}, model.config, tok, out, dtype,
                      model.directory, stop_tokens=stop_tokens)
    return time.perf_counter() - t0


def export_run(run: str | Path, out: str | Path, dtype: str | None = None, trust_remote_code: bool = False
               ) -> list[Path]:
    """A run directory's training state (``RUN/state``, or that state directory itself) as an HF model directory in
    ``out``: the model's config as the run built it, the run's tokenizer, the state's master weights in ``dtype``
    (None: the dtype the run's model came in). ``trust_remote_code``: this caller's alone (a run directory's
    config never allows a model's code to run); temporary files that killed writes left in the run directory are
    removed."""
    from megatrain.data import load_tokenizer
    from megatrain.export import export_dtype, export_pretrained, set_special_ids
    from megatrain.inputs import model_source
    from megatrain.rundir import RUN_FILE, remove_leftovers
    from megatrain.train_config import TrainConfig

    run = Path(run)
    if not (run / RUN_FILE).is_file() and (run.parent / RUN_FILE).is_file():
        run = run.parent  # the state directory was named
    try:
        cfg = TrainConfig(**json.loads((run / RUN_FILE).read_text())["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{run} is not a run directory of megatrain train (its {RUN_FILE}: {type(e).__name__}: "
                         f"{e})") from None
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose another output directory")
    remove_leftovers(run)
    model = model_source(cfg.model, cfg.vocab, cfg.seq, trust_remote_code)
    tok = load_tokenizer(run)
    if model.weights is None:
        set_special_ids(model.config, tok)
    tensors = train_state.master_sources(run / STATE_DIR)  # every file's checksum checked first
    return export_pretrained(tensors, model.config, tok, out, export_dtype(dtype or cfg.export_dtype or model.dtype),
                             model.directory, stop_tokens=cfg.stop_tokens())
