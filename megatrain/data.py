"""Training text: a local file or the default corpus, a tokenizer built locally, fixed-length sequences."""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
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
    """The documentation strings of :data:`CORPUS_MODULES` (modules, their public classes, functions, methods)."""
    docs: dict[str, None] = {}

    def add(obj) -> None:
        with warnings.catch_warnings():  # some modules warn when their documentation is read (typing.io)
            warnings.simplefilter("ignore", DeprecationWarning)
            d = inspect.getdoc(obj)
        if d:
            docs.setdefault(d, None)

    for name in CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        add(mod)
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                add(obj)
                if inspect.isclass(obj):
                    for a2, o2 in sorted(vars(obj).items()):
                        if not a2.startswith("_") and inspect.isfunction(o2):
                            add(o2)
    return "\n\n".join(docs)


def read_text(path: str | Path) -> str:
    """A .txt file as is; a .jsonl file's "text" fields joined by blank lines."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"data path {p} is a directory; give a .txt or .jsonl file")
    if not p.is_file():
        raise DataError(f"data file {p} does not exist")
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
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return tok


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
