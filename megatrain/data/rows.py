"""Examples -> fixed-length rows (packed whole, or one per row) -> batches in a seeded order, epoch after epoch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatrain.data.errors import DataError
from megatrain.data.formats import Documents

IGNORE_INDEX = -100


@dataclass
class Rows:
    ids: np.ndarray  # (N, T) int32 token ids
    train: np.ndarray  # (N, T) bool: the token is trained on (predicted from the tokens before it)
    positions: np.ndarray | None  # (N, T) int32 packed: each document's positions from 0; None: one per row
    real: np.ndarray  # (N, T) bool: not padding
    cut: int = 0  # documents longer than a row, cut into several (packed)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return int(self.real.sum())

    @property
    def longest(self) -> int:
        """The most positions any document takes in a row (packed: a document's positions start at 0 in each row
        it is cut into; one per row: its tokens up to the row's end)."""
        if not len(self):
            return 0
        if self.positions is None:
            return int(self.real.sum(axis=1).max())
        return int(np.where(self.real, self.positions, -1).max()) + 1


BYTES_PER_TOKEN = 4 + 1 + 4 + 1  # a row's id, trained flag, position and padding flag


def _check_memory(n_rows: int, seq: int) -> None:
    """Refuse ``n_rows`` rows of ``seq`` tokens where they would take more than half the memory available (before
    they are allocated)."""
    from megatrain.runtime.memory.store import available_host_bytes

    need, free = n_rows * seq * BYTES_PER_TOKEN, available_host_bytes()
    if free is not None and need > free // 2:
        raise DataError(f"the data as {n_rows:,} rows of {seq:,} tokens takes {need / 2**30:.1f} GiB, more than half "
                        f"of the {free / 2**30:.1f} GiB of memory available (the model's store needs the rest): "
                        f"train on a part of it" + (", or with a shorter --seq" if n_rows == 1 else ""))


def _first_free(tree: np.ndarray, leaves: int, need: int) -> int:
    """In a segment tree of counts over free-token values 0..leaves-1 (``tree[leaves + v]``: rows with ``v`` tokens
    free), the least value >= ``need`` that some row has; -1 where none has."""
    v, lo, hi = 1, 0, leaves - 1
    if tree[1] == 0:
        return -1
    stack = []
    while True:
        if hi < need or tree[v] == 0:
            if not stack:
                return -1
            v, lo, hi = stack.pop()
            continue
        if lo == hi:
            return lo
        mid = (lo + hi) // 2
        stack.append((2 * v + 1, mid + 1, hi))
        v, hi = 2 * v, mid


def _count(tree: np.ndarray, leaves: int, value: int, delta: int) -> None:
    v = leaves + value
    while v:
        tree[v] += delta
        v //= 2


def pack(docs: Documents, seq: int, pad_id: int) -> Rows:
    """The documents packed whole into rows of ``seq`` tokens: best fit decreasing (the longest first, each into
    the row it leaves the fewest tokens free in, a new row where none has room), so no document of at most ``seq``
    tokens is cut and a reply is never trained without its prompt. A document longer than a row is cut every ``seq``
    tokens (``Rows.cut`` counts them), its last part packed as a document of its own. Each document's positions
    start at 0 and its first token is not trained on (nothing before it in its row predicts it); the free tokens at
    a row's end are padding, positioned as a document of their own."""
    if not len(docs):
        raise DataError("no documents to pack")
    starts = np.concatenate([[0], np.cumsum(docs.lengths)[:-1]]).astype(np.int64)
    lengths = docs.lengths.astype(np.int64)
    whole = lengths // seq
    cut = int((lengths > seq).sum())
    # the pieces: each document's full rows of seq tokens, then what is left of it (the whole of a shorter one)
    n_full = int(whole.sum())
    full_starts = (np.repeat(starts, whole) + seq * (np.arange(n_full) - np.repeat(np.cumsum(whole) - whole, whole)))
    rest = lengths - whole * seq
    left = rest > 0
    p_start = np.concatenate([full_starts, (starts + whole * seq)[left]])
    p_len = np.concatenate([np.full(n_full, seq, dtype=np.int64), rest[left]])
    order = np.argsort(-p_len, kind="stable")
    p_start, p_len = p_start[order], p_len[order]
    n = len(p_len)
    row_of = np.empty(n, dtype=np.int64)
    off_of = np.empty(n, dtype=np.int64)
    leaves = 1 << max(1, int(seq).bit_length())  # free-token values 0..seq
    tree = np.zeros(2 * leaves, dtype=np.int64)
    free_rows: dict[int, list[int]] = {}  # tokens free -> rows with that many
    used: list[int] = []  # per row: tokens taken
    for j in range(n):
        need = int(p_len[j])
        f = _first_free(tree, leaves, need) if need < seq else -1
        if f < 0:  # a new row
            r = len(used)
            used.append(0)
        else:
            r = free_rows[f].pop()
            _count(tree, leaves, f, -1)
        row_of[j], off_of[j] = r, used[r]
        used[r] += need
        free = seq - used[r]
        if free > 0:
            free_rows.setdefault(free, []).append(r)
            _count(tree, leaves, free, 1)
    n_rows = len(used)
    _check_memory(n_rows, seq)
    total = int(p_len.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(p_len) - p_len, p_len)
    src = np.repeat(p_start, p_len) + within
    dst = np.repeat(row_of * seq + off_of, p_len) + within
    ids = np.full(n_rows * seq, pad_id, dtype=np.int32)
    train = np.zeros(n_rows * seq, dtype=bool)
    real = np.zeros(n_rows * seq, dtype=bool)
    ids[dst], train[dst], real[dst] = docs.ids[src], docs.train[src] & (within > 0), True
    positions = np.zeros(n_rows * seq, dtype=np.int32)
    positions[dst] = within
    ids, train, real, positions = (a.reshape(n_rows, seq) for a in (ids, train, real, positions))
    tail = np.asarray(used, dtype=np.int64)[:, None]  # the padding after each row's documents: 0, 1, ...
    col = np.arange(seq, dtype=np.int64)[None, :]
    positions = np.where(col >= tail, col - tail, positions).astype(np.int32)
    return Rows(ids, train, positions, real, cut)


def one_per_row(docs: Documents, seq: int, pad_id: int) -> Rows:
    """One document per row, cut to ``seq`` tokens, right-padded."""
    if not len(docs):
        raise DataError("no documents")
    n = len(docs)
    _check_memory(n, seq)
    ids = np.full((n, seq), pad_id, dtype=np.int32)
    train = np.zeros((n, seq), dtype=bool)
    real = np.zeros((n, seq), dtype=bool)
    start = 0
    for i, length in enumerate(docs.lengths.tolist()):
        k = min(length, seq)
        ids[i, :k], train[i, :k], real[i, :k] = docs.ids[start: start + k], docs.train[start: start + k], True
        start += length
    train[:, 0] = False
    return Rows(ids, train, None, real)


def rows_batch(r: Rows, take: np.ndarray, size: int) -> dict[str, torch.Tensor | None]:
    """Rows ``take`` of ``r`` as a batch of ``size`` rows (filled up with copies of the first, all of their labels
    ignored): input_ids, attention_mask, labels (-100 where not trained), position_ids (None for rows of one
    document each)."""
    fill = size - len(take)
    rows = np.concatenate([take, np.full(fill, take[0])]) if fill > 0 else take
    ids = r.ids[rows].astype(np.int64)
    train = r.train[rows].copy()
    train[len(take):] = False
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(r.real[rows].astype(np.int64)),
            "labels": torch.from_numpy(np.where(train, ids, IGNORE_INDEX)),
            "position_ids": None if r.positions is None else torch.from_numpy(r.positions[rows].astype(np.int64))}


