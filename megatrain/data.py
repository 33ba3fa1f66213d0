"""Training text: a local file or the default corpus, a tokenizer built locally, fixed-length sequences."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Standard-library modules whose documentation forms the default corpus: English prose present on every machine
# that runs Python, so the default job trains offline with nothing downloaded.
CORPUS_MODULES = (
    "collections", "json", "argparse", "logging", "pathlib", "typing", "unittest", "email.message", "http.client",
    "urllib.request", "urllib.parse", "asyncio", "threading", "subprocess", "inspect", "dataclasses", "functools",
    "itertools", "re", "string", "textwrap", "datetime", "decimal", "fractions", "statistics", "random", "csv",
    "sqlite3", "zipfile", "tarfile", "shutil", "os", "io", "socket", "pickle", "copy", "enum", "abc", "contextlib",
    "heapq", "bisect", "calendar", "difflib", "pprint", "traceback", "warnings", "tempfile", "glob", "fnmatch",
    "optparse", "configparser", "gettext", "locale", "codecs", "base64", "hashlib", "uuid", "ipaddress", "mimetypes",
    "smtplib", "imaplib", "ftplib", "wave", "colorsys", "doctest", "pdb", "pydoc", "xml.etree.ElementTree",
    "http.server", "multiprocessing", "concurrent.futures", "queue", "sched", "selectors", "mailbox", "plistlib",
    "shelve", "gzip", "bz2", "lzma", "struct", "array", "weakref", "types", "operator", "numbers", "timeit", "trace",
    "tracemalloc",
)


class DataError(ValueError):
    """Unusable training data; the message names the file and the problem."""


def default_corpus() -> str:
    """The documentation strings of :data:`CORPUS_MODULES` (modules, their public classes, functions, methods),
    read from the standard library's source files: nothing is imported (a module of the same name in the working
    directory is never run); modules written in C, which have no source file, are left out."""
    import ast
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: dict[str, None] = {}

    def add(node) -> None:
        d = ast.get_docstring(node, clean=True)
        if d:
            docs.setdefault(d, None)

    for name in CORPUS_MODULES:
        base = stdlib.joinpath(*name.split("."))
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        if path is None:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        add(tree)
        defs = sorted((n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                       and not n.name.startswith("_")), key=lambda n: n.name)
        for node in defs:
            add(node)
            if isinstance(node, ast.ClassDef):
                for sub in sorted((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                   and not n.name.startswith("_")), key=lambda n: n.name):
                    add(sub)
    return "\n\n".join(docs)


# Reading and tokenizing a data file holds the text, the tokenizer's encodings of the pieces in flight and the token
# ids: measured 11.6 bytes of peak memory per byte of a 200 MB text file (2-core CPU machine, 2026-12-01)
MEMORY_PER_DATA_BYTE = 12


def read_text(path: str | Path) -> str:
    """A .txt file as is; a .jsonl file's "text" fields joined by blank lines."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"data path {p} is a directory; give a .txt or .jsonl file")
    if not p.is_file():
        raise DataError(f"data file {p} does not exist")
    from megatrain.runtime.store import available_host_bytes

    size, free = p.stat().st_size, available_host_bytes()
    if size * MEMORY_PER_DATA_BYTE > free:
        raise DataError(f"data file {p} is {size / 2**30:.2f} GiB; reading and tokenizing it takes about "
                        f"{MEMORY_PER_DATA_BYTE}x that ({size * MEMORY_PER_DATA_BYTE / 2**30:.1f} GiB), more than the "
                        f"{free / 2**30:.1f} GiB of memory available: give a part of it")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if p.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"{p}:{n}: each line must be an object with a string field \"text\"")
            texts.append(rec["text"])
        return "\n\n".join(texts)
    return raw


def build_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on ``text`` (the tokenizers library, on this machine)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_pieces(text, 1), trainer=trainer)
    return tok


def _pieces(text: str, size: int):
    """``text`` in pieces of at least ``size`` characters, cut after a blank line (one piece where there is none)."""
    start = 0
    while start < len(text):
        cut = text.find("\n\n", start + size)
        end = len(text) if cut < 0 else cut + 2
        yield text[start:end]
        start = end


def encode(tok, text: str, piece_chars: int = 1 << 20) -> torch.Tensor:
    """``text``'s token ids (int64), encoded a piece of about ``piece_chars`` characters at a time (cut after blank
    lines): the tokenizer never holds the whole text as one string's encoding (a 20 MB text took 3.5 GB that way)."""
    import numpy as np

    parts = []  # int32 until the end: half the bytes while the pieces are collected
    batch: list[str] = []
    for piece in _pieces(text, piece_chars):
        batch.append(piece)
        if len(batch) == 8:
            parts += [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(batch)]
            batch = []
    if batch:
        parts += [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(batch)]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0, dtype=torch.long)


class TokenStream:
    """The whole text as one token sequence; batches are random windows of ``seq_len`` tokens (seeded)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int = 0, source: str = "data"):
        if ids.numel() < seq_len + 1:
            raise DataError(f"{source} has {ids.numel()} tokens, fewer than one sequence of {seq_len} + 1")
        self.ids, self.seq_len = ids, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        starts = torch.randint(0, self.ids.numel() - self.seq_len, (batch_size,), generator=self.gen)
        return torch.stack([self.ids[s: s + self.seq_len] for s in starts.tolist()])  # (B, T)
