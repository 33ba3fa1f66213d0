"""Checkpoints the forward drops and the backward makes again (ScheduleConfig.dropped_checkpoints, REFWD): the
same training bit for bit as keeping them (fp32, CPU), with and without host checkpoints and dropout; the schedule
and what the verifier refuses."""

import dataclasses

import pytest
import torch

from megatrain.ir import OpKind
from megatrain.planner.checks import check_dropped
from megatrain.planner.passes import build_schedule
from megatrain.planner.verify import ScheduleError, verify

from .models import compile_cpu, hf_model, with_dropout
from .test_parity import OPT, batches


def _train(model, data, n_mb=2, **plan):
    sm = compile_cpu(model, optim=OPT, n_mb=n_mb, weight_slots=2, **plan)
    losses = [sm.train_step(*b).loss for b in data]
    return sm, losses, sm.state_dict()


@pytest.mark.parametrize("family,host,dropout,n,dropped,mb", [("llama", 0, False, 2, [2, 4], 2),
                                                               ("qwen2", 3, False, 2, [2, 4], 2),
                                                               ("gpt2", 2, True, 2, [2, 4], 2),
                                                               ("llama", 4, False, 3, [2, 3, 4], 2),
                                                               ("gpt2", 1, True, 3, [2, 3, 4], 2),
                                                               ("qwen2", 0, False, 2, [2, 4], 1),
                                                               ("llama", 2, False, 3, [2, 3, 4], 1)])
def test_dropped_checkpoints_train_bit_for_bit_as_kept_ones(family, host, dropout, n, dropped, mb):
    """Three steps with clipping, ``mb`` micro-batches: every checkpoint kept against ``n`` of them dropped and made
    again: every other one (blocks 2 and 4; the embedding's output is layer 1's, kept), or a run of three where
    that is not enough (2, 3 and 4 made again from 1; the top block's, layer 5's, is kept: ``droppable``); losses,
    weights equal exactly; each dropped checkpoint's REFWD (of the layer below it) ran once per micro-batch and
    step. One micro-batch: a checkpoint made again where its slot still holds it (the executor's slot check)."""
    data = batches(n_steps=3)
    extra = with_dropout(family, 0.1) if dropout else {}
    make = lambda: hf_model(family, num_hidden_layers=4, **extra)  # noqa: E731
    _, l0, w0 = _train(make(), data, mb, host_checkpoints=host, dropped_checkpoints=0)
    sm, l1, w1 = _train(make(), data, mb, host_checkpoints=host, dropped_checkpoints=n)
    cfg = sm.schedule_for(*data[0][0].shape).config
    assert cfg.dropped_checkpoints == n and [l for l in range(cfg.n_layers) if cfg.dropped(l)] == dropped
    s = sm.schedule_for(*data[0][0].shape)
    remade = [(op.layer, op.mb) for op in s.ops if op.kind is OpKind.REFWD]
    assert sorted(remade) == sorted((l - 1, j) for l in dropped for j in range(mb))
    assert not [op for op in s.ops if op.kind in (OpKind.SAVE_ACT, OpKind.LOAD_ACT) and cfg.dropped(op.layer)]
    assert l1 == l0
    assert w1.keys() == w0.keys()
    for n in w0:
        assert torch.equal(w1[n], w0[n]), n


def test_the_verifier_refuses_a_backward_before_its_checkpoint_is_made_again():
    """Removing a REFWD, or moving it behind the BWD that reads what it makes, breaks a named rule; so does a
    REFWD under a kept checkpoint, and a count beyond the checkpoints there are."""
    data = batches(n_steps=1)
    sm = compile_cpu(hf_model("llama", num_hidden_layers=4), optim=OPT, n_mb=2, dropped_checkpoints=2)
    s, graph = sm.schedule_for(*data[0][0].shape), sm.graph
    verify(s, graph, sm.hardware)
    refwd = next(op for op in s.ops if op.kind is OpKind.REFWD)
    gone = s.with_ops([op for op in s.ops if op.id != refwd.id], "mutation: a REFWD removed")
    with pytest.raises(ScheduleError):
        verify(gone, graph, sm.hardware)
    bwd = next(op for op in s.ops if op.kind is OpKind.BWD and op.layer == refwd.layer + 1 and op.mb == refwd.mb)
    late = [op for op in s.ops if op.id != refwd.id]
    late.insert(late.index(bwd) + 1, refwd)
    with pytest.raises(ScheduleError):
        verify(s.with_ops(late, "mutation: a REFWD after the BWD it makes the checkpoint of"), graph, sm.hardware)
    kept = dataclasses.replace(s.config, dropped_checkpoints=1)  # layer 4's kept: its REFWD (layer 3's) has no place
    with pytest.raises(ScheduleError, match="keeps layer 4's checkpoint"):
        verify(dataclasses.replace(s, config=kept), graph, sm.hardware)
    with pytest.raises(ValueError, match="dropped_checkpoints must be an integer in 0..3"):
        check_dropped(graph, dataclasses.replace(s.config, dropped_checkpoints=4))
    with pytest.raises(ValueError, match="cannot be dropped"):
        build_schedule(graph, dataclasses.replace(s.config, saved_acts=(4,)))


