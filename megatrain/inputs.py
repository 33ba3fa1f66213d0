"""What a ``megatrain train`` run trains: the model (its config, where its weights and tokenizer come from) and the
data (examples, rows, batches), read and checked before the model's memory is allocated."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrain.data import (Batches, DataError, Documents, Rows, build_tokenizer, default_corpus, load_records,
                            load_tokenizer, one_per_row, pack, to_example, tokenize)
from megatrain.data.stream import BUFFER_ROWS, StreamBatches

TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class ModelSource:
    config: object  # transformers.PretrainedConfig
    directory: Path | None  # an HF model directory, or None (tiny-llama, a preset)
    weights: Path | None  # the directory holding safetensors weights, or None (initialized from the seed)
    dtype: str  # the dtype its weights were saved in ("float32", "bfloat16", ...)

    def describe(self) -> str:
        return f"weights from {self.weights}" if self.weights else "weights initialized from the seed"


def model_source(name: str, vocab: int, seq: int, trust_remote_code: bool = False) -> ModelSource:
    """The model a run trains: tiny-llama, a planner preset, or an HF model directory (its config; its weights if
    it has safetensors ones, refused in one line if it has only ``.bin`` ones). Remote code is never run unless
    asked: a config naming Python files of its own is refused without ``trust_remote_code``."""
    from transformers import AutoConfig

    from megatrain.planner.graph import PRESETS, config_size

    if name == "tiny-llama":
        return ModelSource(AutoConfig.for_model(**TINY_LLAMA, vocab_size=vocab, max_position_embeddings=seq), None,
                           None, "float32")
    if name in PRESETS:
        kind = "llama" if name.startswith("llama") else "qwen2"
        cfg = AutoConfig.for_model(model_type=kind, max_position_embeddings=max(seq, 4096), **PRESETS[name])
        return ModelSource(cfg, None, None, "bfloat16")
    d = Path(name)
    if not (d / "config.json").is_file():
        raise ValueError(f"model {name!r} is neither tiny-llama, a preset, nor a directory with config.json")
    try:
        raw = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{d / 'config.json'} is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{d / 'config.json'}: expected an object of fields, got a {type(raw).__name__}")
    if raw.get("auto_map") and not trust_remote_code:
        raise ValueError(f"model {d} names Python code of its own in config.json (auto_map); megatrain runs no code "
                         f"from a model directory unless asked: pass --trust-remote-code if you trust it")
    try:
        cfg = AutoConfig.from_pretrained(d, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers' configs raise their own types (validators of fields)
        while (e.__cause__ or e.__context__) is not None:  # what the config's own check said
            e = e.__cause__ or e.__context__
        raise ValueError(f"{d / 'config.json'} is not a model config transformers reads "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''})") from None
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):  # before building anything of it
        config_size({key: getattr(cfg, key, None)}, key)
    heads = getattr(cfg, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0 and "head_dim" not in raw and cfg.hidden_size % heads:
        raise ValueError(f"{d / 'config.json'}: hidden_size ({cfg.hidden_size}) is not a multiple of "
                         f"num_attention_heads ({heads}), and no head_dim is given")
    weights = d if any((d / f).is_file() for f in WEIGHT_FILES) else None
    if weights is None and (any(d.glob("*.bin")) or any(d.glob("*.pt")) or any(d.glob("*.pth"))):
        raise ValueError(f"model {d} has its weights only as PyTorch pickles (.bin/.pt); megatrain reads "
                         f"safetensors: convert them (load with from_pretrained and save_pretrained(..., "
                         f"safe_serialization=True)); it never starts such a model from random weights")
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").replace("torch.", "")
    return ModelSource(cfg, d, weights, dtype if dtype in ("float32", "bfloat16", "float16") else "float32")


@dataclass
class DataSource:
    """The rows a run trains on (and holds out for evaluation), and where they came from."""

    batches: Batches | StreamBatches
    eval_rows: Rows | None
    description: str
    digest: str  # of the rows, their trained tokens and positions: a resumed run checks it
    tokens: int
    longest: int  # the most positions a document takes in a row (streamed: the row's length, not known before)


def _strings(record) -> list[str]:
    """Every string in a record (the text a tokenizer built from the data learns from)."""
    if isinstance(record, str):
        return [record]
    if isinstance(record, dict):
        return [s for v in record.values() for s in _strings(v)]
    if isinstance(record, list):
        return [s for v in record for s in _strings(v)]
    return []


def data_source(data: str | None, tok, *, seq: int, seed: int, fmt: str | None, columns: dict[str, str],
                packing: bool, eval_data: str | None, eval_split: float, streaming: bool = False) -> DataSource:
    """Examples of ``data`` (None: the default corpus) tokenized with ``tok``, in rows of ``seq`` tokens (packed or
    one per row), in a seeded order; ``eval_data`` or a share ``eval_split`` of the examples held out.
    ``streaming``: read as training goes (:mod:`megatrain.data.stream`), never whole."""
    if streaming and data is not None and mixture(data) is not None:
        raise DataError(f"--data {data}: a mix of sources is read whole, not streamed (--streaming reads one)")
    if streaming:
        return _streamed(data, tok, seq=seq, seed=seed, fmt=fmt, columns=columns, packing=packing,
                         eval_data=eval_data, eval_split=eval_split)
    if data is None:
        examples = Documents.of([to_example({"text": d}, "text", tok, {}) for d in default_corpus()])
        what = "the default corpus"
    elif (mix := mixture(data)) is not None:
        examples, what = mixed(mix, tok, seed=seed, fmt=fmt, columns=columns)
    else:
        _say_size(data)
        examples = tokenize(load_records(data), tok, fmt=fmt, columns=columns, source=data)
        what = data
    held = None
    if eval_data is not None:
        held = tokenize(load_records(eval_data), tok, fmt=fmt, columns=columns, source=eval_data)
    elif eval_split > 0:
        order = np.random.default_rng([seed, 1 << 20]).permutation(len(examples))
        n_eval = max(1, round(eval_split * len(examples)))
        if n_eval >= len(examples):
            raise DataError(f"{what}: holding out {eval_split:.0%} of {len(examples)} examples leaves none to train on")
        held = examples.select(np.sort(order[:n_eval]))
        examples = examples.select(np.sort(order[n_eval:]))
    arrange = pack if packing else one_per_row
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows, dropped = trained_rows(arrange(examples, seq, pad), examples, seq, packing, what)
    eval_rows = trained_rows(arrange(held, seq, pad), held, seq, packing, "the held-out data")[0] \
        if held is not None else None
    h = hashlib.sha256()
    for a in (rows.ids, rows.train, rows.positions if rows.positions is not None else np.zeros(0)):
        h.update(np.ascontiguousarray(a).tobytes())
    how = ("packed, each document whole in one row" + (f"; {rows.cut:,} longer than a row cut every {seq} tokens"
                                                        if rows.cut else "")) if packing else "one per row"
    if dropped:
        how += (f"; {dropped:,} rows left out with no token to train on, their documents' trained tokens past "
                f"{'the row they were cut from' if packing else f'the first {seq}'}")
    desc = (f"{what}: {len(examples):,} examples, {rows.tokens:,} tokens in {len(rows):,} rows of {seq} ({how})"
            + (f", {len(held):,} held out for eval" if held is not None else ""))
    longest = max(rows.longest, eval_rows.longest if eval_rows is not None else 0)
    return DataSource(Batches(rows, seed), eval_rows, desc, h.hexdigest(), rows.tokens, longest)


def trained_rows(rows: Rows, docs: Documents, seq: int, packing: bool, what: str) -> tuple[Rows, int]:
    """``rows`` without those that hold no token to train on (a long prompt's part cut off its reply, or a document
    truncated before its reply: they would add steps that train nothing), and how many were left out; one line
    naming the longest document and ``seq`` where none is left."""
    keep = rows.train.any(axis=1)
    if keep.all():
        return rows, 0
    if not keep.any():
        raise DataError(f"{what}: no row has a token to train on: every trained token lies past the first {seq} "
                        f"tokens of its document{' (one per row, truncated)' if not packing else ''}; the longest "
                        f"document has {int(docs.lengths.max()):,} tokens: raise --seq or shorten the prompts")
    return Rows(rows.ids[keep], rows.train[keep], rows.positions[keep] if rows.positions is not None else None,
                rows.real[keep], rows.cut), int((~keep).sum())


def mixture(data: str) -> list[tuple[str, float]] | None:
    """``--data a.jsonl:0.7,b.parquet:0.3``: each source and its weight (1 where a source has none), or None for
    one source without a weight."""
    parts = data.split(",")
    if len(parts) == 1 and not re.search(r":[0-9.]+(e-?[0-9]+)?$", data):
        return None
    out = []
    for part in parts:
        path, sep, w = part.rpartition(":")
        if not sep or not re.fullmatch(r"[0-9.]+(e-?[0-9]+)?", w):
            path, w = part, "1"
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if not (math.isfinite(weight) and weight > 0) or not path:
            raise DataError(f"--data {data}: a mix is sources with weights > 0, e.g. a.jsonl:0.7,b.jsonl:0.3; "
                            f"got {part!r}")
        out.append((path, weight))
    return out


def mixed(mix: list[tuple[str, float]], tok, *, seed: int, fmt: str | None,
          columns: dict[str, str]) -> tuple[Documents, str]:
    """The examples of a mix of sources (each read with its own format, detected from its records unless ``fmt``
    names one), each source taking its weight's share of a mix as large as all of them together: a smaller share
    than its size is a seeded sample of its examples, a larger one repeats them (every one as often, give or take
    one). Returns the examples and their description."""
    docs = []
    for path, _ in mix:
        _say_size(path)
        docs.append(tokenize(load_records(path), tok, fmt=fmt, columns=columns, source=path))
    total, weights = sum(len(d) for d in docs), sum(w for _, w in mix)
    parts, said = [], []
    for k, ((path, w), d) in enumerate(zip(mix, docs)):
        n = max(1, round(total * w / weights))
        order = np.random.default_rng([seed, 2 << 20, k]).permutation(len(d))
        parts.append(d.select(np.resize(order, n)))
        said.append(f"{path} {w / weights:.0%} ({n:,} of its {len(d):,} examples"
                    + (f", each {n / len(d):.1f} times" if n > len(d) else "") + ")")
    out = Documents(np.concatenate([p.ids for p in parts]), np.concatenate([p.train for p in parts]),
                    np.concatenate([p.lengths for p in parts]))
    return out, "a mix of " + ", ".join(said)


SAY_FROM_BYTES = 64 << 20  # data this large gets a line before it is read: tokenizing it takes a minute or more


def _say_size(data: str) -> None:
    """One line on stderr before large data is read and tokenized in memory (a GB takes minutes)."""
    import sys

    p = Path(data)
    files = [p] if p.is_file() else [f for f in p.iterdir() if f.is_file()] if p.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    if size >= SAY_FROM_BYTES:
        print(f"megatrain train: reading and tokenizing {data} ({size / 2**20:,.0f} MiB) before the first step; "
              f"--streaming reads it as training goes instead", file=sys.stderr, flush=True)


def _streamed(data: str | None, tok, *, seq: int, seed: int, fmt: str | None, columns: dict[str, str],
              packing: bool, eval_data: str | None, eval_split: float) -> DataSource:
    if data is None:
        raise DataError("streaming reads a data source given with --data; the default corpus is small enough to "
                        "hold")
    if eval_split:
        raise DataError("a streamed data source has no held-out share (its size is not known before it is read): "
                        "give the held-out data with --eval-data")
    load_records(data, streaming=True)  # readable, before anything else is built
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batches = StreamBatches(lambda: load_records(data, streaming=True), tok, seq=seq, pad_id=pad, packing=packing,
                            seed=seed, fmt=fmt, columns=columns, source=data)
    eval_rows = None
    if eval_data is not None:
        held = tokenize(load_records(eval_data), tok, fmt=fmt, columns=columns, source=eval_data)
        eval_rows = (pack if packing else one_per_row)(held, seq, pad)
    h = hashlib.sha256(json.dumps({"stream": str(Path(data).resolve()) if Path(data).exists() else data,
                                   "sizes": _sizes(Path(data)), "seq": seq, "packing": packing}).encode())
    how = "packed, each document whole in one row" if packing else "one per row"
    desc = (f"{data}: streamed, in rows of {seq} ({how}), shuffled through {BUFFER_ROWS:,} rows"
            + (f"; {len(eval_rows):,} rows of {eval_data} held out for eval" if eval_rows is not None else ""))
    return DataSource(batches, eval_rows, desc, h.hexdigest(), 0, seq)


def _sizes(p: Path) -> list[int]:
    """The sizes of a local source's files (what a resumed run finds changed), none for a cached dataset."""
    if p.is_file():
        return [p.stat().st_size]
    if p.is_dir():
        return [f.stat().st_size for f in sorted(p.iterdir()) if f.is_file()]
    return []


