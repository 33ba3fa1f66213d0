"""Documents packed into one row (position ids restarting at each) train as the documents run one by one: the same
loss and gradients (fp32, CPU)."""

import dataclasses

import pytest
import torch

from .models import compile_cpu, hf_model, record_grads
from .test_parity import OPT

NO_CLIP = dataclasses.replace(OPT, max_grad_norm=None)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_packed_documents_equal_documents_one_by_one(family):
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 97, (n,), generator=g) for n in (7, 12, 5)]
    T = sum(len(d) for d in docs) + 2  # two tokens of padding at the end of the packed row
    packed = torch.cat([*docs, torch.zeros(2, dtype=torch.long)])[None]
    pos = torch.cat([*(torch.arange(len(d)) for d in docs), torch.arange(2)])[None]
    mask = torch.ones_like(packed)
    mask[0, -2:] = 0
    one = compile_cpu(hf_model(family), optim=NO_CLIP, n_mb=1)
    assert one.captured.packs
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
    for n, a in g_packed.items():
        b = g_rows[n]
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max()) + 1e-12, n


def test_packing_is_refused_where_documents_cannot_be_kept_apart_and_positions_are_checked():
    from .models import TinyGPT

    ids = torch.randint(3, 97, (2, 8))
    sm = compile_cpu(TinyGPT(tied=False), n_mb=1)
    with pytest.raises(ValueError, match="cannot keep documents packed into one row apart"):
        sm.train_step(ids, position_ids=torch.arange(8).expand(2, 8))
    sm = compile_cpu(hf_model("llama"), n_mb=1)
    for bad in (torch.arange(1, 9).expand(2, 8), torch.tensor([[0, 1, 2, 4, 5, 0, 1, 2]] * 2)):
        with pytest.raises(ValueError, match="position_ids must start each row at 0"):
            sm.train_step(ids, position_ids=bad)
    assert sm.step == 0
