"""Training data: sources (files through HF ``datasets``, or the default corpus), formats and chat templates,
tokenizers, and rows packed or padded into batches. Its names load with their module on first use, so that what
needs only the formats' names (the command line's parser, ``megatrain plan``) does not import torch."""

import importlib

_HOMES = {"default_corpus": "corpus", "DataError": "errors", "FORMATS": "formats", "Documents": "formats",
          "Example": "formats", "chat_example": "formats", "to_example": "formats", "Batches": "rows", "Rows": "rows",
          "one_per_row": "rows", "pack": "rows", "load_records": "sources", "tokenize": "sources",
          "MIN_VOCAB": "tokenizer", "build_tokenizer": "tokenizer", "load_tokenizer": "tokenizer"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'megatrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megatrain.data.{_HOMES[name]}"), name)
