"""Moments left for after the update pass (StreamExecutor.defer_moments, on the CPU with the fake CUDA of
tests/runtime/fake_cuda.py): a host update writes the masters alone, the moments come from the gradient still in
its host buffer after the step's updates, and the next gradient store into that buffer waits for them. Trained
state (masters, moments, step counts) bit-identical to the program-order executor, which updates in one pass;
without the wait a store overwrites a gradient whose moments are not done, and the check sees it."""

import copy
import dataclasses
import threading
import time

from types import SimpleNamespace

import pytest
import torch

from megatrain.ir import OpKind, Stream
from megatrain.runtime.optim import cpu_adamw
from megatrain.runtime.issue.stream_copies import StreamCopies
from megatrain.ir import deferrable_opts
from megatrain.runtime.issue.streams import StreamExecutor

from .fake_cuda import FakeCuda
from .models import compile_cpu, hf_model
from .test_parity import OPT, batches

pytestmark = pytest.mark.skipif(not cpu_adamw.available(), reason="no C compiler to build the host kernel")

NATIVE = dataclasses.replace(OPT, fused=True, host_kernel="native")
PLANS = {
    "host": dict(n_mb=3, weight_slots=2),
    "kept-and-split": dict(n_mb=3, weight_slots=2, split_opt=2, opt_part=700, grad_kept=2),
    "split": dict(n_mb=3, weight_slots=2, split_opt=3, opt_part=700, grad_kept=0),
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
        if plan == "split":  # a split update's parts store the masters alone
            sched = ex.st.schedule
            stores = [op for op in sched.ops if op.kind is OpKind.STORE_OPT and op.layer in sched.config.split_opt]
            assert stores and all(op.id in ex.deferred_moments for op in stores)
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


def test_a_state_load_waits_for_an_earlier_steps_split_moments():
    """The moments rows of a split layer's state load wait for the host's moments of the layer's last deferred
    update, unless that update is the load's own step's (its parts load before the moments exist); the master row
    never waits. (End to end the next step's gradient store into the layer's buffer waits first where the layer
    keeps its buffer; this is the wait for a schedule where it does not.)"""
    class Order:
        def wait_for_rows(self, *a):
            pass

    class Cuda:
        def current_stream(self):
            return None

    ex = StreamExecutor.__new__(StreamExecutor)
    ex.moments_wait_s = 0.0
    copies = StreamCopies(Cuda(), torch.device("cpu"), {}, Order(), None, lambda: 1, ex._wait_moments)
    earlier, later, done = object(), object(), threading.Event()
    ex.split_moments_due = {4: (earlier, done)}
    copies.before_row(4, 0, later)
    copies.before_row(4, 1, earlier)
    copies.before_row(3, 2, later)
    waiter = threading.Thread(target=copies.before_row, args=(4, 2, later))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    done.set()
    waiter.join(5)
    assert not waiter.is_alive() and ex.moments_wait_s > 0.1


def test_a_split_layers_moments_wait_for_its_state_loads(monkeypatch):
    """The host computes a split layer's moments only once every part's state load has read the old ones (their
    events synchronized first), and marks them done even when computing them fails."""
    from megatrain.runtime.ops import update as update_ops

    class Event:
        def __init__(self):
            self.synced = False

        def synchronize(self):
            self.synced = True

    events = {1: Event(), 5: Event(), 9: Event()}
    seen = []
    monkeypatch.setattr(update_ops, "split_moments_on_host",
                        lambda ex, layer, h, st: seen.append((layer, h, [e.synced for e in events.values()])))
    done, times = threading.Event(), []
    StreamExecutor._split_moments_task(SimpleNamespace(ctx=None), 4, 2, [1, 5, 9], events, None, done, times)
    assert seen == [(4, 2, [True, True, True])] and done.is_set() and len(times) == 1

    def fail(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(update_ops, "split_moments_on_host", fail)
    done = threading.Event()
    with pytest.raises(RuntimeError, match="boom"):
        StreamExecutor._split_moments_task(SimpleNamespace(ctx=None), 4, 2, [1], events, None, done, [])
    assert done.is_set()


def test_a_split_update_with_its_gradient_kept_on_the_device_stores_its_moments():
    """Only a split update whose every part reads its gradient from a host buffer stores the masters alone: one
    whose gradient stays on the device has no buffer for the host to compute the moments from."""
    for plan, want in (("split", True), ("kept-and-split", False)):
        sm = compile_cpu(hf_model("qwen2"), optim=NATIVE, **PLANS[plan])
        sched = sm.schedule_for(*batches(n_steps=1)[0][0].shape)
        cfg, deferred = sched.config, deferrable_opts(sched)
        stores = [op for op in sched.ops if op.kind is OpKind.STORE_OPT and op.layer in cfg.split_opt]
        assert stores
        for op in stores:
            assert (op.id in deferred) == (want and op.layer not in cfg.grad_kept), (plan, op)
        assert want or any(op.layer in cfg.grad_kept for op in stores)
