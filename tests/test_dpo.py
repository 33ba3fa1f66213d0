"""megatrain train --method dpo against TRL's DPOTrainer (losses, the metrics it reports, the weights), the reference
log-probabilities against a plain HF model's, a resumed run against one that never stopped, and the per-sequence
weights objective an RL loop drives against plain PyTorch."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from megatrain.cli import main

from .data.tokenizers import llama3_tokenizer

PAIRS = [("What is two plus two?", "It is four.", "It is five."), ("The capital of France?", "Paris.", "London, I think."),
         ("Hello there, how are you?", "Fine, thank you.", "Go away."),
         ("Name a fast animal.", "The quick brown fox.", "The lazy dog.")]
STEPS, LR, BETA = 10, 1e-3, 0.1


def _records(conversational: bool) -> list[dict]:
    if conversational:
        return [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                 "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS]
    return [{"prompt": p + " ", "chosen": c, "rejected": r} for p, c, r in PAIRS]


def _model_dir(path, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = llama3_tokenizer()
    cfg = AutoConfig.for_model(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                               max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def _train(tmp_path, name, data, *extra, loss="sigmoid", steps=STEPS):
    out = tmp_path / name
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--method", "dpo", "--beta",
                 str(BETA), "--dpo-loss", loss, "--steps", str(steps), "--batch", "8", "--mb", "2", "--seq", "64",
                 "--lr", str(LR), "--warmup", "0", "--schedule", "constant", "--weight-decay", "0", "--betas",
                 "0.9,0.999", "--clip", "1.0", "--out", str(out), *extra]) == 0
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("conversational,loss", [(False, "sigmoid"), (True, "ipo")], ids=["strings-sigmoid",
                                                                                       "messages-ipo"])
def test_dpo_equals_trl_dpo_trainer(tmp_path, monkeypatch, conversational, loss):
    """Every step of the whole data set (4 pairs: 8 sequences) in both, so their data orders do not matter. The
    messages case forms the head's logits 4 positions at a time (the objective's two passes over chunks)."""
    pytest.importorskip("trl", reason="TRL is the reference here (the test extra installs it)")
    if conversational:
        import megatrain.layout

        monkeypatch.setattr(megatrain.layout, "LOSS_CHUNK_TOKENS", 16)  # (4 rows a micro-batch)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = _model_dir(tmp_path / "model")
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _records(conversational)))
    out, ours = _train(tmp_path, "run", data, loss=loss)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, attn_implementation="sdpa")
    args = DPOConfig(output_dir=str(tmp_path / "trl"), max_steps=STEPS, per_device_train_batch_size=len(PAIRS),
                     learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                     report_to=[], beta=BETA, loss_type=[loss], max_length=64, use_cpu=True, seed=0,
                     disable_tqdm=True, bf16=False)  # (TRL's default is bf16 autocast; both here are fp32)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(_records(conversational)),
                         processing_class=tok)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(ours) == len(theirs) == STEPS
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected"):
        # (at the first step the model is the reference: every reward is 0 up to rounding, and which of a pair's
        # is larger a matter of ulps where the reference's log-probabilities were summed in other chunks)
        first = 1 if key == "rewards/accuracies" else 0
        assert [r[key] for r in ours][first:] == pytest.approx([h[key] for h in theirs][first:], abs=1e-5,
                                                               rel=1e-6), key
    assert ours[-1]["rewards/margins"] > 0.1 and ours[-1]["loss"] < ours[0]["loss"]
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, p in trainer.model.state_dict().items():
        assert torch.allclose(trained[name], p, atol=1e-5, rtol=0), name


def _check_reference(ref, model_dir, tok, records):
    """``ref`` (pairs x chosen, rejected) against a plain HF model's log-probabilities of each completion."""
    from transformers import AutoModelForCausalLM

    from megatrain.data.preference import tokenize_pairs

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = tokenize_pairs(records, tok, 64, "prefs")
    for i in range(len(pairs)):
        for j, which in enumerate(("chosen", "rejected")):
            ids, start = pairs.sequence(i, which)
            ids = torch.tensor([ids])
            with torch.no_grad():
                logits = hf(input_ids=ids).logits[0, start - 1:-1]
            want = -F.cross_entropy(logits, ids[0, start:], reduction="sum")
            assert float(ref[i, j]) == pytest.approx(float(want), abs=1e-4), (i, which)


