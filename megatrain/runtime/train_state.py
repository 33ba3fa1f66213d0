"""Training state on disk: everything a run needs to go on exactly where it stopped, kept safe from crashes.

A state is a directory holding ``state.json`` (the step, each layer's optimizer step count, the layout of the
parameters in the store, a CRC-32 of every file, and whatever the caller adds, e.g. the data order) and one raw file
per layer that owns weights: its fp32 master weights, exp_avg and exp_avg_sq, one after the other (the store's first
three rows, written and read in place, so saving and loading a large model needs no memory beyond the store). The
gradient row is not kept: a step starts by overwriting it.

The directory a caller names (``save(store, "run/state")``) holds states as ``step-<N>/`` subdirectories and a
pointer file, ``LATEST``, naming the current one. Saving writes a hidden ``.partial-<pid>-<n>/`` (each file synced
to disk, the manifest last), renames it to ``step-<N>/``, then replaces ``LATEST`` atomically (a new file renamed
over it), and only then removes the states it superseded. Whatever moment a crash hits, ``LATEST`` names a complete
state, the old one or the new. Loading follows ``LATEST``; where it is missing or names nothing complete (a crash,
a hand edit), the newest complete state found is taken instead -- also a state an earlier version saved directly in
the directory, or left next to it as ``.<name>.old-<pid>`` / ``.<name>.partial-<pid>``. Partial directories of
saves that died are removed by the next save. Each file's CRC-32 is checked as it is read.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from megatrain.capture import Captured
from megatrain.runtime.state_dirs import (FORMAT, LATEST, MANIFEST, STEP_DIR, VERSION, find, is_state_root,
                                          layer_file, layer_nbytes, legacy_siblings, pid_alive, remove_stale)
from megatrain.runtime.store import ROWS, HostStore

KEPT_ROWS = ROWS[:3]  # master, exp_avg, exp_avg_sq
_CHUNK = 64 << 20  # bytes per write / CRC call: CRC-32 runs at ~2.3 GB/s a thread, releasing the GIL


class NonFiniteState(ValueError):
    """The weights or moments to save are not all finite numbers."""


def _layout(cap: Captured) -> dict:
    def frozen(lay) -> dict:
        # a layer whose parameters are all frozen keeps its master weights alone (one row, not KEPT_ROWS); one
        # frozen in part the moments of its first ``trainable`` elements
        return {"rows": 1} if lay.frozen else {"trainable": lay.trainable} if lay.trainable is not None else {}

    return {
        "layers": {str(i): {"name": seg.name, "numel": int(seg.numel), **frozen(cap.graph[i])}
                   for i, seg in enumerate(cap.segments) if seg.numel},
        "params": {name: [layer, off, list(shape)] for name, (layer, off, shape) in cap.model_param_names.items()},
    }


def _crc(view: memoryview) -> int:
    crc = 0
    for i in range(0, len(view), _CHUNK):
        crc = zlib.crc32(view[i: i + _CHUNK], crc)
    return crc


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(store: HostStore, directory: str | Path, *, step: int, optimizer_steps: dict[int, int],
         extra: dict | None = None) -> Path:
    """Write the store's master weights and moments with ``step`` (steps taken), each layer's optimizer step count
    and ``extra`` (JSON) as a new state in ``directory``, which becomes the current one in one atomic rename.
    Returns the new state's own directory. Weights or moments that are not finite are refused
    (:class:`NonFiniteState`) and nothing changes."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} exists and is not a directory; it is left as it is: choose another path")
    if root.is_dir() and any(root.iterdir()) and not is_state_root(root):
        raise ValueError(f"{root} exists and is not a saved training state; it is left as it is: choose another path")
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    tmp = root / f".partial-{os.getpid()}-{_counter()}"
    tmp.mkdir()
    try:
        crcs = _write_layers(store, tmp)
        manifest = {"format": FORMAT, "version": VERSION, "step": int(step),
                    "optimizer_steps": {str(k): int(v) for k, v in optimizer_steps.items()},
                    "rows": list(KEPT_ROWS), "dtype": "float32", **_layout(store.captured),
                    "crc32": {layer_file(k): v for k, v in crcs.items()}, "extra": extra or {}}
        _write_synced(tmp / MANIFEST, json.dumps(manifest).encode())
        _fsync_dir(tmp)
        final = root / f"step-{int(step):08d}"
        k = 0
        while final.exists():  # the same step saved again: a new name, so the one LATEST names is never touched
            k += 1
            final = root / f"step-{int(step):08d}.{k}"
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took back; the state saved before stays current
        raise
    pointer = root / f".{LATEST}.{os.getpid()}"
    _write_synced(pointer, (final.name + "\n").encode())
    os.replace(pointer, root / LATEST)  # the one step that makes the new state current
    _fsync_dir(root)
    for old in root.iterdir():  # superseded states, and the files of a state an earlier version saved here
        if old == final or old.name == LATEST:
            continue
        if STEP_DIR.match(old.name):
            shutil.rmtree(old, ignore_errors=True)
        elif old.name == MANIFEST or (old.name.startswith("layer-") and old.suffix == ".bin"):
            old.unlink(missing_ok=True)
    for old in legacy_siblings(root):
        if not pid_alive(int(old.name.rsplit("-", 1)[1])):
            shutil.rmtree(old, ignore_errors=True)
    return final


