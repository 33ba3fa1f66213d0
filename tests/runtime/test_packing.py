"""Documents packed into one row (position ids restarting at each) train as the documents run one by one: the same
loss and gradients (fp32, CPU)."""

import dataclasses
import inspect

import numpy as np
import pytest
import torch

from megatrain.capture import documents, packed_attention
from megatrain.capture.tracer import Packed

from .models import compile_cpu, hf_model, record_grads
from .test_parity import OPT

block_mask = packed_attention.block_mask
NO_CLIP = dataclasses.replace(OPT, max_grad_norm=None)


def _with_offsets(sm):
    """Packed micro-batches carry their documents' offsets on the CPU too (the runtime gives them on the GPU only):
    the causal-mask builder passes the marker on and the attention builds the mask from the offsets."""
    assert sm.captured.varlen

    def packed(position_ids):
        cu, longest = packed_attention.doc_offsets(position_ids)
        return Packed(cu, longest)

    sm.executor.ctx.packed_mask = packed
    return sm


@pytest.mark.parametrize("family,offsets", [("llama", False), ("qwen2", False), ("gemma2", False), ("phi3", False),
                                            ("llama", True), ("qwen2", True)])
def test_packed_documents_equal_documents_one_by_one(family, offsets, monkeypatch):
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 97, (n,), generator=g) for n in (7, 12, 5)]
    T = sum(len(d) for d in docs) + 2  # two tokens of padding at the end of the packed row
    packed = torch.cat([*docs, torch.zeros(2, dtype=torch.long)])[None]
    pos = torch.cat([*(torch.arange(len(d)) for d in docs), torch.arange(2)])[None]
    mask = torch.ones_like(packed)
    mask[0, -2:] = 0
    one = compile_cpu(hf_model(family), optim=NO_CLIP, n_mb=1)
    assert one.captured.packs
    built = []
    if offsets:
        _with_offsets(one)
        monkeypatch.setattr(packed_attention, "block_mask", lambda *a: built.append(a) or block_mask(*a))
    g_packed = record_grads(one)
    st_packed = one.train_step(packed, mask, position_ids=pos)
    rows = torch.zeros(3, T, dtype=torch.long)  # the same documents, one per row, right-padded
    rmask = torch.zeros_like(rows)
    for i, d in enumerate(docs):
        rows[i, : len(d)] = d
        rmask[i, : len(d)] = 1
    other = compile_cpu(hf_model(family), optim=NO_CLIP, n_mb=1)
    g_rows = record_grads(other)
    st_rows = other.train_step(rows, rmask)
    assert st_packed.tokens == st_rows.tokens == sum(len(d) - 1 for d in docs)
    assert st_packed.loss == pytest.approx(st_rows.loss, rel=1e-6)
    assert set(g_packed) == set(g_rows) == set(one.captured.model_param_names)
    blocks = sum(seg.name.startswith("model.layers.") for seg in one.captured.segments)
    assert len(built) == (2 * blocks if offsets else 0)  # each block's attention, forward and recompute
    for n, a in g_packed.items():
        b = g_rows[n]
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max()) + 1e-12, n


HYBRIDS = [("qwen3_next", 1, 0), ("qwen3_5_text", 2, 2), ("qwen3_5_moe_text", 1, 0), ("olmo_hybrid", 1, 0),
           ("nemotron_h", 2, 1), ("zamba2", 1, 0)]


def test_the_hybrids_whose_packed_rows_are_taken_are_the_ones_tested_here():
    assert documents.FAMILIES == {family for family, *_ in HYBRIDS}


