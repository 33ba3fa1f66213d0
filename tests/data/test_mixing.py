"""Several datasets with weights (``--data a.jsonl:0.7,b.jsonl:0.3``): each source read in its own format, taking
its weight's share of a mix as large as all of them together (sampled where that is fewer than it has, repeated
evenly where more), seeded; bad weights and a streamed mix refused in one line."""

import json
from collections import Counter

import pytest

from megatrain.data import DataError
from megatrain.inputs import data_source, mixture

from .tokenizers import chatml_tokenizer


def _write(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"text": f"alpha {i}"}) for i in range(30)))
    b.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"beta {i}?"},
                                                    {"role": "assistant", "content": f"answer {i}"}]})
                           for i in range(10)))
    return a, b


def _docs(src, tok):
    """The mix's documents as text, one per document (rows one per document)."""
    rows = src.batches.rows
    out = []
    for r in range(len(rows)):
        ids = [int(t) for t in rows.ids[r] if t != tok.pad_token_id]
        out.append(tok.decode(ids))
    return out


def test_each_source_takes_its_share_in_its_own_format(tmp_path):
    a, b = _write(tmp_path)
    tok = chatml_tokenizer()
    src = data_source(f"{a}:0.5,{b}:0.5", tok, seq=64, seed=0, fmt=None, columns={}, packing=False, eval_data=None,
                      eval_split=0.0)
    docs = _docs(src, tok)
    alpha = Counter(d for d in docs if "alpha" in d)
    beta = Counter(d for d in docs if "beta" in d)
    assert sum(alpha.values()) == 20 and set(alpha.values()) == {1}  # 20 of its 30, each once
    assert sum(beta.values()) == 20 and set(beta.values()) == {2} and len(beta) == 10  # each of its 10 twice
    assert all("<|im_start|>assistant" in d for d in beta)  # (rendered with the chat template)
    assert f"a mix of {a} 50% (20 of its 30 examples), {b} 50% (20 of its 10 examples, each 2.0 times)" in src.description
    again = data_source(f"{a}:0.5,{b}:0.5", tok, seq=64, seed=0, fmt=None, columns={}, packing=False,
                        eval_data=None, eval_split=0.0)
    assert again.digest == src.digest  # seeded
    other = data_source(f"{a}:0.5,{b}:0.5", tok, seq=64, seed=1, fmt=None, columns={}, packing=False,
                        eval_data=None, eval_split=0.0)
    assert Counter(d for d in _docs(other, tok) if "alpha" in d) != alpha  # another sample of a


def test_weights_are_parsed_and_bad_ones_refused(tmp_path):
    assert mixture("data.jsonl") is None
    assert mixture("a.jsonl:0.7,b.jsonl:0.3") == [("a.jsonl", 0.7), ("b.jsonl", 0.3)]
    assert mixture("a.jsonl,b.jsonl:2") == [("a.jsonl", 1.0), ("b.jsonl", 2.0)]
    for bad in ("a.jsonl:0,b.jsonl:1", "a.jsonl:1,:1"):
        with pytest.raises(DataError, match="a mix is sources with weights > 0"):
            mixture(bad)
    a, b = _write(tmp_path)
    with pytest.raises(DataError, match="a mix of sources is read whole, not streamed"):
        data_source(f"{a}:1,{b}:1", chatml_tokenizer(), seq=64, seed=0, fmt=None, columns={}, packing=True,
                    eval_data=None, eval_split=0.0, streaming=True)


def test_rows_with_no_token_to_train_on_are_left_out_and_none_left_is_one_line(tmp_path):
    """A prompt longer than a row: packed, the parts cut off its reply hold no trained token and would make steps
    that train nothing (a batch of them stopped a run mid-way); they are left out and counted. One per row, a
    document truncated before its reply likewise; where no row is left, one line names --seq and the longest
    document."""
    tok = chatml_tokenizer()
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": ("tell me " + "very " * 40
                                                                                    if i % 2 else "hi") + f" {i}"},
                                                       {"role": "assistant", "content": f"ok {i}"}]})
                              for i in range(10)))
    for packing in (True, False):
        src = data_source(str(data), tok, seq=96, seed=0, fmt=None, columns={}, packing=packing, eval_data=None,
                          eval_split=0.0)
        rows = src.batches.rows
        assert rows.train.any(axis=1).all()
        assert "rows left out with no token to train on" in src.description
        short = data_source(str(data), tok, seq=96, seed=0, fmt=None, columns={}, packing=packing,
                            eval_data=None, eval_split=0.0)
        assert short.digest == src.digest
    with pytest.raises(DataError, match="no row has a token to train on: every trained token lies past the first "
                                        "8 tokens of its document .one per row, truncated.; the longest document "
                                        "has [0-9]+ tokens: raise --seq or shorten the prompts"):
        data_source(str(data), tok, seq=8, seed=0, fmt=None, columns={}, packing=False, eval_data=None,
                    eval_split=0.0)
