"""Property tests over random layer graphs, batch shapes, slot counts and budgets."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.ir import OpKind, Schedule, ScheduleConfig
from megatrain.planner.cost import device_memory, host_memory
from megatrain.planner.graph import Layer, LayerGraph
from megatrain.planner.hardware import PRESETS
from megatrain.planner.passes import build_schedule, setup_schedule
from megatrain.planner.choices import device_update_sets, unsaved
from megatrain.planner.search import PlanError, plan, saved_act_layers, with_saved_acts
from megatrain.planner.critical import critical_path
from megatrain.planner.simulate import bound, simulate
from megatrain.planner.carried import carried_deps, join, unroll
from megatrain.planner.verify import ScheduleError, verify

SPEC = PRESETS["h200"]
MiB = 1 << 20


@st.composite
def graphs(draw, max_layers=64):
    n = draw(st.integers(2, max_layers))
    tied = draw(st.booleans())
    size = st.integers(1, 4_000_000)
    layers = [Layer(name="embed", kind="embedding", template="embedding", params=draw(size),
                    act_bytes_per_token=draw(st.integers(2, 8192)), work_bytes_per_token=draw(st.integers(0, 8192)))]
    for i in range(1, n - 1):  # uneven blocks, sometimes a norm
        kind = draw(st.sampled_from(["block", "block", "norm"]))
        layers.append(Layer(name=f"l{i}", kind=kind, template=kind, params=draw(size),
                            matmul_flops_per_token=draw(st.floats(0, 1e8)),
                            attn_flops_per_token_per_seq=draw(st.floats(0, 1e4)),
                            act_bytes_per_token=draw(st.integers(2, 8192)),
                            work_bytes_per_token=draw(st.integers(0, 65536)),
                            saved_bytes_per_token=(saved := draw(st.integers(0, 131072)) if kind == "block" else 0),
                            lean_saved_bytes_per_token=draw(st.integers(0, saved))))
    layers.append(Layer(name="head", kind="head", template="head", params=0 if tied else draw(size),
                        tie=0 if tied else None, matmul_flops_per_token=draw(st.floats(0, 1e8)),
                        work_bytes_per_token=draw(st.integers(0, 8192)),
                        logit_bytes_per_token=draw(st.integers(4, 40000))))
    return LayerGraph(layers)


@st.composite
def configs(draw, graph):
    seq = draw(st.sampled_from([16, 128, 1024]))
    eligible = [l for l in range(len(graph)) if graph[l].tie is None and not graph.tied_to(l)]
    gpu_opt = tuple(sorted(draw(st.sets(st.sampled_from(eligible)) if eligible else st.just(set()))))
    resident = tuple(sorted(draw(st.sets(st.sampled_from(gpu_opt))) if gpu_opt else ()))
    host_checkpoints = draw(st.integers(0, len(graph) - 2))
    savable = [l for l in range(host_checkpoints + 1, len(graph) - 1) if graph[l].saved_bytes_per_token]
    clip = draw(st.booleans())
    keepable = [l for l in eligible if l not in gpu_opt] if clip else []
    return ScheduleConfig(
        n_layers=len(graph), n_steps=draw(st.integers(1, 2)), n_mb=draw(st.integers(1, 5)),
        mb_tokens=seq * draw(st.integers(1, 4)), seq_len=seq, weight_slots=draw(st.integers(1, 4)),
        grad_slots=draw(st.integers(1, 3)), wire_bytes_per_param=draw(st.sampled_from([2, 4])),
        host_checkpoints=host_checkpoints, clip=clip,
        budget_bytes=draw(st.integers(64 * MiB, 4096 * MiB)), gpu_opt=gpu_opt,
        saved_acts=tuple(sorted(draw(st.sets(st.sampled_from(savable))) if savable else ())),
        resident_opt=tuple(draw(st.permutations(resident))),
        saved_lean=draw(st.booleans()),
        grad_kept=tuple(sorted(draw(st.sets(st.sampled_from(keepable))) if keepable else ())),
        grad_host_bytes=draw(st.sampled_from([2, 4])), host_grad_slots=draw(st.integers(1, 3)),
    )


@given(st.data())
def test_every_schedule_verifies_fits_and_respects_the_bound(data):
    graph = data.draw(graphs())
    cfg = data.draw(configs(graph))
    s = build_schedule(graph, cfg)
    fits = device_memory(graph, s).total_nbytes <= cfg.budget_bytes
    if not fits:  # the one way a built schedule may fail: it needs more than the budget
        with pytest.raises(ValueError, match="schedule rule 'memory'"):
            verify(s, graph)
        return
    verify(s, graph)
    tl = simulate(s, graph, SPEC)
    b = bound(s, graph, SPEC)
    assert tl.peak_nbytes <= tl.reserved_nbytes <= cfg.budget_bytes
    assert tl.makespan_s >= b.makespan_s * (1 - 1e-9)
    assert tl.step_s >= b.step_s * (1 - 1e-9)
    # the networkx event graph's longest path is the bound's critical path (two derivations of one number)
    assert critical_path(s, graph, SPEC).length_s == pytest.approx(b.critical_path_s, rel=1e-9, abs=1e-12)
    for op in s.ops:  # deps finish before their dependents start; a state load runs alongside the store it waits
        # for (from the store's first row on) and ends after it
        for d in op.deps:
            if op.kind is OpKind.LOAD_OPT and s.ops[d].kind is OpKind.STORE_OPT:
                assert tl.start_s[d] < tl.start_s[op.id] + 1e-12 and tl.end_s[d] <= tl.end_s[op.id] + 1e-12
            else:
                assert tl.end_s[d] <= tl.start_s[op.id] + 1e-12
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(s.to_json()) == s
    assert build_schedule(graph, cfg).to_text() == s.to_text()
    # the saved activations change what the cost model charges, not the ops (the search builds once per candidate)
    assert build_schedule(graph, unsaved(cfg)).ops == s.ops


@given(st.data())
def test_a_run_s_set_up_then_its_steps_verify_as_one_schedule(data):
    """The pairs a run issues back to back -- the plan's set-up (where it keeps anything on the device), then its
    step, then the step again -- joined with what each carries over from the one before verify as one schedule;
    without the carried dependencies two steps do not where a layer is updated on the host (the next step would
    load weights the step before still updates; device updates are ordered by their stream alone)."""
    graph = data.draw(graphs(max_layers=12))
    cfg = dataclasses.replace(data.draw(configs(graph)), n_steps=1, budget_bytes=1 << 40)
    step = build_schedule(graph, cfg)
    setup = setup_schedule(graph, step)
    assert (setup is None) == (not cfg.gpu_opt)
    for prev in (setup, step) if setup is not None else (step,):
        verify(prev, graph)
        carried = carried_deps(prev, step, graph)
        verify(join(prev, step, carried), graph)
        assert all(d < len(prev.ops) for deps in carried for d in deps)
        if prev is step and any(graph[l].tie is None and l not in cfg.gpu_opt for l in range(len(graph))):
            with pytest.raises(ScheduleError, match="load-after-opt|state-after-store"):
                verify(join(prev, step, tuple(() for _ in carried)), graph)
    verify(unroll(setup, step, graph, 3), graph)  # what the runtime issues over three steps


@given(st.data())
def test_stream_ops_never_overlap(data):
    graph = data.draw(graphs(max_layers=12))
    cfg = data.draw(configs(graph))
    s = build_schedule(graph, cfg)
    tl = simulate(s, graph, SPEC)
    for ops in s.by_stream().values():
        for a, b in zip(ops, ops[1:]):
            assert tl.end_s[a.id] <= tl.start_s[b.id] + 1e-12


@settings(max_examples=30)  # each example runs the search twice (the second checks it is deterministic): 40 s for 60
@given(st.data(), st.integers(1, 8), st.integers(16, 12000))
def test_plan_fits_or_refuses_clearly(data, n_seqs, budget_mib):
    graph = data.draw(graphs(max_layers=16))
    seq = 128
    try:
        p = plan(graph, SPEC, n_seqs * seq, seq, budget_bytes=budget_mib * MiB, n_steps=1)
    except PlanError as e:
        msg = str(e)
        assert "GiB" in msg and ("budget" in msg or "host" in msg)
        return
    verify(p.schedule, graph, SPEC)
    assert p.timeline.peak_nbytes <= p.timeline.reserved_nbytes <= budget_mib * MiB
    assert sum(host_memory(graph, p.schedule).values()) <= SPEC.host_bytes
    again = plan(graph, SPEC, n_seqs * seq, seq, budget_bytes=budget_mib * MiB, n_steps=1)
    assert again.schedule.to_text() == p.schedule.to_text()


@given(st.data(), st.integers(1, 8), st.integers(64, 12000), st.sampled_from(["fp32", "bf16"]))
def test_the_gradient_placements_the_search_picks_verify_fit_and_are_what_the_store_allocates(data, n_seqs,
                                                                                            budget_mib, dtype):
    """Random graphs, budgets and hosts: the plan's kept gradients and host buffers verify and fit the device and
    the host, and the host bytes the plan counts for gradients are what the runtime's buffers take for it."""
    import torch

    from megatrain.planner.cost import host_floor, slot_params
    from megatrain.runtime.memory.store import GradBuffers, grad_host_dtype

    graph = data.draw(graphs(max_layers=16))
    seq = 128
    store = host_floor(graph, ScheduleConfig(n_layers=len(graph)))["store"]
    spec = dataclasses.replace(SPEC, host_bytes=store + data.draw(st.integers(0, 16 * graph.n_params)))
    try:
        p = plan(graph, spec, n_seqs * seq, seq, budget_bytes=budget_mib * MiB, n_steps=1, grad_host_dtype=dtype,
                 clip=data.draw(st.booleans()))
    except PlanError as e:
        assert "GiB" in str(e) and ("budget" in str(e) or "host" in str(e))
        return
    s, cfg = p.schedule, p.schedule.config
    verify(s, graph, spec)
    assert device_memory(graph, s).total_nbytes <= cfg.budget_bytes
    host = host_memory(graph, s)
    assert sum(host.values()) <= spec.host_bytes
    assert dtype == "bf16" or cfg.grad_host_bytes == 4
    buffers = GradBuffers(pinned=False)
    numels = slot_params(graph, s)["h"]
    assert buffers.extra_nbytes(numels, grad_host_dtype(cfg)) == host["gradients"]
    if host["gradients"] <= 1 << 24:  # small enough to allocate here: fit() allocates exactly that
        buffers.fit(numels, grad_host_dtype(cfg), lambda: None)
        assert buffers.nbytes == host["gradients"]
        assert all(b.dtype == (torch.bfloat16 if cfg.grad_host_bytes == 2 else torch.float32) for b in buffers.bufs)


