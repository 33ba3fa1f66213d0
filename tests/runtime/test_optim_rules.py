"""What the optimizer updates and how fast: transformers' learning-rate schedules, its weight-decay rule (none on
biases and norm weights), and frozen parameters (requires_grad=False: no gradient, no update, left out of the
global norm) -- each against transformers' own code or plain PyTorch training."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import megatrain
from megatrain.capture import CaptureError
from megatrain.capture.params import no_decay_names
from megatrain.runtime.issue.streams import StreamExecutor
from megatrain.runtime.optim import cpu_adamw, lr_at
from megatrain.runtime.optim.config import SCHEDULES

from .fake_cuda import FakeCuda
from .models import FAMILIES, Block, TinyGPT, compile_cpu, hf_model
from .test_parity import OPT, batches, check, reference_train


def _transformers_lrs(name: str, lr: float, warmup: int, total: int, **kwargs) -> list[float]:
    """The learning rate of each step as the HF Trainer sees it: an optimizer stepped by get_scheduler's
    scheduler."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=kwargs)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_is_transformers_after_warmup(name):
    lr, warmup, total = 2e-3, 5, 40
    kwargs = ({"min_lr": 2e-4} if name == "cosine_with_min_lr" else
              {"num_decay_steps": 8, "min_lr_ratio": 0.1} if name == "warmup_stable_decay" else {})
    cfg = megatrain.OptimConfig(lr=lr, warmup_steps=warmup, total_steps=total, schedule=name,
                                min_lr=2e-4 if name in ("cosine_with_min_lr", "warmup_stable_decay") else 0.0,
                                decay_steps=8 if name == "warmup_stable_decay" else None)
    ref = _transformers_lrs(name, lr, warmup, total, **kwargs)
    mine = [lr_at(cfg, s) for s in range(total)]
    assert mine[:warmup] == pytest.approx([lr * (s + 1) / warmup for s in range(warmup)], rel=1e-12)
    assert mine[warmup:] == pytest.approx(ref[warmup:], rel=1e-12, abs=1e-15)
    if name != "constant":
        assert mine[-1] < 0.3 * lr  # it did decay


def test_the_default_schedule_is_cosine_down_to_min_lr():
    cfg = megatrain.OptimConfig(lr=1.0, warmup_steps=2, total_steps=12, min_lr=0.1)
    assert cfg.schedule_name == "cosine_with_min_lr"
    assert lr_at(cfg, 2) == pytest.approx(1.0) and lr_at(cfg, 7) == pytest.approx(0.55)  # half way: the middle
    assert megatrain.OptimConfig(lr=1.0).schedule_name == "constant"


@pytest.mark.parametrize("kw, says", [
    (dict(schedule="polynomial"), "schedule must be one of"),
    (dict(schedule="linear", min_lr=1e-4), "the linear schedule has none"),
    (dict(schedule="cosine", decay_steps=3), "decay_steps is warmup_stable_decay's"),
    (dict(schedule="warmup_stable_decay", decay_steps=50), "decay_steps must be from 1 to the 18 steps"),
    (dict(min_lr=1.0), "min_lr must be from 0 up to the peak lr"),
    (dict(betas=(0.9, 1.0)), "betas must be two numbers in [0, 1)"),
    (dict(eps=0.0), "eps must be positive"),
])
def test_bad_schedules_are_refused_in_one_line(kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        megatrain.OptimConfig(lr=1e-3, warmup_steps=2, total_steps=20, **kw)
    with pytest.raises(ValueError, match="decays over total_steps, which is not given"):
        megatrain.OptimConfig(lr=1e-3, schedule="linear")


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["gpt2", "falcon_alibi"])
def test_no_decay_names_are_transformers_rule(family):
    from transformers import Trainer

    model = hf_model(family)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    names = {n for n, _ in model.named_parameters()}
    assert no_decay_names(model) & names == names - decay
    assert no_decay_names(model)  # every family has norm weights


