"""The search's shortcuts against trying every candidate in full: pruning by the compute floor (a candidate whose
floor under its step's compute is above the k-th best step so far is not built) never changes the plan, and the
floor is never above a simulated step, nor the device memory the search refuses by before building above what a
schedule takes; on random layer graphs."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.planner.cost import device_memory, gemm_workspace_nbytes
from megatrain.planner.hardware import PRESETS
from megatrain.planner.limits import min_device_nbytes
from megatrain.planner.passes import build_schedule
from megatrain.planner.search import PlanError, plan
from megatrain.planner.simulate import compute_floor, simulate
from tests.planner.test_properties import graphs

SPEC = PRESETS["h200"]


@settings(max_examples=4, deadline=None)  # each example searches every candidate twice: about 2 s
@given(graph=graphs(max_layers=7), seqs=st.integers(1, 8), seq=st.sampled_from([256, 1024, 4096]),
       budget_mib=st.integers(200, 4000), split=st.sampled_from([0, "auto"]), dtype=st.sampled_from(["fp32", "bf16"]))
def test_pruning_never_drops_the_plan_and_the_floor_is_below_every_step(graph, seqs, seq, budget_mib, split, dtype):
    kw = dict(tokens=seqs * seq, seq_len=seq, budget_bytes=budget_mib << 20, gpu_opt_every=None, wire_bytes=None,
              split_opt=split, grad_host_dtype=dtype, order="exhaustive")
    try:
        full = plan(graph, SPEC, prune=False, **kw)
    except PlanError as e:
        try:
            plan(graph, SPEC, prune=True, **kw)
        except PlanError as pruned:
            assert str(pruned) == str(e)
            return
        raise AssertionError("pruned, a plan was found where none fits")
    pruned = plan(graph, SPEC, prune=True, **kw)
    assert pruned.schedule.to_text() == full.schedule.to_text()
    assert len(pruned.tried) == len(full.tried)
    ran = [c for c, why in full.tried if why.endswith(" s/step)") or why.endswith(" s/step")][:6]
    for cfg in ran:
        steady = simulate(build_schedule(graph, cfg), graph, SPEC, curve=False).steady_step_s
        spare = cfg.budget_bytes - min_device_nbytes(graph, dataclasses.replace(
            cfg, gemm_workspace_bytes=gemm_workspace_nbytes(SPEC)))
        assert compute_floor(graph, cfg, SPEC, spare) <= steady * (1 + 1e-9)
        # the device memory the search refuses by before building is never above what the schedule takes
        assert min_device_nbytes(graph, cfg) <= device_memory(graph, build_schedule(graph, cfg)).total_nbytes


@settings(max_examples=6, deadline=None)  # each example builds every candidate: about half a second
@given(graph=graphs(max_layers=7), seqs=st.integers(1, 8), seq=st.sampled_from([256, 1024, 4096]))
def test_the_device_floor_is_below_every_candidates_schedule(graph, seqs, seq):
    """min_device_nbytes against the built schedule of every candidate (budget unbounded, so none is refused),
    slots for every layer and device checkpoints included: the search refuses by it before building."""
    from megatrain.planner.choices import candidates

    for cfg in candidates(graph, seqs * seq, seq, 1 << 50, clip=True, n_steps=1, gpu_opt_every=None,
                          wire_bytes=None):
        cfg = dataclasses.replace(cfg, gemm_workspace_bytes=gemm_workspace_nbytes(SPEC))
        assert min_device_nbytes(graph, cfg) <= device_memory(graph, build_schedule(graph, cfg)).total_nbytes, cfg