@given(st.data(), st.integers(1, 8))
def test_fixed_decisions_are_kept_or_refused_clearly(data, n_seqs):
    """Any mix of decisions the user pins (micro-batches, weight slots, wire, checkpoints on the host, device
    updates, saved layers, clipping): the plan keeps every one of them, or the request is refused with a PlanError
    (never another exception, never a plan that quietly changed a pinned decision)."""
    graph = data.draw(graphs(max_layers=12))
    n = len(graph)
    fixed = {k: v for k, v in {
        "n_mb": data.draw(st.sampled_from([None, 1, 2, 3])),
        "weight_slots": data.draw(st.sampled_from([None, 2, 3, "all"])),
        "wire_bytes": data.draw(st.sampled_from([None, 2, 4])),
        "host_checkpoints": data.draw(st.one_of(st.none(), st.integers(0, n - 2))),
    }.items() if v is not None}
    every = data.draw(st.sampled_from([0, 1, 2, None]))
    resident = data.draw(st.sampled_from([None, 0, 1, 3]))
    saved = data.draw(st.one_of(st.just("auto"), st.integers(0, n)))
    clip = data.draw(st.booleans())
    seq = 128
    try:
        p = plan(graph, SPEC, n_seqs * seq, seq, n_steps=1, clip=clip, saved_acts=saved, gpu_opt_every=every,
                 resident_opt=resident, **fixed)
    except PlanError as e:
        able = sum(1 for l in range(1, n - 1) if graph[l].saved_bytes_per_token > 0)
        if saved != "auto" and saved <= able and "host_checkpoints" not in fixed:
            # a count the candidates with every checkpoint on the device can keep is not refused for the count
            assert "saved_acts must be" not in str(e), str(e)
        assert str(e)
        return
    c = p.schedule.config
    verify(p.schedule, graph, SPEC)
    assert c.clip == clip
    assert c.n_mb == fixed.get("n_mb", c.n_mb)
    assert c.weight_slots == {"all": n}.get(fixed.get("weight_slots"), fixed.get("weight_slots", c.weight_slots))
    assert c.wire_bytes_per_param == fixed.get("wire_bytes", c.wire_bytes_per_param)
    assert c.host_checkpoints == fixed.get("host_checkpoints", c.host_checkpoints)
    if saved != "auto":
        assert len(c.saved_acts) == saved
    if every:
        assert c.gpu_opt == device_update_sets(graph, every)[0]
    if resident is not None:
        assert c.resident_opt == c.gpu_opt[:resident]
    elif clip:  # with clipping keeping a state costs no device memory: "auto" keeps them all
        assert c.resident_opt == c.gpu_opt
    if c.saved_lean:  # lean saved layers only where keeping everything would keep fewer layers, or not fit
        full = dataclasses.replace(c, saved_lean=False)
        if saved == "auto":
            assert len(saved_act_layers(graph, full, "auto")) < len(c.saved_acts)
        else:
            assert device_memory(graph, build_schedule(graph, full)).total_nbytes > c.budget_bytes