def test_decay_on_every_parameter_when_asked():
    opt = dataclasses.replace(OPT, decay_all=True)
    model = hf_model("qwen2")  # biases on q, k, v
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, opt_cfg=opt)
    sm = compile_cpu(model, optim=opt, n_mb=3)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    # and the two rules differ on this model: the default leaves the biases' decay out
    default = compile_cpu(hf_model("qwen2"), optim=OPT, n_mb=3)
    for b in data:
        default.train_step(*b)
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(default.state_dict()[bias], sm.state_dict()[bias])


FROZEN = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
          "model.norm.weight")


def _frozen_qwen2():
    model = hf_model("qwen2", tie_word_embeddings=False)
    for n in FROZEN:
        model.get_parameter(n).requires_grad_(False)
    for p in model.model.layers[1].parameters():  # a whole block
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("gpu_opt_every", [0, 1])
def test_frozen_parameters_are_not_updated_and_the_rest_train_as_in_pytorch(gpu_opt_every):
    """Host updates, and every layer with something to train updated through the device path (the device is the
    CPU here)."""
    opt = OPT  # not fused: Qwen2's k biases have an analytically zero gradient (see test_parity)
    model = _frozen_qwen2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, opt_cfg=opt)
    sm = compile_cpu(model, optim=opt, n_mb=3, gpu_opt_every=gpu_opt_every)
    assert (1 in sm.schedule_for(6, 12).config.gpu_opt) == bool(gpu_opt_every)  # block 0, q_proj frozen
    assert sm.captured.frozen == {n for n, p in model.named_parameters() if not p.requires_grad} > set(FROZEN)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    sd = sm.state_dict()
    for n in sm.captured.frozen:
        assert torch.equal(sd[n], before[n]), n
    k = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(sd[k], before[k])
    block1 = sm.captured.model_param_names["model.layers.1.mlp.up_proj.weight"][0]
    assert sm.optimizer.steps(block1) == 0
    # the layers frozen whole (the embedding, block 1, the final norm) keep their master weights alone: no Adam
    # moments on the host, and no device update; block 0, frozen in part, keeps the moments of what trains, its
    # trained parameters laid out first
    from megatrain.planner.cost import host_memory

    frozen = [l for l in range(len(sm.graph)) if sm.graph[l].frozen]
    assert frozen == [0, block1, len(sm.graph) - 2]
    assert all(len(sm.store.rows(l)) == (1 if l in frozen else 3) for l in sm.store.owners())
    block0, q_numel = sm.captured.model_param_names[k][0], sum(before[q].numel() for q in FROZEN[1:3])
    lay0 = sm.graph[block0]
    assert lay0.trainable == lay0.params - q_numel and [r.numel() for r in sm.store.rows(block0)] == \
        [lay0.params, lay0.trainable, lay0.trainable]
    assert all(sm.captured.model_param_names[q][1] >= lay0.trainable for q in FROZEN[1:3])
    n, nf = sm.graph.n_params, sum(sm.graph[l].params for l in frozen) + q_numel
    assert sm.store.nbytes == {"master": 4 * n, "exp_avg": 4 * (n - nf), "exp_avg_sq": 4 * (n - nf)}
    plan = sm.schedule_for(6, 12)
    assert host_memory(sm.graph, plan)["store"] == sum(sm.store.nbytes.values())
    assert not set(frozen) & set(plan.config.gpu_opt)


def test_a_frozen_tied_embedding_freezes_the_head_with_it():
    torch.manual_seed(0)
    model = TinyGPT(tied=True)
    model.wte.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    data = [(ids, torch.ones_like(ids), labels) for ids, _, labels in batches(n_steps=2)]
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, hf=False)
    sm = compile_cpu(model, optim=OPT, n_mb=3)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    assert torch.equal(sm.state_dict()["lm_head.weight"], model.wte.weight)


