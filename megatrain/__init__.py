"""megatrain: full-precision training of models larger than GPU memory on one GPU.

The host owns the model (fp32 master weights and Adam state); the GPU streams layers through on a static schedule
that the planner computes before the first step.
"""

from megatrain.api import PlanOptions, StepStats, StreamedModel, compile
from megatrain.ir import Op, OpKind, Schedule, ScheduleConfig, Stream
from megatrain.runtime.optim import OptimConfig

__version__ = "0.1.0"
__all__ = ["Op", "OpKind", "OptimConfig", "PlanOptions", "Schedule", "ScheduleConfig", "StepStats", "Stream",
           "StreamedModel", "compile", "__version__"]
