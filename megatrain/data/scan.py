"""Data files read once before they are loaded, a bounded buffer at a time: a record too large for memory, a CSV
row with the wrong number of cells, a file that is empty or not UTF-8, each refused in one line naming the file and
the line, and data too large to prepare in memory sent to ``--streaming``; before ``datasets`` reads anything."""

from __future__ import annotations

import codecs
import csv
import sys
from pathlib import Path

from megatrain.data.errors import DataError

MAX_RECORD_BYTES = 32 << 20  # one record: a line of JSON lines, a CSV row, a paragraph of text (~8M tokens)
MAX_DOCUMENT_BYTES = 256 << 20  # a .json file that is one JSON document (an array) is parsed whole
READ_BYTES = 16 << 20  # read at a time
NL = b"\n"
# host memory preparing data in memory takes per byte of data files at its peak (records parsed, tokenized,
# packed): 1 GB of chat JSON lines peaked at 11.3 GB; 94 MiB of short chats with a small vocabulary (0.7 tokens a
# byte) at 2.1 GiB more (34 bytes a token). Above half of what is available the run is sent to --streaming
PREP_BYTES_PER_DATA_BYTE = 24


def check_files(files: list[Path], kind: str, *, streaming: bool, available: int | None) -> None:
    """Each data file of ``kind`` (a ``datasets`` loader's name) checked (:func:`check_file`), and without
    ``streaming`` their size against ``available`` host memory."""
    total = 0
    for f in files:
        check_file(f, kind)
        total += f.stat().st_size
    need = total * PREP_BYTES_PER_DATA_BYTE
    if not streaming and available is not None and need > available // 2:
        raise DataError(f"{files[0] if len(files) == 1 else files[0].parent}: {total / 2**30:.2f} GiB of data files "
                        f"would take about {need / 2**30:.1f} GiB to prepare in memory ({PREP_BYTES_PER_DATA_BYTE} "
                        f"bytes per byte of data), more than half of the {available / 2**30:.1f} GiB available: "
                        f"train with --streaming (read as training goes), or on a part of the data")


def check_file(path: Path, kind: str) -> None:
    if kind in ("json", "csv", "text"):
        if path.stat().st_size == 0 or not _has_text(path):
            raise DataError(f"data file {path} is empty")
    if kind == "json":
        _check_lines(path, "record (a line of JSON)")
        if _first_byte(path) == b"[" and path.stat().st_size > MAX_DOCUMENT_BYTES:
            raise DataError(f"data file {path} is one JSON document of {path.stat().st_size / 2**20:.0f} MiB, read "
                            f"whole: above {MAX_DOCUMENT_BYTES >> 20} MiB give it as JSON lines (.jsonl, a record a "
                            f"line)")
    elif kind == "csv":
        _check_csv(path)
    elif kind == "text":
        _check_lines(path, "paragraph", paragraphs=True)


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            if block.strip():
                return True
    return False


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if block.strip():
                return block.lstrip()[:1]
    return b""


def _check_lines(path: Path, what: str, paragraphs: bool = False) -> None:
    """Every line (or paragraph: lines up to a blank one) of ``path`` at most :data:`MAX_RECORD_BYTES`, the whole
    file UTF-8; read :data:`READ_BYTES` at a time."""
    decode = codecs.getincrementaldecoder("utf-8")()
    line, size, start, offset = 1, 0, 1, 0  # the line being read, the record's bytes so far, its first line
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            try:
                decode.decode(block)
            except UnicodeDecodeError as e:
                at, where = offset + e.start, line + block.count(NL, 0, e.start)
                raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {at:,}, line "
                                f"{where:,})") from None
            pos = 0
            while (nl := block.find(NL, pos)) >= 0:
                blank = nl == pos
                size += nl - pos
                _refuse_large(path, what, size, start)
                if blank or not paragraphs:  # a line ends a record; a blank one a paragraph
                    size, start = 0, line + 1
                line += 1
                pos = nl + 1
            size += len(block) - pos
            _refuse_large(path, what, size, start)
            offset += len(block)
        try:
            decode.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(f"data file {path} is not UTF-8 text (it ends inside a character)") from None


def _refuse_large(path: Path, what: str, size: int, line: int) -> None:
    if size > MAX_RECORD_BYTES:
        raise DataError(f"data file {path} line {line:,}: a {what} of more than {MAX_RECORD_BYTES >> 20} MiB (the "
                        f"most one record may take); split it into smaller records")


def _check_csv(path: Path) -> None:
    """Every row of the CSV file ``path`` with as many cells as its header names (else the reader shifts columns,
    taking the first as an index), every cell at most :data:`MAX_RECORD_BYTES`, the file UTF-8."""
    _check_lines(path, "line")
    limit = csv.field_size_limit()
    csv.field_size_limit(min(MAX_RECORD_BYTES, sys.maxsize))
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            try:
                header = next(reader, None)
                if not header:
                    raise DataError(f"data file {path} is empty: a CSV file starts with a header naming its columns")
                for row in reader:
                    if row and len(row) != len(header):
                        raise DataError(f"data file {path} line {reader.line_num:,}: {len(row)} "
                                        f"{'cell' if len(row) == 1 else 'cells'}, its header names {len(header)} "
                                        f"columns ({', '.join(header)})"[:300])
            except csv.Error as e:
                raise DataError(f"data file {path} line {reader.line_num:,}: not a CSV row ({e}; a cell may take at "
                                f"most {MAX_RECORD_BYTES >> 20} MiB)") from None
    finally:
        csv.field_size_limit(limit)
