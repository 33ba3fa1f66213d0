"""compile() reads the caller's model and changes nothing of it: its parameters and buffers (names, kinds, objects,
values, requires_grad) and its config are the same after compiling and training a step. (Blocks with persistent
float buffers, a router's bias, once had them turned into frozen parameters of the caller's own blocks.)"""

import pytest
import torch

from ..planner.test_moe import FAMILIES as MOE_FAMILIES
from .models import (DROPOUT_FIELDS, FAMILIES, MORE_FAMILIES, STATE_CASES, compile_cpu, hf_model, state_model,
                     with_dropout)
from .test_moe_parity import moe_model
from .test_parity import batches


def _snapshot(model):
    params = {n: (id(p), p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    buffers = {n: (id(b), b.clone()) for n, b in model.named_buffers()}
    return params, buffers, model.config.to_dict()


@pytest.mark.parametrize("family", sorted({*FAMILIES, *MORE_FAMILIES, *MOE_FAMILIES}))
def test_compile_leaves_the_callers_model_as_it_was(family):
    if family in MOE_FAMILIES:
        model = moe_model(family)
    else:
        model = hf_model(family, **(with_dropout(family, 0.0) if family in DROPOUT_FIELDS else {}))
    before = _snapshot(model)
    sm = compile_cpu(model, n_mb=1)
    sm.train_step(*batches(n_steps=1)[0])
    params, buffers, config = _snapshot(model)
    assert params.keys() == before[0].keys() and buffers.keys() == before[1].keys()
    for n, (ident, grad, value) in params.items():
        assert ident == before[0][n][0] and grad == before[0][n][1] and torch.equal(value, before[0][n][2]), n
    for n, (ident, value) in buffers.items():
        assert ident == before[1][n][0] and torch.equal(value, before[1][n][1]), n
    assert config == before[2]


@pytest.mark.parametrize("case", STATE_CASES)
def test_compile_leaves_a_model_with_carried_or_shared_state_as_it_was(case):
    """The same for the models whose blocks hand state on (GLM-MoE-DSA's top-k indices, Gemma's stored keys and
    values: Gemma 4's forward has a method patched for the trace only), take per-layer inputs or share a block."""
    model = state_model(case)
    before = _snapshot(model)
    attrs = {id(m): set(vars(m)) for m in model.modules()}
    sm = compile_cpu(model, n_mb=1)
    sm.train_step(*batches(n_steps=1)[0])
    params, buffers, config = _snapshot(model)
    assert params.keys() == before[0].keys() and buffers.keys() == before[1].keys() and config == before[2]
    assert all(torch.equal(p, before[0][n][2]) for n, (_, _, p) in params.items())
    assert {id(m): set(vars(m)) for m in model.modules()} == attrs
