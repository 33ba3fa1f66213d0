"""The search's default order: a coordinate descent over the candidates' decisions instead of trying every one.

A candidate is a point on a grid of decisions (micro-batches, device updates, weight slots, wire dtype, host
checkpoints, gradient slots, MLP tiles, host gradient dtype, checkpoints dropped; see
:func:`megatrain.planner.choices.candidates`). From a centre every point that differs in one decision is tried, the
best becomes the centre, until it stays (:func:`descend` says where the descents start). The decisions interact
through the device memory: the search's own
"auto" choices (kept gradients, saved activations) fill what a point leaves, which smooths each line, but where
memory is tight a better point can differ in several decisions at once; the device updates and the weight slots
are therefore one line, and each checkpoint placement is descended on its own. The exhaustive order
(``order="exhaustive"``) is the reference: the planner's tests compare the two, and docs/benchmarks.md ("Plan
search time") on the shapes it names.
"""

from __future__ import annotations

from typing import Callable

from megatrain.ir import ScheduleConfig

# the decisions, as ScheduleConfig fields, in the order lines are searched (device updates are one decision: the
# set and how many of it keep their state on the device)
DECISIONS = ("n_mb", "device", "weight_slots", "wire_bytes_per_param", "host_checkpoints", "grad_slots", "seq_tile",
             "grad_host_bytes", "dropped_checkpoints")


def point(cfg: ScheduleConfig) -> tuple:
    """A candidate's decisions, in :data:`DECISIONS` order."""
    return tuple((cfg.gpu_opt, cfg.resident_opt) if d == "device" else getattr(cfg, d) for d in DECISIONS)


def leanest(points: list[tuple], on: str) -> tuple:
    """Of ``points`` (sharing their micro-batches), the one likely to need the least memory ``on`` "device" (no
    device updates, the fewest slots, bf16 on the wire, the most checkpoints on the host, the shortest tiles), on
    the "host" (the same but the wire in fp32, which needs no bf16 shadow there, and every checkpoint on the
    device), or on "both": the device's but with the fp32 wire (the checkpoints on the host, no shadow). Where
    memory is tight the fits lie between them; the descent starts from each."""
    host, wire_up = on == "host", on in ("host", "both")

    def need(p: tuple) -> tuple:
        _, (gpu_opt, _), slots, wire, host_ckpt, gslots, tile, grad, dropped = p
        return (-dropped, len(gpu_opt), -wire if wire_up else wire, host_ckpt if host else -host_ckpt, grad, slots,
                gslots, tile or 1 << 62)
    return min(points, key=need)


# the seeds of each micro-batch count (see leanest)
LEAN = ("device", "both", "host")
HOST_CKPT = DECISIONS.index("host_checkpoints")


def descend(configs: list[ScheduleConfig], evaluate: Callable[[list[int]], None],
            best: Callable[[list[int]], int | None], near: Callable[[int, int], bool] = lambda a, b: True) -> None:
    """Run the descents over ``configs``: ``evaluate(indices)`` tries those configs (the caller keeps the
    outcomes; each index is passed once), ``best(indices)`` is the best runnable of those tried, or where none runs
    the one nearest to fitting (a descent from it moves towards the fits; None: none of them can ever run), and
    ``near(i, top)`` whether a micro-batch count's best ``i`` is worth a descent of its own. From a centre, every
    point that differs from it in one decision is tried (one batch, so a pool of workers shares it), and the best
    of them and the centre is the next centre, until the centre stays. Where the descents start: below."""
    at = {point(c): i for i, c in enumerate(configs)}
    tried: set[int] = set()

    def run(indices: list[int]) -> None:
        new = [i for i in dict.fromkeys(indices) if i not in tried]
        tried.update(new)
        if new:
            evaluate(new)

    by_mb: dict[int, list[tuple]] = {}
    for p in at:
        by_mb.setdefault(p[0], []).append(p)
    seeds = list(dict.fromkeys(at[leanest(ps, on)] for ps in by_mb.values() for on in LEAN))
    run(seeds)
    # Where the checkpoints go all to the device or all to the host, the two placements are two regimes (on the
    # host they free the device memory that device updates and slots then take: a better point may differ in all
    # three at once), each descended with its placement held, from its best seed; long sequences, whose placements
    # range between, descend from the best seed and then from the other seeds of its micro-batch count. After
    # those, a descent from the best point found for each other micro-batch count (they trade device memory with
    # every other decision too).
    placements = sorted({p[HOST_CKPT] for p in at})
    starts: list[tuple[int, int | None]] = []
    if len(placements) <= 2:
        starts = [(b, h) for h in placements
                  if (b := best([i for i in seeds if configs[i].host_checkpoints == h])) is not None]
    elif (first := best(seeds)) is not None:
        starts = [(first, None), *((i, None) for i in seeds if i != first and configs[i].n_mb == configs[first].n_mb)]
    centres: set[tuple[int, int | None]] = set()  # (centre, placement held): where a descent reaches one it stops
    restarted: set[int | None] = set()  # placements whose other micro-batch counts have had their descents
    while starts:
        centre, held = starts.pop(0)
        while (centre, held) not in centres:
            centres.add((centre, held))
            line = [i for i in line_of(at, point(configs[centre]))
                    if held is None or configs[i].host_checkpoints == held]
            run(line)
            nxt = best([centre, *line])
            if nxt is None:
                break
            centre = nxt
        if held in restarted:
            continue
        restarted.add(held)  # then, once per placement, from the best of each other micro-batch count
        here = [i for i in tried if held is None or configs[i].host_checkpoints == held]
        if (top := best(here)) is not None:
            starts += [(b, held) for m in by_mb if m != configs[top].n_mb
                       if (b := best([i for i in here if configs[i].n_mb == m])) is not None and near(b, top)]


# decisions a line changes together (positions in DECISIONS): the device updates and the weight slots trade the
# same device memory (more of one fits only with less of the other), so neither line alone leaves a point where
# both should change; on the 8-block Qwen2.5-0.5B shape of the tests one at a time stops 5% short
TOGETHER = {1: 0, 2: 0}


def line_of(at: dict[tuple, int], p: tuple) -> list[int]:
    """The configs (by index) whose point differs from ``p`` in one decision (or in decisions changed together,
    :data:`TOGETHER`)."""
    out = []
    for q, i in at.items():
        changed = {TOGETHER.get(k, k + len(DECISIONS)) for k, (a, b) in enumerate(zip(p, q)) if a != b}
        if len(changed) == 1:
            out.append(i)
    return out
