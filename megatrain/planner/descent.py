"""The search's default order: coordinate descent over the candidates' decisions instead of trying every one.

A candidate is a point on a grid of decisions (micro-batches, weight slots, wire dtype, host checkpoints, device
updates, host gradient dtype, gradient slots, MLP tiles; see :func:`megatrain.planner.search.candidates`). From the
leanest candidate of each micro-batch count, every value of one decision is tried with the others held, the best
point found so far becomes the centre, and that repeats until no decision's line holds a better point. Most of the
grid is never built: the 7B shape at 32,768 tokens has 1,104 candidates, of which a descent tries about a tenth.

Descent finds a local best; the decisions interact through the device memory, which the search's own "auto"
choices (kept gradients, saved activations) fill whatever the point, so the landscape is smooth along each line.
Its choice is checked against the exhaustive order (``order="exhaustive"``) by the planner's tests and on the
shapes docs/planner.md names."""

from __future__ import annotations

from typing import Callable

from megatrain.ir import ScheduleConfig

# the decisions, as ScheduleConfig fields, in the order lines are searched (device updates are one decision: the
# set and how many of it keep their state on the device)
DECISIONS = ("n_mb", "device", "weight_slots", "wire_bytes_per_param", "host_checkpoints", "grad_slots", "seq_tile",
             "grad_host_bytes")


def point(cfg: ScheduleConfig) -> tuple:
    """A candidate's decisions, in :data:`DECISIONS` order."""
    return tuple((cfg.gpu_opt, cfg.resident_opt) if d == "device" else getattr(cfg, d) for d in DECISIONS)


def leanest(points: list[tuple], on: str) -> tuple:
    """Of ``points`` (sharing their micro-batches), the one likely to need the least memory ``on`` "device" (no
    device updates, the fewest slots, bf16 on the wire, the most checkpoints on the host, the shortest tiles) or
    on the "host" (the same but the wire in fp32, which needs no bf16 shadow there, and every checkpoint on the
    device). Long sequences fit only between the two; the descent takes it from both."""
    host = on == "host"

    def need(p: tuple) -> tuple:
        _, (gpu_opt, _), slots, wire, host_ckpt, gslots, tile, grad = p
        return (len(gpu_opt), -wire if host else wire, host_ckpt if host else -host_ckpt, grad, slots, gslots,
                tile or 1 << 62)
    return min(points, key=need)


def descend(configs: list[ScheduleConfig], evaluate: Callable[[list[int]], None],
            best: Callable[[list[int]], int | None]) -> None:
    """Run the descent over ``configs``: ``evaluate(indices)`` tries those configs (the caller keeps the outcomes;
    each index is passed once), ``best(indices)`` is the best runnable of those tried, or where none runs the one
    nearest to fitting (the leanest on the device can be too much for the host: a descent from it moves towards
    the fits; None: none of them can ever run). The first descent starts from the best of the leanest configs of
    each micro-batch count (:func:`leanest`), then one from the best found for each other count, each to its own
    local best: from a centre, every
    point that differs from it in one decision is tried (one batch, so a pool of workers shares it), and the best
    of them and the centre is the next centre, until the centre stays."""
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
    seeds = list(dict.fromkeys(at[leanest(ps, on)] for ps in by_mb.values() for on in ("device", "host")))
    run(seeds)
    # the best seed first, then the other of its micro-batch count (lean on the device and lean on the host lead
    # to different local bests where memory is tight); after the first, a descent from the best point found for
    # each other micro-batch count (micro-batches trade device memory with every other decision: a count's best may lie where one line
    # from the first answer does not reach)
    first = best(seeds)
    starts = [] if first is None else [first, *(i for i in seeds if i != first and configs[i].n_mb ==
                                                 configs[first].n_mb)]
    others_added = False
    centres: set[int] = set()  # every centre so far: a descent that reaches one goes where that one went
    while starts:
        centre = starts.pop(0)
        if centre in centres:
            continue
        while True:
            centres.add(centre)
            line = line_of(at, point(configs[centre]))
            run(line)
            nxt = best([centre, *line])
            if nxt is None or nxt in centres:
                break
            centre = nxt
        if not others_added:
            others_added = True
            top = best(list(tried))
            starts += [b for m in by_mb if top is not None and m != configs[top].n_mb
                       if (b := best([i for i in tried if configs[i].n_mb == m])) is not None]


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
