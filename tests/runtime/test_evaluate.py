"""An evaluation runs each layer's forward and the loss with dropout off, updates nothing, and gives the loss
plain PyTorch gives the model in eval mode (fp32, CPU)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from .models import compile_cpu, hf_model, with_dropout
from .test_parity import OPT, batches


def _reference_loss(model, ids, mask, labels):
    model = copy.deepcopy(model).eval()
    nxt = torch.full_like(labels, -100)
    nxt[:, :-1] = labels[:, 1:]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), nxt.reshape(-1), ignore_index=-100))


@pytest.mark.parametrize("plan", [dict(n_mb=3, weight_slots=2), dict(n_mb=1, weight_slots="all", gpu_opt_every=1)])
def test_evaluation_equals_plain_pytorch_and_changes_nothing(plan):
    model = hf_model("opt", **with_dropout("opt", 0.1), tie_word_embeddings=False)
    data = batches(n_steps=3)
    sm = compile_cpu(copy.deepcopy(model), optim=OPT, **plan)
    sm.train_step(*data[0])
    trained = {n: t.clone() for n, t in sm.state_dict().items()}
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(trained[n])
    ids, mask, labels = data[1]
    rng = torch.get_rng_state()
    ev = sm.evaluate(ids, mask, labels)
    assert ev.loss == pytest.approx(_reference_loss(plain, ids, mask, labels), rel=1e-6)
    assert sm.evaluate(ids, mask, labels).loss == ev.loss  # no dropout: the same loss again
    assert torch.equal(torch.get_rng_state(), rng)  # no random number taken
    assert all(torch.equal(t, trained[n]) for n, t in sm.state_dict().items()) and sm.step == 1
    assert sm.captured.segments[1].template.training  # training mode back for the steps
    # training goes on as if no evaluation had happened
    ref = compile_cpu(copy.deepcopy(model), optim=OPT, **plan)
    torch.manual_seed(3)
    ref_losses = [ref.train_step(*b).loss for b in data]
    sm2 = compile_cpu(copy.deepcopy(model), optim=OPT, **plan)
    torch.manual_seed(3)
    losses = []
    for b in data:
        losses.append(sm2.train_step(*b).loss)
        sm2.evaluate(*data[2])
    assert losses == ref_losses
