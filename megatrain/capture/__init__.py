"""The front end: a model -> a :class:`Captured` (layer graph, weightless templates, where each weight lives).

``tracer`` traces the forward around the decoder blocks with torch.fx, ``blocks`` finds the blocks, ``layers`` cuts
the traced graph into layers and templates.
"""

from megatrain.capture.layers import Captured, ParamRef, Segment, capture
from megatrain.capture.meta import meta_copy
from megatrain.capture.tracer import CaptureError

__all__ = ["Captured", "CaptureError", "ParamRef", "Segment", "capture", "meta_copy"]
