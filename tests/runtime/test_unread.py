"""A recomputing backward skips the product nothing reads (grad_sink.outputs_unread).

A Llama/Qwen-style block ends with ``residual + mlp(...)`` and returns that sum; in a backward that recomputes the
block's forward, the MLP's down projection is needed for its input and weights only, so its GEMM (a third of the
MLP's forward) is left out. These tests check that it is left out where the block has that form and a probe on the
device agrees, that training is bit for bit what it is with the full recompute, that a linear whose output a
gradient does read is refused by the probe, and that the planner counts the skip for those blocks alone.
"""


import pytest
import torch

from megatrain.ir import Op, OpKind, Stream
from megatrain.planner import cost
from megatrain.planner.graph import from_config, preset
from megatrain.runtime.layers import grad_sink, probe

from .models import compile_cpu, hf_model
from .test_parity import OPT, batches


def _skips(monkeypatch) -> list:
    """Counts the products skipped from now on (one entry per skipped call)."""
    calls: list = []
    forward = grad_sink._UnreadLinearFunction.forward

    def counting(ctx, *args):
        calls.append(args[0].shape)
        return forward(ctx, *args)

    monkeypatch.setattr(grad_sink._UnreadLinearFunction, "forward", staticmethod(counting))
    return calls


def _train(family: str, skip: bool, calls: list, n_mb: int = 2):
    model = hf_model(family, seed=3)
    sm = compile_cpu(model, optim=OPT, n_mb=n_mb)
    assert len(calls) == 1  # the executor's probe, once for the model's one block template
    calls.clear()
    if not skip:
        for i in range(len(sm.graph)):
            sm.executor.runner.mark_unread(i, False)
    losses = [sm.train_step(*b).loss for b in batches(n_steps=3)]
    return sm, losses, {k: v.clone() for k, v in sm.state_dict().items()}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_recompute_skips_the_down_projection_and_training_is_bit_for_bit_the_same(family, monkeypatch):
    calls = _skips(monkeypatch)
    sm, losses, weights = _train(family, skip=True, calls=calls)
    blocks = [i for i, lay in enumerate(sm.graph.layers) if lay.kind == "block"]
    assert all(sm.graph[i].unread_flops_per_token > 0 for i in blocks)
    assert len(calls) == 3 * 2 * len(blocks)  # every block's backward, every micro-batch, every step
    calls.clear()
    _, full_losses, full_weights = _train(family, skip=False, calls=calls)
    assert calls == []  # unmarked: none skipped
    assert losses == full_losses
    assert weights.keys() == full_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], full_weights[k]), k


def test_a_block_whose_mlp_output_a_norm_reads_skips_nothing(monkeypatch):
    # Gemma 2 normalizes the MLP's output before the residual sum: its down projection's product is read
    calls = _skips(monkeypatch)
    sm = compile_cpu(hf_model("gemma2", seed=3), optim=OPT, n_mb=2)
    assert not any(lay.unread_flops_per_token for lay in sm.graph.layers)
    assert not any(sm.executor.runner.unread(i) for i in range(len(sm.graph)))
    sm.train_step(*batches(n_steps=1)[0])
    assert calls == []


def test_the_probe_refuses_a_linear_whose_output_a_gradient_reads():
    sm = compile_cpu(hf_model("qwen2", seed=3), optim=OPT, n_mb=2)
    ex, runner = sm.executor, sm.executor.runner
    block = next(i for i, lay in enumerate(sm.graph.layers) if lay.kind == "block")
    template = sm.captured.segments[block].template
    down = runner.unread(block)[0]
    # the MLP's down projection (the template's MLP is wrapped for tiling by now), confirmed at the executor's start
    assert (down.in_features, down.out_features) == (96, 64) and down.unread
    assert probe.unread_outputs_hold(ex, block)
    # the attention's output projection feeds the post-attention norm: its product is read
    runner._unread[id(template)] = [template.self_attn.o_proj]
    try:
        assert not probe.unread_outputs_hold(ex, block)
        assert not template.self_attn.o_proj.unread  # the probe leaves the marks as they were
        # an executor that finds so warns and recomputes in full
        runner.unread_checked.clear()
        with pytest.warns(UserWarning, match="reads the output of"):
            ex._confirm_unread()
        assert not template.self_attn.o_proj.unread
    finally:
        runner._unread[id(template)] = [down]