_saves = [0]


def _counter() -> int:
    _saves[0] += 1
    return _saves[0]


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_layers(store: HostStore, d: Path) -> dict[int, int]:
    """Each layer's rows to its file, synced; their CRC-32s, computed on other threads while the next layer is
    written."""
    crcs = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for layer in store.owners():
            flat = store.flat(layer)
            if not bool(torch.isfinite(flat).all()):  # a state to go on from holds numbers
                rows = store.rows(layer)
                bad = [KEPT_ROWS[r] for r in range(len(rows)) if not bool(torch.isfinite(rows[r]).all())]
                raise NonFiniteState(f"layer {layer} ({store.captured.segments[layer].name}) holds values that are "
                                     f"not finite in {', '.join(bad)}: the state is not saved (the one saved before "
                                     f"stays current)")
            view = memoryview(flat.numpy()).cast("B")
            crcs[layer] = pool.submit(_crc, view)
            with open(d / layer_file(layer), "wb") as f:
                for i in range(0, len(view), _CHUNK):
                    f.write(view[i: i + _CHUNK])
                f.flush()
                os.fsync(f.fileno())
        return {k: v.result() for k, v in crcs.items()}


def read_manifest(captured: Captured, directory: str | Path) -> dict:
    """The manifest of the state :func:`find` picks in ``directory``, checked against the captured model: the same
    parameters at the same places, every layer file present and of its size, step counts that are counts. Raises
    ValueError naming the problem; touches nothing (so it can run before the store exists). The state's own
    directory is under the key ``"dir"``."""
    d = find(directory)
    path = d / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not a megatrain training state (format {m.get('format')!r})"
                         if isinstance(m, dict) else f"{path} is not a megatrain training state")
    if m.get("version") != VERSION:
        raise ValueError(f"{path}: training state version {m.get('version')!r}; this megatrain reads {VERSION}")
    want = _layout(captured)
    def placed(params) -> dict | None:  # name -> (layer, shape): a layer frozen in part lays its weights out anew
        return {k: (v[0], v[2]) for k, v in params.items() if isinstance(v, list) and len(v) == 3} \
            if isinstance(params, dict) else None

    if placed(m.get("params")) == placed(want["params"]) and isinstance(m.get("layers"), dict) \
            and m["layers"] != want["layers"]:
        def frozen(layers: dict) -> list[str]:
            return sorted((v.get("name", k) + (" in part" if "trainable" in v else "") for k, v in layers.items()
                           if isinstance(v, dict) and (v.get("rows") == 1 or "trainable" in v)))

        def unfrozen(layers: dict) -> dict:
            return {k: {**v, "rows": None, "trainable": None} for k, v in layers.items() if isinstance(v, dict)}

        if unfrozen(m["layers"]) == unfrozen(want["layers"]):
            raise ValueError(f"{d} was saved with the layers {frozen(m['layers']) or 'none'} frozen (no optimizer "
                             f"state for what is frozen), this model has {frozen(want['layers']) or 'none'}: freeze "
                             f"the same parameters to resume from it")
    if m.get("params") != want["params"] or m.get("layers") != want["layers"]:
        got, exp = m.get("params") if isinstance(m.get("params"), dict) else {}, want["params"]
        differ = sorted(set(got) ^ set(exp)) or sorted(k for k in exp if got.get(k) != exp[k])
        raise ValueError(f"{d} was saved from another model: {len(differ)} parameters differ in name, shape or "
                         f"place, e.g. {differ[:3]}")
    for key, lay in m["layers"].items():
        f = d / layer_file(int(key))
        size = f.stat().st_size if f.is_file() else None
        expect = layer_nbytes(lay)
        if size != expect:
            raise ValueError(f"{f}: {'missing' if size is None else f'{size:,} bytes'}, the layer's state is "
                             f"{expect:,} bytes (an incomplete or damaged training state)")
    _check_counts(m, path)
    crcs = m.get("crc32")
    if crcs is not None and (not isinstance(crcs, dict) or set(crcs) != {layer_file(int(k)) for k in m["layers"]}
                             or not all(isinstance(v, int) and not isinstance(v, bool) for v in crcs.values())):
        raise ValueError(f"{path}: 'crc32' does not list one checksum per layer file (a damaged training state)")
    if not isinstance(m.get("extra", {}), dict):
        raise ValueError(f"{path}: 'extra' must be an object, got {type(m['extra']).__name__}")
    m["dir"] = str(d)
    return m


