"""Data read as a stream (--streaming): the rows a whole corpus gives, in a seeded order, epoch after epoch, and a
resumed run goes on where the saved one stopped."""

import json

import numpy as np
import pytest

from megatrain.data import DataError, load_records, one_per_row, pack, tokenize
from megatrain.data.stream import StreamBatches
from megatrain.inputs import data_source

from .tokenizers import CORPUS, chatml_tokenizer

TEXTS = [f"{CORPUS[i % 6]} Number {i}." * (1 + i % 4) for i in range(23)]


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


def _stream(tok, packing, **kw):
    records = [{"text": t} for t in TEXTS]
    return StreamBatches(lambda: iter(records), tok, seq=32, pad_id=tok.pad_token_id or 0, packing=packing, seed=3,
                         **kw)


def _rows_of(batch) -> list[bytes]:
    pos = batch["position_ids"]
    return [b"".join(t[i].numpy().tobytes() for t in (batch["input_ids"], batch["labels"], batch["attention_mask"])
                     + ((pos,) if pos is not None else ())) for i in range(len(batch["input_ids"]))]


@pytest.mark.parametrize("packing", [False, True])
def test_an_epoch_of_the_stream_is_the_whole_corpus_in_rows(tok, packing):
    """With every record in one chunk the stream's first epoch holds exactly the rows the in-memory path makes
    (packed or one per row), each once, in another (seeded) order; the next epoch the same rows again."""
    docs = tokenize(load_records_list(TEXTS), tok)
    whole = (pack if packing else one_per_row)(docs, 32, tok.pad_token_id or 0)
    n = len(whole)
    s = _stream(tok, packing, chunk_records=1000, buffer_rows=8)
    first = _rows_of(s.batch(n))
    from megatrain.data.rows import rows_batch

    assert sorted(first) == sorted(_rows_of(rows_batch(whole, np.arange(n), n)))
    assert s.state() == {"stream": True, "seed": 3, "epoch": 0, "next": n}
    second = _rows_of(s.batch(n))
    assert sorted(second) == sorted(first) and second != first  # a new shuffle
    assert s.state()["epoch"] == 1


def load_records_list(texts):
    import datasets

    return datasets.Dataset.from_list([{"text": t} for t in texts])


def test_small_chunks_keep_every_trained_token(tok):
    """Chunks of 5 records packed apart: the epoch's rows hold every token of every document once."""
    s = _stream(tok, True, chunk_records=5, buffer_rows=4)
    docs = tokenize(load_records_list(TEXTS), tok)
    rows = []
    while True:
        b = s.batch(1)
        if s.state()["epoch"] == 1:  # that row began the next epoch
            break
        rows.append(b)
    real = sum(int(b["attention_mask"].sum()) for b in rows)
    assert real == len(docs.ids)


def test_a_resumed_stream_goes_on_where_the_saved_one_stopped(tok):
    a = _stream(tok, True, chunk_records=4, buffer_rows=6)
    a.batch(5)
    saved = json.loads(json.dumps(a.state()))
    after = [_rows_of(a.batch(5)) for _ in range(4)]  # crosses into the next epoch
    b = _stream(tok, True, chunk_records=4, buffer_rows=6)
    b.restore(saved, "state")
    assert [_rows_of(b.batch(5)) for _ in range(4)] == after
    with pytest.raises(DataError, match="state: the data order is not a streamed one"):
        b.restore({"seed": 3, "epoch": 0, "next": 1, "rows": 9}, "state")  # an in-memory run's
    with pytest.raises(DataError, match="saved with seed 4, this run's is 3"):
        b.restore({**saved, "seed": 4}, "state")
    with pytest.raises(DataError, match="the saved place is row 9,999 of epoch 0, but data streams"):
        b.restore({**saved, "next": 9999}, "state")


def test_an_empty_or_untrainable_stream_is_refused(tok):
    empty = StreamBatches(lambda: iter([]), tok, seq=32, pad_id=0, packing=True, seed=0, source="x.jsonl")
    with pytest.raises(DataError, match="x.jsonl holds no records"):
        empty.batch(1)
    bad = StreamBatches(lambda: iter([{"text": "a"}, {"txt": "b"}]), tok, seq=32, pad_id=0, packing=True, seed=0,
                        source="x.jsonl")
    with pytest.raises(DataError, match="x.jsonl record 2: "):
        bad.batch(1)


def test_data_source_streams_local_files_and_asks_for_eval_data(tok, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    held = tmp_path / "eval.jsonl"
    held.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]))
    src = data_source(str(path), tok, seq=32, seed=1, fmt=None, columns={}, packing=True, eval_data=str(held),
                      eval_split=0.0, streaming=True)
    assert "streamed" in src.description and src.eval_rows is not None and len(src.eval_rows) >= 1
    batch = src.batches.batch(4)
    assert batch["input_ids"].shape == (4, 32) and (batch["labels"] != -100).any()
    assert isinstance(load_records(str(path), streaming=True), __import__("datasets").IterableDataset)
    with pytest.raises(DataError, match="give the held-out data with --eval-data"):
        data_source(str(path), tok, seq=32, seed=1, fmt=None, columns={}, packing=True, eval_data=None,
                    eval_split=0.1, streaming=True)
    with pytest.raises(DataError, match="streaming reads a data source given with --data"):
        data_source(None, tok, seq=32, seed=1, fmt=None, columns={}, packing=True, eval_data=None, eval_split=0.0,
                    streaming=True)
