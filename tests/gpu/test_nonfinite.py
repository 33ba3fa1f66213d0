"""A step whose loss or gradient norm is not finite applies no update on the streaming executor either: device
updates (the factor on the device stops the Triton AdamW), states kept on the device, host updates in the worker,
steps overlapping (the next step's forward under the previous step's updates)."""

import dataclasses

import pytest
import torch

import megatrain
from megatrain.api import NonFiniteStepError

from ..runtime.test_nonfinite import _batches, same, set_weight, snapshot
from .test_streams import small

pytestmark = pytest.mark.gpu

OPT = megatrain.OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2, total_steps=8)


@pytest.mark.parametrize("clip", [1.0, None])
@pytest.mark.parametrize("plan", [dict(gpu_opt_every=1, resident_opt="auto"), dict(gpu_opt_every=2, resident_opt=0),
                                  dict(gpu_opt_every=0)])
def test_streamed_non_finite_step_applies_nothing_and_training_goes_on(plan, clip):
    opt = dataclasses.replace(OPT, max_grad_norm=clip)
    data = [b.cuda() for b in _batches(5)]

    def compiled():
        sm = megatrain.compile(small("llama"), device="cuda", optim=opt, n_mb=2, **plan)
        assert type(sm.executor).__name__ == "StreamExecutor" and sm.overlap_steps
        return sm

    ref = compiled()
    ref_losses = [ref.train_step(b).loss for b in data[:2] + data[3:]]
    sm = compiled()
    if plan["gpu_opt_every"]:
        assert sm.schedule_for(4, 16).config.gpu_opt
    for b in data[:2]:
        sm.train_step(b)
    kept = set_weight(sm, "lm_head.weight", 5, float("inf"))
    before = snapshot(sm)
    with pytest.raises(NonFiniteStepError, match="no update was applied"):
        sm.train_step(data[2])
    assert same(snapshot(sm), before)
    set_weight(sm, "lm_head.weight", 5, kept)
    assert [sm.train_step(b).loss for b in data[3:]] == ref_losses[2:]
    a, b = ref.state_dict(), sm.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
