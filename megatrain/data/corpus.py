"""The default corpus: the documentation strings of Python's standard library, on every machine that runs Python."""

from __future__ import annotations

import functools
from pathlib import Path

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


def default_corpus() -> list[str]:
    """The documentation strings of :data:`CORPUS_MODULES` (modules, their public classes, functions, methods),
    read from the standard library's source files: nothing is imported (a module of the same name in the working
    directory is never run); modules written in C, which have no source file, are left out. Parsed once a process
    (2 s: a run reads it for its tokenizer and for its data)."""
    return list(_parsed())


@functools.lru_cache(maxsize=1)
def _parsed() -> tuple[str, ...]:
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
    return tuple(docs)

