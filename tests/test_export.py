"""HF model directories out, streamed a chunk at a time: the same bytes as transformers' save_pretrained and
safetensors' save_file, and checkpoints read back into the store the same way."""

import json

import pytest
import torch

from megatrain.export import export_pretrained
from megatrain.runtime.state import safetensors_stream, train_state

from .runtime.models import hf_config, hf_model


def _streamed(model):
    import megatrain

    return megatrain.compile(model, device="cpu", kernels=False, streams=False)


@pytest.mark.parametrize("dtype,tied", [(torch.bfloat16, False), (torch.float32, True)])
def test_the_export_is_save_pretrained_byte_for_byte_shards_and_index_included(tmp_path, monkeypatch, dtype, tied):
    from transformers import AutoModelForCausalLM

    from .data.tokenizers import chatml_tokenizer

    model = hf_model("llama", tie_word_embeddings=tied)
    sm = _streamed(model)
    sd = sm.state_dict()
    params = {n: sd[n] for n in sm.captured.model_param_names}
    shard = 40_000 * dtype.itemsize  # several shards, and tensors larger than one (a shard of their own)
    monkeypatch.setattr(safetensors_stream, "CHUNK_BYTES", 4096)  # many chunks per tensor
    files = export_pretrained(params, model.config, chatml_tokenizer(), tmp_path / "ours", dtype, shard_bytes=shard)
    ref = tmp_path / "ref"
    model.to(dtype).save_pretrained(ref, max_shard_size=shard)
    theirs = sorted(p.name for p in ref.glob("model*.safetensors*"))
    assert len(theirs) > 3 and sorted(p.name for p in (tmp_path / "ours").glob("model*.safetensors*")) == theirs
    assert sorted(f.name for f in files) == [n for n in theirs if n.endswith(".safetensors")]
    for name in theirs:
        assert (tmp_path / "ours" / name).read_bytes() == (ref / name).read_bytes(), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert again.dtype == dtype
    for n, p in again.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n


def test_a_file_is_save_file_byte_for_byte_from_tensors_and_from_sources(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tensors = {"b.weight": torch.randn(33, 7), "a": torch.randn(1000), "empty": torch.zeros(0, 4),
               "c.t": torch.randn(5, 3, 2).transpose(0, 2)}  # not contiguous
    monkeypatch.setattr(safetensors_stream, "CHUNK_BYTES", 256)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ref = tmp_path / f"ref-{dtype}.st"
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(ref), metadata={"format": "pt"})
        ours = tmp_path / f"ours-{dtype}.st"
        with open(ours, "wb") as f:
            n = safetensors_stream.write(f, tensors, dtype, {"format": "pt"})
        assert ours.read_bytes() == ref.read_bytes() and n == ref.stat().st_size
        assert safetensors_stream.nbytes(tensors, dtype) == n
        # read back a chunk at a time into fp32, as a checkpoint load does
        meta, entries = safetensors_stream.read_header(ours)
        assert meta == {"format": "pt"}
        loaded = load_file(str(ref))
        buf = torch.empty(256, dtype=torch.uint8)
        with open(ours, "rb") as f:
            for name, e in entries.items():
                dest = torch.empty(e.shape)
                safetensors_stream.read_into(f, e, dest, buf)
                assert torch.equal(dest, loaded[name].float()), (dtype, name)


def test_export_from_a_training_state_reads_its_files_a_chunk_at_a_time(tmp_path, monkeypatch):
    from megatrain.cli import main

    from .test_finetune import CHATS, chat_model_dir

    chat_model_dir(tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CHATS * 4))
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--steps", "2", "--batch", "4",
                 "--seq", "64", "--out", str(out)]) == 0
    masters = train_state.read_masters(out / "state")
    monkeypatch.setattr(safetensors_stream, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(train_state, "_CHUNK", 1024)
    sources = train_state.master_sources(out / "state")
    assert set(sources) == set(masters)
    for name, src in sources.items():
        n = src.numel()
        got = torch.cat([src[lo: lo + 100].clone() for lo in range(0, n, 100)])
        assert torch.equal(got.view(src.shape), masters[name]), name
    assert main(["export", str(out), str(tmp_path / "again"), "--dtype", "fp32"]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert exported.keys() == masters.keys() and all(torch.equal(exported[k], masters[k]) for k in masters)
    # a damaged file is named before anything is written
    layer = next((out / "state").glob("step-*/layer-00001.bin"))
    raw = bytearray(layer.read_bytes())
    raw[len(raw) // 2] ^= 1
    layer.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="layer-00001.bin: checksum mismatch"):
        train_state.master_sources(out / "state")


def test_a_checkpoint_of_any_float_dtype_loads_as_from_pretrained_reads_it(tmp_path, monkeypatch):
    import megatrain
    from transformers import AutoModelForCausalLM

    model = hf_model("qwen2")
    monkeypatch.setattr(safetensors_stream, "CHUNK_BYTES", 512)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        d = tmp_path / str(dtype)
        model.to(dtype).save_pretrained(d, max_shard_size=30_000)
        assert (d / "model.safetensors.index.json").is_file()
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_config("qwen2"))
        sm = megatrain.compile(meta, checkpoint=d, device="cpu", kernels=False, streams=False)
        sd = sm.state_dict()
        for n, p in ref.named_parameters():
            assert torch.equal(sd[n], p), (dtype, n)
        model = model.float()


def test_an_index_that_names_a_file_outside_the_directory_is_refused(tmp_path):
    import megatrain
    from transformers import AutoModelForCausalLM

    hf_model("llama").save_pretrained(tmp_path / "other")
    d = tmp_path / "model"
    hf_model("llama").save_pretrained(d, max_shard_size=30_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    for bad in ("../other/model.safetensors", str(tmp_path / "other" / "model.safetensors")):
        index["weight_map"][first] = bad
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_config("llama"))
        with pytest.raises(ValueError, match=r"its weight_map names '.*other/model.safetensors', which is not a file "
                                             r"in"):
            megatrain.compile(meta, checkpoint=d, device="cpu", kernels=False, streams=False)


def test_the_export_stops_at_the_chat_templates_end_of_turn(tmp_path):
    """A base model's tokenizer ends sequences with <|endoftext|> and its generation_config.json says so; trained on
    ChatML replies that end with <|im_end|>, the exported generation_config stops at both (before, such a model
    never stopped). Llama-3's end of turn is its eos already; --eos-token adds more, and one not in the vocabulary
    is refused, naming it."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from megatrain.export import generation_config, stop_ids, turn_end

    from .data.tokenizers import CHATML, _bpe, llama3_tokenizer

    base = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    base.chat_template = CHATML
    ids = base.get_vocab()
    assert turn_end(base) == "<|im_end|>"
    GenerationConfig(eos_token_id=ids["<|endoftext|>"]).save_pretrained(tmp_path)
    gen = generation_config(None, base, tmp_path)
    assert gen.eos_token_id == [ids["<|endoftext|>"], ids["<|im_end|>"]]
    assert generation_config(None, base, None).eos_token_id == [ids["<|endoftext|>"], ids["<|im_end|>"]]
    llama = llama3_tokenizer()
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert turn_end(llama) == "<|eot_id|>" and generation_config(None, llama, None).eos_token_id == eot
    header = llama.convert_tokens_to_ids("<|start_header_id|>")
    assert generation_config(None, llama, None, ("<|start_header_id|>",)).eos_token_id == [eot, header]
    base.chat_template = None
    assert turn_end(base) is None and stop_ids(base) == []
    with pytest.raises(ValueError, match="<\\|eom_id\\|>: not a token"):
        stop_ids(llama, ("<|eom_id|>",))