def tokenizer_for(model: ModelSource, data: str | None, vocab: int, resume: str | None, trust_remote_code: bool,
                  streaming: bool = False):
    """The run's tokenizer: the resumed run's, the model directory's (required where the model has weights), or a
    BPE of ``vocab`` tokens built from the data (a model trained from scratch; read as a stream with
    ``streaming``)."""
    if resume:
        return load_tokenizer(resume), f"tokenizer from {resume}"
    if model.directory is not None and (model.weights is not None or _has_tokenizer(model.directory)):
        return load_tokenizer(model.directory, trust_remote_code=trust_remote_code), \
            f"tokenizer from {model.directory}"
    if data is None:
        texts = default_corpus()
    else:  # (a mix: every source's)
        paths = [p for p, _ in mixture(data) or [(data, 1.0)]]
        texts = (s for path in paths for r in load_records(path, streaming=streaming) for s in _strings(r))
    size = min(vocab, model.config.vocab_size) if model.directory is not None else vocab
    return build_tokenizer(texts, size), f"a {size}-token BPE built from the data"


def _has_tokenizer(d: Path) -> bool:
    from megatrain.data.tokenizer import TOKENIZER_FILES

    return any((d / f).is_file() for f in TOKENIZER_FILES)


__all__ = ["DataSource", "ModelSource", "data_source", "mixture", "model_source", "tokenizer_for"]


