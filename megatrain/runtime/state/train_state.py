"""Training state on disk: everything a run needs to go on exactly where it stopped, kept safe from crashes.

A state is a directory holding ``state.json`` (the step, each layer's optimizer step count, the layout of the
parameters in the store, a CRC-32 of every file, whatever the caller adds, e.g. the data order, and a SHA256 of all
of that, so that an edit or damage of the manifest is seen when it is read) and one raw file per layer that owns
weights: its fp32 master weights, exp_avg and exp_avg_sq, one after the other (the store's first three rows, written
and read in place, so saving and loading a large model needs no memory beyond the store). The gradient row is not
kept: a step starts by overwriting it.

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

import errno
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from megatrain.capture import Captured
from megatrain.rundir import flush_to_disk
from megatrain.runtime.state.safetensors_stream import CHUNK_BYTES
from megatrain.runtime.state.state_dirs import (FORMAT, LATEST, MANIFEST, STEP_DIR, VERSION, find, is_state_root,
                                          layer_file, layer_nbytes, legacy_siblings, load_manifest, manifest_bytes,
                                          pid_alive, remove_stale)
from megatrain.runtime.memory.store import ROWS, HostStore

KEPT_ROWS = ROWS[:3]  # master, exp_avg, exp_avg_sq
_CHUNK = CHUNK_BYTES  # bytes per write / read / CRC call: CRC-32 runs at ~2.3 GB/s a thread, releasing the GIL
# layer files written at once by a save: on a 2-core VM's disk 4 GiB in 16 files went at 1.14 GB/s from one
# thread, 1.79 from two, 1.57 from four (docs/benchmarks.md, "The journey"); NVMe disks take more
SAVE_WRITERS = min(4, os.cpu_count() or 1)
# host memory a save, a load or an export from a state takes beyond the store: a chunk of the state's files read
# (an export's, a checksum's); a save writes straight from the store and a load reads straight into it
STATE_IO_HOST_BYTES = _CHUNK


class NoSpace(OSError):
    """The disk cannot take the state: nothing was changed (the state saved before stays current)."""

    def __str__(self) -> str:
        return self.strerror


class NonFiniteState(ValueError):
    """The weights or moments to save are not all finite numbers."""


def state_nbytes(store: HostStore) -> int:
    """Bytes a state of ``store`` takes on disk (its layer files; the manifest is a few KB more)."""
    return sum(store.flat(l).numel() * 4 for l in store.owners())


def _no_space(root: Path, need: int, why: str) -> NoSpace:
    from megatrain.layout import fmt_bytes

    free = shutil.disk_usage(root).free
    return NoSpace(errno.ENOSPC, f"no space left on the disk: the training state needs {fmt_bytes(need)} and {root} "
                                 f"has {fmt_bytes(free)} free{why}; it is not saved")


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
         extra: dict | None = None, writers: int = SAVE_WRITERS, parameter_steps: dict[str, int] | None = None) -> Path:
    """Write the store's master weights and moments with ``step`` (steps taken), each layer's optimizer step count
    (and ``parameter_steps``: those of the parameters behind their layer's, by name) and ``extra`` (JSON) as a new
    state in ``directory``, which becomes the current one in one atomic rename.
    Returns the new state's own directory. ``writers``: layer files written at once. Weights or moments that are
    not finite are refused (:class:`NonFiniteState`), and so is a state the disk has no room for
    (:class:`NoSpace`, before anything is written, or when the disk fills up while it is); either way nothing
    changes. Memory beyond the store: :data:`STATE_IO_HOST_BYTES`."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} exists and is not a directory; it is left as it is: choose another path")
    if root.is_dir() and any(root.iterdir()) and not is_state_root(root):
        raise ValueError(f"{root} exists and is not a saved training state; it is left as it is: choose another path")
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    need = state_nbytes(store)
    if shutil.disk_usage(root).free < need + (1 << 20):  # (the manifest, the pointer)
        raise _no_space(root, need, " (the state saved before is removed only once the new one is complete)")
    tmp = root / f".partial-{os.getpid()}-{_counter()}"
    tmp.mkdir()
    try:
        crcs = _write_layers(store, tmp, writers)
        manifest = {"format": FORMAT, "version": VERSION, "step": int(step),
                    "optimizer_steps": {str(k): int(v) for k, v in optimizer_steps.items()},
                    "parameter_steps": {k: int(v) for k, v in (parameter_steps or {}).items()},
                    "rows": list(KEPT_ROWS), "dtype": "float32", **_layout(store.captured),
                    "crc32": {layer_file(k): v for k, v in crcs.items()}, "extra": extra or {}}
        _write_synced(tmp / MANIFEST, manifest_bytes(manifest))
        _fsync_dir(tmp)
        final = root / f"step-{int(step):08d}"
        k = 0
        while final.exists():  # the same step saved again: a new name, so the one LATEST names is never touched
            k += 1
            final = root / f"step-{int(step):08d}.{k}"
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took back; the state saved before stays current
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise _no_space(root, need, f" (the disk filled up while {e.filename or 'the state'} was written)") \
                from None
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
        flush_to_disk(f)