class ShuffledOrder:
    """``n`` items in an order shuffled with ``seed`` for each epoch; :meth:`take` the next ones (into the next epoch
    where this one runs out)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.next = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.next == len(self._order):
                self.epoch, self.next = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            k = min(count - len(out), len(self._order) - self.next)
            out.extend(int(i) for i in self._order[self.next: self.next + k])
            self.next += k
        return out


class Batches(ShuffledOrder):
    """``rows`` in an order shuffled with ``seed`` for each epoch; :meth:`batch` takes the next rows (into the next
    epoch where this one runs out). The place in that order (:meth:`state`) is all a resumed run needs."""

    def __init__(self, rows: Rows, seed: int):
        if not rows.train.any():
            raise DataError("the data has no token to train on")
        self.rows = rows
        super().__init__(len(rows), seed)

    def batch(self, size: int) -> dict[str, torch.Tensor | None]:
        """The next ``size`` rows: input_ids, attention_mask, labels (-100 where not trained), position_ids (None
        for rows of one document each)."""
        return self.rows_batch(np.asarray(self.take(size)), size)

    def rows_batch(self, take: np.ndarray, size: int) -> dict[str, torch.Tensor | None]:
        return rows_batch(self.rows, take, size)

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "next": self.next, "rows": len(self.rows)}

    def taken(self, batch: int) -> float:
        """Batches of ``batch`` rows taken so far (each step takes one, a skipped step too)."""
        return (self.epoch * len(self.rows) + self.next) / batch

    def restore(self, state: dict, where: str) -> None:
        """Go on from :meth:`state`; one line naming ``where`` if it does not fit these rows."""
        try:
            epoch, nxt, n = int(state["epoch"]), int(state["next"]), int(state["rows"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{where}: the data order is not one this megatrain reads ({state!r})"[:300]) from None
        if n != len(self.rows) or state.get("seed") != self.seed:
            raise DataError(f"{where}: the data order saved ({n} rows, seed {state.get('seed')}) is not this data's "
                            f"({len(self.rows)} rows, seed {self.seed})")
        if not (epoch >= 0 and 0 <= nxt <= n):
            raise DataError(f"{where}: the data order saved is row {nxt} of epoch {epoch}, outside this data's "
                            f"{n} rows")
        self.epoch, self.next = epoch, nxt
        self._order = self._permutation(epoch)
