"""Fine-tuning a local HF model on chat data, and what comes out loading back into HF unchanged."""

import json

import pytest
import torch

from megatrain.cli import main

from .data.tokenizers import chatml_tokenizer

CHATS = [[{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}],
         [{"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": "Paris."}],
         [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there?"},
          {"role": "assistant", "content": "Hello, how are you today?"}]]


def chat_model_dir(path, dtype=torch.float32):
    """A tiny Qwen2 model with a ChatML tokenizer (eos <|im_end|>), saved as from_pretrained reads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = chatml_tokenizer()
    cfg = AutoConfig.for_model(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                               max_position_embeddings=256, tie_word_embeddings=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def test_fine_tune_a_chat_model_and_load_the_export_with_hf(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatrain.runtime.state import train_state

    chat_model_dir(tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CHATS * 8))
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--steps", "20", "--batch", "4",
                 "--seq", "64", "--lr", "3e-3", "--export-dtype", "bf16", "--out", str(out)]) == 0
    head = capsys.readouterr().out
    assert f"weights from {tmp_path / 'model'}, tokenizer from {tmp_path / 'model'}" in head
    assert "24 examples" in head and "(packed, each document whole in one row)" in head
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt.shape[1]
    masters = train_state.read_masters(out / "state")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), masters[name].to(torch.bfloat16)), name
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < losses[0]
    # the same directory again from the training state alone, in fp32
    assert main(["export", str(out), str(tmp_path / "again"), "--dtype", "fp32"]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert again.dtype == torch.float32
    assert all(torch.equal(p.detach(), masters[n]) for n, p in again.named_parameters())
    assert AutoTokenizer.from_pretrained(tmp_path / "again").chat_template == tok.chat_template


def test_a_model_directory_without_safetensors_or_tokenizer_is_refused(tmp_path, capsys):
    model, tok = chat_model_dir(tmp_path / "bin")
    for f in (tmp_path / "bin").glob("*.safetensors"):
        f.unlink()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    chat_model_dir(tmp_path / "notok")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "notok" / f).unlink(missing_ok=True)
    capsys.readouterr()
    for model_dir, msg in ((tmp_path / "bin", "has its weights only as PyTorch pickles (.bin/.pt); megatrain reads "
                                              "safetensors: convert them"),
                           (tmp_path / "notok", "holds no tokenizer (none of tokenizer.json")):
        assert main(["train", "--model", str(model_dir), "--steps", "2", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("packing", [True, False])
def test_the_default_model_exports_its_own_special_tokens(tmp_path, packing):
    """A model trained from scratch: its config's bos / eos / pad are the tokenizer the run built (not the config
    class's defaults, which are other tokens of this vocabulary)."""
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "run"
    argv = ["train", "--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0", "--out", str(out)]
    assert main(argv + ([] if packing else ["--no-packing"])) == 0
    cfg, tok = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>" and cfg.eos_token_id == tok.eos_token_id
    assert cfg.bos_token_id == tok.bos_token_id and cfg.pad_token_id == tok.pad_token_id


def test_held_out_loss_is_the_loss_on_the_held_out_rows_only(tmp_path):
    """--eval-split holds out documents (seeded) before packing; the reported loss is plain HF's loss on those
    rows with the trained weights, and the training rows never include them."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatrain.inputs import data_source

    texts = [f"document {i}: " + " ".join(["streaming", "layers", "through", "one", "device"][: 2 + i % 4])
             for i in range(40)]
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--steps", "4", "--batch", "4", "--seq", "32", "--warmup", "0",
                 "--vocab", "300", "--eval-split", "0.2", "--eval-every", "2", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    tok = AutoTokenizer.from_pretrained(out)
    source = data_source(str(data), tok, seq=32, seed=0, fmt=None, columns={}, packing=True, eval_data=None,
                         eval_split=0.2)
    rows, train_rows = source.eval_rows, source.batches.rows
    held = {tuple(r[m]) for r, m in zip(rows.ids, rows.real)}
    assert not held & {tuple(r[m]) for r, m in zip(train_rows.ids, train_rows.real)}
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(rows)):
            ids = torch.from_numpy(rows.ids[i: i + 1].astype(np.int64))
            pos = torch.from_numpy(rows.positions[i: i + 1].astype(np.int64))
            labels = torch.from_numpy(np.where(rows.train[i: i + 1], rows.ids[i: i + 1], -100).astype(np.int64))
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100,
                                                             reduction="sum"))
            count += int((labels[0, 1:] != -100).sum())
    assert evals[-1]["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert evals[-1]["eval_tokens"] == count
    assert json.loads((out / "summary.json").read_text())["eval_loss"] == evals[-1]["eval_loss"]


def test_positions_past_the_models_limit_are_warned_of_once(tmp_path, capsys):
    """A document that takes more positions in a row than the config's max_position_embeddings: one warning line
    naming both (the run goes on); within the limit, none. ``Rows.longest`` against a count of each row's
    positions."""
    import numpy as np

    from megatrain.data.formats import Documents, Example
    from megatrain.data.rows import one_per_row, pack

    chat_model_dir(tmp_path / "model")  # max_position_embeddings 256
    long_reply = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    chats = CHATS + [[{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": long_reply}]]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": c}) for c in chats * 4))
    # (one step: the fine-tuning default warmup, 3% of the steps rounded up, is none here, not a refusal)
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(data), "--steps", "1", "--batch", "2"]
    assert main([*args, "--seq", "512", "--out", str(tmp_path / "a")]) == 0
    warned = [l for l in capsys.readouterr().err.splitlines() if "max_position_embeddings" in l]
    assert len(warned) == 1 and "in a row of 512, past the model's max_position_embeddings (256)" in warned[0]
    assert main([*args, "--seq", "256", "--out", str(tmp_path / "b")]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().err

    docs = Documents.of([Example(list(range(3, 3 + n)), [True] * n) for n in (5, 40, 7, 90, 2)])
    for rows in (pack(docs, 64, 0), one_per_row(docs, 64, 0)):
        pos = rows.positions if rows.positions is not None else np.broadcast_to(np.arange(64), rows.ids.shape)
        want = max(int(p[m].max()) + 1 for p, m in zip(pos, rows.real))
        assert rows.longest == want == 64
    # packed whole into 128: the 90-token document lies in one row, all of its positions there
    assert pack(docs, 128, 0).longest == 90 and pack(docs, 256, 0).longest == 90
    assert one_per_row(docs, 128, 0).longest == 90


def test_an_eos_token_the_vocabulary_lacks_is_refused_before_training(tmp_path, capsys):
    chat_model_dir(tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CHATS))
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--steps", "2", "--batch", "2",
                 "--seq", "64", "--eos-token", "<|im_start|>,<|nope|>", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "--eos-token <|nope|>: not a token of the tokenizer's vocabulary" in err
    assert not (out / "metrics.jsonl").exists()