def _write_layers(store: HostStore, d: Path, writers: int) -> dict[int, int]:
    """Each layer's rows to its file, synced, ``writers`` files at once, each file's CRC-32 computed as it is
    written; returns them. A layer that holds values that are not finite stops the save
    (:class:`NonFiniteState`)."""
    def write(layer: int) -> int:
        flat = store.flat(layer)
        if not _finite(flat):  # a state to go on from holds numbers
            rows = store.rows(layer)
            bad = [KEPT_ROWS[r] for r in range(len(rows)) if not _finite(rows[r])]
            raise NonFiniteState(f"layer {layer} ({store.captured.segments[layer].name}) holds values that are "
                                 f"not finite in {', '.join(bad)}: the state is not saved (the one saved before "
                                 f"stays current)")
        view = memoryview(flat.numpy()).cast("B")
        crc = 0
        path = d / layer_file(layer)
        try:
            with open(path, "wb") as f:
                for i in range(0, len(view), _CHUNK):
                    f.write(view[i: i + _CHUNK])
                    crc = zlib.crc32(view[i: i + _CHUNK], crc)
                flush_to_disk(f)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from None
        return crc

    pool = ThreadPoolExecutor(max_workers=max(1, writers))
    try:
        futures = {layer: pool.submit(write, layer) for layer in store.owners()}
        return {layer: fut.result() for layer, fut in futures.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure, the files not begun are not written


def _finite(t: torch.Tensor) -> bool:
    """Every element of ``t`` finite: its least and greatest (NaN propagates through both), a reduction that takes
    no memory (``torch.isfinite(t).all()`` takes a float and two bool tensors of ``t``'s size: 658 MiB for a layer
    of 98M elements, measured)."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def read_manifest(captured: Captured, directory: str | Path) -> dict:
    """The manifest of the state :func:`find` picks in ``directory``, checked against the captured model: the same
    parameters at the same places, every layer file present and of its size, step counts that are counts. Raises
    ValueError naming the problem; touches nothing (so it can run before the store exists). The state's own
    directory is under the key ``"dir"``."""
    d = find(directory)
    path = d / MANIFEST
    m = load_manifest(path)
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
    if m.get("params") != want["params"]:
        got, exp = m.get("params") if isinstance(m.get("params"), dict) else {}, want["params"]
        differ = sorted(set(got) ^ set(exp)) or sorted(k for k in exp if got.get(k) != exp[k])
        raise ValueError(f"{d} was saved from another model: {len(differ)} parameters differ in name, shape or "
                         f"place, e.g. {differ[:3]}")
    if m.get("layers") != want["layers"]:
        got = m.get("layers") if isinstance(m.get("layers"), dict) else {}
        differ = sorted(set(got) ^ set(want["layers"]), key=int) or sorted(
            (k for k in want["layers"] if got.get(k) != want["layers"][k]), key=int)
        raise ValueError(f"{path}: its layers do not match this model's ({len(differ)} differ, e.g. layer "
                         f"{differ[0]}: saved {got.get(differ[0])}, this model {want['layers'].get(differ[0])})")
    for key, lay in m["layers"].items():
        f = d / layer_file(int(key))
        size = f.stat().st_size if f.is_file() else None
        expect = layer_nbytes(lay)
        if size != expect:
            raise ValueError(f"{f}: {'missing' if size is None else f'{size:,} bytes'}, the layer's state is "
                             f"{expect:,} bytes (an incomplete or damaged training state)")
    _check_counts(m, path)
    _check_crcs(m, path)
    if not isinstance(m.get("extra", {}), dict):
        raise ValueError(f"{path}: 'extra' must be an object, got {type(m['extra']).__name__}")
    m["dir"] = str(d)
    return m


def _check_crcs(m: dict, path: Path) -> None:
    crcs = m.get("crc32")
    if not isinstance(crcs, dict) or set(crcs) != {layer_file(int(k)) for k in m["layers"]} \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in crcs.values()):
        raise ValueError(f"{path}: 'crc32' does not list one checksum per layer file (a damaged training state)")


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
    ahead = {k: v for k, v in steps.items() if v > m["step"]}
    if ahead:  # a layer is updated once a step at most
        raise ValueError(f"{path}: layers {sorted(ahead, key=int)} took more optimizer steps ({max(ahead.values())}) "
                         f"than the state's {m['step']} steps (an inconsistent training state)")
    params = m.setdefault("parameter_steps", {})  # (states written before it was kept: none behind)
    if not isinstance(params, dict) or not all(count(v) for v in params.values()):
        raise ValueError(f"{path}: 'parameter_steps' must map parameter names to step counts (integers >= 0)")
    unknown = sorted(set(params) - set(m.get("params", {})))
    if unknown:
        raise ValueError(f"{path}: 'parameter_steps' names parameters the model does not have: {unknown[:3]}")


def load(store: HostStore, directory: str | Path, progress: Callable[[int], None] | None = None) -> dict:
    """Read the state :func:`find` picks in ``directory`` into ``store`` (checked first, see :func:`read_manifest`),
    checking each file's CRC-32; returns its manifest (``step``, ``optimizer_steps``, ``extra``, ``dir``).
    ``progress(n)``: called with each layer's parameter count. A checksum that does not match raises ValueError
    naming the file; the store then holds part of the damaged state (load a good one, or start again)."""
    m = read_manifest(store.captured, directory)
    for hook in store.before_load:  # whoever holds device copies writes them back and lets them go
        hook()
    d = Path(m["dir"])
    crcs = m["crc32"]
    checks = []
    store.generation += 1  # device copies of the old masters are stale from here on, whatever happens
    store.shadows = None  # made again from the new masters when next needed
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for key in m["layers"]:
            layer = int(key)
            flat = store.flat(layer)
            view = memoryview(flat.numpy()).cast("B")
            with open(d / layer_file(layer), "rb") as f:
                got = f.readinto(view)  # straight into the store
                if hasattr(os, "posix_fadvise"):  # (the page cache need not keep what the store now holds)
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if got != len(view):
                raise ValueError(f"{d / layer_file(layer)}: read {got} of {len(view)} bytes")
            checks.append((d / layer_file(layer), crcs[layer_file(layer)], pool.submit(_crc, view)))
            if progress is not None:
                progress(store.master(layer).numel())
        for path, want, fut in checks:
            if fut.result() != want:
                raise ValueError(f"{path}: checksum mismatch (CRC-32 {fut.result():08x}, the manifest says "
                                 f"{want:08x}): the file was damaged after it was saved")
    return m


class _MasterRows:
    """One parameter's fp32 master weights in a layer file, read a slice at a time into one reused buffer (a
    :class:`~megatrain.runtime.state.safetensors_stream.Source`: each slice is valid until the next is read)."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, ...], buf: torch.Tensor):
        self.path, self.offset, self.shape, self.buf = path, offset, tuple(shape), buf

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __getitem__(self, s: slice) -> torch.Tensor:
        lo, hi = s.start or 0, min(self.numel(), self.numel() if s.stop is None else s.stop)
        k = (hi - lo) * 4
        if k > self.buf.numel():
            raise ValueError(f"a slice of {hi - lo} elements is more than the read buffer holds")
        with open(self.path, "rb") as f:
            got = os.preadv(f.fileno(), [memoryview(self.buf.numpy())[:k]], self.offset + lo * 4)
        if got != k:
            raise ValueError(f"{self.path}: read {got} of {k} bytes (the file was cut after it was checked)")
        return self.buf[:k].view(torch.float32)