def test_outside_a_recompute_a_marked_linear_computes_its_product():
    sm = compile_cpu(hf_model("qwen2", seed=3), optim=OPT, n_mb=2)
    block = next(i for i, lay in enumerate(sm.graph.layers) if lay.kind == "block")
    down = sm.executor.runner.unread(block)[0]
    x = torch.randn(2, 3, down.in_features)
    w = torch.randn(down.out_features, down.in_features)
    down._parameters["weight"] = w
    try:
        with torch.enable_grad():
            want = torch.nn.functional.linear(x, w)
            assert torch.equal(down(x), want)  # marked, but outputs_unread is not in effect
            with grad_sink.outputs_unread(fill=float("nan")):
                assert torch.isnan(down(x)).all()
            with torch.no_grad(), grad_sink.outputs_unread():
                assert torch.equal(down(x), want)  # a forward without autograd always forms it
    finally:
        down._parameters["weight"] = None


def test_the_planner_counts_the_skip_for_dense_llama_and_qwen_blocks_alone():
    from megatrain.ir import ScheduleConfig

    g = preset("qwen2.5-7b")
    block = next(i for i, lay in enumerate(g.layers) if lay.kind == "block")
    H, inter = 3584, 18944
    assert g[block].unread_flops_per_token == 2.0 * H * inter
    cfg = ScheduleConfig(n_layers=len(g), n_steps=1, n_mb=4, mb_tokens=8192, seq_len=1024)
    bwd = Op(0, OpKind.BWD, Stream.COMPUTE, 0, block, 0)
    fwd = Op(1, OpKind.FWD, Stream.COMPUTE, 0, block, 0)
    mm_bwd, _ = cost.matmul_and_attention_flops(g, cfg, bwd)
    mm_fwd, _ = cost.matmul_and_attention_flops(g, cfg, fwd)
    assert mm_bwd == pytest.approx(3 * mm_fwd - 2.0 * H * inter * 8192)
    # a layer whose activations are kept does not recompute: nothing to skip
    saved = ScheduleConfig(n_layers=len(g), n_steps=1, n_mb=4, mb_tokens=8192, seq_len=1024, saved_acts=(block,))
    assert cost.matmul_and_attention_flops(g, saved, bwd)[0] == pytest.approx(2 * mm_fwd)
    # Gemma 2 (a norm reads the MLP's output) and mixtures of experts (the router's gradient reads the experts')
    gemma = from_config({"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "head_dim": 16})
    assert not any(lay.unread_flops_per_token for lay in gemma.layers)
    assert not any(lay.unread_flops_per_token for lay in preset("qwen3-30b-a3b").layers)


def test_a_recompute_on_one_thread_skips_nothing_on_another():
    # two models' steps may run at once (data-parallel ranks on threads): one's recompute must not reach the other
    import threading

    lin = torch.nn.Sequential(torch.nn.Linear(4, 3))
    grad_sink.install(lin)
    lin[0].unread = True
    x = torch.randn(2, 4)
    inside, release = threading.Event(), threading.Event()

    def recompute():
        with grad_sink.outputs_unread(fill=float("nan")):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=recompute)
    t.start()
    try:
        assert inside.wait(10)
        with torch.enable_grad():
            assert torch.equal(lin(x), torch.nn.functional.linear(x, lin[0].weight, lin[0].bias))
    finally:
        release.set()
        t.join()
    with torch.enable_grad(), grad_sink.outputs_unread(fill=float("nan")):
        assert torch.isnan(lin(x)).all()
