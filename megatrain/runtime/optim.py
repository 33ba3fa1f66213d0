"""AdamW on the host store, one layer at a time, with an LR schedule and exact global-norm clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatrain.runtime.store import HostStore


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (AdamW), applied to every parameter
    max_grad_norm: float | None = 1.0  # clip by the exact global norm; None: no clipping
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps to lr
    total_steps: int | None = None  # cosine decay to min_lr over these steps; None: constant after warmup
    min_lr: float = 0.0
    fused: bool = True  # torch's fused AdamW kernel on the host, megatrain's Triton one for device updates (False:
    # torch's per-tensor loop on both)
    threads: int | None = None  # host threads for the update (None: torch's setting); fewer than the cores leaves
    # one free for the thread that issues GPU work, so no update waits on a descheduled thread

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"learning rate must be positive, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.warmup_steps < 0 or (self.total_steps is not None and self.total_steps <= self.warmup_steps):
            raise ValueError(f"need 0 <= warmup_steps ({self.warmup_steps}) < total_steps ({self.total_steps})")


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.total_steps is None:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class HostAdamW:
    """One ``torch.optim.AdamW`` per owning layer over the store's flat master row, with its moments living in the
    store's exp_avg / exp_avg_sq rows (the optimizer allocates nothing)."""

    def __init__(self, store: HostStore, cfg: OptimConfig):
        self.store, self.cfg = store, cfg
        self.opts: dict[int, torch.optim.AdamW] = {}
        self.params: dict[int, torch.Tensor] = {}  # the view objects the optimizers hold (a new view would not do)
        for layer in store.owners():
            p = self.params[layer] = store.master(layer)
            opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                    fused=cfg.fused or None)
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                            "exp_avg": store.row(layer, "exp_avg"), "exp_avg_sq": store.row(layer, "exp_avg_sq")}
            self.opts[layer] = opt
        self.step_index = 0
        self.threads = cfg.threads  # may be changed between steps (benchmarks sweep it)
        self._device_opts: dict[tuple, tuple[torch.optim.AdamW, torch.nn.Parameter]] = {}  # device updates
        self._grad_scales: dict[str, torch.Tensor] = {}  # per device: the fused kernel's 1 / clip factor

    def begin_step(self) -> float:
        """Start an optimizer step; returns its learning rate."""
        lr = lr_at(self.cfg, self.step_index)
        for opt in self.opts.values():
            opt.param_groups[0]["lr"] = lr
        return lr

    def clip_factor(self, total_norm: torch.Tensor) -> torch.Tensor:
        """The factor gradients of global norm ``total_norm`` (an fp32 tensor) are scaled by, on its device:
        max_norm / (norm + 1e-6), at most 1, in fp32, as torch.nn.utils.clip_grad_norm_ computes it."""
        return torch.clamp(self.cfg.max_grad_norm / (total_norm + 1e-6), max=1.0)

    def _grad_scale(self, grad: torch.Tensor, coef: float | torch.Tensor) -> torch.Tensor | None:
        """Apply the step's clip factor ``coef`` (a float, or a 0-dim tensor on ``grad``'s device) to ``grad``: for
        the fused kernels a 0-dim fp32 tensor holding 1 / coef, which they divide the gradient by as they read it
        (no extra pass over it; a NaN factor, a step that must not update, makes the Triton kernel change nothing);
        otherwise ``grad`` is scaled in place (returns None)."""
        if isinstance(coef, torch.Tensor):  # a device update: the factor stays on the device
            if self.cfg.fused:
                return (1.0 / coef.double()).float()  # as a float factor's 1 / coef below
            grad.mul_(coef)
            return None
        if coef == 1.0:
            return None
        if self.cfg.fused:  # the scalar is filled in place: a new CUDA tensor from a Python number would be a
            # copy from pageable memory, which waits for the whole compute stream
            key = str(grad.device)
            if key not in self._grad_scales:
                self._grad_scales[key] = torch.empty((), dtype=torch.float32, device=grad.device)
            return self._grad_scales[key].fill_(1.0 / coef)
        grad.mul_(coef)
        return None

    def step_layer(self, layer: int, coef: float = 1.0) -> None:
        """AdamW on one layer's host block, its gradient scaled by ``coef`` (the step's clip factor).""" 
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # OpenMP: applies to the calling thread's parallel regions
        grad = self.store.grad(layer)
        opt = self.opts[layer]
        self._torch_step(opt, self.params[layer], grad, self._grad_scale(grad, coef))
        self.store.refresh_shadow(layer)  # a plan with a bf16 wire loads the shadow next

    def step_layer_on(self, layer: int, block: torch.Tensor, lr: float, coef: float | torch.Tensor = 1.0,
                      out: torch.Tensor | None = None) -> bool:
        """AdamW on a copy of the layer's block on the device (``block``: (4, n), rows as the store's), with the
        same hyper-parameters and step count as :meth:`step_layer`, learning rate ``lr`` (the step's: the host may
        still work on the previous step's updates) and clip factor ``coef`` (a device tensor spares the host a
        wait for the gradient norm); the caller copies master and moments (and the bf16 shadow, if any) back to
        the store.

        On a GPU (with ``fused``) the update is one Triton pass (``kernels.adamw_step``), which also writes the new
        master in ``out``'s dtype into ``out`` if given; returns whether it did (else the caller rounds it)."""
        master, exp_avg, exp_avg_sq, grad = block
        host_step = self.opts[layer].state[self.params[layer]]["step"]
        scale = self._grad_scale(grad, coef)
        if block.is_cuda and self.cfg.fused:
            from megatrain.kernels.adamw import adamw_step

            cfg = self.cfg
            adamw_step(master, exp_avg, exp_avg_sq, grad, lr=lr, betas=cfg.betas, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, step=int(host_step) + 1, grad_scale=scale, out=out)
            host_step.add_(1)  # the host's count stays the one truth, whichever side updates the layer
            return out is not None
        opt, p = self._device_opt(layer, block.device)
        state = opt.state[p]
        state["step"].fill_(float(host_step))
        state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
        opt.param_groups[0]["lr"] = lr
        p.data = master
        try:
            self._torch_step(opt, p, grad, scale)
        finally:
            p.data = torch.empty(0, device=block.device)
            state["exp_avg"] = state["exp_avg_sq"] = None
        host_step.add_(1)
        return False

    @staticmethod
    def _torch_step(opt: torch.optim.AdamW, p: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor | None) -> None:
        """``opt.step()`` with ``grad`` as ``p``'s gradient, divided by ``scale`` in the fused kernel if given."""
        p.grad = grad
        if scale is not None:
            opt.grad_scale = scale
        try:
            opt.step()
        finally:
            p.grad = None
            if scale is not None:
                del opt.grad_scale

    def _device_opt(self, layer: int, device: torch.device) -> tuple[torch.optim.AdamW, torch.nn.Parameter]:
        key = (layer, str(device))
        if key not in self._device_opts:
            p = torch.nn.Parameter(torch.empty(0, device=device))
            cfg = self.cfg
            opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                    fused=cfg.fused or None)
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=device)}
            self._device_opts[key] = (opt, p)
        return self._device_opts[key]

    def grad_norm(self) -> float:
        """The step's global gradient norm (computed over the host gradients once per step, or as set by
        :meth:`set_grad_norm`)."""
        self._clip_coefficient()
        return self.last_grad_norm

    def end_step(self, applied: bool = True) -> None:
        """End the step; one whose updates were not applied (its loss or gradient norm was not finite) does not
        count: the learning rate schedule stays where it was."""
        if applied:
            self.step_index += 1
