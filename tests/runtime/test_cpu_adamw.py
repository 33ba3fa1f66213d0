"""megatrain's host AdamW kernel (runtime/cpu_adamw.c) against torch's fused CPU AdamW, bit for bit: every row,
several steps, sizes with and without a remainder past the vector width, with and without a clip factor and weight
decay; the split into a master-only pass and a moments-only pass leaves what one full pass leaves; and a training
run whose host updates use it ends with the same bits as one using torch's kernel."""

import dataclasses

import pytest
import torch

import megatrain
from megatrain.runtime import cpu_adamw

from .models import hf_model

pytestmark = pytest.mark.skipif(not cpu_adamw.available(), reason="no C compiler to build the host kernel")

HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8)


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5,
            [torch.randn(n, generator=g) for _ in range(3)])


def _torch_reference(master, exp_avg, exp_avg_sq, grads, weight_decay, scale):
    p, m, v = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    opt = torch.optim.AdamW([p], **HP, weight_decay=weight_decay, fused=True)
    opt.state[p] = {"step": torch.zeros(()), "exp_avg": m, "exp_avg_sq": v}
    for g in grads:
        p.grad = g.clone()
        if scale is not None:
            opt.grad_scale = torch.tensor(scale, dtype=torch.float32)
        opt.step()
    return p.detach(), m, v


@pytest.mark.parametrize("n", [5, 16, 1000, 4099, 65536 + 3])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("scale", [None, 1 / 0.37])
@pytest.mark.parametrize("split", [False, True], ids=["full", "master-then-moments"])
def test_the_kernel_gives_torch_fused_adamws_bits(n, weight_decay, scale, split):
    master, exp_avg, exp_avg_sq, grads = _rows(n, seed=n)
    scale = None if scale is None else torch.tensor(scale, dtype=torch.float32).item()
    want = _torch_reference(master, exp_avg, exp_avg_sq, grads, weight_decay, scale)
    p, m, v = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    shadow = torch.zeros(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, 1):
        kept = g.clone()
        kw = dict(**HP, weight_decay=weight_decay, step=step, grad_scale=scale)
        if split:
            cpu_adamw.adamw(p, m, v, g, **kw, out=shadow, mode=cpu_adamw.MASTER)
            cpu_adamw.adamw(p, m, v, g, **kw, mode=cpu_adamw.MOMENTS)
        else:
            cpu_adamw.adamw(p, m, v, g, **kw, out=shadow)
        assert torch.equal(g, kept), "the gradient is only read"
    for got, ref in zip((p, m, v), want):
        assert torch.equal(got, ref)
    assert torch.equal(shadow, p.to(torch.bfloat16))


def test_the_master_pass_leaves_the_moments_and_the_moments_pass_the_master():
    master, exp_avg, exp_avg_sq, grads = _rows(4096, seed=1)
    p, m, v = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    cpu_adamw.adamw(p, m, v, grads[0], **HP, weight_decay=0.1, step=1, mode=cpu_adamw.MASTER)
    assert torch.equal(m, exp_avg) and torch.equal(v, exp_avg_sq) and not torch.equal(p, master)
    before = p.clone()
    cpu_adamw.adamw(p, m, v, grads[0], **HP, weight_decay=0.1, step=1, mode=cpu_adamw.MOMENTS)
    assert torch.equal(p, before) and not torch.equal(m, exp_avg) and not torch.equal(v, exp_avg_sq)


def test_bad_rows_are_refused_by_name():
    rows = [torch.zeros(8) for _ in range(4)]
    with pytest.raises(ValueError, match="exp_avg_sq must be a contiguous torch.float32"):
        cpu_adamw.adamw(rows[0], rows[1], torch.zeros(8, dtype=torch.float64), rows[3], **HP, weight_decay=0.0,
                        step=1)
    with pytest.raises(ValueError, match="step counts updates from 1"):
        cpu_adamw.adamw(*rows, **HP, weight_decay=0.0, step=0)


def test_host_kernel_setting_is_checked():
    with pytest.raises(ValueError, match="host_kernel must be"):
        megatrain.OptimConfig(host_kernel="fast")


def test_training_with_the_kernel_ends_with_torch_kernels_bits():
    """Three clipped steps (weight decay on some parameters, not on norms) of a small HF model, host updates by each
    kernel: every master, moment and step count the same."""
    opt = megatrain.OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 97, (4, 16), generator=g) for _ in range(3)]
    runs = {}
    for kernel in ("native", "torch"):
        sm = megatrain.compile(hf_model("llama"), device="cpu", optim=dataclasses.replace(opt, host_kernel=kernel),
                               n_mb=2)
        assert sm.optimizer.native == (kernel == "native")
        for b in data:
            sm.train_step(b)
        runs[kernel] = {l: sm.store.block(l)[:3].clone() for l in sm.store.owners()}
    assert runs["native"].keys() == runs["torch"].keys()
    for layer, block in runs["native"].items():
        assert torch.equal(block, runs["torch"][layer]), f"layer {layer}"
