"""Which host updates start before the step's global norm is known (``ScheduleConfig.speculate``).

With exact clipping no update may apply before the norm, which needs every gradient: the host's update pass then
follows the backward, and the next forward waits on it. An update made as soon as its gradient is on the host,
with a clip factor of 1, is the update the pass would make wherever the step is not clipped; where it is, its CHECK
puts back the masters it kept and makes the update again with the step's factor. The window is the layers whose
gradients come first (the last layers: the backward reaches them first), as many as

- the host memory the plan leaves holds (4 bytes a parameter: the masters each such update keeps), and
- the backward hides (their updates, the copy of the masters included, run on the host while it goes on), and
- pay for themselves at the expected share of clipped steps (``clip_rate``): a layer in the window takes its
  update out of the pass after the norm on a step that is not clipped, and adds the masters' copy back and the
  update again on one that is.
"""

from __future__ import annotations

from dataclasses import replace

from megatrain.ir import LayerGraph, Op, OpKind, ScheduleConfig, Stream
from megatrain.planner.checks import PlanError
from megatrain.layout import KEPT_MASTER_BYTES, block_bytes
from megatrain.planner.cost import duration_s, early_update_s, host_floor, opt_seconds
from megatrain.planner.hardware import HardwareSpec

# shares of the "auto" window the search tries, the first on every candidate, the others (0: none) on the fastest:
# the host also computes the step before's deferred moments during the backward, and a window that fills it holds
# up the updates after the norm (Llama-3-70B on the H200 preset: 57 layers 37.1 s/step simulated, 40 layers 30.8,
# none 33.7)
AUTO_SHARES = (0.75, 1.0, 0.5, 0.25, 0)


def speculate_eligible(graph: LayerGraph, cfg: ScheduleConfig) -> list[int]:
    """Layers whose update can start before the step's guard (see ``planner.checks.check_speculate``), in the order
    their gradients reach the host (the last layer first)."""
    if not (cfg.clip and cfg.train):
        return []
    return [l for l in reversed(range(len(graph)))
            if graph[l].tie is None and not graph.tied_to(l) and not graph[l].frozen and graph[l].params
            and l not in cfg.gpu_opt and l not in cfg.split_opt and l not in cfg.grad_kept]


def backward_s(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec) -> float:
    """Seconds of a step's backward on the device (each layer's backward and the head's loss, every micro-batch):
    the time the host has for updates made during it."""
    ops = [Op(0, OpKind.LOSS if l == len(graph) - 1 else OpKind.BWD, Stream.COMPUTE, 0, l, 0)
           for l in range(1, len(graph))]
    return cfg.n_mb * sum(duration_s(graph, cfg, spec, op) for op in ops)


def speculation_set(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec, choice: int | str | float,
                    host_free: int, clip_rate: float) -> tuple[int, ...]:
    """``speculate`` for ``cfg``: the first ``choice`` of :func:`speculate_eligible`, or for "auto" the window the
    module's docstring describes within ``host_free`` bytes of host memory and at ``clip_rate`` (a float: that
    share of it)."""
    able = speculate_eligible(graph, cfg)
    if isinstance(choice, float):
        whole = speculation_set(graph, cfg, spec, "auto", host_free, clip_rate)
        return whole[:round(len(whole) * choice)]
    if choice != "auto":
        if choice > len(able):
            raise PlanError(f"speculate={choice}: only {len(able)} layers can update before the step's guard "
                            f"(updated on the host, their gradient on the host during the backward, owning their "
                            f"weights, training, with clipping)")
        return tuple(able[:choice])
    hide = backward_s(graph, cfg, spec)
    master = bool(spec.cpu_adam_master_params_per_s)
    out: list[int] = []
    used = busy = 0.0
    for l in able:
        p = graph.weight_params(l)
        early, gain = early_update_s(cfg, spec, p), opt_seconds(cfg, spec, p, master)
        kept = block_bytes(graph[l]) if cfg.speculate_keeps == "state" else p * KEPT_MASTER_BYTES
        if used + kept > host_free or busy + early > hide or gain <= clip_rate * early:
            break
        out.append(l)
        used += kept
        busy += early
    return tuple(out)


def host_left(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec) -> int:
    """Host bytes a plan of ``cfg`` leaves at least, whatever gradients it keeps on the device: the spec's for plans
    less the store, shadow, checkpoints and process (``cost.host_floor``) and a host buffer for the gradient of
    every layer not updated on the device."""
    grads = sum(graph.weight_params(l) for l in range(len(graph)) if graph[l].tie is None and l not in cfg.gpu_opt)
    return max(spec.host_plan_bytes - sum(host_floor(graph, cfg).values()) - grads * cfg.grad_host_bytes, 0)


def with_speculation(graph: LayerGraph, cfg: ScheduleConfig, spec: HardwareSpec, choice: int | str | float,
                     host_free: int, clip_rate: float) -> ScheduleConfig:
    """``cfg`` with its :func:`speculation_set`."""
    return replace(cfg, speculate=speculation_set(graph, cfg, spec, choice, host_free, clip_rate))
