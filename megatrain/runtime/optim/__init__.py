"""The optimizer: its settings and learning-rate schedule (:mod:`.config`), AdamW over the host store's layers with
exact global-norm clipping, on the host or on the device (:mod:`.adamw`), and the host's native AdamW kernel
(:mod:`.cpu_adamw`, built from ``cpu_adamw.c`` on first use)."""

from megatrain.runtime.optim.adamw import HostAdamW
from megatrain.runtime.optim.config import OptimConfig, lr_at

__all__ = ["HostAdamW", "OptimConfig", "lr_at"]
