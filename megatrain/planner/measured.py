"""A hardware spec's link and host fields from rates measured on the machine (``megatrain probe``).

The simulator (``planner.simulate._rates``) gives each copy direction its rate alone, both directions together at
most ``duplex_bytes_per_s``, the host's AdamW ``cpu_adam_params_per_s`` less a share per copy direction running at
its full rate (with both: the product of what each leaves it), and each copy direction a share less while the
AdamW runs. :func:`fit` inverts that model for the rates of each case measured alone and in pairs; :func:`report`
sets each measured case beside the rates the fitted spec's model gives it (the case with all three running is
measured but not fitted: it checks the model).
Pure: no torch here; the measuring is ``megatrain.probe``'s.
"""

from __future__ import annotations

import dataclasses

from megatrain.ir import Stream
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.simulate import _rates

# the most a fitted slowdown share may be (the spec refuses a share that stops a queue; a measured 1.0 is a stall,
# not a rate)
MAX_SLOWDOWN = 0.9

# the measured cases: their names and which of (h2d, d2h, the host's AdamW) run in each
CASES = (("h2d alone", (True, False, False)), ("d2h alone", (False, True, False)), ("both ways", (True, True, False)),
         ("AdamW alone", (False, False, True)), ("AdamW + h2d", (True, False, True)),
         ("AdamW + d2h", (False, True, True)), ("AdamW + both ways", (True, True, True)))

# the update split in two passes, each timed alone (the host kernel's MASTER and MOMENTS modes): with clipping the
# streaming executor's host updates write the masters in the update pass and leave the moments for later; the spec
# field each fits
PASSES = (("AdamW masters alone", "cpu_adam_master_params_per_s"), ("AdamW moments alone", "cpu_moments_params_per_s"))


def _share_lost(loaded: float, alone: float) -> float:
    return min(max(1.0 - loaded / alone, 0.0), MAX_SLOWDOWN)


def fit(m: dict[str, dict[str, float]]) -> dict[str, float]:
    """HardwareSpec fields from ``m``: for each case of :data:`CASES` by name, the measured rate of each queue
    running ("h2d", "d2h": bytes/s; "adam": parameters/s), and of :data:`PASSES` those measured ("adam")."""
    h2d, d2h, adam = m["h2d alone"]["h2d"], m["d2h alone"]["d2h"], m["AdamW alone"]["adam"]
    both, with_h2d, with_d2h = m["both ways"], m["AdamW + h2d"], m["AdamW + d2h"]
    out = {"h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h,
           "duplex_bytes_per_s": min(both["h2d"] + both["d2h"], h2d + d2h), "cpu_adam_params_per_s": adam,
           "cpu_h2d_slowdown": _share_lost(with_h2d["adam"], adam),
           "h2d_cpu_slowdown": _share_lost(with_h2d["h2d"], h2d),
           "cpu_d2h_slowdown": _share_lost(with_d2h["adam"], adam),
           "d2h_cpu_slowdown": _share_lost(with_d2h["d2h"], d2h)}
    out.update({field: m[name]["adam"] for name, field in PASSES if name in m})
    return out


def predict(spec: HardwareSpec, h2d: bool, d2h: bool, adam: bool) -> dict[str, float]:
    """The rates the simulator gives ``spec``'s queues with the named ones running (as :func:`fit` reads them)."""
    queues = [(s, 0) for s, on in ((Stream.H2D, h2d), (Stream.D2H, d2h), (Stream.CPU, adam)) if on]
    out = {s.name.lower(): r for (s, _), r in _rates(spec, queues).items()}
    if "cpu" in out:
        out["adam"] = out.pop("cpu") * spec.cpu_adam_params_per_s
    return out


def with_fitted(base: HardwareSpec, fields: dict[str, float], **more) -> HardwareSpec:
    """``base`` with ``fields`` (and ``more``) in place, named ``<base>-measured``, checked as a spec file is."""
    d = dataclasses.asdict(base)
    d.update(fields, name=f"{base.name}-measured", **more)
    return HardwareSpec.from_dict(d)


def report(m: dict[str, dict[str, float]], spec: HardwareSpec) -> list[str]:
    """A line per case measured: each queue's rate (GB/s, AdamW in G params/s) and in brackets ``spec``'s."""
    lines = []
    for name, running in CASES:
        model = predict(spec, *running)
        parts = [f"{'AdamW' if k == 'adam' else k} {v / 1e9:.1f} ({model[k] / 1e9:.1f})"
                 for k, v in sorted(m[name].items())]
        lines.append(f"{name:20s} " + ", ".join(parts))
    for name, field in PASSES:
        if name in m:
            lines.append(f"{name:20s} AdamW {m[name]['adam'] / 1e9:.1f} ({getattr(spec, field) / 1e9:.1f})")
    return lines
