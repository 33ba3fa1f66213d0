"""The planner: layer graph + batch shape + hardware spec -> a verified static Schedule."""

from megatrain.planner.graph import Layer, LayerGraph, chain, from_config, preset
from megatrain.planner.hardware import HardwareSpec, hardware
from megatrain.planner.passes import build_schedule
from megatrain.planner.search import Plan, PlanError, plan
from megatrain.planner.simulate import Bound, Timeline, bound, simulate
from megatrain.planner.verify import ScheduleError, verify

__all__ = [
    "Bound", "HardwareSpec", "Layer", "LayerGraph", "Plan", "PlanError", "ScheduleError", "Timeline", "bound",
    "build_schedule", "chain", "from_config", "hardware", "plan", "preset", "simulate", "verify",
]
