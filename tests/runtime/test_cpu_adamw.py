"""megatrain's host AdamW kernel (runtime/optim/cpu_adamw.c) against torch's fused CPU AdamW, bit for bit: every row,
several steps, sizes with and without a remainder past the vector width, with and without a clip factor and weight
decay; the split into a master-only pass and a moments-only pass leaves what one full pass leaves; and a training
run whose host updates use it ends with the same bits as one using torch's kernel."""

import dataclasses

import pytest
import torch

import megatrain
from megatrain.runtime.optim import cpu_adamw

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
@pytest.mark.parametrize("split", [False, True, "to"], ids=["full", "master-then-moments", "into-other-rows"])
def test_the_kernel_gives_torch_fused_adamws_bits(n, weight_decay, scale, split):
    master, exp_avg, exp_avg_sq, grads = _rows(n, seed=n)
    scale = None if scale is None else torch.tensor(scale, dtype=torch.float32).item()
    want = _torch_reference(master, exp_avg, exp_avg_sq, grads, weight_decay, scale)
    p, m, v = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    shadow = torch.zeros(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, 1):
        kept = g.clone()
        kw = dict(**HP, weight_decay=weight_decay, step=step, grad_scale=scale)
        if split == "to":  # the rows read stay as they were; the new ones are read by the next step
            to, before = tuple(torch.full_like(t, float("nan")) for t in (p, m, v)), (p.clone(), m.clone(), v.clone())
            cpu_adamw.adamw(p, m, v, g, **kw, out=shadow, to=to)
            assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))
            p, m, v = to
        elif split:
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
    with pytest.raises(ValueError, match="separate memory"):
        cpu_adamw.adamw(*rows, **HP, weight_decay=0.0, step=1, to=(torch.zeros(8), rows[1], torch.zeros(8)))
    with pytest.raises(ValueError, match="writes every row"):
        cpu_adamw.adamw(*rows, **HP, weight_decay=0.0, step=1, to=tuple(torch.zeros(8) for _ in range(3)),
                        mode=cpu_adamw.MASTER)
    with pytest.raises(ValueError, match="step counts updates from 1"):
        cpu_adamw.adamw(*rows, **HP, weight_decay=0.0, step=0)


def test_host_kernel_setting_is_checked():
    with pytest.raises(ValueError, match="host_kernel must be"):
        megatrain.OptimConfig(host_kernel="fast")
    with pytest.raises(ValueError, match="host_block must be 0"):
        megatrain.OptimConfig(host_block=-4)


def test_training_with_the_kernel_ends_with_torch_kernels_bits():
    """Three clipped steps (weight decay on some parameters, not on norms) of a small HF model, host updates by each
    kernel (ours with each thread's share fixed and with threads taking runs as they come free): every master,
    moment and step count the same; ours times each step's passes by its own clock."""
    opt = megatrain.OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 97, (4, 16), generator=g) for _ in range(3)]
    runs = {}
    for kernel, block in (("native", 0), ("native", 64), ("torch", 0)):
        sm = megatrain.compile(hf_model("llama"), device="cpu", n_mb=2,
                               optim=dataclasses.replace(opt, host_kernel=kernel, host_block=block))
        assert sm.optimizer.native == (kernel == "native")
        for b in data:
            sm.train_step(b)
        runs[kernel, block] = {l: sm.store.block(l)[:3].clone() for l in sm.store.owners()}
        timed = sm.optimizer.kernel_time
        if kernel == "native":
            n = sum(sm.store.master(l).numel() for l in sm.optimizer.opts)
            assert sorted(timed) == [0, 1, 2] and all(p == n and s > 0 for s, p in timed.values())
        else:
            assert not timed
    for key in (("native", 0), ("native", 64)):
        assert runs[key].keys() == runs["torch", 0].keys()
        for layer, block in runs[key].items():
            assert torch.equal(block, runs["torch", 0][layer]), f"{key}: layer {layer}"


@pytest.mark.parametrize("mode", [cpu_adamw.FULL, cpu_adamw.MASTER, cpu_adamw.MOMENTS])
def test_a_dynamic_schedule_gives_the_static_ones_bits_and_the_pass_is_timed(mode):
    master, exp_avg, exp_avg_sq, grads = _rows(100_003, seed=7)
    kw = dict(**HP, weight_decay=0.1, step=3, grad_scale=1.25, mode=mode, threads=3)
    results = []
    for block in (0, 1000, 4096):  # runs not a multiple of the vector width, and one that is
        p, m, v = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
        shadow = torch.zeros(p.numel(), dtype=torch.bfloat16)
        secs = cpu_adamw.adamw(p, m, v, grads[0], **kw, out=None if mode == cpu_adamw.MOMENTS else shadow,
                               block=block)
        assert 0 < secs < 60
        results.append((p, m, v, shadow))
    written = (results[0][1], exp_avg) if mode == cpu_adamw.MOMENTS else (results[0][0], master)
    assert not torch.equal(*written)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="block must be 0"):
        cpu_adamw.adamw(p, m, v, grads[0], **kw, block=-1)
