"""Where training states live on disk (see :mod:`megatrain.runtime.state.train_state`): the names of a state's files and
directories, which state a directory's pointer file or, failing it, its newest complete state makes current, and
the partial directories of saves that died."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

FORMAT = "megatrain-train-state"
VERSION = 2  # 2: the manifest carries a checksum of itself (SHA256) and a CRC-32 of every layer file
CHECKSUM = "sha256"  # the manifest's key for the checksum of the rest of it
MANIFEST = "state.json"
LATEST = "LATEST"
STEP_DIR = re.compile(r"^step-(\d+)(\.\d+)?$")
PARTIAL = re.compile(r"^\.partial-(\d+)-\d+$")
LEGACY = re.compile(r"^\.(?P<name>.+)\.(old|partial)-(\d+)$")  # what saves before the pointer file left behind


def manifest_bytes(manifest: dict) -> bytes:
    """``manifest`` as written: its JSON with :data:`CHECKSUM`, the SHA256 of its canonical JSON without it."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return json.dumps({**body, CHECKSUM: _digest(body)}).encode()


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_manifest(path: Path) -> dict:
    """The manifest in ``path``, checked whole: readable JSON of a state of this version whose checksum matches
    its contents (any edit, or damage, of state.json is refused here, naming it). ValueError otherwise."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not a megatrain training state (format {m.get('format')!r})"
                         if isinstance(m, dict) else f"{path} is not a megatrain training state")
    if m.get("version") != VERSION:
        why = " (saved without a checksum of its manifest)" if m.get("version") == 1 else ""
        raise ValueError(f"{path}: training state version {m.get('version')!r}{why}; this megatrain reads {VERSION}")
    if not isinstance(m.get(CHECKSUM), str):
        raise ValueError(f"{path}: no '{CHECKSUM}' checksum of the manifest (a damaged training state)")
    body = {k: v for k, v in m.items() if k != CHECKSUM}
    if _digest(body) != m[CHECKSUM]:
        raise ValueError(f"{path}: its contents do not match its checksum ('{CHECKSUM}'): the manifest was edited or "
                         f"damaged after it was saved; the state is not used")
    return body


def layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.bin"


def layer_nbytes(lay: dict) -> int:
    """Bytes of a layer's file, from its manifest entry: its masters, and the moments of the elements that train."""
    n = int(lay["numel"])
    return 4 * (n + 2 * (0 if lay.get("rows") == 1 else int(lay.get("trainable", n))))


def is_state_root(d: Path) -> bool:
    return (d / LATEST).is_file() or (d / MANIFEST).is_file() or any(
        STEP_DIR.match(x.name) or PARTIAL.match(x.name) for x in d.iterdir())


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: str | Path) -> list[Path]:
    """Remove the partial directories that saves into ``root`` left when their process died, and the states that
    ``LATEST`` no longer names when it names a complete one (a save that died between moving the pointer and
    removing them); returns them."""
    root = Path(root)
    gone = []
    if not root.is_dir():
        return gone
    current = _pointed(root)
    for x in sorted(root.iterdir()):
        if current is not None and x != current and STEP_DIR.match(x.name) and x.is_dir():
            shutil.rmtree(x, ignore_errors=True)
            gone.append(x)
            continue
        m = PARTIAL.match(x.name)
        if m and x.is_dir() and not pid_alive(int(m.group(1))):
            shutil.rmtree(x, ignore_errors=True)
            gone.append(x)
        elif x.name.startswith(f".{LATEST}.") and x.is_file() and not pid_alive(int(x.name.rsplit(".", 1)[1])):
            x.unlink(missing_ok=True)
            gone.append(x)
    return gone


def _quick_manifest(d: Path) -> dict | None:
    """``d``'s manifest if ``d`` holds a complete state (the manifest, written last, readable, and every layer file
    of its size), else None. The checksums are checked when the state is read."""
    try:
        m = json.loads((d / MANIFEST).read_text())
        if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("layers"), dict):
            return None
        for key, lay in m["layers"].items():
            f = d / layer_file(int(key))
            if not f.is_file() or f.stat().st_size != layer_nbytes(lay):
                return None
        return m
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _pointed(root: Path) -> Path | None:
    """The complete state ``root``'s ``LATEST`` names, None where it names none."""
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if STEP_DIR.match(name) and _quick_manifest(root / name) is not None else None


def find(directory: str | Path) -> Path:
    """The complete state to read from ``directory`` (see the module doc), or where none is complete the newest
    that has a manifest (:func:`read_manifest` then names what is wrong with it); ValueError if there is none."""
    root = Path(directory)
    current = _pointed(root)
    if current is not None:
        return current
    candidates = [root] + [x for x in root.iterdir() if STEP_DIR.match(x.name) or PARTIAL.match(x.name)] \
        if root.is_dir() else []
    candidates += legacy_siblings(root)
    if not candidates:
        raise ValueError(f"{root} is not a saved training state (no such directory)")
    found = [(m["step"], d.stat().st_mtime, d) for d in candidates if d.is_dir()
             and (m := _quick_manifest(d)) is not None and isinstance(m.get("step"), int)]
    if found:
        return max(found, key=lambda t: (t[0], t[1]))[2]
    damaged = [d for d in candidates if (d / MANIFEST).is_file()]  # read_manifest then says what is wrong
    if damaged:
        return max(damaged, key=lambda d: (d / MANIFEST).stat().st_mtime)
    raise ValueError(f"{root} is not a saved training state (no {MANIFEST}, and no complete state in it)")


def legacy_siblings(root: Path) -> list[Path]:
    """What saves before the pointer file left next to ``root`` when a crash hit between their renames:
    ``.<name>.old-<pid>`` (the state before) and ``.<name>.partial-<pid>`` (the new one, complete or not)."""
    if not root.parent.is_dir():
        return []
    return [x for x in root.parent.iterdir() if x.is_dir() and (m := LEGACY.match(x.name)) and m["name"] == root.name]
