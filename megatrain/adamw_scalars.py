"""The scalars of one AdamW update, as torch's fused kernel forms them: what the host kernel (runtime/optim/cpu_adamw.c)
and the GPU's (kernels.adamw) both take, each rounded to float, so the two leave the same bits. Outside both
packages: the host kernel needs it on machines without triton, and the kernels import nothing of the runtime."""

from __future__ import annotations

import math


def scalars(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int) -> dict[str, float]:
    """The kernel's scalars for AdamW's update ``step``, in double, as torch's fused kernel forms them; the kernel
    takes each rounded to float (as the GPU's Triton kernel does: :mod:`megatrain.kernels.adamw`, the same
    arithmetic)."""
    beta1, beta2 = betas
    return dict(decay=1 - lr * weight_decay, w1=1 - beta1, beta2=beta2, w2=1 - beta2,
                neg_step=-(lr / (1 - beta1 ** step)), bc2_sqrt=math.sqrt(1 - beta2 ** step), eps=eps)
