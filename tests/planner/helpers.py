"""Graphs and schedules the planner tests share."""

from megatrain.ir import Op, Schedule, ScheduleConfig
from megatrain.planner.graph import from_config

GiB = 1 << 30

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, tie_word_embeddings=True)


def tiny_graph(**kw):
    return from_config({**TINY, **kw}, name="tiny")


def config(graph, **kw) -> ScheduleConfig:
    base = dict(n_layers=len(graph), n_steps=1, n_mb=2, mb_tokens=64, seq_len=32, weight_slots=2, grad_slots=2,
                wire_bytes_per_param=2, host_checkpoints=0, clip=True, budget_bytes=GiB)
    base.update(kw)
    return ScheduleConfig(**base)


def renumber(schedule: Schedule, ops: list[Op]) -> Schedule:
    """``ops`` (old ids, any order) renumbered to positions; dependencies on removed ops are dropped."""
    new = {op.id: i for i, op in enumerate(ops)}
    out = [Op(i, op.kind, op.stream, op.step, op.layer, op.mb, op.slots,
              tuple(sorted(new[d] for d in op.deps if d in new))) for i, op in enumerate(ops)]
    return Schedule(tuple(out), schedule.config, schedule.provenance)
