"""plan(): refuse what cannot fit, then search the planner's decisions and keep the fastest schedule that verifies."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from megatrain.ir import Schedule, ScheduleConfig
from megatrain.planner.checks import SPECULATE_KEEPS, PlanError
from megatrain.planner.descent import descend
from megatrain.planner.choices import (LONG_SEQ, SPLIT_TRIED, candidates, choose_grad_kept, drop_choices,
                                       saved_act_layers, split_eligible, split_sets, spread, tile_choices,
                                       with_saved_acts, with_split)
from megatrain.planner.cost import (device_memory, gemm_workspace_nbytes, host_floor, host_memory,
                                    speculation_redo_s)
from megatrain.planner.graph import LayerGraph
from megatrain.planner.speculation import AUTO_SHARES, host_left, with_speculation
from megatrain.planner.limits import (FLOOR_NOTE, check_request, gib, margin_refusal, min_device_nbytes,
                                      no_fit_error)
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.passes import build_schedule, relabel_saved, repeat
from megatrain.planner.simulate import Bound, Slower, Timeline, bound, compute_floor, simulate
from megatrain.planner.verify import check_memory, verify

# the orders the candidates are tried in: a coordinate descent over their decisions (megatrain.planner.descent), or
# every one (the reference the descent is tested against)
ORDERS = ("descent", "exhaustive")


@dataclass
class Plan:
    schedule: Schedule
    timeline: Timeline
    bound: Bound
    graph: LayerGraph
    spec: HardwareSpec
    tokens: int
    tried: list[tuple[ScheduleConfig, str]] = field(default_factory=list)  # every candidate and its outcome
    margin_taken: str | None = None  # where a faster plan was refused for the host margin alone: in words
    speculation_left: str | None = None  # where a plan with updates before the norm was not worth it: in words
    n_candidates: int = 0  # candidates the search could have tried (before the split updates' round)
    n_searched: int = 0  # of them, those it tried (``tried`` holds them, then the split updates' round)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.timeline.steady_step_s


def _screen(graph: LayerGraph, spec: HardwareSpec, budget: int, cutoff: tuple[bool, float] | None,
            cfg: ScheduleConfig) -> tuple | None:
    """:func:`_try`'s checks that build nothing (its outcome where one refuses ``cfg``, else None): the search runs
    them in its own process and sends a worker only what it must build."""
    if cutoff is not None and (cfg.grad_host_bytes != 4) > cutoff[0]:
        return cfg, "bf16 host gradients, where a plan with fp32 ones runs (not built)", None, None, None
    host, need = sum(host_floor(graph, cfg).values()), min_device_nbytes(graph, cfg)
    over = max(host / spec.host_bytes, need / budget)  # (both: a descent moves towards fitting both)
    if host > spec.host_bytes:
        return cfg, f"host memory {gib(host)} > {gib(spec.host_plan_bytes)} {FLOOR_NOTE}", None, None, over
    if need > budget:
        return cfg, f"device memory >= {gib(need)} > budget {gib(budget)}", None, None, over
    if cutoff is not None and (cfg.grad_host_bytes != 4) == cutoff[0] and \
            (floor := compute_floor(graph, cfg, spec, budget - need)) > cutoff[1]:
        return cfg, f"compute floor {floor:.4f} s/step > {cutoff[1]:.4f}, the best so far's (not built)", None, \
            None, None
    return None


def _try(graph: LayerGraph, spec: HardwareSpec, budget: int, saved_acts: int | str, grad_kept: int | str,
         speculate: int | str, clip_rate: float, cutoff: tuple[bool, float] | None,
         cfg: ScheduleConfig, keeps: str = "") -> tuple[ScheduleConfig, str, tuple | None, tuple | None, float | None]:
    """One candidate of :func:`plan`: its config with the kept gradients and saved activations chosen, the outcome,
    its rank (None where it cannot run), and for a candidate refused only because it would take some of the host
    margin (``HardwareSpec.host_margin``), the rank it would have had (else None), and where it does not fit, by
    how much: the memory it needs over what there is (of the host, or the device budget; inf: a choice it cannot
    take; else None), which leads a descent that starts where nothing fits towards a fit. Checks what is cheap
    first (:func:`_screen`), builds the schedule (once, twice with kept gradients), checks it against the device
    budget and the host memory, and simulates it. ``cutoff``: (bf16 host gradients, seconds) of the k-th best
    candidate so far, plus the share :func:`rank` counts as equally fast: a candidate that cannot rank before it
    (bf16 gradients where it has fp32 ones, or a floor under its step's compute above the seconds,
    :func:`~megatrain.planner.simulate.compute_floor`) is refused without being built, and one built is simulated
    only until its steady step is known to be longer (``simulate``'s ``give_up_s``). (The bound on a built
    schedule, :func:`~megatrain.planner.simulate.bound`, costs about what its simulation does: no use for pruning.)
    Module level, so that worker processes can run it."""
    refused = _screen(graph, spec, budget, cutoff, cfg)
    if refused is not None:
        return refused
    if keeps == "auto" and speculate:  # keeping the state where its window is as long as keeping the masters' (one
        # pass an update where there were two and a copy: as fast or faster); where it is shorter, both are tried
        forms = [replace(cfg, speculate_keeps=k) for k in ("state", "masters")]
        if not _state_holds(graph, spec, cfg, speculate, clip_rate):
            outs = [_try(graph, spec, budget, saved_acts, grad_kept, speculate, clip_rate, cutoff, c) for c in forms]
            ran = [o for o in outs if o[2] is not None]
            return min(ran, key=lambda o: o[2]) if ran else outs[1]
        cfg = forms[0]
    limit = spec.host_plan_bytes
    steps, cfg = cfg.n_steps, replace(cfg, n_steps=1)  # decided and checked on one step's schedule
    try:  # a count of kept gradients or saved layers this candidate cannot take
        if speculate:  # a count, or a share of the "auto" window (float) the host holds with every gradient in a
            # host buffer: the last layers, which then keep no gradient on the device
            cfg = with_speculation(graph, cfg, spec, speculate, host_left(graph, cfg, spec), clip_rate)
        base = choose_grad_kept(graph, cfg, grad_kept)  # its ops, for every choice of saved activations
        cfg = base.config
        host = sum(host_memory(graph, base).values())
        if host > spec.host_bytes:
            return replace(cfg, n_steps=steps), f"host memory {gib(host)} > {gib(limit)}", None, None, \
                host / spec.host_bytes
        cfg = with_saved_acts(graph, cfg, saved_acts, base)
    except (PlanError, ValueError) as e:
        return replace(cfg, n_steps=steps), str(e), None, None, math.inf
    s = relabel_saved(base, cfg)
    try:
        check_memory(s, graph, spec)  # (each step of a run holds what one does)
    except ValueError as e:
        return replace(cfg, n_steps=steps), str(e), None, None, device_memory(graph, s).total_nbytes / budget
    s = repeat(graph, s, steps)
    cfg = s.config if s.config.speculate else replace(s.config, speculate_keeps="masters")  # (no window: no keeping)
    try:  # (one that cannot rank before the cutoff's is not simulated to its end)
        tl = simulate(s, graph, spec, curve=False, steady_only=True, give_up_s=cutoff[1] if cutoff is not None and (
            cfg.grad_host_bytes != 4) == cutoff[0] else None)
    except Slower as e:
        return cfg, f"{e}, the best so far's (not simulated to its end)", None, None, None
    # fp32 gradients wherever a plan with them fits (bf16 ones only where asked for and needed); updates made before
    # the guard ranked with what the share of steps expected to be clipped adds
    redo = clip_rate * speculation_redo_s(graph, cfg, spec) if cfg.speculate else 0.0
    key = (cfg.grad_host_bytes != 4, round(tl.steady_step_s + redo, 6), tl.makespan_s, tl.reserved_nbytes, cfg.n_mb,
           cfg.weight_slots, host)
    if host > limit:
        return cfg, (f"host memory {gib(host)} > {gib(limit)} (of {gib(spec.host_bytes)}, "
                     f"{gib(spec.host_margin)} left free; {tl.steady_step_s:.4f} s/step)"), None, key, host / limit
    return cfg, f"{tl.steady_step_s:.4f} s/step", key, None, None


# A micro-batch count whose best point after the first descents is more than this share slower than the best one's
# gets no descent of its own (each of a long micro-batch count's lines builds schedules of many more ops)
RESTART_SLACK = 0.05

# Plans whose simulated steady step is within this share of the fastest one's count as equally fast; among them the
# one needing the least host memory is taken (host memory is what bounds the model a machine trains, and a plan
# that leaves it free leaves room for the rest of the process)
HOST_LEAN_SLACK = 0.01

# A window of updates before the norm (``speculate``) is taken only where the simulator puts its plan this share
# faster than the fastest without one: what the window's updates cost the host beside the backward is not simulated
# (H100 leases: Qwen2.5-7B at 24 GiB simulated 1.6% faster and measured 6% slower, on the full card 1.7% faster and
# 7% slower; the Mistral-Large slice simulated 9.1% faster and measured 6% faster; docs/benchmarks.md, "Host updates
# before the global norm")
SPECULATE_GAIN = 0.04


def worth_speculating(order: list[int], outcomes: list) -> tuple[list[int], str | None]:
    """``order`` (:func:`rank`'s, of ``outcomes``) with the plans without a window of updates before the norm first
    where the first has one and is less than :data:`SPECULATE_GAIN` faster than the fastest of them (same gradient
    dtype on the host), and a sentence saying so; else ``order`` and None."""
    if not order or not outcomes[order[0]][0].speculate:
        return order, None
    first = outcomes[order[0]][2]
    without = [i for i in order if not outcomes[i][0].speculate and outcomes[i][2][0] == first[0]]
    if not without or outcomes[without[0]][2][1] > first[1] * (1 + SPECULATE_GAIN):
        return order, None
    return without + [i for i in order if i not in without], (
        f"a window of {len(outcomes[order[0]][0].speculate)} updates before the norm simulated {first[1]:.3f} s/step "
        f"(the clipped steps' redo counted) against {outcomes[without[0]][2][1]:.3f} without: less than the "
        f"{SPECULATE_GAIN:.0%} its unsimulated host cost needs, not taken")


def _try_share(graph: LayerGraph, spec: HardwareSpec, budget: int, saved_acts: int | str, grad_kept: int | str,
               clip_rate: float, cutoff: tuple[bool, float] | None, cfg: ScheduleConfig, share: float,
               keeps: str = ""):
    """:func:`_try` of ``cfg`` with ``share`` of its "auto" window of updates before the guard (module level, for
    the worker processes)."""
    return _try(graph, spec, budget, saved_acts, grad_kept, share, clip_rate, cutoff, cfg, keeps)


def _state_holds(graph: LayerGraph, spec: HardwareSpec, cfg: ScheduleConfig, speculate: int | float,
                 clip_rate: float) -> bool:
    """Whether ``cfg``'s window of updates before the guard is as long keeping the state as keeping the masters."""
    free = host_left(graph, cfg, spec)
    state, masters = (len(with_speculation(graph, replace(cfg, speculate_keeps=k), spec, speculate, free,
                                           clip_rate).speculate) for k in ("state", "masters"))
    return state >= masters


def undecided(cfg: ScheduleConfig) -> ScheduleConfig:
    """The candidate :func:`_try` made ``cfg`` from: without the kept gradients, saved activations and updates
    before the guard it decides."""
    return replace(cfg, grad_kept=(), host_grad_part=0, saved_acts=(), saved_lean=False, speculate=())


def _cutoff(outcomes: list, k: int, slack: float = HOST_LEAN_SLACK) -> tuple[bool, float] | None:
    """:func:`_try`'s cutoff from ``outcomes``: the ``k``-th best key's gradient dtype and seconds (plus ``slack``),
    so that a candidate it refuses can be neither the best nor one of the ``k`` best the split updates start from
    (None: fewer than ``k`` run)."""
    keys = sorted(o[2] for o in outcomes if o[2] is not None)  # (bf16 host gradients, steady seconds, ...)
    if len(keys) < k:
        return None
    return keys[k - 1][0], keys[k - 1][1] * (1 + slack)


def rank(keys: list[tuple | None], fewest_mb: bool = False) -> list[int]:
    """Indices of the runnable candidates (their :func:`_try` key not None), best first: the fastest by simulated
    steady-state step, except that among those within :data:`HOST_LEAN_SLACK` of it (with the same gradient dtype
    on the host) the one needing the least host memory comes first; with ``fewest_mb`` (the plan chosen at the end)
    the one with the fewest micro-batches before it: more of them cost the host more than the simulator counts
    (Qwen2.5-7B at 24 GiB on the H100: 8 measured 7.5% slower than 4, simulated 0.3% apart; docs/benchmarks.md,
    "The runtime in rooms")."""
    able = [(key, i) for i, key in enumerate(keys) if key is not None]
    if not able:
        return []
    best = min(able)[0]

    def order(item):
        key, i = item
        near = key[0] == best[0] and key[1] <= best[1] * (1 + HOST_LEAN_SLACK)
        return (not near, key[4] if near and fewest_mb else 0, key[-1] if near else 0, key, i)

    return [i for _, i in sorted(able, key=order)]


def _refine_split(graph: LayerGraph, outcomes: list, split: list[tuple[ScheduleConfig, tuple[int, ...]]],
                  opt_part: int | None, run: Callable[[list[ScheduleConfig]], list]) -> list:
    """The outcomes of split counts next to the fastest one :func:`plan` tried (``split``: the candidate and split set
    of each of its last ``len(split)`` outcomes), one layer more and one fewer at a time while that is faster:
    the share of the update pass the host and the link each take best lies anywhere between the shares
    :func:`split_sets` tries (on a host with a slower AdamW one or two split layers more simulate 2-3% faster
    on the 7B shape at 24 GiB)."""
    first = len(outcomes) - len(split)
    at = {first + i: (c, len(layers)) for i, (c, layers) in enumerate(split)}  # outcome index -> (candidate, count)
    found: list = []
    while True:
        order = rank([o[2] for o in outcomes + found])
        if not order or order[0] not in at:  # the fastest plan splits nothing (or is not one of these)
            return found
        c, n = at[order[0]]
        able = split_eligible(graph, c)
        more = [k for k in (n - 1, n + 1) if 1 <= k <= len(able) and (c, k) not in at.values()]
        if not more:
            return found
        at.update({len(outcomes) + len(found) + i: (c, k) for i, k in enumerate(more)})
        found += run([with_split(graph, c, spread(able, k), opt_part) for k in more])


def plan(graph: LayerGraph, spec: HardwareSpec, tokens: int, seq_len: int, *, budget_bytes: int | None = None,
         clip: bool = True, n_steps: int = 3, saved_acts: int | str = "auto", grad_kept: int | str = "auto",
         split_opt: int | str = 0, opt_part: int | None = None, speculate: int | str = 0, clip_rate: float = 0.1,
         speculate_keeps: str = "masters",
         workers: int = 1, order: str = "descent", prune: bool = True,
         progress: Callable[[int, int], None] | None = None, **fixed) -> Plan:
    """The fastest schedule (by simulated steady-state step time, the fewest micro-batches, then the leanest on host
    memory among those within :data:`HOST_LEAN_SLACK` of it, then the end of the second-to-last of ``n_steps``
    steps, then the order of :func:`candidates`) among :func:`candidates` that verifies and fits the device budget
    and the host, each with the saved activations ``saved_acts`` chooses (see :func:`saved_act_layers`). Raises
    :class:`PlanError` before building anything when nothing can fit.

    Each candidate tried is built once, checked against the memory budget and simulated (:func:`_try`); the full
    verification then runs on the fastest, and on the next where one fails it. ``order``: "descent" tries the
    candidates a coordinate descent over their decisions reaches (:func:`~megatrain.planner.descent.descend`; all
    of them where it finds none that runs), "exhaustive" every one. ``prune``: a candidate that cannot rank first
    by its bound is not simulated (see :func:`_try`'s cutoff; the choice is the same). ``workers`` > 1 spreads the
    candidates over that many processes (the answer is the same); ``progress(done, total)`` is called as they
    finish.

    ``speculate``: the host updates made before the step's guard (``ScheduleConfig.speculate``; with clipping): a
    count of layers every candidate takes, or "auto": every candidate takes the first of
    :data:`~megatrain.planner.speculation.AUTO_SHARES` of the window
    :func:`~megatrain.planner.speculation.speculation_set` gives it, and the fastest is tried again with the
    others (none among them); each ranked with ``clip_rate`` (the share of steps expected to be clipped) times what
    a clipped step adds. ``speculate_keeps``: what those updates keep (``ScheduleConfig.speculate_keeps``), or
    "auto": the masters, and the fastest is tried again keeping the state (with each share of its window)."""
    budget = spec.budget_bytes if budget_bytes is None else int(budget_bytes)
    check_request(graph, spec, tokens, seq_len, budget)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise PlanError(f"workers must be a positive integer, got {workers!r}")
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise PlanError(f"steps to simulate must be a positive integer, got {n_steps!r}")
    gemm = gemm_workspace_nbytes(spec)
    configs = [replace(c, gemm_workspace_bytes=gemm)
               for c in candidates(graph, tokens, seq_len, budget, clip=clip, n_steps=n_steps, **fixed)]
    if saved_acts != "auto" and configs:  # a count no plan can keep, even with every checkpoint on the device
        saved_act_layers(graph, replace(configs[0], host_checkpoints=0), saved_acts)
    if grad_kept != "auto" and (not isinstance(grad_kept, int) or isinstance(grad_kept, bool) or grad_kept < 0):
        raise PlanError(f"grad_kept must be 'auto' or a count of layers >= 0, got {grad_kept!r}")
    if opt_part is not None and (not isinstance(opt_part, int) or isinstance(opt_part, bool) or opt_part < 1):
        raise PlanError(f"opt_part must be a number of elements >= 1, got {opt_part!r}")
    if split_opt not in (0, "auto") and configs:  # a fixed count: every candidate splits that many
        if not clip:
            raise PlanError(f"split_opt={split_opt} splits the update pass after the backward, which needs "
                            f"clipping (without it each update follows its gradient)")
        able = []
        for c in configs:  # (a candidate whose device updates leave fewer layers to split is left out)
            try:
                able.append(with_split(graph, c, split_sets(graph, c, split_opt)[0], opt_part))
            except PlanError as e:
                refused = e
        if not able:
            raise refused
        configs = able
    if order not in ORDERS:
        raise PlanError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if speculate != "auto" and (not isinstance(speculate, int) or isinstance(speculate, bool) or speculate < 0):
        raise PlanError(f"speculate must be 'auto' or a count of layers >= 0, got {speculate!r}")
    if speculate and speculate != "auto" and not clip:
        raise PlanError(f"speculate={speculate} starts updates before the step's clip factor is known, which needs "
                        f"clipping (without it each update follows its gradient)")
    if isinstance(clip_rate, bool) or not isinstance(clip_rate, (int, float)) or not 0 <= clip_rate <= 1:
        raise PlanError(f"clip_rate must be a share of steps in 0..1, got {clip_rate!r}")
    if speculate_keeps not in ("auto", *SPECULATE_KEEPS):
        raise PlanError(f"speculate_keeps must be 'auto' or one of {', '.join(SPECULATE_KEEPS)}, got "
                        f"{speculate_keeps!r}")
    if speculate_keeps != "auto":
        configs = [replace(c, speculate_keeps=speculate_keeps) for c in configs]
    fixed_spec = AUTO_SHARES[0] if speculate == "auto" else speculate
    keeps = speculate_keeps if speculate_keeps == "auto" else ""  # (where fixed, each config has it)
    job = functools.partial(_try, graph, spec, budget, saved_acts, grad_kept, fixed_spec, clip_rate, keeps=keeps)
    keep = SPLIT_TRIED if split_opt == "auto" and clip else 1  # the best candidates pruning must leave
    results: dict[int, tuple] = {}  # config index -> its outcome
    with contextlib.ExitStack() as stack:
        run = map  # in the order of the configs either way
        if workers > 1 and len(configs) > 1:
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(configs))))
            run = lambda f, cs: pool.map(f, cs, chunksize=1)  # noqa: E731 - (a line mixes refusals of a
            # millisecond with builds of a second: one at a time keeps both processes busy)

        def evaluate(indices: list[int]) -> None:
            total = len(results) + len(indices)
            cut = _cutoff(list(results.values()), keep) if prune else None
            build = []
            for i in indices:
                out = _screen(graph, spec, budget, cut, configs[i])
                if out is None:
                    build.append(i)
                    continue
                results[i] = out
                if progress is not None:
                    progress(len(results), total)
            for i, out in zip(build, run(functools.partial(job, cut), [configs[i] for i in build])):
                results[i] = out
                if progress is not None:
                    progress(len(results), total)

        def best(indices: list[int]) -> int | None:  # the best runnable, else the nearest to a fit (None: none)
            done = [i for i in indices if i in results]
            first = rank([results[i][2] for i in done])
            if first:
                return done[first[0]]
            near = [(results[i][4], i) for i in done if results[i][4] is not None]
            return min(near)[1] if near else None

        def near(i: int, top: int) -> bool:  # worth a descent of its own: within RESTART_SLACK of the best
            a, b = results[i][2], results[top][2]
            return b is None or a is not None and a[0] == b[0] and a[1] <= b[1] * (1 + RESTART_SLACK)

        if order == "descent":
            descend(configs, evaluate, best, near)
        if not rank([o[2] for o in results.values()]):  # every candidate: the exhaustive order, or a descent that
            rest = [i for i in range(len(configs)) if i not in results]  # found none to run (a refusal names all)
            batch = 16 * workers if prune else len(rest) or 1  # (pruning sets its cutoff between batches)
            for k in range(0, len(rest), batch):
                evaluate(rest[k:k + batch])
        done = sorted(results)
        outcomes = [results[i] for i in done]
        if split_opt == "auto" and clip:  # the fastest few again, a share of their host updates split to the device
            bases = [configs[done[i]] for i in rank([o[2] for o in outcomes])[:SPLIT_TRIED]]
            split = [(c, layers) for c in bases for layers in split_sets(graph, c, "auto")]
            # (one that cannot rank first is not simulated to its end: the refinement moves from the fastest)
            whole = functools.partial(job, _cutoff(outcomes, 1) if prune else None)
            outcomes += run(whole, [with_split(graph, c, layers, opt_part) for c, layers in split])
            outcomes += _refine_split(graph, outcomes, split, opt_part, lambda cs: list(run(whole, cs)))
        top = rank([o[2] for o in outcomes])[:1]
        if speculate == "auto" and clip and top:  # the fastest again with the other shares of its window (none
            # among them; simulated to its end where within SPECULATE_GAIN of the fastest, which it is then taken
            # before: worth_speculating)
            base = undecided(outcomes[top[0]][0])
            for shares, slack in ((AUTO_SHARES[1:-1], HOST_LEAN_SLACK), (AUTO_SHARES[-1:], SPECULATE_GAIN)):
                outcomes += run(functools.partial(_try_share, graph, spec, budget, saved_acts, grad_kept, clip_rate,
                                                  _cutoff(outcomes, 1, slack) if prune else None, base, keeps=keeps),
                                shares)
        top = rank([o[2] for o in outcomes])[:1]
        if speculate and speculate_keeps == "auto" and clip and top:  # the fastest again, its window keeping the
            # state: one update pass instead of two, for the host memory of a spare block
            base = replace(undecided(outcomes[top[0]][0]), speculate_keeps="state")
            cut = _cutoff(outcomes, 1) if prune else None
            outcomes += run(functools.partial(_try_share, graph, spec, budget, saved_acts, grad_kept, clip_rate, cut,
                                              base), AUTO_SHARES[:-1]) if speculate == "auto" else \
                run(functools.partial(_try, graph, spec, budget, saved_acts, grad_kept, fixed_spec, clip_rate, cut),
                    [base])
        top = rank([o[2] for o in outcomes])[:1]
        if split_opt == "auto" and clip and spec.cpu_adam_master_params_per_s and top:  # with the update pass
            # searched, the fastest again with every host update in one pass: where the host is what a step waits
            # for, the moments' second pass costs more than it saves
            again = functools.partial(job, _cutoff(outcomes, 1) if prune else None)
            outcomes += run(again, [replace(undecided(outcomes[top[0]][0]), defer_moments=False)])
            if progress is not None:
                progress(len(outcomes), len(outcomes))
    tried: list[tuple[ScheduleConfig, str]] = [(o[0], o[1]) for o in outcomes]
    ranked, left = rank([o[2] for o in outcomes], fewest_mb=True), None
    if speculate == "auto":
        ranked, left = worth_speculating(ranked, outcomes)
    for i in ranked:
        cfg = outcomes[i][0]
        s = build_schedule(graph, cfg)
        try:
            verify(s, graph, spec)
        except ValueError as e:
            tried[i] = (cfg, str(e))
            continue
        tl = simulate(s, graph, spec)
        return Plan(s, tl, bound(s, graph, spec), graph, spec, tokens, tried, margin_refusal(outcomes, tl, spec),
                    left, len(configs), len(done))
    # nothing fits: a sequence shorter than LONG_SEQ, of layers that tile, again with what long ones get; a long one
    # again with some checkpoints dropped (GiBs each), each made again by a forward in the backward
    short = not fixed.get("short_tiles") and fixed.get("seq_tile") is None and seq_len < LONG_SEQ and \
        tile_choices(tokens, True) != [0] and any(l.tile_work_bytes_per_token for l in graph.layers)
    drop = not fixed.get("dropping") and fixed.get("dropped_checkpoints") is None and seq_len >= LONG_SEQ and \
        drop_choices(graph)
    if short or drop:
        return plan(graph, spec, tokens, seq_len, budget_bytes=budget_bytes, clip=clip, n_steps=n_steps,
                    saved_acts=saved_acts, grad_kept=grad_kept, split_opt=split_opt, opt_part=opt_part,
                    speculate=speculate, clip_rate=clip_rate, speculate_keeps=speculate_keeps, workers=workers,
                    order=order, prune=prune, progress=progress,
                    **{**fixed, "short_tiles" if short else "dropping": True})
    raise no_fit_error([why for _, why in tried], spec, budget=budget,
                       bf16_tried=fixed.get("grad_host_dtype", "fp32") == "bf16")
