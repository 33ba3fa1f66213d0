"""Evaluation on the streaming executor: the same loss as in program order, and training after it goes on as if
it had not happened."""

import copy

import pytest
import torch

import megatrain

from ..runtime.test_parity import batches
from .test_streams import small

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("plan", [dict(n_mb=2, weight_slots=2, gpu_opt_every=0),
                                  dict(n_mb=2, weight_slots="all", gpu_opt_every=1)])
def test_streamed_evaluation(plan):
    model = small("llama")
    data = [[t.cuda() for t in b] for b in batches(n_steps=3)]
    opt = megatrain.OptimConfig(lr=1e-3, max_grad_norm=1.0)
    runs = {}
    for streams in (False, True):
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", streams=streams, optim=opt, **plan)
        losses, evals = [], []
        for b in data:
            losses.append(sm.train_step(*b).loss)
            evals.append(sm.evaluate(*data[0]).loss)
        runs[streams] = (losses, evals, sm.state_dict())
    assert runs[True][1] == runs[False][1]
    assert runs[True][0] == runs[False][0]
    plain = megatrain.compile(copy.deepcopy(model), device="cuda", optim=opt, **plan)
    assert [plain.train_step(*b).loss for b in data] == runs[True][0]
    sd, ref = runs[True][2], plain.state_dict()
    assert all(torch.equal(sd[n], ref[n]) for n in sd)