def master_sources(directory: str | Path) -> dict[str, _MasterRows]:
    """The master weights of the state :func:`find` picks in ``directory``, by parameter name (tied names once), as
    sources that read them from the state's files a chunk at a time (what an export writes, in
    :data:`STATE_IO_HOST_BYTES`), without a model. Every file's size and CRC-32 is checked first, a chunk at a
    time."""
    d = find(directory)
    path = d / MANIFEST
    m = load_manifest(path)
    try:
        params, layers = m["params"], m["layers"]
        _check_crcs(m, path)
        crcs = m["crc32"]
        for key, lay in layers.items():
            f = d / layer_file(int(key))
            if not f.is_file() or f.stat().st_size != layer_nbytes(lay):
                raise ValueError(f"{f}: missing or not of the layer's size (an incomplete or damaged training "
                                 f"state)")
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a training state this megatrain reads ({type(e).__name__}: {e})") from None
    buf = torch.empty(_CHUNK, dtype=torch.uint8)
    for key in layers:
        f = d / layer_file(int(key))
        if _file_crc(f, buf) != crcs[layer_file(int(key))]:
            raise ValueError(f"{f}: checksum mismatch: the file was damaged after it was saved")
    return {name: _MasterRows(d / layer_file(int(layer)), 4 * off, shape, buf)
            for name, (layer, off, shape) in params.items()}


def _file_crc(path: Path, buf: torch.Tensor) -> int:
    """CRC-32 of the file ``path``, read a chunk of ``buf`` at a time."""
    view = memoryview(buf.numpy())
    crc = 0
    with open(path, "rb") as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return crc


def read_masters(directory: str | Path) -> dict[str, torch.Tensor]:
    """The master weights of the state :func:`find` picks in ``directory`` as tensors of their own (4 bytes per
    parameter of new memory: for a large model use :func:`master_sources`)."""
    out, step = {}, _CHUNK // 4
    for name, src in master_sources(directory).items():
        t = torch.empty(src.numel())
        for lo in range(0, src.numel(), step):
            t[lo: lo + step] = src[lo: lo + step]
        out[name] = t.view(src.shape)
    return out