def chat_template_file(path: str, tok) -> str:
    """The Jinja chat template in the file ``path``, or the one named so (:data:`NAMED_TEMPLATES`, where no such
    file exists), which replaces the tokenizer's (the export carries it); checked by rendering a two-turn
    conversation with ``tok``, and a named one's special tokens each one token of ``tok``: one line where not."""
    from megatrain.data.tokenizer import NAMED_TEMPLATES

    p = Path(path)
    if p.is_file():
        text = p.read_text(encoding="utf-8", errors="replace")
    elif path in NAMED_TEMPLATES:
        text, markers = NAMED_TEMPLATES[path]
        unk = getattr(tok, "unk_token_id", None)
        for m in markers:
            ids = tok.encode(m, add_special_tokens=False)
            if len(ids) != 1 or ids[0] == unk:
                raise ValueError(f"--chat-template {path}: {m} is not one token of this tokenizer's vocabulary "
                                 f"({len(tok):,} tokens), as the template needs (a model whose tokenizer lacks it "
                                 f"has never seen it: give a template file in its own tokens)")
    else:
        raise ValueError(f"--chat-template {path}: no such file (a Jinja chat template, as tokenizer_config.json's "
                         f"chat_template holds), nor a template's name ({', '.join(NAMED_TEMPLATES)})")
    try:
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                chat_template=text, tokenize=False)
    except Exception as e:  # (jinja2's syntax and undefined errors, the template's own raise_exception)
        raise ValueError(f"--chat-template {path}: the template does not render a conversation: "
                         f"{type(e).__name__}: {e}"[:400]) from None
    return text


def steps_for_epochs(cfg, data):
    """``cfg`` (a TrainConfig) with the steps of ``cfg.epochs`` passes over ``data``'s rows, ``cfg.batch`` rows a step (rounded
    up: the last pass may end in the middle of a step's batch, which the data order fills from the next pass)."""
    rows = getattr(data.batches, "rows", None)
    if rows is None:
        raise ValueError("--epochs needs the data's size, which streamed data (--streaming) does not have before "
                         "it is read: give --steps")
    out = dataclasses.replace(cfg, steps=max(1, math.ceil(cfg.epochs * len(rows) / cfg.batch)))
    out.check()
    return out
