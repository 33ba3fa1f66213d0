"""Training state on disk: everything a run needs to go on exactly where it stopped.

A state directory holds ``state.json`` (the step, each layer's optimizer step count, the layout of the parameters
in the store, and whatever the caller adds, e.g. the data order) and one raw file per layer that owns weights:
its fp32 master weights, exp_avg and exp_avg_sq, one after the other (the store's first three rows, written and
read in place, so saving and loading a large model needs no memory beyond the store). The gradient row is not
kept: a step starts by overwriting it.

Saving writes a new directory next to the target and swaps it in only when every file is complete, so a crash
while saving leaves the previous state as it was. Loading checks the whole directory against the model (layout,
file sizes) before it writes anything into the store.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from megatrain.capture import Captured
from megatrain.runtime.store import ROWS, HostStore

FORMAT = "megatrain-train-state"
VERSION = 1
KEPT_ROWS = ROWS[:3]  # master, exp_avg, exp_avg_sq
MANIFEST = "state.json"


def _layout(cap: Captured) -> dict:
    return {
        "layers": {str(i): {"name": seg.name, "numel": int(seg.numel)} for i, seg in enumerate(cap.segments)
                   if seg.numel},
        "params": {name: [layer, off, list(shape)] for name, (layer, off, shape) in cap.model_param_names.items()},
    }


def _file(layer: int) -> str:
    return f"layer-{layer:05d}.bin"


def save(store: HostStore, directory: str | Path, *, step: int, optimizer_steps: dict[int, int],
         extra: dict | None = None) -> Path:
    """Write the store's master weights and moments with ``step`` (steps taken), each layer's optimizer step count
    and ``extra`` (JSON) to ``directory``, replacing a state saved there before only once the new one is whole."""
    d = Path(directory)
    if d.exists() and not (d / MANIFEST).is_file():
        raise ValueError(f"{d} exists and is not a saved training state; it is left as it is: choose another path")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.parent / f".{d.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for layer in store.owners():
            rows = store.block(layer)[: len(KEPT_ROWS)]
            with open(tmp / _file(layer), "wb") as f:
                f.write(memoryview(rows.numpy()).cast("B"))
                f.flush()
                os.fsync(f.fileno())
        manifest = {"format": FORMAT, "version": VERSION, "step": int(step),
                    "optimizer_steps": {str(k): int(v) for k, v in optimizer_steps.items()},
                    "rows": list(KEPT_ROWS), "dtype": "float32", **_layout(store.captured), "extra": extra or {}}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took back; the state saved before stays
        raise
    old = d.parent / f".{d.name}.old-{os.getpid()}"
    if d.exists():
        d.rename(old)
    tmp.rename(d)
    if old.exists():
        shutil.rmtree(old)
    return d


def read_manifest(captured: Captured, directory: str | Path) -> dict:
    """``directory``'s manifest, checked against the captured model: the same parameters at the same places,
    every layer file present and of its size. Raises ValueError naming the problem; touches nothing (so it can
    run before the store exists)."""
    d = Path(directory)
    path = d / MANIFEST
    if not path.is_file():
        raise ValueError(f"{d} is not a saved training state (no {MANIFEST})")
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not a megatrain training state (format {m.get('format')!r})"
                         if isinstance(m, dict) else f"{path} is not a megatrain training state")
    if m.get("version") != VERSION:
        raise ValueError(f"{path}: training state version {m.get('version')!r}; this megatrain reads {VERSION}")
    want = _layout(captured)
    if m.get("params") != want["params"] or m.get("layers") != want["layers"]:
        got, exp = m.get("params") or {}, want["params"]
        differ = sorted(set(got) ^ set(exp)) or sorted(k for k in exp if got.get(k) != exp[k])
        raise ValueError(f"{d} was saved from another model: {len(differ)} parameters differ in name, shape or "
                         f"place, e.g. {differ[:3]}")
    for key, lay in m["layers"].items():
        f = d / _file(int(key))
        size = f.stat().st_size if f.is_file() else None
        expect = lay["numel"] * 4 * len(KEPT_ROWS)
        if size != expect:
            raise ValueError(f"{f}: {'missing' if size is None else f'{size:,} bytes'}, the layer's state is "
                             f"{expect:,} bytes (an incomplete or damaged training state)")
    steps = m.get("optimizer_steps")
    if not isinstance(m.get("step"), int) or not isinstance(steps, dict) or set(steps) != set(m["layers"]):
        raise ValueError(f"{path}: the step counts do not match the layers (a damaged training state)")
    return m


def load(store: HostStore, directory: str | Path, progress: Callable[[int], None] | None = None) -> dict:
    """Read a state written by :func:`save` into ``store`` (checked first, see :func:`read_manifest`); returns its
    manifest (``step``, ``optimizer_steps``, ``extra``). ``progress(n)``: called with each layer's parameter count."""
    m = read_manifest(store.captured, directory)
    for hook in store.before_load:  # whoever holds device copies writes them back and lets them go
        hook()
    d = Path(directory)
    for key in m["layers"]:
        layer = int(key)
        rows = store.block(layer)[: len(KEPT_ROWS)]
        view = memoryview(rows.numpy()).cast("B")
        with open(d / _file(layer), "rb") as f:
            got = f.readinto(view)
        if got != len(view):
            raise ValueError(f"{d / _file(layer)}: read {got} of {len(view)} bytes")
        if progress is not None:
            progress(rows.shape[1])
    store.shadows = None  # made again from the new masters when next needed
    store.generation += 1  # device copies of the old masters are stale
    return m
