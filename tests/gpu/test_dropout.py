"""Dropout on the GPU: streamed (streaming executor, bf16) vs the same model resident on the GPU with the same
masks (seeded per layer and micro-batch as megatrain seeds them), and recomputed vs saved layers bit for bit."""

import copy

import pytest
import torch

import megatrain

from ..runtime.models import hf_model, with_dropout
from ..runtime.test_dropout import LayerSeeds
from ..runtime.test_parity import batches as make_batches
from .test_gpu_parity import LR, N_MB, STEPS, resident_reference

pytestmark = pytest.mark.gpu


def model(family):
    """Dropout 0.1 everywhere but GPT-2's embedding: the resident reference runs under autocast, which leaves the
    embedding sum in fp32, and CUDA's dropout draws other masks for an fp32 tensor than for a bf16 one (18% of the
    elements differ, measured on the H200), so there the two runs cannot draw the same masks."""
    return hf_model(family, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False,
                    **{**with_dropout(family, 0.1), **({"embd_pdrop": 0.0} if family == "gpt2" else {})})


def streamed(m, data, saved_acts):
    opt = megatrain.OptimConfig(lr=LR, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
    sm = megatrain.compile(m, device="cuda", optim=opt, n_mb=N_MB, weight_slots=2, saved_acts=saved_acts)
    assert type(sm.executor).__name__ == "StreamExecutor"
    torch.manual_seed(99)
    losses = [sm.train_step(*b).loss for b in data]
    return sm, losses, {n: t.clone() for n, t in sm.state_dict().items()}


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_dropout_streamed_on_cuda_matches_resident_training_with_the_same_masks(family):
    base = model(family)
    assert base.training
    data = make_batches(n_steps=STEPS, B=8, T=256, vocab=4096)
    sm, losses, got = streamed(copy.deepcopy(base), data, saved_acts=0)
    _, saved_losses, saved = streamed(copy.deepcopy(base), data, saved_acts="auto")
    assert sm.schedule_for(8, 256, saved_acts="auto").config.saved_acts  # some layers did keep activations
    # a saved layer draws what a recomputed one draws: the same training, bit for bit
    assert saved_losses == losses and all(torch.equal(saved[n], got[n]) for n in got)
    runs = {}
    for name, seed in (("same masks", 99), ("other masks", 7)):  # the second: a control that other masks fail
        ref_model = copy.deepcopy(base).cuda()
        seeds = LayerSeeds(ref_model, sm, device="cuda")
        torch.manual_seed(seed)
        ref_losses, ref = resident_reference(ref_model, data, before_mb=seeds.before_mb)
        # how far the weight matrices moved apart, as a fraction of what AdamW can move an element in these steps
        drift = max(float((got[n] - p).abs().mean()) / (LR * STEPS) for n, p in ref.items() if p.dim() == 2)
        runs[name] = (ref_losses, ref, drift)
    print(f"{family}: drift with the same masks {runs['same masks'][2]:.3f}, other masks {runs['other masks'][2]:.3f}")
    ref_losses, ref, drift = runs["same masks"]
    # the bounds of test_gpu_parity: bf16 rounding apart. An element can move by at most about lr a step whatever
    # its gradient; on average the same masks keep the weight matrices within a small part of that (the 100M test
    # bounds it by 0.1; measured here: OPT 0.05 with the same masks, 0.59 with others), other masks do not.
    # Biases are left out of the mean: they hold entries whose gradient is analytically zero (the k projection's:
    # softmax ignores a shift shared by all keys), which AdamW moves by about lr a step in the direction of each
    # run's own rounding noise (seen: 0.39 on OPT's k_proj.bias after 3 steps)
    assert losses == pytest.approx(ref_losses, rel=5e-3)
    for n, p in ref.items():
        assert float((got[n] - p).abs().max()) <= 2 * LR * STEPS + 1e-6, n
    assert drift <= 0.15
    assert runs["other masks"][2] > 2 * drift