def test_a_model_with_nothing_to_train_is_refused():
    model = hf_model("llama")
    model.requires_grad_(False)
    with pytest.raises(CaptureError, match="every parameter of the model has requires_grad=False"):
        compile_cpu(model, optim=OPT)



def test_a_state_saved_with_other_layers_frozen_is_refused_in_one_line(tmp_path):
    """A frozen layer's saved state is its master weights alone: resuming it where the layer trains (or the other
    way round) is refused, naming the frozen layers, before anything is read."""
    from megatrain.runtime.state import train_state

    data = batches(n_steps=2)
    sm = compile_cpu(_frozen_qwen2(), optim=OPT, n_mb=3)
    sm.train_step(*data[0])
    sm.save_state(tmp_path / "state")
    again = compile_cpu(_frozen_qwen2(), optim=OPT, n_mb=3)  # the same freezing resumes, moments and all
    again.load_state(tmp_path / "state")
    assert all(torch.equal(a, b) for l in sm.store.owners() for a, b in zip(sm.store.rows(l), again.store.rows(l)))
    assert sm.train_step(*data[1]).loss == again.train_step(*data[1]).loss
    assert all(torch.equal(sm.store.flat(l), again.store.flat(l)) for l in sm.store.owners())
    with pytest.raises(ValueError, match=r"saved with the layers \['embed', 'model.layers.0 in part', "
                                         r"'model.layers.1', 'norm'\] frozen .* this model has none: freeze the "
                                         r"same parameters"):
        train_state.read_manifest(compile_cpu(hf_model("qwen2", tie_word_embeddings=False), optim=OPT,
                                              n_mb=3).captured, tmp_path / "state")


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "constant"] + ["constant_with_warmup"])
def test_warmup_from_zero_is_transformers_at_every_step(name):
    """warmup_start="zero" (the fine-tuning default of megatrain train): every step's learning rate, the warmup's
    included, is the HF Trainer's for the same schedule (its constant schedule with warmup is
    constant_with_warmup)."""
    lr, warmup, total = 2e-3, 5, 40
    ours = "constant" if name == "constant_with_warmup" else name
    kwargs = ({"min_lr": 2e-4} if name == "cosine_with_min_lr" else
              {"num_decay_steps": 8, "min_lr_ratio": 0.1} if name == "warmup_stable_decay" else {})
    cfg = megatrain.OptimConfig(lr=lr, warmup_steps=warmup, total_steps=None if ours == "constant" else total,
                                schedule=ours, warmup_start="zero",
                                min_lr=2e-4 if name in ("cosine_with_min_lr", "warmup_stable_decay") else 0.0,
                                decay_steps=8 if name == "warmup_stable_decay" else None)
    mine = [lr_at(cfg, s) for s in range(total)]
    assert mine[0] == (2e-4 if name == "warmup_stable_decay" else 0.0)  # (its warmup starts at min_lr)
    assert mine == pytest.approx(_transformers_lrs(name, lr, warmup, total, **kwargs), rel=1e-12, abs=1e-15)


def test_fine_tuning_warms_up_from_zero_and_training_from_scratch_from_the_first_step(tmp_path):
    from megatrain.train_config import TrainConfig

    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    assert TrainConfig(model=str(model)).optim_config().warmup_start == "zero"
    assert TrainConfig().optim_config().warmup_start == "first"
    assert TrainConfig(model=str(model), warmup_start="first").optim_config().warmup_start == "first"
    with pytest.raises(ValueError, match="warmup_start must be 'first' or 'zero'"):
        megatrain.OptimConfig(warmup_start="one")


USES = [None]  # the steps in which each SometimesBlock's extra projections run (set before each step's forwards)


