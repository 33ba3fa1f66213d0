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
