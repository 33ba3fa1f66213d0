"""Rows made while training runs, from a dataset read as a stream (``--streaming``): a corpus larger than memory is
never held whole, as flat arrays or as rows.

Records are read in the source's order, tokenized a chunk at a time, arranged into rows of ``seq`` tokens (packed
or one per row, exactly as :mod:`megatrain.data.rows` arranges a whole corpus, within each chunk) and shuffled
through a buffer of rows drawn from with the run's seed; an epoch ends where the stream does, and the next reads it
again in another shuffled order. The place in the stream (epoch, rows taken in it) is the state a resumed run
needs: it reads the stream again from the epoch's start and skips those rows, which come out the same (the same
records, chunks and draws).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from megatrain.data.errors import DataError
from megatrain.data.formats import Documents, detect, to_example
from megatrain.data.rows import Rows, one_per_row, pack, rows_batch

CHUNK_RECORDS = 256  # records tokenized and arranged into rows together
BUFFER_ROWS = 4096  # rows the shuffle draws from


class StreamBatches:
    """Batches of rows from ``records()`` (a fresh pass over the source each call), with the interface of
    :class:`~megatrain.data.rows.Batches`: :meth:`batch`, :meth:`state`, :meth:`restore`."""

    def __init__(self, records: Callable[[], Iterable[dict]], tok, *, seq: int, pad_id: int, packing: bool,
                 seed: int, fmt: str | None = None, columns: dict[str, str] | None = None, source: str = "data",
                 chunk_records: int = CHUNK_RECORDS, buffer_rows: int = BUFFER_ROWS):
        self.records, self.tok, self.seq, self.pad_id, self.packing = records, tok, seq, pad_id, packing
        self.seed, self.fmt, self.columns, self.source = seed, fmt, columns or {}, source
        self.chunk_records, self.buffer_rows = chunk_records, buffer_rows
        self.epoch, self.in_epoch, self._trained = 0, 0, False
        self._rows = self._epoch_rows(0)

    def _chunks(self) -> Iterator[Documents]:
        fmt, chunk = self.fmt, []
        for i, record in enumerate(self.records()):
            try:
                if fmt is None:
                    fmt = detect(record, self.columns)
                chunk.append(to_example(record, fmt, self.tok, self.columns))
            except DataError as e:
                raise DataError(f"{self.source} record {i + 1}: {e}") from None
            if len(chunk) == self.chunk_records:
                yield Documents.of(chunk)
                chunk = []
        if chunk:
            yield Documents.of(chunk)

    def _epoch_rows(self, epoch: int) -> Iterator[tuple]:
        """Epoch ``epoch``'s rows, one at a time (ids, train, positions or None, real), in its shuffled order."""
        rng = np.random.default_rng([self.seed, epoch, 2])
        arrange = pack if self.packing else one_per_row
        buf: list[tuple] = []

        def draw():
            j = int(rng.integers(len(buf)))
            buf[j], buf[-1] = buf[-1], buf[j]
            return buf.pop()

        for docs in self._chunks():
            rows = arrange(docs, self.seq, self.pad_id)
            for r in range(len(rows)):
                buf.append((rows.ids[r], rows.train[r], None if rows.positions is None else rows.positions[r],
                            rows.real[r]))
                if len(buf) >= self.buffer_rows:
                    yield draw()
        while buf:
            yield draw()

    def _next_row(self) -> tuple:
        for _ in range(2):
            row = next(self._rows, None)
            if row is not None:
                self.in_epoch += 1
                self._trained |= bool(row[1].any())
                return row
            if self.in_epoch == 0:
                raise DataError(f"{self.source} holds no records")
            if not self._trained:
                raise DataError(f"{self.source}: the data has no token to train on")
            self.epoch, self.in_epoch = self.epoch + 1, 0
            self._rows = self._epoch_rows(self.epoch)
        raise AssertionError("unreachable: a new epoch yields rows where the one before did")

    def batch(self, size: int) -> dict:
        """The next ``size`` rows (into the next epoch where the stream runs out), as
        :meth:`~megatrain.data.rows.Batches.batch` gives them."""
        rows = [self._next_row() for _ in range(size)]
        positions = None if rows[0][2] is None else np.stack([r[2] for r in rows])
        return rows_batch(Rows(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), positions,
                               np.stack([r[3] for r in rows])), np.arange(size), size)

    def state(self) -> dict:
        return {"stream": True, "seed": self.seed, "epoch": self.epoch, "next": self.in_epoch}

    def taken(self, batch: int) -> float | None:
        """Batches of ``batch`` rows taken so far, where the stream is in its first epoch (None after: its epochs'
        lengths are not known)."""
        return self.in_epoch / batch if self.epoch == 0 else None

    def restore(self, state: dict, where: str) -> None:
        """Go on from :meth:`state`: the stream read again from the saved epoch's start, its rows up to the saved
        place skipped; one line naming ``where`` if the state is not a stream's of this seed or the stream is
        shorter now."""
        try:
            epoch, nxt = int(state["epoch"]), int(state["next"])
            ok = state.get("stream") is True and epoch >= 0 and nxt >= 0
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise DataError(f"{where}: the data order is not a streamed one this megatrain reads ({state!r})"[:300])
        if state.get("seed") != self.seed:
            raise DataError(f"{where}: the data order was saved with seed {state.get('seed')}, this run's is "
                            f"{self.seed}")
        self.epoch, self.in_epoch, self._trained = epoch, 0, True
        self._rows = self._epoch_rows(epoch)
        for _ in range(nxt):
            if next(self._rows, None) is None:
                raise DataError(f"{where}: the saved place is row {nxt:,} of epoch {epoch}, but {self.source} "
                                f"streams {self.in_epoch:,} rows now")
            self.in_epoch += 1
