"""Updates split to the device after the backward (``split_opt``: state streamed through the optimizer slots a part
at a time) train bit for bit like host updates on the CPU (fp32), with gradients from host buffers or kept on the
device, and match plain PyTorch training."""

import copy

import pytest
import torch

from megatrain.ir import OpKind

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches, check, reference_train


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_split_updates_train_bit_for_bit_like_host_updates(family):
    model, data = hf_model(family), batches(n_steps=3)
    runs = {}
    for name, plan in {"host": dict(split_opt=0), "split": dict(split_opt=3, opt_part=700, grad_kept=0),
                       "split-kept": dict(split_opt=3, opt_part=700, grad_kept="auto")}.items():
        sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, **plan)
        stats = [sm.train_step(*b) for b in data]
        runs[name] = (sm, [s.loss for s in stats], [s.grad_norm for s in stats], sm.state_dict())
    for name in ("split", "split-kept"):
        sm, losses, norms, sd = runs[name]
        cfg = sm.schedule_for(6, 12).config
        parts = {op.mb for op in sm.schedule_for(6, 12).ops if op.kind is OpKind.OPT and op.layer in cfg.split_opt}
        assert len(cfg.split_opt) == 3 and len(parts) > 2 and bool(cfg.grad_kept) == (name == "split-kept")
        assert losses == runs["host"][1] and norms == runs["host"][2] and max(norms) > OPT.max_grad_norm
        assert all(torch.equal(sd[n], runs["host"][3][n]) for n in sd)
        for layer in cfg.split_opt:  # Adam's step count advanced once per step, not once per part
            assert sm.optimizer.steps(layer) == len(data)


def test_split_updates_match_plain_pytorch():
    model = hf_model("qwen2")
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, split_opt=2, opt_part=1000)
    stats = [sm.train_step(*b) for b in data]
    assert sm.schedule_for(6, 12).config.split_opt
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def test_plans_that_follow_each_other_hold_their_own_slots_and_train_as_host_updates():
    """One model trained by plans in turn (device updates with states kept there and three split layers, one split
    layer, none, the first again): after each step every device slot is of the size the plan counts, not the
    larger of this plan's and an earlier one's (at 48 GiB on the H200 a plan with fewer split layers ran out of
    memory after one with more), and the run trains bit for bit as host updates do."""
    model, data = hf_model("qwen2", num_hidden_layers=6, tie_word_embeddings=False), batches(n_steps=4)
    plans = [dict(gpu_opt_every=2, split_opt=3, opt_part=700), dict(gpu_opt_every=2, split_opt=1, opt_part=700),
             dict(gpu_opt_every=0, split_opt=0), dict(gpu_opt_every=2, split_opt=3, opt_part=700)]
    sm = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3)
    host = compile_cpu(copy.deepcopy(model), optim=OPT, n_mb=3, split_opt=0)
    seen = set()
    for b, plan in zip(data, plans):
        got, want = sm.train_step(*b, **plan), host.train_step(*b)
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
        cfg = sm.schedule_for(6, 12, **plan).config
        seen.add((cfg.gpu_opt, cfg.split_opt))
        sizes = sm.executor.dev.slot_numels(sm.schedule_for(6, 12, **plan))
        for pool in "wgok":
            assert [t.numel() for t in getattr(sm.executor.dev, pool)] == sizes[pool], (pool, plan)
    assert len(seen) == 3 and any(len(s) == 3 for _, s in seen) and ((), ()) in seen
    sd, ref = sm.state_dict(), host.state_dict()
    assert all(torch.equal(sd[n], ref[n]) for n in sd)