@given(st.data(), st.floats(0.0, 1.2))
def test_saved_layers_keep_less_only_where_that_keeps_more(data, room):
    """Budgets from no room for saved activations to room for all of them kept in full: the choice fits, and a
    lean plan keeps more layers than keeping everything would (``auto``) or is the only one that fits (a count)."""
    graph = data.draw(graphs(max_layers=16))
    cfg = dataclasses.replace(data.draw(configs(graph)), saved_acts=(), saved_lean=False, n_steps=1)
    able = [l for l in range(cfg.host_checkpoints + 1, len(graph) - 1) if graph[l].saved_bytes_per_token]
    base = device_memory(graph, build_schedule(graph, cfg)).total_nbytes
    full_need = sum(graph[l].saved_bytes_per_token for l in able) * cfg.mb_tokens * cfg.n_mb
    cfg = dataclasses.replace(cfg, budget_bytes=base + int(room * full_need) + 1)
    choice = data.draw(st.one_of(st.just("auto"), st.integers(0, len(able))))
    c = with_saved_acts(graph, cfg, choice)
    full = saved_act_layers(graph, dataclasses.replace(cfg, saved_lean=False), choice)
    if choice == "auto":
        mem = device_memory(graph, build_schedule(graph, c)).total_nbytes
        assert mem <= cfg.budget_bytes
        assert len(c.saved_acts) >= len(full)
        assert c.saved_lean == (len(c.saved_acts) > len(full))
        verify(build_schedule(graph, c), graph)
    else:  # a count is kept as asked; whether it fits the budget at all is checked after (the API, verify)
        assert len(c.saved_acts) == choice
        if c.saved_lean:
            over = device_memory(graph, build_schedule(graph, dataclasses.replace(c, saved_lean=False)))
            assert over.total_nbytes > cfg.budget_bytes