def test_blocks_that_hand_the_next_more_than_their_output_keep_their_checkpoints():
    """A block that stores items for later ones (GLM-MoE-DSA's top-k indices, Gemma 3n's shared keys and values:
    Layer.carry_bytes_per_token) would store them again in a REFWD: the check refuses a count, and the search's
    round of dropped checkpoints has nothing to try."""
    from megatrain.ir import LayerGraph, ScheduleConfig
    from megatrain.planner.choices import drop_choices
    from megatrain.planner.graph import preset

    g = preset("qwen2.5-7b")
    assert drop_choices(g) == [3, 7, 10, 14, 18, 21]
    layers = list(g.layers)
    layers[5] = dataclasses.replace(layers[5], carry_bytes_per_token=8)
    carrying = LayerGraph(layers, name="carrying")
    assert drop_choices(carrying) == []
    with pytest.raises(ValueError, match="hand the next more than their output"):
        check_dropped(carrying, ScheduleConfig(n_layers=len(carrying), dropped_checkpoints=1))
    check_dropped(carrying, ScheduleConfig(n_layers=len(carrying)))


def test_qwen_7b_at_524k_tokens_fits_an_h100_with_runs_of_checkpoints_dropped():
    """The H100's 74.35 GiB and 125 GiB host hold one 524,288-token sequence of the Qwen2.5-7B shape with fp32 host
    gradients only where more than every other checkpoint is dropped (docs/planner.md, "Checkpoints dropped");
    with every other one at most, nothing fits."""
    from megatrain.planner.graph import preset
    from megatrain.planner.hardware import PRESETS
    from megatrain.planner.search import PlanError, plan

    g, spec = preset("qwen2.5-7b"), PRESETS["h100"]
    fixed = dict(n_mb=1, weight_slots=2, wire_bytes=4, gpu_opt_every=0, resident_opt=0, seq_tile=4096,
                 grad_host_dtype="fp32")
    cfg = plan(g, spec, 524288, 524288, **fixed).schedule.config
    assert cfg.dropped_checkpoints > 14 and cfg.drop_run() > 1
    with pytest.raises(PlanError, match="no plan fits"):
        plan(g, spec, 524288, 524288, dropped_checkpoints=14, **fixed)


def test_the_top_blocks_checkpoint_is_never_dropped():
    """The top block's checkpoint (layer L-2's input), which the first backward reads right after the loss, is
    kept at every count and run length; the others of 1..L-3 each dropped at the largest count."""
    from megatrain.ir import ScheduleConfig
    from megatrain.ir.schedule import MAX_DROP_RUN, droppable, max_dropped

    for n_layers in (4, 7, 31):
        for run in range(1, MAX_DROP_RUN + 1):
            for n in range(max_dropped(droppable(n_layers), run) + 1):
                cfg = ScheduleConfig(n_layers=n_layers, dropped_checkpoints=n)
                assert sum(map(cfg.dropped, range(n_layers))) == n and not cfg.dropped(n_layers - 2)
        most = ScheduleConfig(n_layers=n_layers, dropped_checkpoints=max_dropped(droppable(n_layers), MAX_DROP_RUN))
        assert [l for l in range(n_layers) if most.dropped(l)] == \
            [l for l in range(2, n_layers - 2) if (l - 1) % (MAX_DROP_RUN + 1)]
