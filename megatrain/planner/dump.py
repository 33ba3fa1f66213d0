"""Dumps of schedules and timelines: a text table, a Chrome trace (Perfetto), a PNG Gantt chart with memory curve."""

from __future__ import annotations

import json
from pathlib import Path

from megatrain.ir import STREAM_ORDER, Op, OpKind, Schedule, format_table
from megatrain.planner.simulate import Timeline

KIND_COLORS = {
    OpKind.LOAD_W: "#4c72b0", OpKind.LOAD_ACT: "#8fb0d8", OpKind.FWD: "#55a868", OpKind.LOSS: "#c44e52",
    OpKind.BWD: "#2d6b3c", OpKind.SAVE_ACT: "#dd8452", OpKind.STORE_G: "#937860", OpKind.OPT: "#8172b3",
    OpKind.LOAD_OPT: "#b7a9de", OpKind.STORE_OPT: "#5a4a8f", OpKind.EVAL: "#e17c7f", OpKind.NORM: "#c9b18b",
    OpKind.GUARD: "#222222", OpKind.LOAD_IN: "#9a9a9a", OpKind.LOSS_OUT: "#7a7a7a", OpKind.KEEP_W: "#2b4f7e",
    OpKind.CHECK: "#b05050", OpKind.REFWD: "#8cc79a",
}
GiB = 1 << 30


def table(schedule: Schedule, timeline: Timeline | None = None, mark: int | None = None) -> str:
    """One row per op; with a timeline, its start and end in ms; ``mark`` flags one op with ``<-- HERE``."""
    if timeline is None:
        return format_table(schedule, mark=mark)
    return format_table(schedule, timeline.start_s, timeline.end_s, mark=mark)


def _label(op: Op) -> str:
    mb = f" m{op.mb}" if op.mb is not None else ""
    return f"{op.kind.value} L{op.layer}{mb}"


def chrome_trace(timelines: list[Timeline]) -> dict:
    """A Chrome trace: one process per timeline (simulated, measured), one thread per stream, a memory counter."""
    events = []
    for pid, tl in enumerate(timelines):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": tl.source}})
        for tid, s in enumerate(STREAM_ORDER):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": s.value}})
        tids = {s: i for i, s in enumerate(STREAM_ORDER)}
        for op, a, b in zip(tl.ops, tl.start_s, tl.end_s):
            events.append({"ph": "X", "name": _label(op), "cat": op.kind.value, "pid": pid, "tid": tids[op.stream],
                           "ts": a * 1e6, "dur": (b - a) * 1e6, "args": {"op": str(op), "step": op.step}})
        for t, nbytes in tl.memory:
            events.append({"ph": "C", "name": "device memory", "pid": pid, "ts": t * 1e6,
                           "args": {"GiB": nbytes / GiB}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timelines: list[Timeline], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines)))
    return path


PLOT_EXTRA = "pictures need matplotlib: pip install 'megatrain[plot]'"


def can_plot() -> bool:
    """Whether matplotlib is installed (it is an extra: ``megatrain[plot]``)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot(timelines: list[Timeline], path: str | Path, title: str = "", budget_nbytes: int | None = None) -> Path:
    """A PNG: for each timeline one lane per stream (ops coloured by kind), and device memory in use below (needs
    matplotlib: :func:`can_plot`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(timelines)
    fig, axes = plt.subplots(n + 1, 1, figsize=(14, 2.2 * n + 2.6), sharex=True,
                             gridspec_kw={"height_ratios": [2.2] * n + [1.6]})
    for ax, tl in zip(axes[:-1], timelines):
        for lane, s in enumerate(STREAM_ORDER):
            bars = [(a, b - a, KIND_COLORS[op.kind]) for op, a, b in zip(tl.ops, tl.start_s, tl.end_s)
                    if op.stream is s and b > a]
            if bars:
                ax.broken_barh([(a, w) for a, w, _ in bars], (lane - 0.4, 0.8), facecolors=[c for *_, c in bars],
                               edgecolor="none")
        ax.set_yticks(range(len(STREAM_ORDER)), [s.value for s in STREAM_ORDER])
        ax.set_ylim(len(STREAM_ORDER) - 0.5, -0.5)
        ax.set_title(f"{tl.source}: {tl.n_steps} step(s), {tl.makespan_s:.3f} s, "
                     f"steady {tl.steady_step_s:.3f} s/step", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    mem = axes[-1]
    for tl in timelines:
        xs = [t for t, _ in tl.memory]
        ys = [b / GiB for _, b in tl.memory]
        mem.step(xs, ys, where="post", label=f"{tl.source}: in use (peak {tl.peak_nbytes / GiB:.2f} GiB)")
        if tl.reserved_nbytes:
            mem.axhline(tl.reserved_nbytes / GiB, ls="--", lw=1, color="gray",
                        label=f"reserved {tl.reserved_nbytes / GiB:.2f} GiB")
    if budget_nbytes:
        mem.axhline(budget_nbytes / GiB, ls=":", lw=1, color="red", label=f"budget {budget_nbytes / GiB:.1f} GiB")
    mem.set_ylabel("device GiB")
    mem.set_xlabel("seconds")
    mem.set_ylim(bottom=0)
    mem.legend(loc="upper right", fontsize=8)
    handles = [Patch(color=c, label=k.value) for k, c in KIND_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
