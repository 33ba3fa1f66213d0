"""megatrain: full-precision training of models larger than GPU memory on one GPU.

The host owns the model (fp32 master weights and Adam state); the GPU streams layers through on a static schedule
that the planner computes before the first step.
"""

import importlib

__version__ = "0.1.0"
# the public names, imported when first used (so that the command line starts, and takes signals, before torch loads)
_NAMES = {"PlanOptions": "megatrain.planner.request", "StepStats": "megatrain.api",
          "StreamedModel": "megatrain.api", "compile": "megatrain.compiler", "Op": "megatrain.ir",
          "OpKind": "megatrain.ir", "Schedule": "megatrain.ir", "ScheduleConfig": "megatrain.ir",
          "Stream": "megatrain.ir", "OptimConfig": "megatrain.runtime.optim"}
__all__ = sorted([*_NAMES, "__version__"])


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")


def __dir__():
    return __all__
