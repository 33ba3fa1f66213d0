"""Training data: sources (files through HF ``datasets``, or the default corpus), formats and chat templates,
tokenizers, and rows packed or padded into batches."""

from megatrain.data.corpus import default_corpus
from megatrain.data.errors import DataError
from megatrain.data.formats import FORMATS, Documents, Example, chat_example, to_example
from megatrain.data.rows import Batches, Rows, one_per_row, pack
from megatrain.data.sources import load_records, tokenize
from megatrain.data.tokenizer import MIN_VOCAB, build_tokenizer, load_tokenizer

__all__ = ["Batches", "DataError", "Documents", "Example", "FORMATS", "MIN_VOCAB", "Rows", "build_tokenizer",
           "chat_example", "default_corpus", "load_records", "load_tokenizer", "one_per_row", "pack", "to_example", "tokenize"]
