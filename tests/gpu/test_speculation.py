"""Host updates made before the step's global norm (``speculate``) on the streaming executor with real CUDA streams:
4 steps, the clip triggered on two of them, bit-identical fp32 masters, moments and step counts to the same plan
without them, whether each keeps its masters or writes its state to a spare block; the steps overlap (the next
forward under the previous step's checks)."""

import copy
import dataclasses

import pytest

import megatrain

from ..runtime.test_nonfinite import _batches, same, snapshot
from .test_streams import small

pytestmark = pytest.mark.gpu

OPT = megatrain.OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=1e9, warmup_steps=2, total_steps=8,
                            host_kernel="native")


@pytest.mark.parametrize("keeps", ["masters", "state"])
@pytest.mark.parametrize("plan", [dict(gpu_opt_every=0, split_opt=0), dict(gpu_opt_every=3, split_opt=0)])
def test_updates_before_the_norm_are_bit_identical_with_two_steps_clipped(plan, keeps):
    model, data = small("qwen2"), [b.cuda() for b in _batches(4)]
    probe = megatrain.compile(copy.deepcopy(model), device="cuda", optim=OPT, n_mb=2, speculate=0, **plan)
    norms = sorted(probe.train_step(b).grad_norm for b in data)
    opt = dataclasses.replace(OPT, max_grad_norm=(norms[1] + norms[2]) / 2)
    runs, clipped = [], []
    for speculate in (0, 4):
        sm = megatrain.compile(copy.deepcopy(model), device="cuda", optim=opt, n_mb=2, speculate=speculate,
                               speculate_keeps=keeps, **plan)
        assert type(sm.executor).__name__ == "StreamExecutor" and sm.overlap_steps
        cfg = sm.schedule_for(4, 16).config
        assert len(cfg.speculate) == speculate and cfg.speculate_keeps == (keeps if speculate else "masters")
        clipped.append([sm.train_step(b).grad_norm > opt.max_grad_norm for b in data])
        runs.append(snapshot(sm))
    assert clipped[0] == clipped[1] and sum(clipped[0]) == 2, clipped
    assert same(*runs)
