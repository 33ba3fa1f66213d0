"""Triton kernels. Each op: ``_op_*_kernel`` -> ``op_forward`` / ``op_backward`` launchers -> an autograd Function
-> a functional entry point; ``reference.py`` holds the pure-torch definitions they are tested against.

On a machine without CUDA the kernels run in Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before this package is imported.
"""

from megatrain.kernels.adamw import adamw_step
from megatrain.kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_forward
from megatrain.kernels.rmsnorm import rms_norm
from megatrain.kernels.rope import rope
from megatrain.kernels.swiglu import swiglu

__all__ = ["adamw_step", "linear_cross_entropy", "linear_cross_entropy_forward", "rms_norm", "rope", "swiglu"]
