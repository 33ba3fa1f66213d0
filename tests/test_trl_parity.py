"""megatrain's chat fine-tuning against TRL's SFTTrainer: a tiny Llama-3-template model, the loss on the replies
alone, one conversation per row (padded) and padding-free packing; each step's loss within 1e-5 over 20 steps.
Every step's batch is the whole data set (8 conversations), so the two trainers' data orders do not matter; TRL
takes it in one micro-batch (megatrain in two where unpacked: its loss is the mean over the step's tokens either
way)."""

import json

import pytest
import torch

from megatrain.cli import main

from .data.tokenizers import LLAMA3_GENERATION, llama3_tokenizer

CHATS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "It is four."}, {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "Six."}],
    [{"role": "user", "content": "The capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there, how are you?"},
     {"role": "assistant", "content": "Hello, how are you today?"}],
    [{"role": "user", "content": "Name a fast animal."}, {"role": "assistant", "content": "The quick brown fox."},
     {"role": "user", "content": "And a lazy one?"}, {"role": "assistant", "content": "The lazy dog."}],
] * 2
STEPS, LR = 20, 1e-3


@pytest.mark.parametrize("packing", [False, True], ids=["one-per-row", "padding-free-packing"])
def test_losses_equal_trl_sft_trainer(tmp_path, capsys, packing):
    pytest.importorskip("trl", reason="TRL is the reference here (the test extra installs it)")
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    tok = llama3_tokenizer()
    tok.chat_template = LLAMA3_GENERATION
    cfg = AutoConfig.for_model(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                               max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CHATS))
    # one row per conversation: 8 rows of 64 in two micro-batches of 4; packed: the 8 in two rows of 256, one each
    seq, rows, mb = (256, 2, 1) if packing else (64, 8, 2)
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--steps", str(STEPS),
                 "--batch", str(rows), "--mb", str(mb), "--seq", str(seq), "--lr", str(LR), "--warmup", "0",
                 "--schedule", "constant", "--weight-decay", "0", "--betas", "0.9,0.999", "--clip", "1.0",
                 "--out", str(out)] + ([] if packing else ["--no-packing"])) == 0
    assert f"in {rows} rows of {seq}" in capsys.readouterr().out  # (each step takes the whole data set)
    ours = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, attn_implementation="sdpa")
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_steps=STEPS, per_device_train_batch_size=rows,
                     gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, logging_steps=1,
                     save_strategy="no", report_to=[], assistant_only_loss=True, packing=packing,
                     padding_free=packing, max_length=seq, use_cpu=True, seed=0, disable_tqdm=True,
                     bf16=False)  # (TRL's default is bf16 autocast; both here are fp32)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"messages": m} for m in CHATS]),
                         processing_class=tok)
    trainer.train()
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(ours) == len(theirs) == STEPS
    assert ours == pytest.approx(theirs, abs=1e-5)
    assert ours[-1] < ours[0] - 1.0  # (it trained)
