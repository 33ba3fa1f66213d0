"""Training data: sources (files through HF ``datasets``, or the default corpus), formats and chat templates,
tokenizers, and rows packed or padded into batches. Each name is imported from its module when first asked for:
a command that only reads the formats' names (the command line's help) does not import torch with the rows."""

import importlib

_WHERE = {"default_corpus": "corpus", "DataError": "errors", "FORMATS": "formats", "Documents": "formats",
          "Example": "formats", "chat_example": "formats", "to_example": "formats", "Batches": "rows", "Rows": "rows",
          "one_per_row": "rows", "pack": "rows", "load_records": "sources", "tokenize": "sources",
          "MIN_VOCAB": "tokenizer", "build_tokenizer": "tokenizer", "load_tokenizer": "tokenizer"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
