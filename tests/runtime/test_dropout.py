"""Dropout trains exactly: a recomputed forward draws what its first forward drew (fp32, CPU).

The reference is the untouched model trained by plain PyTorch (tests/runtime/test_parity.py), with forward
pre-hooks that seed torch's generators at each layer boundary by megatrain's rule (runtime/layers/rng.py: one draw
per step from the default generator, then a seed per layer and micro-batch). Forward, backward, clipping and AdamW are all
plain PyTorch; the hooks only decide which masks each layer draws, and megatrain must then produce the same loss and
the same gradients whether its backward recomputes the forward or keeps its activations.
"""

import copy

import pytest
import torch

from megatrain.runtime.layers import rng

from .models import compile_cpu, hf_model, with_dropout
from .test_parity import OPT, batches, check, reference_train


class LayerSeeds:
    """Seeds a plain model's layers as megatrain seeds the layers it cut the model into: the embedding layer when
    the model's forward starts, block i before block i, the norm layer after the last block, the head before the
    output embedding. ``before_mb`` (for reference_train) draws the step's seed at a step's first micro-batch and
    puts the generators back where that draw left them, as a streamed step does."""

    def __init__(self, model, streamed, device=torch.device("cpu")):
        segs = streamed.captured.segments
        self.device = torch.device(device)
        self.step, self.mb, self.after_draw, self.hooks = None, 0, None, []
        hook = self.hooks.append
        hook(model.register_forward_pre_hook(lambda *_: self._seed(0)))
        blocks = [s for s in segs if s.kind == "block"]
        for seg in blocks:
            hook(model.get_submodule(seg.name).register_forward_pre_hook(lambda *_, i=seg.index: self._seed(i)))
        norm = next((s.index for s in segs if s.kind == "norm"), None)
        if norm is not None:
            hook(model.get_submodule(blocks[-1].name).register_forward_hook(lambda *_: self._seed(norm)))
        head = segs[-1].index
        hook(model.get_output_embeddings().register_forward_pre_hook(lambda *_: self._seed(head)))

    def before_mb(self, step: int, mb: int) -> None:
        if step != self.step:
            if self.after_draw is not None:
                torch.set_rng_state(self.after_draw)
            self.step, self.step_seed = step, rng.draw_step_seed()
            self.after_draw = torch.get_rng_state()
        self.mb = mb

    def _seed(self, layer: int) -> None:
        rng.seed_generators(rng.layer_seed(self.step_seed, layer, self.mb), self.device)


def train_both(family, saved_acts, n_steps=3, **kw):
    """(streamed model, its step stats, the reference model, its losses and norms), both from seed 0."""
    model = hf_model(family, **with_dropout(family, 0.1), **kw)
    assert model.training
    ref = copy.deepcopy(model)
    data = batches(n_steps=n_steps)
    sm = compile_cpu(model, optim=OPT, n_mb=3, saved_acts=saved_acts)
    seeds = LayerSeeds(ref, sm)
    torch.manual_seed(1234)
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, before_mb=seeds.before_mb)
    torch.manual_seed(1234)
    stats = [sm.train_step(*b) for b in data]
    return sm, stats, ref, ref_losses, ref_norms


@pytest.mark.parametrize("family", ["opt", "phi", "gpt2"])
@pytest.mark.parametrize("saved_acts", [0, 3])
def test_dropout_trains_as_plain_pytorch_with_the_same_masks(family, saved_acts):
    """OPT (untied) and Phi over 3 steps; GPT-2 (head tied to the embedding) over one: the streamed run sums the tied
    gradient's two parts in another order than autograd (an ulp apart), and the analytically zero gradient of the
    k-projection's bias turns that ulp into an lr-sized AdamW step after the first."""
    tied = family == "gpt2"
    sm, stats, ref, ref_losses, ref_norms = train_both(family, saved_acts, n_steps=1 if tied else 3,
                                                       tie_word_embeddings=tied)
    assert bool(sm.captured.tied_names) == tied
    assert sm.schedule_for(6, 12).config.saved_acts == tuple(range(1, 4))[:saved_acts]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def test_without_the_same_masks_the_reference_differs():
    """The check above can fail: a reference that draws its own masks (no seeding hooks) ends elsewhere."""
    model = hf_model("opt", **with_dropout("opt", 0.1))
    ref = copy.deepcopy(model)
    data = batches(n_steps=1)
    torch.manual_seed(1234)
    ref_losses, _ = reference_train(ref, data, n_mb=3)
    torch.manual_seed(1234)
    sm = compile_cpu(model, optim=OPT, n_mb=3)
    assert abs(sm.train_step(*data[0]).loss - ref_losses[0]) > 1e-4 * ref_losses[0]


def test_recomputed_and_saved_layers_draw_the_same_and_each_step_takes_one_number():
    """Bit for bit the same training whether the backward recomputes or keeps the forward's activations; each
    step takes one number from the default generator and measuring saved bytes takes none."""
    data = batches(n_steps=2)
    runs = []
    for saved in (0, 3):
        sm = compile_cpu(hf_model("opt", **with_dropout("opt", 0.1), tie_word_embeddings=False), optim=OPT, n_mb=3,
                         saved_acts=saved)
        torch.manual_seed(7)
        losses = []
        for b in data:
            before = torch.get_rng_state()
            losses.append(sm.train_step(*b).loss)
            after = torch.get_rng_state()
            torch.set_rng_state(before)
            rng.draw_step_seed()
            assert torch.equal(torch.get_rng_state(), after)
        runs.append((losses, {n: t.clone() for n, t in sm.state_dict().items()}))
    (l0, w0), (l3, w3) = runs
    assert l0 == l3 and all(torch.equal(w0[n], w3[n]) for n in w0)
    sm = compile_cpu(hf_model("opt", **with_dropout("opt", 0.1)), optim=OPT, n_mb=3, saved_acts="auto")
    before = torch.get_rng_state()
    sm.planning_graph(12)  # runs the embedding and a block on random tokens
    assert torch.equal(torch.get_rng_state(), before)
