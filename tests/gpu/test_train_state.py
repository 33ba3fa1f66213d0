"""Training state on the GPU: a run with the streaming executor (steps overlapping, states kept on the device)
saved, loaded into a new model and continued takes the same steps as one that never stopped."""

import copy

import pytest
import torch

import megatrain

from ..runtime.models import hf_model
from ..runtime.test_parity import batches

pytestmark = pytest.mark.gpu

OPT = megatrain.OptimConfig(lr=1e-3, max_grad_norm=0.5, warmup_steps=2, total_steps=8)


@pytest.mark.parametrize("plan", [dict(n_mb=2, gpu_opt_every=2, resident_opt="auto"),
                                  dict(n_mb=2, gpu_opt_every=0, weight_slots=3)])
def test_saved_and_resumed_on_the_gpu_equals_unbroken(tmp_path, plan):
    model = hf_model("qwen2", hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=4)
    data = [[t.cuda() for t in b] for b in batches(n_steps=6)]

    def fresh():
        return megatrain.compile(copy.deepcopy(model), device="cuda", optim=OPT, **plan)

    whole = fresh()
    assert whole.overlap_steps  # the step's updates run on under the next one
    ref = [whole.train_step(*b) for b in data]
    first = fresh()
    for b in data[:3]:
        first.train_step(*b)
    first.save_state(tmp_path / "s")
    first.train_step(*data[3])  # goes on; the state saved stays what it was
    resumed = fresh()
    resumed.load_state(tmp_path / "s")
    rest = [resumed.train_step(*b) for b in data[3:]]
    assert [(s.step, s.lr) for s in rest] == [(s.step, s.lr) for s in ref[3:]]
    assert [s.loss for s in rest] == [s.loss for s in ref[3:]]
    assert [s.grad_norm for s in rest] == pytest.approx([s.grad_norm for s in ref[3:]], rel=1e-6)
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
