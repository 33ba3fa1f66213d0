"""Where the checkpoints live is a plan's choice that must not change what training computes: any number of them on
the host, any dropped and made again, any weight slots and micro-batches, each plan run by the CPU executor (whose
slot checks refuse a schedule that would lose what a later op reads) gives bit for bit the losses and weights of
every checkpoint kept on the device with the same micro-batches."""

import dataclasses
import functools

import torch
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from megatrain.ir.schedule import MAX_DROP_RUN, droppable, max_dropped

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches

DATA = batches(n_steps=2)
N_LAYERS = 6  # the tiny llama: embedding, 3 blocks, final norm, head


def _train(n_mb: int, **plan):
    torch.manual_seed(0)
    sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=n_mb, **plan)
    assert len(sm.graph) == N_LAYERS
    cfg = sm.schedule_for(*DATA[0][0].shape).config
    assert all(getattr(cfg, k) == v for k, v in plan.items() if k != "weight_slots"), (cfg, plan)
    return [sm.train_step(*b).loss for b in DATA], sm.state_dict()


@functools.cache
def _kept(n_mb: int):
    return _train(n_mb, host_checkpoints=0, dropped_checkpoints=0)


@settings(max_examples=16, deadline=None, derandomize=True)
@given(n_mb=st.sampled_from([1, 2, 3]), slots=st.sampled_from([1, 2, "all"]),
       host=st.integers(0, N_LAYERS - 2), dropped=st.integers(0, max_dropped(droppable(N_LAYERS), MAX_DROP_RUN)))
@example(n_mb=1, slots=1, host=N_LAYERS - 2, dropped=0)  # the top block's comes back where it still lies
@example(n_mb=1, slots=2, host=2, dropped=2)  # a run of two made again from a kept one, one micro-batch
def test_any_placement_of_the_checkpoints_trains_as_keeping_them(n_mb, slots, host, dropped):
    losses, weights = _train(n_mb, weight_slots=slots, host_checkpoints=host, dropped_checkpoints=dropped)
    ref_losses, ref = _kept(n_mb)
    assert losses == ref_losses
    assert all(torch.equal(weights[n], t) for n, t in ref.items())


OPT_FUSED = dataclasses.replace(OPT, fused=True)  # (device and host updates: the same arithmetic, bit for bit)


@functools.cache
def _host_only(n_mb: int):
    sm = compile_cpu(hf_model("llama"), optim=OPT_FUSED, n_mb=n_mb, weight_slots=2)
    return [sm.train_step(*b).loss for b in DATA], sm.state_dict()


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(n_mb=st.sampled_from([1, 2, 3]), slots=st.sampled_from([1, 2, "all"]), host=st.integers(0, N_LAYERS - 2),
       dropped=st.integers(0, 2), gpu=st.sampled_from([0, 1, 2]), saved=st.sampled_from([0, 1, 2]),
       kept=st.sampled_from([0, "auto"]), spec=st.sampled_from([0, 2]), split=st.sampled_from([0, 1]))
def test_any_plan_the_planner_takes_trains_as_host_updates_alone(n_mb, slots, host, dropped, gpu, saved, kept, spec,
                                                                 split):
    """The checkpoints' places with device updates, saved activations, gradients kept on the device, updates before
    the norm and split updates on top: each combination the planner takes (the others it refuses with a
    ValueError, rejected here) trains as every update on the host with every checkpoint kept, bit for bit."""
    try:
        sm = compile_cpu(hf_model("llama"), optim=OPT_FUSED, n_mb=n_mb, weight_slots=slots, host_checkpoints=host,
                         dropped_checkpoints=dropped, gpu_opt_every=gpu, saved_acts=saved, grad_kept=kept,
                         speculate=spec, split_opt=split)
        sm.schedule_for(*DATA[0][0].shape)  # (planned for the batch's shape: where a refusal comes)
    except ValueError:
        reject()
    losses = [sm.train_step(*b).loss for b in DATA]
    ref_losses, ref = _host_only(n_mb)
    assert losses == ref_losses
    assert all(torch.equal(sm.state_dict()[n], t) for n, t in ref.items())
