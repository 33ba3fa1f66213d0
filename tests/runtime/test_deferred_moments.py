"""Moments left for after the update pass (StreamExecutor.defer_moments, on the CPU with the fake CUDA of
tests/runtime/fake_cuda.py): a host update writes the masters alone, the moments come from the gradient still in
its host buffer after the step's updates, and the next gradient store into that buffer waits for them. Trained
state (masters, moments, step counts) bit-identical to the program-order executor, which updates in one pass;
without the wait a store overwrites a gradient whose moments are not done, and the check sees it."""

import copy
import dataclasses
import time

import pytest
import torch

from megatrain.ir import OpKind, Stream
from megatrain.runtime import cpu_adamw
from megatrain.runtime.streams import StreamExecutor, deferrable_opts

from .fake_cuda import FakeCuda
from .models import compile_cpu, hf_model
from .test_parity import OPT, batches

pytestmark = pytest.mark.skipif(not cpu_adamw.available(), reason="no C compiler to build the host kernel")

NATIVE = dataclasses.replace(OPT, fused=True, host_kernel="native")
PLANS = {
    "host": dict(n_mb=3, weight_slots=2),
    "kept-and-split": dict(n_mb=3, weight_slots=2, split_opt=2, opt_part=700, grad_kept=2),
}


class _NoWait(dict):
    """A moments_due table that never makes a store wait."""

    def pop(self, key, default=None):
        super().pop(key, default)
        return None


def _state(sm):
    sm.wait()
    return ({l: sm.store.block(l)[:3].clone() for l in sm.store.owners()},
            {l: sm.optimizer.steps(l) for l in sm.store.owners()})


def _train(plan, wait=True, slow_moments=0.0, monkeypatch=None):
    model, data = hf_model("qwen2"), batches(n_steps=3)
    ref = compile_cpu(copy.deepcopy(model), optim=NATIVE, **PLANS[plan])
    sm = compile_cpu(copy.deepcopy(model), optim=NATIVE, **PLANS[plan])
    ex = sm.executor = StreamExecutor(sm.captured, sm.store, sm.optimizer, torch.device("cpu"), sm.compute_dtype,
                                      runner=sm.executor.runner, cuda=FakeCuda())
    sm.overlap_steps = True
    if not wait:
        ex.moments_due = _NoWait()
    if slow_moments:
        step_moments = sm.optimizer.step_moments
        monkeypatch.setattr(sm.optimizer, "step_moments",
                            lambda *a, **k: (time.sleep(slow_moments), step_moments(*a, **k)))
    deferred = []
    for b in data:
        ref.train_step(*b)
        sm.train_step(*b)
        deferred.append(len(ex.deferred_moments))
    return _state(ref), _state(sm), deferred, ex


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_deferred_moments_train_bit_identically(plan):
    want, got, deferred, ex = _train(plan)
    assert min(deferred) > 0
    assert want[1] == got[1]
    for layer, block in want[0].items():
        assert torch.equal(block, got[0][layer]), f"layer {layer}"


def test_a_store_that_does_not_wait_for_the_moments_is_seen(monkeypatch):
    """Moments slowed down: with the wait the run is still exact; without it the next step's gradient stores
    overwrite buffers whose moments are not yet taken, and the moments differ."""
    want, got, _, _ = _train("host", slow_moments=0.3, monkeypatch=monkeypatch)
    assert all(torch.equal(b, got[0][l]) for l, b in want[0].items())
    monkeypatch.undo()
    want, got, _, _ = _train("host", wait=False, slow_moments=0.3, monkeypatch=monkeypatch)
    assert not all(torch.equal(b, got[0][l]) for l, b in want[0].items())


def test_an_update_whose_buffer_is_written_again_in_its_step_is_not_deferred():
    """A kept gradient that passes through a host buffer after another layer's update read it: that update's
    moments cannot wait (its gradient is gone), every other host update's can."""
    sm = compile_cpu(hf_model("qwen2"), optim=NATIVE, **PLANS["host"])
    sched = sm.schedule_for(*batches(n_steps=1)[0][0].shape)
    host_opts = [op for op in sched.ops if op.kind is OpKind.OPT and op.stream is Stream.CPU]
    deferred = deferrable_opts(sched)
    for op in host_opts:
        later = [o for o in sched.ops if o.id > op.id and o.kind is OpKind.STORE_G and o.stream is Stream.D2H
                 and o.slot("h") == op.slot("h")]
        assert (op.id in deferred) == (not later), op
    assert deferred and len(deferred) < len(host_opts)