def test_reference_logps_are_a_plain_models_and_a_resumed_run_goes_on_as_one_that_never_stopped(tmp_path, capsys):
    from megatrain.dpo import REFERENCE_FILE

    tok = _model_dir(tmp_path / "model")
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _records(False) * 2))  # 8 pairs: two steps an epoch
    whole, ran = _train(tmp_path, "whole", data, steps=6)
    ref = torch.load(whole / REFERENCE_FILE)["ref"]
    _check_reference(ref, tmp_path / "model", tok, _records(False) * 2)
    # --ref-model: another model's, streamed alone before the one trained
    _model_dir(tmp_path / "other", seed=1)
    other, _ = _train(tmp_path, "other-ref", data, "--ref-model", str(tmp_path / "other"), steps=1)
    assert "other's" in capsys.readouterr().err
    _check_reference(torch.load(other / REFERENCE_FILE)["ref"], tmp_path / "other", tok, _records(False) * 2)
    _train(tmp_path, "first", data, steps=3)
    assert "one forward pass of the initial weights" in capsys.readouterr().err
    again = tmp_path / "again"  # (the rest of its config is the run's own)
    assert main(["train", "--resume", str(tmp_path / "first"), "--steps", "6", "--out", str(again)]) == 0
    rest = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    assert f"reference log-probabilities of 8 pairs: those of {tmp_path / 'first'}" in capsys.readouterr().err
    assert [r["step"] for r in rest] == [4, 5, 6]
    assert [(r["loss"], r["rewards/margins"]) for r in rest] == [(r["loss"], r["rewards/margins"]) for r in ran[3:]]
    assert torch.equal(torch.load(again / REFERENCE_FILE)["ref"], ref)


@pytest.mark.parametrize("argv,msg", [
    (["--batch", "6"], "--method dpo: --batch (6) counts sequences, two per pair, and each of the 2 micro-batches "
                       "holds whole pairs: a multiple of 4"),
    (["--beta", "0"], "beta must be a finite number > 0, got 0.0"),
    (["--eval-split", "0.1"], "--method dpo reads its pairs whole and holds none out"),
])
def test_bad_dpo_requests_are_refused_in_one_line(tmp_path, capsys, argv, msg):
    _model_dir(tmp_path / "model")
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _records(False)))
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--method", "dpo", "--steps", "2",
                 "--seq", "64", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1 and not out.exists()
    bad = tmp_path / "text.jsonl"
    bad.write_text(json.dumps({"text": "not a pair"}))
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(bad), "--method", "dpo", "--steps", "2",
                 "--seq", "64", "--out", str(out)]) == 2
    assert "record 1 has no prompt, chosen, rejected" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-chunk", "small-chunks"])
def test_sequence_weights_step_equals_plain_pytorch(monkeypatch, chunk):
    """The objective an RL loop drives: minus each sequence's log-probability sum times its weight, averaged over
    the sequences; one step of it against the same loss and AdamW in plain PyTorch, the head's logits formed whole
    or a few positions at a time (its two passes: log-probabilities, then the backward a chunk at a time)."""
    if chunk is not None:
        import megatrain.layout

        monkeypatch.setattr(megatrain.layout, "LOSS_CHUNK_TOKENS", chunk)  # 2 rows a micro-batch: 4 positions
    from transformers import AutoConfig, AutoModelForCausalLM

    import megatrain
    from megatrain.objectives import SequenceWeights
    from megatrain.runtime.optim import OptimConfig

    cfg = AutoConfig.for_model(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                               max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (4, 12))
    labels = ids.clone()
    labels[:, :5] = -100  # the prompts
    weights = torch.tensor([1.0, -0.5, 0.25, -0.75])
    sm = megatrain.compile(copy.deepcopy(model), optim=OptimConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=None),
                           n_mb=2)
    st = sm.train_step(ids, labels=labels, objective=SequenceWeights(), rows={"weights": weights})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, betas=sm.optimizer.cfg.betas,
                            eps=sm.optimizer.cfg.eps)
    logits = model(input_ids=ids).logits[:, :-1]
    logps = -F.cross_entropy(logits.reshape(-1, 64), labels[:, 1:].reshape(-1), reduction="none").view(4, 11)
    loss = -(weights * logps.sum(1)).mean()
    loss.backward()
    opt.step()
    assert st.loss == pytest.approx(loss.item(), abs=1e-5)  # (a sum whose terms nearly cancel)
    assert st.metrics["weights/mean"] == pytest.approx(float(weights.mean()))
    for name, p in sm.state_dict().items():
        assert torch.allclose(p, model.state_dict()[name], atol=1e-6), name


def test_the_rl_loop_example_raises_its_reward():
    """examples/grpo_loop.py: sampling with HF generate, group-relative advantages, megatrain steps with them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "grpo_loop.py"
    spec = importlib.util.spec_from_file_location("grpo_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rewards = example.main(["--iterations", "12"])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
