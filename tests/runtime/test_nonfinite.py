"""A step whose loss or global gradient norm is not finite applies no update at all (CPU, program-order
executor; tests/gpu/test_nonfinite.py runs the streaming executor): weights, moments, step counts and the learning
rate schedule stay as they were, and training goes on as if the step had never been tried."""

import dataclasses

import pytest
import torch

import megatrain
from megatrain.api import NonFiniteStepError
from megatrain.runtime.state import train_state

from .models import hf_model

OPT = megatrain.OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2, total_steps=8)
PLANS = {"host": dict(), "device": dict(gpu_opt_every=1, resident_opt="auto"),
         "device-sent-back": dict(gpu_opt_every=2, resident_opt=0)}


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (4, 16), generator=g) for _ in range(n)]


def snapshot(sm):
    """Every bit of the training state: master, moments (as integers, so NaN and inf compare), step counts."""
    sm.wait()
    sm.executor.sync_resident()
    blocks = {l: sm.store.block(l)[:3].clone().view(torch.int32) for l in sm.store.owners()}
    opt = sm.optimizer
    steps = {l: opt.steps(l) for l in sm.store.owners()}
    return blocks, steps, opt.step_index, sm.step


def set_weight(sm, name, index, value):
    """Write one element of a weight from outside, as a user would (states kept on the device go back to the
    store first); returns what was there."""
    w = sm.state_dict()[name].clone()
    old = float(w.view(-1)[index])
    w.view(-1)[index] = value
    sm.store.load_state({name: w})
    return old


def same(a, b):
    return all(torch.equal(a[0][l], b[0][l]) for l in a[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("clip", [1.0, None])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_an_inf_weight_applies_nothing_and_training_goes_on_as_if_the_step_was_not_tried(plan, clip):
    opt = dataclasses.replace(OPT, max_grad_norm=clip)
    data = _batches(5)
    ref = megatrain.compile(hf_model("llama"), device="cpu", optim=opt, n_mb=2, **PLANS[plan])
    ref_losses = [ref.train_step(b).loss for b in data[:2] + data[3:]]
    sm = megatrain.compile(hf_model("llama"), device="cpu", optim=opt, n_mb=2, **PLANS[plan])
    for b in data[:2]:
        sm.train_step(b)
    kept = set_weight(sm, "lm_head.weight", 5, float("inf"))  # a weight every token's logits read
    before = snapshot(sm)
    with pytest.raises(NonFiniteStepError, match=r"step 3: loss (nan|inf).*no update was applied \(the weights "
                                                 r"and Adam moments are those after step 2\)") as e:
        sm.train_step(data[2])
    assert e.value.stats.skipped and sm.skipped_steps == 1
    assert same(snapshot(sm), before)
    set_weight(sm, "lm_head.weight", 5, kept)
    losses = [sm.train_step(b).loss for b in data[3:]]
    assert losses == ref_losses[2:]
    a, b = ref.state_dict(), sm.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_huge_learning_rate_stops_at_the_step_whose_loss_is_not_finite_and_skip_goes_on():
    opt = dataclasses.replace(OPT, lr=1e30, warmup_steps=0)
    data = _batches(6)
    sm = megatrain.compile(hf_model("llama"), device="cpu", optim=opt, n_mb=2, nonfinite="skip")
    stats = []
    for b in data:
        before = snapshot(sm)
        st = sm.train_step(b)
        stats.append(st)
        if st.skipped:  # nothing changed
            assert same(snapshot(sm), before)
    assert any(s.skipped for s in stats) and not stats[0].skipped
    assert sm.skipped_steps == sum(s.skipped for s in stats) and sm.step == len(stats) - sm.skipped_steps
    sm.nonfinite = "raise"
    with pytest.raises(NonFiniteStepError):
        sm.train_step(data[0])
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('raise', 'skip'\), got 'ignore'"):
        sm.nonfinite = "ignore"


def test_a_state_that_is_not_finite_is_not_saved(tmp_path):
    sm = megatrain.compile(hf_model("llama"), device="cpu", optim=OPT, n_mb=2)
    sm.train_step(_batches(1)[0])
    good = sm.save_state(tmp_path / "s")
    files = {f.name: f.read_bytes() for f in good.iterdir()}
    sm.store.row(2, "exp_avg")[3] = float("nan")
    with pytest.raises(train_state.NonFiniteState, match=r"layer 2 \(model.layers.1\) holds values that are not "
                                                         r"finite in exp_avg: the state is not saved"):
        sm.save_state(tmp_path / "s")
    assert train_state.find(tmp_path / "s") == good
    assert {f.name: f.read_bytes() for f in good.iterdir()} == files
    assert sorted(x.name for x in (tmp_path / "s").iterdir()) == ["LATEST", good.name]
