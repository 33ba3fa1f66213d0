"""Weight gradients written by the linears' backward straight into the fp32 gradient slot (grad_sink.py).

Against autograd's gradients of the same ``nn.Linear`` computation: outside a sink a SinkLinear is an ordinary
linear; inside one its weight and bias gradients land at their offsets, written by the first contribution and
added by later ones (the same linear called twice in one backward, or a later micro-batch), and autograd returns
none for them. The executor takes that path for every linear of the templates.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatrain.runtime.layers import grad_sink
from megatrain.runtime.layers.grad_sink import GradSink, SinkLinear, sink_to

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches


def _sink_linear(bias: bool, seed: int = 0) -> SinkLinear:
    torch.manual_seed(seed)
    parent = nn.Sequential(nn.Linear(6, 5, bias=bias))
    assert grad_sink.install(parent) == 1 and type(parent[0]) is SinkLinear
    return parent[0]


@pytest.mark.parametrize("bias", [True, False])
def test_outside_a_sink_gradients_are_those_of_nn_linear(bias):
    lin = _sink_linear(bias)
    lin.offsets = (0, 30)  # bound for a backward, but no sink in effect
    x = torch.randn(2, 3, 6, requires_grad=True)
    dy = torch.randn(2, 3, 5)
    got = torch.autograd.grad(lin(x), [x, *lin.parameters()], dy)
    want = torch.autograd.grad(F.linear(x, lin.weight, lin.bias), [x, *lin.parameters()], dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _slot_after(calls, accumulate: bool, start: torch.Tensor):
    """The (36,) fp32 slot after backward passes of ``calls`` (each a list of inputs passed through the linear,
    summed) with the weight at offset 0 and the bias at offset 30."""
    lin = _sink_linear(True)
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    lin._parameters.update(weight=w, bias=b)
    g = start.clone()
    returned = []
    for xs, dy in calls:
        lin.offsets = (0, 30)
        out = sum(lin(x) for x in xs)
        sink = GradSink(g, accumulate=accumulate)
        with sink_to(sink):
            returned.append(torch.autograd.grad(out, [w, b], dy, allow_unused=True))
        assert sink.written == {0, 30}
        accumulate = True
    return lin, g, returned


def test_inside_a_sink_the_gradients_land_in_the_slot():
    torch.manual_seed(1)
    xs = [torch.randn(4, 6) for _ in range(3)]
    dys = [torch.randn(4, 5) for _ in range(2)]
    start = torch.full((36,), 7.0)
    # one backward with the linear called twice, then a second micro-batch added
    lin, g, returned = _slot_after([(xs[:2], dys[0]), (xs[2:], dys[1])], accumulate=False, start=start)
    assert all(r == (None, None) for r in returned)  # autograd returns nothing for them
    ref_w = dys[0].t() @ (xs[0] + xs[1]) + dys[1].t() @ xs[2]
    ref_b = 2 * dys[0].sum(0) + dys[1].sum(0)
    torch.testing.assert_close(g[:30].view(5, 6), ref_w)
    torch.testing.assert_close(g[30:35], ref_b)
    assert g[35] == 7.0  # outside both spans: untouched
    # a slot that already holds gradients is added to
    _, g2, _ = _slot_after([(xs[:1], dys[0])], accumulate=True, start=start)
    torch.testing.assert_close(g2[:30].view(5, 6), 7.0 + dys[0].t() @ xs[0])
    torch.testing.assert_close(g2[30:35], 7.0 + dys[0].sum(0))


def test_sinks_do_not_nest():
    g = torch.zeros(4)
    with sink_to(GradSink(g, False)):
        with pytest.raises(RuntimeError, match="already in effect"):
            with sink_to(GradSink(g, False)):
                pass


def test_put_writes_adds_and_clears_what_autograd_returns():
    g = torch.full((6,), 5.0)
    sink = GradSink(g, accumulate=False)
    sink.put(0, 2, torch.tensor([1.0, 2.0]))
    sink.put(0, 2, torch.tensor([1.0, 1.0]))  # the same span again: added
    sink.put(2, 2, None)  # not used by the output: cleared
    torch.testing.assert_close(g, torch.tensor([2.0, 3.0, 0.0, 0.0, 5.0, 5.0]))
    GradSink(g, accumulate=True).put(2, 2, None)  # a later micro-batch: left as it is
    assert g[2:4].eq(0).all()


def test_bf16_on_the_cpu_matches_the_fp32_product():
    torch.manual_seed(2)
    a, b = torch.randn(5, 64), torch.randn(64, 6)
    g = torch.zeros(30)
    sink = GradSink(g, accumulate=False)
    sink.matmul(0, a.bfloat16(), b.bfloat16())
    torch.testing.assert_close(g.view(5, 6), a.bfloat16().float() @ b.bfloat16().float(), rtol=2e-2, atol=2e-2)


def test_the_executor_sends_every_template_linear_to_the_sink(monkeypatch):
    """Each backward of a block writes its seven linears' weights and its three biases through the sink, and the
    training still matches plain PyTorch (tests/runtime/test_parity.py compares it step by step)."""
    calls = []
    matmul, sum_rows = GradSink.matmul, GradSink.sum_rows
    monkeypatch.setattr(GradSink, "matmul", lambda self, off, a, b: (calls.append("w"), matmul(self, off, a, b)))
    monkeypatch.setattr(GradSink, "sum_rows", lambda self, off, t: (calls.append("b"), sum_rows(self, off, t)))
    sm = compile_cpu(hf_model("qwen2"), optim=OPT, n_mb=2)
    sm.train_step(*batches(n_steps=1)[0])
    blocks, head = 3, 1  # the tiny qwen2: three blocks and an untied head (a linear, no fused loss on the CPU)
    n_mb = 2
    assert calls.count("w") == n_mb * (7 * blocks + head)
    assert calls.count("b") == n_mb * 3 * blocks  # q, k, v biases
