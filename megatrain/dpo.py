"""``megatrain train --method dpo``: the preference pairs as the run's data, and the reference model's
log-probabilities from one streamed forward pass of the initial weights over every pair before the first step (an
evaluation schedule: no second model in host memory). They are kept with the run (``reference_logps.pt``) and a
resumed run takes them from the run it continues."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from megatrain.data.errors import DataError

REFERENCE_FILE = "reference_logps.pt"


def pair_source(cfg, tok):
    """The run's :class:`megatrain.inputs.DataSource` of preference pairs (``cfg.data``: one file or dataset)."""
    from megatrain.data import load_records
    from megatrain.data.preference import PairBatches, tokenize_pairs
    from megatrain.inputs import DataSource, mixture
    from megatrain.objectives import DPO

    if cfg.data is None or mixture(cfg.data) is not None:
        raise DataError("--method dpo needs --data: one file or dataset of preference pairs (prompt, chosen, "
                        "rejected)")
    pairs = tokenize_pairs(load_records(cfg.data), tok, cfg.seq, cfg.data)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batches = PairBatches(pairs, cfg.seed, cfg.seq, pad, DPO(cfg.beta, cfg.dpo_loss))
    tokens = sum(len(p) + len(c) + len(r) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected))
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected))
    what = (f"{cfg.data}: {len(pairs):,} preference pairs, one sequence per row of {cfg.seq} (chosen and rejected)"
            + (f"; {pairs.cut:,} cut to {cfg.seq} tokens" if pairs.cut else "")
            + (f"; {pairs.left_out:,} left out, their prompt filling the row" if pairs.left_out else "")
            + f"; DPO ({cfg.dpo_loss}, beta {cfg.beta:g})")
    return DataSource(batches, None, what, pairs.digest(), tokens, longest)


def reference_model(cfg, batches, device=None) -> float:
    """``cfg.ref_model``'s log-probabilities (``batches.ref``): the directory compiled alone, its pairs evaluated,
    its store freed before the model trained is compiled. Returns the seconds it took."""
    import gc

    from transformers import AutoModelForCausalLM

    import megatrain
    from megatrain.capture.packed_attention import attention_for
    from megatrain.inputs import model_source

    src = model_source(cfg.ref_model, cfg.vocab, cfg.seq)
    if src.weights is None:
        raise DataError(f"--ref-model {cfg.ref_model}: no safetensors weights there")
    t0 = time.perf_counter()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(src.config, attn_implementation=attention_for(src.config))
    ref = megatrain.compile(meta, checkpoint=src.weights, device=device)
    pairs = batches.pairs
    top = max(max(ids, default=0) for part in (pairs.prompt, pairs.chosen, pairs.rejected) for ids in part)
    if top >= ref.captured.vocab_size:
        raise DataError(f"--ref-model {cfg.ref_model}: its vocabulary ({ref.captured.vocab_size:,} tokens) does not "
                        f"hold the data's token {top:,} (the reference must share the trained model's tokenizer)")
    evaluate_pairs(ref, batches, cfg.batch)
    del ref
    gc.collect()
    return time.perf_counter() - t0


def evaluate_pairs(sm, batches, batch: int) -> None:
    """Each pair's chosen and rejected log-probability sums under ``sm``, from evaluation steps of ``batch`` rows,
    into ``batches.ref``."""
    pairs = batches.pairs
    per = batch // 2
    ref = torch.zeros(len(pairs), 2, dtype=torch.float64)
    for a in range(0, len(pairs), per):
        chunk = [i % len(pairs) for i in range(a, a + per)]  # (the last one filled from the start)
        b = batches.rows_batch(chunk, n_mb=1, train=False)  # (rows: the chunk's chosen, then its rejected)
        rows = sm.evaluate(b["input_ids"], b["attention_mask"], b["labels"]).row_logps.double()
        n = min(per, len(pairs) - a)
        ref[a:a + n, 0], ref[a:a + n, 1] = rows[:n], rows[per:per + n]
        print(f"\rreference log-probabilities: {a + n:,} of {len(pairs):,} pairs", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)
    batches.ref = ref.float()


def reference_logps(sm, batches, cfg, out: Path) -> float:
    """Each pair's chosen and rejected log-probability sums under the model as it is now (``batches.ref``), from
    evaluation steps of ``cfg.batch`` rows; or those ``--ref-model`` gave (:func:`reference_model`), or those of the
    run ``cfg.resume`` continues; written to ``out``. Returns the seconds it took (0 where read)."""
    pairs = batches.pairs
    digest = pairs.digest()
    if batches.ref is not None:  # (--ref-model's)
        torch.save({"digest": digest, "ref": batches.ref}, out / REFERENCE_FILE)
        return 0.0
    if cfg.resume:
        kept = torch.load(Path(cfg.resume) / REFERENCE_FILE)
        if kept.get("digest") != digest or kept["ref"].shape != (len(pairs), 2):
            raise DataError(f"{cfg.resume}/{REFERENCE_FILE} is not for these pairs")
        batches.ref = kept["ref"]
        torch.save(kept, out / REFERENCE_FILE)
        return 0.0
    t0 = time.perf_counter()
    evaluate_pairs(sm, batches, cfg.batch)
    torch.save({"digest": digest, "ref": batches.ref}, out / REFERENCE_FILE)
    return time.perf_counter() - t0
