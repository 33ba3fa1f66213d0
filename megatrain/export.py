"""Trained weights as an HF model directory that ``from_pretrained`` (weights) and ``AutoTokenizer`` (tokenizer, chat
template, special tokens) read unchanged: safetensors shards with their index, config.json in the export dtype,
the tokenizer saved with ``save_pretrained``, generation_config.json. Every file is written whole or not at all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megatrain.rundir import flush_to_disk, save_whole, write_whole
from megatrain.runtime.state import safetensors_stream
from megatrain.runtime.state.safetensors_stream import Source

# shards of at most 5 GB (transformers 5's save_pretrained defaults to 50 GB; 5 GB files are what model hubs hold,
# and a file a disk cannot take whole costs less)
SHARD_BYTES = 5 * 10**9
INDEX = "model.safetensors.index.json"
# host memory an export takes beyond the weights it reads: a chunk read (from a training state's files) and its
# cast (megatrain.runtime.state.safetensors_stream.write); the planner counts it (cost.STAGE_HOST_BYTES)
EXPORT_HOST_BYTES = 2 * safetensors_stream.CHUNK_BYTES
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def export_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"export dtype must be one of bf16, fp32, fp16, got {name!r}")
    return DTYPES[name]


def set_special_ids(config, tok) -> None:
    """``config``'s bos / eos / pad token ids from the tokenizer the run uses (a model built from scratch would
    otherwise keep its config class's defaults, which name other tokens of this vocabulary)."""
    config.bos_token_id = tok.bos_token_id
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id


_PROBE_REPLY = "megatrain-probe-reply"


def turn_end(tok) -> str | None:
    """The special token ``tok``'s chat template ends an assistant's turn with (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``, ...): the one that follows a reply in a rendered conversation; None without a template or
    where no special token follows the reply."""
    if not tok.chat_template:
        return None
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": _PROBE_REPLY}], tokenize=False)
    except Exception:  # a template that needs more than a plain exchange (a system turn, tools): none found
        return None
    at = text.rfind(_PROBE_REPLY)
    rest = text[at + len(_PROBE_REPLY):] if at >= 0 else ""
    special = sorted(set(tok.all_special_tokens) | {t for t in tok.get_added_vocab()}, key=len, reverse=True)
    return next((t for t in special if t and rest.startswith(t)), None)


def stop_ids(tok, stop_tokens: tuple[str, ...] = ()) -> list[int]:
    """Ids of ``stop_tokens`` (each one token of ``tok``'s vocabulary; ValueError naming one that is not) and of
    the chat template's end of turn (:func:`turn_end`), where it has one."""
    vocab = tok.get_vocab()
    missing = [t for t in stop_tokens if t not in vocab]
    if missing:
        raise ValueError(f"--eos-token {', '.join(missing)}: not a token of the tokenizer's vocabulary (each must "
                         f"be one token, e.g. <|im_end|> or <|eot_id|>)")
    end = turn_end(tok)
    return [vocab[t] for t in dict.fromkeys([*stop_tokens, *([end] if end else [])])]


def generation_config(config, tok, model_dir: Path | None, stop_tokens: tuple[str, ...] = ()):
    """The model directory's generation_config.json if it has one, else one from the tokenizer; in either, its
    end-of-sequence ids joined by the chat template's end of turn and ``stop_tokens`` (:func:`stop_ids`): a base
    model fine-tuned on chat data then stops where its replies ended in training."""
    from transformers import GenerationConfig

    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(model_dir)
    else:
        gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    eos = gen.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    eos += [i for i in stop_ids(tok, stop_tokens) if i not in eos]
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos or None
    return gen


def export_pretrained(tensors: dict[str, "torch.Tensor | Source"], config, tok, out: str | Path,
                      dtype: torch.dtype, model_dir: Path | None = None, *,
                      shard_bytes: int = SHARD_BYTES, stop_tokens: tuple[str, ...] = ()) -> list[Path]:
    """Write an HF model directory to ``out``: ``tensors`` (parameter name -> weights, tied names once; a tensor or
    a :class:`~megatrain.runtime.state.safetensors_stream.Source` that reads its elements a slice at a time) cast to
    ``dtype`` in safetensors shards of at most ``shard_bytes`` (split and named as ``save_pretrained`` does, with its
    index), config.json (``dtype`` recorded), the tokenizer, generation_config.json (stopping at ``stop_tokens`` and
    the chat template's end of turn as well: :func:`generation_config`). Returns the weight files.

    Each file is written tensor by tensor, a chunk at a time (:func:`megatrain.runtime.state.safetensors_stream.write`):
    the memory this takes beyond the tensors is two chunks (:data:`EXPORT_HOST_BYTES`), whatever the model's size;
    a tensor that is not contiguous is made so first (one tensor's copy)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    size = lambda t: math.prod(t.shape) * dtype.itemsize  # noqa: E731
    split = split_state_dict_into_shards_factory(tensors, get_storage_size=size, max_shard_size=shard_bytes,
                                                 filename_pattern="model{suffix}.safetensors")
    files = []
    for name, keys in split.filename_to_tensors.items():
        shard = {k: tensors[k] for k in keys}
        save_whole(out / name, lambda p, shard=shard: _write_weights(p, shard, dtype))
        files.append(out / name)
    if split.is_sharded:  # the index as save_pretrained writes it
        index = {"metadata": {"total_parameters": sum(math.prod(t.shape) for t in tensors.values()),
                              **split.metadata}, "weight_map": split.tensor_to_filename}
        write_whole(out / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.dtype = dtype
    save_whole(out / "config.json", config.to_json_file)
    save_tokenizer(tok, out)
    gen = generation_config(config, tok, model_dir, stop_tokens)
    save_whole(out / "generation_config.json", gen.to_json_file)
    return files


def _write_weights(path: str, tensors: dict, dtype: torch.dtype) -> None:
    with open(path, "wb") as f:
        safetensors_stream.write(f, tensors, dtype, {"format": "pt"})
        flush_to_disk(f)


def save_tokenizer(tok, out: Path) -> None:
    """``tok.save_pretrained`` into ``out`` through a temporary directory: a full disk leaves no cut file there."""
    import os
    import shutil

    tmp = out / f".tokenizer-{os.getpid()}"
    try:
        tok.save_pretrained(str(tmp))
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
    except Exception as e:  # noqa: BLE001 - a tokenizer's writers raise their own types for a full disk
        if isinstance(e, OSError):
            raise OSError(e.errno, f"{out}: the tokenizer could not be written ({e.strerror or e})") from None
        raise OSError(f"{out}: the tokenizer could not be written ({e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
