"""A step's batch checked and completed before anything runs (:meth:`StreamedModel.train_step` and ``evaluate``):
integer tensors of one shape, token ids in the vocabulary, packed rows' positions, the labels each position predicts,
the micro-batches' slices."""

from __future__ import annotations

import torch

from megatrain.ir import Schedule
from megatrain.runtime.issue.executor import MicroBatch
from megatrain.runtime.ops.compute import IGNORE_INDEX


def complete(captured, input_ids, attention_mask, labels, position_ids, rows=None):
    """(ids, mask, next labels, position ids or None, valid tokens), or one ValueError naming what is wrong;
    ``rows``: per-row tensors an objective reads, each with a first dimension of the batch's rows."""
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask), ("labels", labels),
                    ("position_ids", position_ids)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool and
                              name != "attention_mask"):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"the batch is empty (input_ids of shape {tuple(input_ids.shape)})")
    for name, t in (("attention_mask", attention_mask), ("labels", labels), ("position_ids", position_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(t.shape)}")
    for name, t in (rows or {}).items():
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != input_ids.shape[0]:
            raise ValueError(f"rows[{name!r}] must be a tensor with one entry per row ({input_ids.shape[0]}), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    input_ids = input_ids.long()
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    if position_ids is not None:
        position_ids = check_packing(captured, position_ids.long())
    if labels is None:
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        if position_ids is not None:
            labels = labels.masked_fill(position_ids == 0, IGNORE_INDEX)
    labels = labels.long()
    vocab = captured.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids must be in [0, {vocab})")
    valid = labels[labels != IGNORE_INDEX]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
        raise ValueError(f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX}")
    nxt = torch.full_like(labels, IGNORE_INDEX)
    nxt[:, :-1] = labels[:, 1:]
    return input_ids, attention_mask, nxt, position_ids, int((nxt != IGNORE_INDEX).sum())


def check_packing(captured, position_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids`` of packed rows, checked: this model keeps packed documents apart, and each row's positions
    start at 0 and either go on by one or restart at 0."""
    if not captured.packs:
        raise ValueError(f"{captured.graph.name}: this model cannot keep documents packed into one row apart "
                         f"(position_ids given): its forward takes no position ids, its attention mask is read by "
                         f"more than HF's mask builders, or its blocks carry a recurrent state or a convolution from "
                         f"token to token that is not run a document at a time (capture.documents.FAMILIES); pass "
                         f"one document per row, right-padded")
    step = position_ids[:, 1:] - position_ids[:, :-1]
    if bool((position_ids[:, 0] != 0).any()) or bool(((step != 1) & (position_ids[:, 1:] != 0)).any()):
        raise ValueError("position_ids must start each row at 0 and then go on by 1, or restart at 0 where the "
                         "next packed document begins")
    return position_ids


def micro_batches(schedule: Schedule, ids, mask, nxt, pos, rows=None) -> list[MicroBatch]:
    """The batch cut into the schedule's micro-batches, each its consecutive share of the rows."""
    n = schedule.config.n_mb
    b = len(ids) // n
    cut = lambda t, i: None if t is None else t[i * b:(i + 1) * b]  # noqa: E731
    return [MicroBatch(cut(ids, i), cut(mask, i), cut(nxt, i), cut(pos, i),
                       None if rows is None else {k: cut(v, i) for k, v in rows.items()}) for i in range(n)]