def _check_counts(m: dict, path: Path) -> None:
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not count(m.get("step")):
        raise ValueError(f"{path}: 'step' must be a count of steps (an integer >= 0), got {m.get('step')!r}")
    steps = m.get("optimizer_steps")
    if not isinstance(steps, dict) or set(steps) != set(m["layers"]):
        raise ValueError(f"{path}: 'optimizer_steps' must give a step count for each of the layers "
                         f"{sorted(m['layers'], key=int)} (a damaged training state)")
    bad = {k: v for k, v in steps.items() if not count(v)}
    if bad:
        raise ValueError(f"{path}: 'optimizer_steps' must be integers >= 0, got {bad}")


def load(store: HostStore, directory: str | Path, progress: Callable[[int], None] | None = None) -> dict:
    """Read the state :func:`find` picks in ``directory`` into ``store`` (checked first, see :func:`read_manifest`),
    checking each file's CRC-32; returns its manifest (``step``, ``optimizer_steps``, ``extra``, ``dir``).
    ``progress(n)``: called with each layer's parameter count. A checksum that does not match raises ValueError
    naming the file; the store then holds part of the damaged state (load a good one, or start again)."""
    m = read_manifest(store.captured, directory)
    for hook in store.before_load:  # whoever holds device copies writes them back and lets them go
        hook()
    d = Path(m["dir"])
    crcs = m.get("crc32") or {}
    checks = []
    store.generation += 1  # device copies of the old masters are stale from here on, whatever happens
    store.shadows = None  # made again from the new masters when next needed
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for key in m["layers"]:
            layer = int(key)
            flat = store.flat(layer)
            view = memoryview(flat.numpy()).cast("B")
            with open(d / layer_file(layer), "rb") as f:
                got = f.readinto(view)
            if got != len(view):
                raise ValueError(f"{d / layer_file(layer)}: read {got} of {len(view)} bytes")
            if layer_file(layer) in crcs:
                checks.append((d / layer_file(layer), crcs[layer_file(layer)], pool.submit(_crc, view)))
            if progress is not None:
                progress(store.master(layer).numel())
        for path, want, fut in checks:
            if fut.result() != want:
                raise ValueError(f"{path}: checksum mismatch (CRC-32 {fut.result():08x}, the manifest says "
                                 f"{want:08x}): the file was damaged after it was saved")
    return m


def read_masters(directory: str | Path) -> dict[str, "torch.Tensor"]:
    """The master weights of the state :func:`find` picks in ``directory``, by parameter name (tied names once),
    read from its files with their checksums checked, without a model: what an export needs."""
    d = find(directory)
    path = d / MANIFEST
    try:
        m = json.loads(path.read_text())
        params, layers = m["params"], m["layers"]
        crcs = m.get("crc32") or {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a training state this megatrain reads ({type(e).__name__}: {e})") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise ValueError(f"{path} is not a megatrain training state of version {VERSION}")
    rows = {}
    for key, lay in layers.items():
        f = d / layer_file(int(key))
        n = int(lay["numel"])
        if not f.is_file() or f.stat().st_size != layer_nbytes(lay):
            raise ValueError(f"{f}: missing or not of the layer's size (an incomplete or damaged training state)")
        raw = bytearray(f.read_bytes())
        if layer_file(int(key)) in crcs and zlib.crc32(raw) != crcs[layer_file(int(key))]:
            raise ValueError(f"{f}: checksum mismatch: the file was damaged after it was saved")
        rows[int(key)] = torch.frombuffer(raw, dtype=torch.float32)[:n]
    out = {}
    for name, (layer, off, shape) in params.items():
        numel = 1
        for s in shape:
            numel *= s
        out[name] = rows[int(layer)][off: off + numel].view(*shape)
    return out
