"""HF-layout safetensors checkpoints read into the store: which file holds what, checked from the headers alone
before anything is allocated, and where each tensor goes (a parameter, or one expert's rows of a parameter that
stacks every expert's, through transformers' conversion mapping for the family)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatrain.capture import Captured


def check_weights_dir(captured: Captured, directory: str | Path) -> list[Path]:
    """The files of an HF-layout safetensors checkpoint for ``captured``, refused with one message naming the file
    and the problem (unreadable, a tensor the model lacks or of another shape, a parameter missing) from the
    headers alone, before any weight is read or any store allocated."""
    return checkpoint_plan(captured, directory)[0]


def _conversions(model_type: str) -> tuple[list, list]:
    """transformers' renamings and per-expert merges for checkpoints of ``model_type`` (its
    ``conversion_mapping``): ([(source regex, target)], [(source patterns, target pattern)]), the merges those that
    stack each expert's matrices into one (E, rows, cols) parameter, their rows concatenated in pattern order where
    there are several; a checkpoint that needs any other is refused."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        mapping = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:  # noqa: BLE001 - an older or newer transformers without it: names as they are
        return [], []
    renames, merges = [], []
    for c in mapping:
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(c, "operations", None) or []]
        src, dst = list(getattr(c, "source_patterns", [])), list(getattr(c, "target_patterns", []))
        if not ops and len(src) == len(dst) == 1:
            renames.append((src[0], dst[0]))
        elif len(dst) == 1 and ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            merges.append((src, dst[0]))
    return renames, merges


def checkpoint_plan(captured: Captured, directory: str | Path) -> tuple[list[Path], dict[str, tuple]]:
    """:func:`check_weights_dir`'s files, and where each tensor goes: key -> (parameter, None, None) for a tensor
    that is a parameter, or (parameter, expert, first row) for one expert's matrix of a parameter that holds every
    expert's (a checkpoint that stores experts one by one, as HF's save_pretrained writes MoE models: transformers'
    conversion mapping for the model type says which)."""
    from megatrain.runtime.state.safetensors_stream import read_header

    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        for f in files:
            if not isinstance(f, str) or not _inside(d, f):
                raise ValueError(f"{index}: its weight_map names {f!r}, which is not a file in {d} (an index names "
                                 f"the shards beside it)")
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{d} holds neither model.safetensors nor model.safetensors.index.json")
    names, seen = captured.model_param_names, set()
    renames, merges = _conversions(captured.graph.name)
    placement: dict[str, tuple] = {}
    parts: dict[str, dict[tuple[int, int], tuple[str, tuple]]] = {}  # merged parameter -> (source, expert) -> key
    for f in files:
        path = d / f
        if not path.is_file():
            raise FileNotFoundError(f"{index}: names {f}, which {d} does not hold")
        shapes = {key: e.shape for key, e in read_header(path)[1].items()}
        for key, shape in shapes.items():
            name = key
            for src, dst in renames:
                name = re.sub(src, dst, name)
            canon = captured.tied_names.get(name, name)
            if canon in names:
                if shape != tuple(names[canon][2]):
                    raise ValueError(f"{path}: tensor {key!r} has shape {shape}, the model expects "
                                     f"{tuple(names[canon][2])}")
                placement[key] = (canon, None, None)
                seen.add(canon)
                continue
            hit = _merged(name, merges)
            if hit is None or hit[0] not in names:
                raise ValueError(f"{path}: tensor {key!r} is not a parameter of the captured model")
            target, source, expert = hit
            parts.setdefault(target, {})[(source, expert)] = (key, shape)
    for target, got in parts.items():
        n_src = max(i for i, _ in got) + 1
        full = tuple(names[target][2])
        rows = [next((sh[0] for (i, _), (_, sh) in got.items() if i == j), 0) for j in range(n_src)]
        want = {(i, e) for i in range(n_src) for e in range(full[0])}
        shapes_ok = len(full) == 3 and sum(rows) == full[1] and all(
            sh == (rows[i], full[2]) for (i, _), (_, sh) in got.items())
        if set(got) != want or not shapes_ok:
            raise ValueError(f"{d}: the experts' tensors of {target!r} (shape {full}) are not one ({sum(rows)}, "
                             f"{full[2] if len(full) == 3 else '?'}) matrix per expert and source for all "
                             f"{full[0]} experts ({len(got)} tensors found)")
        for (i, e), (key, _) in got.items():
            placement[key] = (target, e, sum(rows[:i]))
        seen.add(target)
    missing = sorted(set(names) - seen)
    if missing:
        raise ValueError(f"{d}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    return [d / f for f in files], placement


def _inside(d: Path, name: str) -> bool:
    """``name`` (as an index gives it) is a path inside ``d``, not one that leads out of it (read as it is written:
    a file in ``d`` may be a link, as in the HF cache's snapshots)."""
    p = Path(name)
    return bool(p.parts) and not p.is_absolute() and ".." not in p.parts


def _merged(name: str, merges: list) -> tuple[str, int, int] | None:
    """(target parameter, source index, expert) where ``name`` is one expert's matrix a merge gathers, else None."""
    for sources, target in merges:
        for i, pattern in enumerate(sources):
            m = re.fullmatch(r"(.*?)" + re.escape(pattern).replace(r"\*", r"(\d+)"), name)
            if m:
                return m.group(1) + target, i, int(m.group(2))
    return None
