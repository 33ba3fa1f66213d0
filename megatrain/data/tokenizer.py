"""Tokenizers: a model directory's own (through ``AutoTokenizer``), or a byte-level BPE built from the training data
for a model trained from scratch, with ChatML's special tokens and template so chat data trains on it too."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from megatrain.data.errors import DataError

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END)
MIN_VOCAB = 256 + len(SPECIALS)  # the byte-level alphabet and the special tokens
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LLAMA3 = ("{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}{{ '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# --chat-template NAME: a template by name, for a model whose tokenizer brings none (a base model) or another; each
# with the special tokens it needs as single tokens of the vocabulary
NAMED_TEMPLATES = {"chatml": (CHATML, (IM_START, IM_END)),
                   "llama3": (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def build_tokenizer(docs: Iterable[str], vocab_size: int):
    """A byte-level BPE trained on ``docs`` (the tokenizers library, on this machine), as an HF fast tokenizer:
    end of text ``<|endoftext|>`` (also the padding), ChatML's ``<|im_start|>`` / ``<|im_end|>`` and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHATML
    return fast


def _check_references(d: Path) -> None:
    """Refuse a tokenizer_config.json that names a file outside ``d`` (its ``*_file`` fields: a path that is
    absolute or climbs out with ``..``)."""
    import json

    cfg = d / "tokenizer_config.json"
    try:
        fields = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # (AutoTokenizer says what is wrong with it)
    for key, value in fields.items() if isinstance(fields, dict) else ():
        if key.endswith("_file") and isinstance(value, str) and (Path(value).is_absolute()
                                                                 or ".." in Path(value).parts):
            raise DataError(f"{cfg}: {key} names {value!r}, a file outside {d} (a tokenizer's files are read from its "
                            f"own directory)")


def load_tokenizer(directory: str | Path, *, trust_remote_code: bool = False):
    """The tokenizer saved in ``directory`` (an HF model directory or a run directory), any format
    ``AutoTokenizer`` reads; one line naming the directory where there is none or it cannot be read."""
    from transformers import AutoTokenizer

    d = Path(directory)
    _check_references(d)
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise DataError(f"{d} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): a model directory with "
                        f"weights needs its own tokenizer (save it there with tokenizer.save_pretrained)")
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - AutoTokenizer raises many types for a bad file
        raise DataError(f"{d}: the tokenizer cannot be read ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if tok.eos_token_id is None:
        raise DataError(f"{d}: the tokenizer has no end-of-sequence token (eos_token), which separates documents")
    return tok