@pytest.mark.parametrize("family,n_mb,saved", HYBRIDS)
def test_packed_documents_in_recurrent_blocks_equal_documents_one_by_one(family, n_mb, saved):
    """Hybrids (gated delta nets, Mamba-2 with its convolution; Zamba2's shared attention block between them): two
    packed rows of documents of several lengths (their buckets: 12 and 11, 7, 6, 5, the 2 padding tokens) train as
    the documents one per row, right-padded: loss and gradients (fp32, CPU), every mixer given the layout; ``saved``
    layers keep their forward's activations for the backward instead of recomputing it."""
    from .models import zamba2_model

    make = zamba2_model if family == "zamba2" else lambda: hf_model(family)
    g = torch.Generator().manual_seed(5)
    lengths = ((7, 12, 5), (11, 6, 9))
    docs = [[torch.randint(3, 97, (n,), generator=g) for n in row] for row in lengths]
    T = 26  # the first row ends in two tokens of padding
    packed = torch.stack([torch.cat([*row, torch.zeros(T - sum(map(len, row)), dtype=torch.long)]) for row in docs])
    pos = torch.stack([torch.cat([*(torch.arange(len(d)) for d in row), torch.arange(T - sum(map(len, row)))])
                       for row in docs])
    mask = (torch.arange(T) < torch.tensor([[sum(map(len, row))] for row in docs])).long()
    one = compile_cpu(make(), optim=NO_CLIP, n_mb=n_mb, saved_acts=saved)
    assert one.captured.packs and one.captured.docs_apart and not one.captured.varlen
    assert len(one.schedule_for(len(packed), T).config.saved_acts) == saved
    runs = []
    for seg in one.captured.segments:
        for m in documents.mixers(seg.template) if seg.kind == "block" else []:
            m.register_forward_pre_hook(lambda mod, a, kw: runs.append(any(isinstance(v, Packed) and v.docs
                                                                           for v in (*a, *kw.values()))),
                                        with_kwargs=True)
    assert runs == [] and any(documents.mixers(s.template) for s in one.captured.segments if s.kind == "block")
    g_packed = record_grads(one)
    st_packed = one.train_step(packed, mask, position_ids=pos)
    assert runs and all(runs)  # each mixer's forward (and recompute) was handed the documents' layout
    flat = [d for row in docs for d in row]
    rows = torch.zeros(len(flat), T, dtype=torch.long)
    rmask = torch.zeros_like(rows)
    for i, d in enumerate(flat):
        rows[i, : len(d)] = d
        rmask[i, : len(d)] = 1
    other = compile_cpu(make(), optim=NO_CLIP, n_mb=n_mb)
    g_rows = record_grads(other)
    st_rows = other.train_step(rows, rmask)
    assert st_packed.tokens == st_rows.tokens == sum(len(d) - 1 for d in flat)
    assert st_packed.loss == pytest.approx(st_rows.loss, rel=1e-6)
    scale = max(float(b.abs().max()) for b in g_rows.values())
    for n, a in g_packed.items():  # (fp32 sums in other shapes: within 1e-6 of the largest gradient)
        assert float((a - g_rows[n]).abs().max()) <= 1e-6 * scale, n


def test_document_buckets_hold_every_token_once_and_pad_a_bucket_by_at_most_its_growth():
    pos = torch.cat([torch.arange(n) for n in (3, 40, 9, 33, 2, 10, 3, 31, 32, 37)]).view(2, 100)
    layout = documents.buckets(pos)
    assert layout.tokens == 200 and layout.shapes == [(4, 40), (1, 31), (2, 10), (2, 3), (1, 2)]  # 32 x 1.25 = 40
    gathered = torch.cat(layout.src)
    real = gathered[gathered < 200]
    assert sorted(real.tolist()) == list(range(200))  # every token once; the rest reads the zero row
    for s, (n, longest) in zip(layout.src, layout.shapes):
        lens = (s.view(n, longest) < 200).sum(1)
        assert int(lens.max()) == longest and int(lens.min()) * documents.GROWTH >= longest
        assert all(bool((r[: int(k)] == r[0] + torch.arange(int(k))).all()) for r, k in zip(s.view(n, longest), lens))
    x = torch.randn(2, 100, 8)
    seen = []
    y = layout.run(lambda h: seen.append(h.shape) or h * 2, x)  # each document a row of its own, back in place
    assert torch.equal(y, x * 2) and seen == [(n, longest, 8) for n, longest in layout.shapes]
    # rows of one document each (one long sequence given its positions) run as they are, with no copy
    whole = documents.buckets(torch.arange(100).expand(2, 100))
    assert whole.whole and not layout.whole and whole.run(lambda h: h, x) is x


def test_packing_is_refused_where_documents_cannot_be_kept_apart_and_positions_are_checked(monkeypatch):
    from .models import TinyGPT

    ids = torch.randint(3, 97, (2, 8))
    sm = compile_cpu(TinyGPT(tied=False), n_mb=1)
    with pytest.raises(ValueError, match="cannot keep documents packed into one row apart"):
        sm.train_step(ids, position_ids=torch.arange(8).expand(2, 8))
    # a hybrid family whose mixers are not run apart: their state and convolution would run from one document into
    # the next
    monkeypatch.setattr(documents, "FAMILIES", documents.FAMILIES - {"qwen3_5_text"})
    hybrid = compile_cpu(hf_model("qwen3_5_text"), n_mb=1)
    assert not hybrid.captured.packs
    with pytest.raises(ValueError, match="cannot keep documents packed into one row apart"):
        hybrid.train_step(ids, position_ids=torch.arange(8).expand(2, 8))
    sm = compile_cpu(hf_model("llama"), n_mb=1)
    for bad in (torch.arange(1, 9).expand(2, 8), torch.tensor([[0, 1, 2, 4, 5, 0, 1, 2]] * 2)):
        with pytest.raises(ValueError, match="position_ids must start each row at 0"):
            sm.train_step(ids, position_ids=bad)
    assert sm.step == 0