class SometimesBlock(nn.Module):
    """A TinyGPT block with two projections that run only in some steps (``USES``): in the others autograd gives
    them no gradient."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.inner = Block(d, heads)
        self.extra_a, self.extra_b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = self.inner(x)
        a, b = USES[0]
        if a:
            x = x + self.extra_a(x)
        if b:
            x = x + self.extra_b(x)
        return x


def _sometimes_gpt():
    torch.manual_seed(0)
    model = TinyGPT(tied=False)
    model.blocks = nn.ModuleList(SometimesBlock(48, 4) for _ in range(3))
    for p in model.blocks.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.07)
    return model


NO_GRAD_PLANS = {  # (plan, megatrain's host kernel, the streaming executor on a fake CUDA)
    "host": (dict(gpu_opt_every=0), False, False),
    "host-native": (dict(gpu_opt_every=0), True, False),
    "device": (dict(gpu_opt_every=1), False, False),
    "device-native": (dict(gpu_opt_every=1), True, False),
    "split": (dict(gpu_opt_every=0, split_opt=3, opt_part=700, grad_kept=0), True, True),
    "kept-and-split": (dict(gpu_opt_every=0, split_opt=2, opt_part=700, grad_kept=2), True, True),
    "speculate": (dict(gpu_opt_every=0, speculate=3), True, True),
}


@pytest.mark.parametrize("plan", sorted(NO_GRAD_PLANS))
def test_a_parameter_without_a_gradient_in_a_step_is_left_alone_as_in_pytorch(tmp_path, plan):
    """torch.optim.AdamW skips a parameter whose .grad is None: no update, no weight decay, its step count stays
    (Adam's bias correction then counts the steps it had a gradient in). Projections that run in some steps only:
    extra_a in steps 0 and 3, extra_b in steps 1 and 3 (none in step 0: its first update is in step 1 with a count
    of 1; in the reference, when it had one gradient). Host updates and device updates (the device is the CPU),
    torch's kernel and megatrain's, split updates in parts (their moments deferred by the streaming executor),
    updates made before the global norm; the state saved after step 2 and loaded into a new model keeps the counts
    behind (the last step then updates both)."""
    kw, fused, streams = NO_GRAD_PLANS[plan]
    if fused and not cpu_adamw.available():
        pytest.skip("no C compiler to build the host kernel")
    uses = [(True, False), (False, True), (False, False), (True, True)]
    opt = dataclasses.replace(OPT, fused=fused, host_kernel="native" if fused else "auto", total_steps=4)
    model = _sometimes_gpt()
    ref = copy.deepcopy(model)
    data = batches(n_steps=4)

    def set_uses(step, mb):
        USES[0] = uses[step]

    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, hf=False, opt_cfg=opt, before_mb=set_uses)

    def streamed():
        sm = compile_cpu(copy.deepcopy(model), optim=opt, n_mb=3, **kw)
        if streams:
            sm.executor = StreamExecutor(sm.captured, sm.store, sm.optimizer, torch.device("cpu"), sm.compute_dtype,
                                         runner=sm.executor.runner, cuda=FakeCuda())
            sm.overlap_steps = True
        return sm

    sm, stats = streamed(), []
    for step, b in enumerate(data[:3]):
        USES[0] = uses[step]
        stats.append(sm.train_step(*b))
    sm.wait()  # (the streaming executor's last updates)
    behind = sm.optimizer.parameter_steps()
    assert behind == {f"blocks.{i}.extra_{k}.{p}": n for i in range(3) for k, n in (("a", 1), ("b", 1))
                      for p in ("weight", "bias")}, behind
    sm.save_state(tmp_path / "state")
    sm = streamed()
    sm.load_state(tmp_path / "state")
    assert sm.optimizer.parameter_steps() == behind
    USES[0] = uses[3]
    stats.append(sm.train_step(*data[3]))
    sm.wait()
    # (the k part of qkv.bias: an analytically zero gradient, see test_family_matches_plain_pytorch)
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms,
          skip=lambda name: name.endswith("qkv.bias"))
    assert sm.optimizer.parameter_steps() == {n: 2 for n in behind}  # (torch's counts: 2 steps with a gradient)
    assert {sm.optimizer.steps(l) for l in sm.store.owners()} == {4}
