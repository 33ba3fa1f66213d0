"""Where training data comes from: local files and directories read through HF ``datasets`` (json, jsonl,
parquet, arrow, csv, text), or a dataset already in the local HF cache by name; tokenized in batches, cached by
``datasets``, never held as one string."""

from __future__ import annotations

from pathlib import Path

from megatrain.data.errors import DataError
import numpy as np

from megatrain.data.formats import FORMATS, Documents, detect, to_example

# file suffix -> the datasets loader that reads it
LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


def load_records(source: str, *, split: str = "train", streaming: bool = False):
    """``source`` as an HF ``datasets.Dataset`` of records: a file, a directory's files of one kind (their suffix
    picks the loader; text files hold one document per blank-line-separated paragraph), or the name of a dataset
    already in the local HF cache. ``streaming``: an iterable dataset read as it is iterated (a cached dataset:
    its Arrow files, read in order). One line naming the source where it cannot be read."""
    import logging

    import datasets

    datasets.disable_progress_bars()
    # (its json reader logs a parse error before raising it, which the line below names by its line number)
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    p = Path(source)
    try:
        if p.is_file() or p.is_dir():
            files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file() and f.suffix in LOADERS)
            if not files:
                raise DataError(f"data directory {p} holds no {'/'.join(sorted(LOADERS))} file")
            kinds = {LOADERS.get(f.suffix) for f in files}
            if None in kinds:
                raise DataError(f"data file {p} has suffix {p.suffix!r}; readable: {', '.join(sorted(LOADERS))}")
            if len(kinds) > 1:
                raise DataError(f"data directory {p} mixes file kinds {sorted(kinds)}; give one kind")
            kind = kinds.pop()
            from megatrain.data.scan import check_files
            from megatrain.runtime.memory.store import available_host_bytes

            check_files(files, kind, streaming=streaming, available=available_host_bytes())
            extra = {"sample_by": "paragraph"} if kind == "text" else _csv_options(files[0]) if kind == "csv" else {}
            try:
                return datasets.load_dataset(kind, data_files=[str(f) for f in files], split=split,
                                             streaming=streaming, **extra)
            except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable data
                if kind == "json" and len(files) > 1 and "Cast" in type(_innermost(e)).__name__:
                    raise DataError(_fields_differ(p, files)) from None
                bad = _bad_json_line(files) if kind == "json" else None
                if bad is not None:
                    raise DataError(bad) from None
                raise
        if not _in_cache(source):
            raise DataError(f"data {source} is neither a file, a directory, nor a dataset in the local HF cache "
                            f"({datasets.config.HF_DATASETS_CACHE})")
        offline = datasets.config.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = True  # nothing is downloaded: the cached copy or an error
        try:
            out = datasets.load_dataset(source, split=split)
            return out.to_iterable_dataset() if streaming else out
        finally:
            datasets.config.HF_HUB_OFFLINE = offline
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable data
        raise DataError(f"{source} {_why(e)}") from None


def _csv_options(first: Path) -> dict:
    """How a CSV source is read: every column as text, named by the first file's header (else the reader takes a
    column of digits for numbers, and "4" as a completion would be refused as not a string), and an empty cell as
    an empty string (not a missing value)."""
    import csv

    import datasets

    try:
        with open(first, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"data file {first}: its CSV header cannot be read ({type(e).__name__}: {e})") from None
    if not header:
        raise DataError(f"data file {first} is empty: a CSV file starts with a header naming its columns")
    if any(not name.strip() for name in header) or len(set(header)) < len(header):
        raise DataError(f"data file {first}: its CSV header {header!r} must name every column once"[:300])
    return {"features": datasets.Features({name: datasets.Value("string") for name in header}), "na_filter": False}


def _innermost(e: BaseException) -> BaseException:
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def _fields_differ(source: Path, files: list[Path]) -> str:
    """Which JSON files of a directory hold records with other fields than the first's (their first records)."""
    import json

    def fields(f: Path) -> list[str]:
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        return ["?"]
                    return sorted(rec) if isinstance(rec, dict) else ["?"]
        return []

    first = fields(files[0])
    other = next((f for f in files[1:] if fields(f) != first), files[1])
    return (f"data directory {source}: its files hold records of other fields ({files[0].name}: {first}, "
            f"{other.name}: {fields(other)}); the files of one data source hold one format")[:400]


def _bad_json_line(files: list[Path]) -> str | None:
    """For JSON Lines files the reader refused: the first line that is not one JSON object, by file and line number
    (the reader names a byte position); None where each line is one (a JSON file of one array: the reader's
    message stands)."""
    import json

    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            first = fh.read(1)
            while first.isspace():
                first = fh.read(1)
            if first == "[":  # one JSON document, not lines
                return None
            fh.seek(0)
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line.rstrip("\r\n"))
                except ValueError as e:
                    return f"data file {f} line {n}: not a JSON object ({e.msg} at column {e.colno})"
                if not isinstance(rec, dict):
                    return f"data file {f} line {n}: a JSON {type(rec).__name__}, not an object of fields"
    return None


def _why(e: BaseException) -> str:
    """What the innermost of a chain of exceptions says (datasets wraps the reader's error in its own)."""
    e = _innermost(e)
    if isinstance(e, UnicodeDecodeError):
        return f"is not UTF-8 text ({e.reason} at byte {e.start})"
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"cannot be read as training data ({type(e).__name__}: {msg[:300]})"


def _in_cache(name: str) -> bool:
    from datasets import config

    cache = Path(config.HF_DATASETS_CACHE)
    return any((cache / n).exists() for n in (name.replace("/", "___"), name.split("/")[-1]))


def tokenize(records, tok, *, fmt: str | None = None, columns: dict[str, str] | None = None,
             source: str = "data") -> Documents:
    """Every record tokenized (:func:`~megatrain.data.formats.to_example`), in ``fmt`` (None: detected from the
    first record), fields renamed by ``columns`` (format field -> column), as flat arrays read from the Arrow
    table ``datasets`` keeps on disk. A record that cannot be read is one line naming it."""
    columns = columns or {}
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; formats: {', '.join(FORMATS)}")
    if len(records) == 0:
        raise DataError(f"{source} holds no records")
    first = records[0]
    if fmt is None:
        try:
            fmt = detect(first, columns)
        except DataError as e:
            raise DataError(f"{source}: {e}") from None

    def convert(batch, idx):
        ids, train = [], []
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        for row, i in zip(rows, idx):
            try:
                ex = to_example(row, fmt, tok, columns)
            except DataError as e:
                raise DataError(f"{source} record {i + 1}: {e}") from None
            ids.append(ex.ids)
            train.append(ex.train)
        return {"ids": ids, "train": train}

    try:
        out = records.map(convert, batched=True, batch_size=256, with_indices=True,
                          remove_columns=records.column_names, desc=None)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets wraps what the function raised
        cause = e.__cause__ or e.__context__
        if isinstance(cause, DataError):
            raise cause from None
        raise DataError(f"{source} {_why(e)}") from None
    import pyarrow as pa
    import pyarrow.compute as pc

    table = out.data.table if hasattr(out.data, "table") else out.data
    flat = {c: pa.concat_arrays([ch.flatten() for ch in table.column(c).chunks]).to_numpy(zero_copy_only=False)
            for c in ("ids", "train")}
    lengths = pa.concat_arrays([pc.list_value_length(ch) for ch in table.column("ids").chunks])
    return Documents(flat["ids"].astype(np.int32), flat["train"].astype(bool), lengths.to_numpy().astype(np.int64))