def test_document_offsets_and_the_mask_they_describe_match_hf():
    """Offsets follow HF's rule (a document starts wherever a position is not the previous plus one, and at each
    row), and the mask built from them is the one HF's causal-mask builder makes from the position ids."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 0, 1, 2]])
    cu, longest = packed_attention.doc_offsets(pos)
    assert cu.tolist() == [0, 3, 5, 9, 10, 16, 17, 20] and cu.dtype == torch.int32 and longest == 6
    ours = packed_attention.block_mask(Packed(cu, longest), 2)
    cfg = AutoConfig.for_model("llama", hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    given = {"config": cfg, "inputs_embeds": torch.zeros(2, 10, 16), "input_embeds": torch.zeros(2, 10, 16),
             "position_ids": pos}
    params = inspect.signature(create_causal_mask).parameters  # names differ between transformers versions
    theirs = create_causal_mask(**{k: given.get(k) for k, p in params.items()
                                   if k in given or p.default is inspect.Parameter.empty})
    assert ours.shape == (2, 1, 10, 10) and torch.equal(ours, theirs.expand_as(ours))
    assert ours[0, 0, 4].tolist() == [False] * 3 + [True] * 2 + [False] * 5  # position 4: its document's 3..4


def test_families_that_cannot_take_offsets_keep_the_mask_builders():
    """Gemma-2 soft-caps its scores (the flash kernel cannot): its packed rows keep HF's masks."""
    assert not compile_cpu(hf_model("gemma2"), n_mb=1).captured.varlen
    assert compile_cpu(hf_model("qwen2"), n_mb=1).captured.varlen


def test_rows_packed_whole_train_as_the_documents_one_per_row():
    """The data path's packing (best fit decreasing, every document whole in one row): a step over the packed rows
    has the loss and gradients of a step over the same documents one per row, padded (fp32, CPU). Packing that cut
    documents at row ends trained their continuations without what came before."""
    from megatrain.data import Documents, one_per_row, pack
    from megatrain.data.formats import Example
    from megatrain.data.rows import rows_batch

    g = torch.Generator().manual_seed(2)
    lengths = [11, 5, 14, 3, 9, 16, 7, 12]
    docs = Documents.of([Example(torch.randint(3, 97, (n,), generator=g).tolist(), [True] * n) for n in lengths])
    steps = []
    for rows in (pack(docs, 16, 0), one_per_row(docs, 16, 0)):
        assert rows.tokens == sum(lengths)
        b = rows_batch(rows, np.arange(len(rows)), len(rows) + len(rows) % 2)
        sm = compile_cpu(hf_model("llama"), optim=NO_CLIP, n_mb=1 if len(rows) % 2 else 2)
        grads = record_grads(sm)
        st = sm.train_step(b["input_ids"], b["attention_mask"], b["labels"], position_ids=b["position_ids"])
        steps.append((st, grads))
    (packed, g_packed), (single, g_single) = steps
    assert len(pack(docs, 16, 0)) < len(lengths) and packed.tokens == single.tokens == sum(n - 1 for n in lengths)
    assert packed.loss == pytest.approx(single.loss, rel=1e-6)
    for n, a in g_packed.items():
        b = g_single[n]
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max()) + 1e-12, n


def test_train_refuses_packed_rows_for_a_hybrid_before_it_reads_the_data(tmp_path, capsys, monkeypatch):
    """``megatrain train`` on a checkpoint of a hybrid whose mixers are not run apart (Qwen3.5 taken out of
    ``documents.FAMILIES``) with packing (the default): one line naming --no-packing, from the model's blocks alone,
    before the data is read or any store is built."""
    from megatrain import train
    from megatrain.cli import main

    from ..data.tokenizers import llama3_tokenizer

    tok = llama3_tokenizer()
    hf_model("qwen3_5_text", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
             pad_token_id=tok.pad_token_id).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    capsys.readouterr()  # (save_pretrained's progress bar)
    (tmp_path / "d.jsonl").write_text('{"text": "one document"}\n')
    monkeypatch.setattr(train, "data_source", lambda *a, **kw: pytest.fail("the data was read"))
    monkeypatch.setattr(documents, "FAMILIES", documents.FAMILIES - {"qwen3_5_text"})
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "d.jsonl"), "--steps", "1",
                 "--out", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    assert "cannot keep documents packed into one row apart" in err and "--no-packing" in err
    assert len(err.strip().splitlines()) == 1