def test_tiny_budget_is_refused_before_anything_is_built():
    from megatrain.planner.graph import preset

    with pytest.raises(PlanError, match=r"GPU budget 1.00 GiB is too small for one layer.*needs 3.43 GiB.*"
                                        r"cuBLAS workspaces 0.06 GiB"):
        plan(preset("qwen2.5-7b"), SPEC, 32768, 1024, budget_bytes=1 << 30)
    with pytest.raises(PlanError, match=r"does not fit host memory.*x 12 B.*812.56 GiB.*125.00 GiB"):
        plan(preset("qwen2.5-72b"), SPEC, 32768, 1024)
    with pytest.raises(PlanError, match="multiple of the sequence length"):
        plan(preset("qwen2.5-0.5b"), SPEC, 1000, 1024)


def test_the_smallest_plan_checked_first_tiles_as_the_search_would():
    """The check before the search assumes tiles where the search tries them: micro-batches of LONG_SEQ tokens or
    more, and shorter ones where one untiled cannot fit the budget. A sequence that does not fit is refused naming
    the sequence and the longest that passes the same check."""
    from megatrain.planner.graph import preset
    from megatrain.planner.choices import LONG_SEQ, SEQ_TILES, tile_choices
    from megatrain.planner.limits import check_request

    assert tile_choices(LONG_SEQ // 2) == [0] and tile_choices(LONG_SEQ) == [0, *SEQ_TILES]
    assert tile_choices(LONG_SEQ // 2, short=True) == [0, *(t for t in SEQ_TILES if t < LONG_SEQ // 2)]
    g = preset("qwen2.5-7b")
    for seq in (65536, 524288):
        with pytest.raises(PlanError, match=rf"too small for one {seq:,}-token sequence: .*MLPs over "
                                            rf"{min(SEQ_TILES)}-token tiles.* no sequence longer than") as e:
            plan(g, SPEC, seq, seq, budget_bytes=4 << 30)
        longest = e.value.longest
        assert longest % 1024 == 0 and 0 < longest < seq and f"than {longest:,} tokens" in str(e.value)
        check_request(g, SPEC, longest, longest, 4 << 30)  # passes
        with pytest.raises(PlanError, match="too small"):
            check_request(g, SPEC, longest + 1024, longest + 1024, 4 << 30)
    with pytest.raises(PlanError, match="too small for one layer"):  # the weights alone are over the budget
        plan(g, SPEC, 4096, 4096, budget_bytes=2 << 30)


def test_a_sequence_shorter_than_long_ones_gets_their_plans_where_it_fits_no_other():
    """Below LONG_SEQ the search tries untiled plans with every checkpoint on the device or every one on the
    host; where none of those fits (7B, 65,536 tokens, a 20 GiB budget) it searches again with tiles and the
    checkpoints split, and plans."""
    from megatrain.planner.graph import preset

    p = plan(preset("qwen2.5-7b"), PRESETS["h100"], 65536, 65536, budget_bytes=20 << 30, workers=2)
    cfg = p.schedule.config
    assert cfg.seq_tile and 0 < cfg.host_checkpoints < 29
    assert device_memory(preset("qwen2.5-7b"), p.schedule).total_nbytes <= 20 << 30
