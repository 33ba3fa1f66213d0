"""Preference pairs for ``megatrain train --method dpo``: records with a ``prompt`` and a ``chosen`` and a ``rejected``
completion, as TRL's preference format has them -- three strings, or three message lists (the prompt's turns, each
completion's assistant turn) rendered by the chat template -- tokenized by TRL's rule, so the same data trains the
same way:

- strings: the prompt alone and the prompt followed by each completion, each with the tokenizer's special tokens,
  the completions ending with the end-of-sequence token (added where absent);
- messages: the prompt rendered with the generation prompt, and the prompt followed by each completion rendered;
- each completion starts where its tokens and the prompt's part (the shorter common prefix of the two, where a
  template renders a prompt alone otherwise);
- a pair is cut to ``seq`` tokens keeping its start; a pair whose prompt fills ``seq`` is left out (counted).

A step's batch holds whole pairs: each micro-batch its pairs' chosen sequences, then the same pairs' rejected ones
(what :class:`megatrain.objectives.DPO` reads), right-padded, the labels the completions' tokens alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from megatrain.data.errors import DataError
from megatrain.data.rows import ShuffledOrder

IGNORE = -100


@dataclass
class Pairs:
    prompt: list[list[int]]
    chosen: list[list[int]]  # each completion's tokens (after its prompt)
    rejected: list[list[int]]
    left_out: int = 0  # pairs whose prompt filled the row
    cut: int = 0  # pairs cut to the row's length

    def __len__(self) -> int:
        return len(self.prompt)

    def sequence(self, i: int, which: str) -> tuple[list[int], int]:
        """Pair ``i``'s chosen or rejected sequence and where its completion starts."""
        return self.prompt[i] + getattr(self, which)[i], len(self.prompt[i])

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.prompt, self.chosen, self.rejected):
            for ids in part:
                h.update(np.asarray(ids, dtype=np.int64).tobytes() + b"|")
        return h.hexdigest()


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids(tok, value, **chat) -> list[int]:
    if isinstance(value, str):
        return list(tok(value)["input_ids"])
    return list(tok(tok.apply_chat_template(value, tokenize=False, **chat), add_special_tokens=False)["input_ids"])


def tokenize_pairs(records, tok, seq: int, source: str) -> Pairs:
    """``records`` (dicts) as :class:`Pairs` (see the module's docstring); one line naming the record and the field
    where one is not a preference pair."""
    out = Pairs([], [], [], 0, 0)
    for n, r in enumerate(records, 1):
        missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(r, dict) or r.get(k) is None]
        if missing:
            raise DataError(f"{source}: record {n} has no {', '.join(missing)} (--method dpo reads pairs: prompt, "
                            f"chosen, rejected; strings or message lists)")
        p, c, x = r["prompt"], r["chosen"], r["rejected"]
        if all(isinstance(v, str) for v in (p, c, x)):
            eos = tok.eos_token or ""
            c, x = (v if v.endswith(eos) else v + eos for v in (c, x))
            prompt, full_c, full_x = _ids(tok, p), _ids(tok, p + c), _ids(tok, p + x)
        elif all(isinstance(v, list) for v in (p, c, x)):
            if not tok.chat_template:
                raise DataError(f"{source}: record {n} holds messages, and the tokenizer has no chat template "
                                f"(--chat-template)")
            prompt = _ids(tok, p, add_generation_prompt=True)
            full_c, full_x = _ids(tok, p + c), _ids(tok, p + x)
        else:
            raise DataError(f"{source}: record {n}: prompt, chosen and rejected must all be strings or all be "
                            f"message lists")
        start = min(_common(prompt, full_c), _common(prompt, full_x))
        if start >= seq:
            out.left_out += 1
            continue
        if max(len(full_c), len(full_x)) > seq:
            out.cut += 1
        out.prompt.append(full_c[:start])
        out.chosen.append(full_c[start:seq])
        out.rejected.append(full_x[start:seq])
    if not len(out):
        raise DataError(f"{source}: no preference pair left to train on ({out.left_out:,} with a prompt of --seq "
                        f"{seq:,} tokens or more)")
    return out


class PairBatches(ShuffledOrder):
    """The pairs in an order shuffled with ``seed`` each epoch; :meth:`batch` takes the next ``size`` // 2 pairs as
    ``size`` rows laid out for ``n_mb`` micro-batches, with the reference log-probabilities of each row (``ref``:
    per pair, chosen and rejected) and the objective. The place in the order is all a resumed run needs (as
    :class:`megatrain.data.Batches`)."""

    def __init__(self, pairs: Pairs, seed: int, seq: int, pad_id: int, objective=None):
        self.pairs, self.seq, self.pad_id, self.objective = pairs, seq, pad_id, objective
        self.n_mb = 1
        self.ref: torch.Tensor | None = None  # (pairs, 2): the reference's log-probability sums
        self.ref_s = 0.0  # seconds --ref-model's pass took
        super().__init__(len(pairs), seed)

    @property
    def rows(self):  # (what a step's rows are counted against: two per pair)
        return range(2 * len(self.pairs))

    def batch(self, size: int) -> dict:
        if size % (2 * self.n_mb):
            raise DataError(f"--batch {size} must hold whole pairs in each of {self.n_mb} micro-batches (a multiple "
                            f"of {2 * self.n_mb})")
        return self.rows_batch(self.take(size // 2))

    def rows_batch(self, pairs: list[int], n_mb: int | None = None, train: bool = True) -> dict:
        """``pairs`` (indices) as a batch: per micro-batch (``n_mb``, default the plan's) its chosen rows, then its
        rejected ones; with ``train``, the objective and each row's reference log-probability too."""
        n_mb = self.n_mb if n_mb is None else n_mb
        per = len(pairs) // n_mb
        order = [(i, w) for m in range(n_mb) for w in ("chosen", "rejected")
                 for i in pairs[m * per:(m + 1) * per]]
        ids = torch.full((len(order), self.seq), self.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE)
        mask = torch.zeros_like(ids)
        for r, (i, which) in enumerate(order):
            s, start = self.pairs.sequence(i, which)
            ids[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s)] = 1
            labels[r, start:len(s)] = ids[r, start:len(s)]
        out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if train and self.objective is not None:
            out["objective"] = self.objective
            out["rows"] = {"ref_logps": torch.stack([self.ref[i, 0 if w == "chosen" else 1] for i, w in order])}
        return out

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "next": self.next, "rows": len(self.pairs), "pairs": True}

    def taken(self, batch: int) -> float:
        return (self.epoch * len(self.pairs) + self.next) / (batch // 2)

    def restore(self, state: dict, where: str) -> None:
        if not state.get("pairs") or state.get("rows") != len(self.pairs) or state.get("seed") != self.seed:
            raise DataError(f"{where}: the data order saved ({state!r})"[:200] + f" is not this data's "
                            f"({len(self.pairs)} pairs, seed {self.seed})")
        self.epoch, self.next = int(state["epoch"]), int(state["next"])
        self._order = self._permutation(self.epoch)
