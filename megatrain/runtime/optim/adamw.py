"""AdamW on the host store, one layer at a time, with an LR schedule and exact global-norm clipping."""

from __future__ import annotations

import bisect
import math
import sys

import torch

from megatrain.layout import HOST_UPDATE_CHUNK
from megatrain.runtime.optim import cpu_adamw
from megatrain.runtime.optim.cpu_adamw import FULL, MASTER, MOMENTS
from megatrain.runtime.optim.config import OptimConfig, lr_at
from megatrain.runtime.memory.store import HostStore

_SAID_TORCH_KERNEL = False  # the notice that megatrain's host kernel could not be built is printed once


def update_ranges(captured, layer: int, decay_all: bool = False) -> list[tuple[int, int, bool]]:
    """The spans of owner ``layer``'s flat block the optimizer updates: (start, end, weight decay applies),
    neighbouring parameters of one kind merged; frozen parameters (``requires_grad=False``) are in none."""
    spans = sorted((off, off + math.prod(shape), name) for name, (owner, off, shape)
                   in captured.model_param_names.items() if owner == layer)
    out: list[tuple[int, int, bool]] = []
    for a, b, name in spans:
        if name in captured.frozen:
            continue
        decay = decay_all or name not in captured.no_decay
        if out and out[-1][1] == a and out[-1][2] == decay:
            out[-1] = (out[-1][0], b, decay)
        else:
            out.append((a, b, decay))
    return out


class HostAdamW:
    """One ``torch.optim.AdamW`` per owning layer over views of the store's flat master row, its moments living in
    the store's exp_avg / exp_avg_sq rows (the optimizer allocates nothing): one parameter group per span of
    :func:`update_ranges` (weight decay or none; frozen parameters are in none). A layer with nothing to update
    has no optimizer."""

    def __init__(self, store: HostStore, cfg: OptimConfig):
        self.store, self.cfg = store, cfg
        self.opts: dict[int, torch.optim.AdamW] = {}
        self.ranges: dict[int, list[tuple[int, int, bool]]] = {}
        # the ranges cut into HOST_UPDATE_CHUNK elements and at every parameter's bounds: each chunk has its own Adam
        # step count (one parameter's count falls behind its layer's in steps that give it no gradient)
        self.chunks: dict[int, list[tuple[int, int, bool]]] = {}
        self.chunk_param: dict[int, list[int]] = {}  # per chunk: the offset of the parameter it is part of
        self.params: dict[int, list[torch.Tensor]] = {}  # the view objects the optimizers hold (new views would not
        # do), one per chunk: a bf16 gradient is read back into fp32 and applied a chunk at a time
        self._advanced: dict[int, list[int]] = {}  # per layer: the chunks its last device update counted a step in
        by_owner: dict[int, list[tuple[int, str]]] = {}
        for name, (owner, off, _) in store.captured.model_param_names.items():
            by_owner.setdefault(owner, []).append((off, name))
        self.param_names = {o: dict(sorted(v)) for o, v in by_owner.items()}  # owner -> {offset: parameter name}
        for layer in store.owners():
            ranges = self.ranges[layer] = update_ranges(store.captured, layer, cfg.decay_all)
            if not ranges:
                continue
            # cut at multiples of the chunk: a gradient that reaches the host in parts of that size (or a multiple)
            # is updated a part at a time (ScheduleConfig.host_grad_part)
            step_ = HOST_UPDATE_CHUNK
            starts = sorted(self.param_names[layer])
            chunks = self.chunks[layer] = []
            for a, b, d in ranges:
                cuts = sorted({a, b, *range((a // step_ + 1) * step_, b, step_), *(o for o in starts if a < o < b)})
                chunks += [(c, e, d) for c, e in zip(cuts, cuts[1:])]
            self.chunk_param[layer] = [starts[bisect.bisect_right(starts, a) - 1] for a, _, _ in chunks]
            master, exp_avg, exp_avg_sq = (store.row(layer, r) for r in ("master", "exp_avg", "exp_avg_sq"))
            views = self.params[layer] = [master[a:b] for a, b, _ in chunks]
            groups = [{"params": [v for v, (_, _, d) in zip(views, chunks) if d == decay],
                       "weight_decay": self._decay(decay)} for decay in (True, False)]
            opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                    fused=cfg.fused or None)
            for v, (a, b, _) in zip(views, chunks):
                opt.state[v] = {"step": torch.zeros((), dtype=torch.float32, device=v.device),
                                "exp_avg": exp_avg[a:b], "exp_avg_sq": exp_avg_sq[a:b]}
            self.opts[layer] = opt
        self.step_index = 0
        self.native = self._native_kernel(cfg)
        self.threads = cfg.threads  # may be changed between steps (benchmarks sweep it)
        self.block = cfg.host_block  # likewise
        # per step (its index; the last few kept): [seconds, parameters] of megatrain's kernel writing masters
        # (FULL or MASTER passes) by the kernel's own clock, against which a host op's span shows its overhead
        self.kernel_time: dict[int, list] = {}
        self._device_opts: dict[tuple, tuple[torch.optim.AdamW, torch.nn.Parameter]] = {}  # device updates
        self._grad_scales: dict[str, torch.Tensor] = {}  # per device: the fused kernel's 1 / clip factor
        self._kept: dict[int, list] = {}  # layer -> [its masters, its step count] before an update made early

    @staticmethod
    def _native_kernel(cfg: OptimConfig) -> bool:
        """Whether host updates run megatrain's kernel (``cfg.host_kernel``; only with ``fused``): building it is
        tried here, before the first step, so that "native" fails at once where it cannot be built."""
        if not cfg.fused or cfg.host_kernel == "torch":
            return False
        try:
            cpu_adamw.library()
        except cpu_adamw.KernelUnavailable as e:
            if cfg.host_kernel == "native":
                raise
            global _SAID_TORCH_KERNEL
            if not _SAID_TORCH_KERNEL:
                print(f"megatrain: host AdamW uses torch's fused kernel ({e}); megatrain's moves 4 bytes per "
                      f"parameter less", file=sys.stderr)
                _SAID_TORCH_KERNEL = True
            return False
        return True

    def _decay(self, applies: bool) -> float:
        return self.cfg.weight_decay if applies else 0.0

    # ---- Adam's step counts, one per chunk: its parameter's (behind its layer's by the steps that gave that
    # parameter no gradient, as torch.optim.AdamW counts only the steps a parameter has a gradient in) ----------
    def _counts(self, layer: int) -> list[torch.Tensor]:
        opt = self.opts.get(layer)
        return [opt.state[v]["step"] for v in self.params[layer]] if opt is not None else []

    def steps(self, layer: int) -> int:
        """The updates layer ``layer`` has had (0 for a layer with nothing to update): its parameters' most."""
        return int(max(self._counts(layer), default=0))

    def set_steps(self, layer: int, n: int) -> None:
        """Every parameter of ``layer`` at ``n`` updates."""
        for c in self._counts(layer):
            c.fill_(float(n))

    def counts(self, layer: int) -> list[int]:
        """Each chunk's step count (for :meth:`set_counts`)."""
        return [int(c) for c in self._counts(layer)]

    def set_counts(self, layer: int, counts: list[int]) -> None:
        for c, n in zip(self._counts(layer), counts, strict=True):
            c.fill_(float(n))

    def parameter_steps(self) -> dict[str, int]:
        """The step counts of the parameters whose count is behind their layer's (steps without a gradient), by
        name: what a training state keeps besides each layer's count."""
        out = {}
        for layer, counts in ((l, self.counts(l)) for l in self.opts):
            top = max(counts)
            for i, n in enumerate(counts):
                if n < top:
                    out[self.param_names[layer][self.chunk_param[layer][i]]] = n
        return out

    def set_parameter_steps(self, steps: dict[str, int]) -> None:
        """Counts of :meth:`parameter_steps`, after each layer's (:meth:`set_steps`)."""
        offsets = {name: (layer, off) for layer, names in self.param_names.items() for off, name in names.items()}
        for name, n in steps.items():
            layer, off = offsets[name]
            for c, p in zip(self._counts(layer), self.chunk_param[layer]):
                if p == off:
                    c.fill_(float(n))

    def _present(self, layer: int, absent) -> list[int]:
        """The indices of ``layer``'s chunks whose parameter has a gradient in the step (``absent``: the offsets of
        the parameters that have none: ``StepState.absent``)."""
        return [i for i, p in enumerate(self.chunk_param[layer]) if not absent or p not in absent]

    def undo_device_step(self, layer: int) -> None:
        """Take back the step count the last device update of ``layer`` advanced (a step not applied)."""
        counts = self._counts(layer)
        for i in self._advanced.pop(layer, range(len(counts))):
            counts[i] -= 1

    def begin_step(self) -> float:
        """Start an optimizer step; returns its learning rate."""
        lr = lr_at(self.cfg, self.step_index)
        for opt in self.opts.values():
            for group in opt.param_groups:
                group["lr"] = lr
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

    def step_layer(self, layer: int, grad: torch.Tensor, coef: float = 1.0, span: tuple[int, int] | None = None,
                   moments: bool = True, absent: frozenset[int] | None = None, spare: bool = False) -> None:
        """AdamW on one layer's host block with its gradient ``grad`` (a host buffer: fp32, changed in place where
        the update scales it, or bf16, read back into fp32 first: ``GradBuffers.as_fp32``) scaled by ``coef`` (the
        step's clip factor). ``span``: (lo, hi), the elements of the block ``grad`` holds the gradient of (one part
        of a gradient that comes to the host in parts; its bounds multiples of HOST_UPDATE_CHUNK or the block's
        end); None: all. ``moments=False`` (megatrain's kernel only): the new masters alone, the moments left for
        :meth:`step_moments` with the same gradient and factor, before anything else reads them or the gradient
        changes (the two leave the bits one update leaves). ``absent``: the offsets of the parameters the step gave
        no gradient (``StepState.absent``): left alone, their step counts too. ``spare`` (megatrain's kernel, the
        whole block): the new state written to the store's spare block for the layer (``HostStore.spare``), the
        rest of the block copied there, the layer's block left as it was."""
        opt = self.opts.get(layer)
        if opt is None:
            return
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # OpenMP: applies to the calling thread's parallel regions
        lo, hi, pairs = self._span_chunks(layer, span, absent)
        if grad.numel() != hi - lo:
            raise AssertionError(f"layer {layer}: a gradient of {grad.numel()} elements for span {lo}..{hi}")
        if any(a < hi and b > lo and not (lo <= a and b <= hi) for a, b, _ in self.chunks[layer]):
            raise AssertionError(f"layer {layer}: span {lo}..{hi} cuts an update chunk (chunks of "
                                 f"{HOST_UPDATE_CHUNK} elements)")
        if self.native:
            self._native_step(layer, opt, grad, coef, lo, hi, FULL if moments else MASTER, absent=absent,
                              spare=spare)
            return
        if not moments or spare:
            raise AssertionError("an update without its moments, or into the spare block, needs megatrain's host "
                                 "kernel")
        if grad.dtype == torch.float32:
            self._torch_step(opt, [v for v, _ in pairs], [grad[a - lo:b - lo] for _, (a, b) in pairs],
                             self._grad_scale(grad, coef))
        else:  # one chunk at a time (a parameter without a gradient is left alone by the step)
            for v, (a, b) in pairs:
                g = self.store.grads.as_fp32(grad[a - lo:b - lo])
                self._torch_step(opt, [v], [g], self._grad_scale(g, coef))
        self.store.refresh_shadow(layer, lo, hi)  # a plan with a bf16 wire loads the shadow next

    def step_moments(self, layer: int, grad: torch.Tensor, coef: float = 1.0,
                     span: tuple[int, int] | None = None, device: bool = False,
                     absent: frozenset[int] | None = None) -> None:
        """The moments of the update :meth:`step_layer` made with ``moments=False`` (same arguments; the gradient
        unchanged since); ``device``: of a split update on the device (:meth:`step_layer_on`) whose parts stored
        the masters alone, in the device update's arithmetic (every element as the GPU's kernel computes it)."""
        opt = self.opts.get(layer)
        if opt is None:
            return
        lo, hi, _ = self._span_chunks(layer, span)
        self._native_step(layer, opt, grad, coef, lo, hi, MOMENTS, whole=device, absent=absent)

    def _native_step(self, layer: int, opt: torch.optim.AdamW, grad: torch.Tensor, coef: float, lo: int, hi: int,
                     mode: int, whole: bool = False, absent: frozenset[int] | None = None, spare: bool = False) -> None:
        """:meth:`step_layer` by megatrain's kernel, a chunk at a time: the same arithmetic as torch's fused
        AdamW (each chunk's step count and its group's lr and weight decay as torch would take them), the
        gradient only read, the shadow (where the store has one) written by the same pass. ``mode``: the rows
        written (``cpu_adamw.FULL``, ``MASTER``: the step counts advance; ``MOMENTS``: of the update just made)."""
        master, exp_avg, exp_avg_sq = rows = self.store.rows(layer)
        to = self.store.spare(layer) if spare else None
        done = []  # the spans updated into the spare: the rest of its rows are copied from the block
        shadow = self.store.shadows[layer] if self.store.shadows is not None else None
        # the clip factor as the fused kernel takes it: the gradient divided by 1 / coef, rounded to fp32
        scale = None if coef == 1.0 else torch.tensor(1.0 / coef, dtype=torch.float32).item()
        lr = opt.param_groups[0]["lr"]  # every group's (begin_step)
        cfg = self.cfg
        for v, (a, b, decay), p in zip(self.params[layer], self.chunks[layer], self.chunk_param[layer]):
            if not (lo <= a and b <= hi) or (absent and p in absent):
                continue
            g = grad[a - lo:b - lo]
            if g.dtype != torch.float32:
                g = self.store.grads.as_fp32(g)
            count = opt.state[v]["step"]
            if mode != MOMENTS:
                count += 1
            secs = cpu_adamw.adamw(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], g, lr=lr, betas=cfg.betas,
                                   eps=cfg.eps, weight_decay=self._decay(decay), step=int(count), grad_scale=scale,
                                   out=shadow[a:b] if shadow is not None and mode != MOMENTS else None, mode=mode,
                                   threads=self.threads, whole=whole, block=self.block,
                                   to=None if to is None else tuple(r[a:b] for r in to))
            bisect.insort(done, (a, b))
            if mode != MOMENTS:
                kt = self.kernel_time.get(self.step_index)
                if kt is None:  # a new step's: the oldest steps' go
                    for old in [k for k in self.kernel_time if k < self.step_index - 8]:
                        del self.kernel_time[old]
                    kt = self.kernel_time[self.step_index] = [0.0, 0]
                kt[0] += secs
                kt[1] += b - a
        for src, dst in zip(rows, to or ()):  # the gaps between the spans updated (a row's end: its length)
            for a, b in zip([0] + [b for _, b in done], [a for a, _ in done] + [src.numel()]):
                if a < min(b, src.numel()):
                    dst[a:b].copy_(src[a:b])

    def count_step(self, layer: int, span: tuple[int, int] | None = None) -> None:
        """The update of ``layer`` (of its elements in ``span``, as :meth:`step_layer` takes it) was applied by
        another process to the store this one shares (data parallel): its Adam step counts advance as that update's
        did."""
        opt = self.opts.get(layer)
        if opt is None:
            return
        for v, _ in self._span_chunks(layer, span)[2]:
            opt.state[v]["step"] += 1

    def _span_chunks(self, layer: int, span: tuple[int, int] | None,
                     absent: frozenset[int] | None = None) -> tuple[int, int, list]:
        """(lo, hi, [(view, (a, b))]): ``span`` (None: the whole block) and the update chunks inside it (of the
        parameters not in ``absent``)."""
        lo, hi = span if span is not None else (0, self.store.master(layer).numel())
        return lo, hi, [(v, (a, b)) for v, (a, b, _), p in zip(self.params[layer], self.chunks[layer],
                                                                self.chunk_param[layer])
                        if lo <= a and b <= hi and not (absent and p in absent)]

    def step_layer_on(self, layer: int, block: torch.Tensor, lr: float, coef: float | torch.Tensor = 1.0,
                      out: torch.Tensor | None = None, span: tuple[int, int] | None = None,
                      absent: frozenset[int] | None = None) -> bool:
        """AdamW on a copy of the layer's block on the device (``block``: (4, n), rows as the store's), with the
        same hyper-parameters and step count as :meth:`step_layer`, learning rate ``lr`` (the step's: the host may
        still work on the previous step's updates) and clip factor ``coef`` (a device tensor spares the host a
        wait for the gradient norm); the caller copies master and moments (and the bf16 shadow, if any) back to
        the store.

        On a GPU (with ``fused``) the update is one Triton pass per range (``kernels.adamw_step``), which also
        writes the new master in ``out``'s dtype into ``out`` if given and the ranges cover the whole block;
        returns whether it did (else the caller rounds it).

        ``span``: (lo, hi), the elements of the layer ``block`` holds (one part of a split update, the parts of a
        step updated in order: the first counts the step); None: all. ``absent``: as :meth:`step_layer` takes it."""
        if layer not in self.opts:
            return False
        if span is None or span[0] == 0:  # the step counts of the parameters with a gradient advance
            counts, present = self._counts(layer), self._present(layer, absent)
            for i in present:
                counts[i] += 1
            self._advanced[layer] = present
        ranges = self._runs(layer, span, absent)
        if not ranges:
            return False
        master, exp_avg, exp_avg_sq, grad = block
        scale = self._grad_scale(grad, coef)
        whole = ranges[0][0] == 0 and ranges[-1][1] == block.shape[1] and all(
            x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
        if block.is_cuda and self.cfg.fused:
            from megatrain.kernels.adamw import adamw_step

            cfg = self.cfg
            for a, b, decay, step in ranges:
                adamw_step(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], lr=lr, betas=cfg.betas,
                           eps=cfg.eps, weight_decay=self._decay(decay), step=step, v_fma=cpu_adamw.v_fma(),
                           grad_scale=scale, out=out[a:b] if out is not None and whole else None)
            return out is not None and whole
        if not block.is_cuda and self.native:  # the CPU as the device: megatrain's kernel on every element, the
            # arithmetic of the GPU's (so a split update's moments computed on the host are the same bits)
            cfg = self.cfg
            for a, b, decay, step in ranges:
                cpu_adamw.adamw(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], lr=lr, betas=cfg.betas,
                                eps=cfg.eps, weight_decay=self._decay(decay), step=step,
                                grad_scale=None if scale is None else float(scale), threads=self.threads,
                                whole=True, block=self.block)
            return False
        opt, p = self._device_opt(layer, block.device)
        state = opt.state[p]
        opt.param_groups[0]["lr"] = lr
        try:
            for a, b, decay, step in ranges:
                state["step"].fill_(float(step - 1))
                state["exp_avg"], state["exp_avg_sq"] = exp_avg[a:b], exp_avg_sq[a:b]
                opt.param_groups[0]["weight_decay"] = self._decay(decay)
                p.data = master[a:b]
                self._torch_step(opt, [p], [grad[a:b]], scale)
        finally:
            p.data = torch.empty(0, device=block.device)
            state["exp_avg"] = state["exp_avg_sq"] = None
        return False

    def _runs(self, layer: int, span: tuple[int, int] | None, absent) -> list[tuple[int, int, bool, int]]:
        """The elements of ``span`` (None: the whole layer) a device update writes, in runs of chunks alike in weight
        decay and step count: (start, end relative to the span, decay, step count), the chunks of ``absent``
        parameters left out."""
        lo, hi = span if span is not None else (0, self.store.master(layer).numel())
        counts, runs = self.counts(layer), []
        for i in self._present(layer, absent):
            a, b, decay = self.chunks[layer][i]
            a, b = max(a, lo) - lo, min(b, hi) - lo
            if a >= b:
                continue
            if runs and runs[-1][1] == a and runs[-1][2:] == (decay, counts[i]):
                runs[-1] = (runs[-1][0], b, decay, counts[i])
            else:
                runs.append((a, b, decay, counts[i]))
        return runs

    @staticmethod
    def _torch_step(opt: torch.optim.AdamW, params: list[torch.Tensor], grads: list[torch.Tensor],
                    scale: torch.Tensor | None) -> None:
        """``opt.step()`` with ``grads`` as ``params``' gradients, divided by ``scale`` in the fused kernel if
        given."""
        for p, g in zip(params, grads):
            p.grad = g
        if scale is not None:
            opt.grad_scale = scale
        try:
            opt.step()
        finally:
            for p in params:
                p.grad = None
            if scale is not None:
                del opt.grad_scale

    def _device_opt(self, layer: int, device: torch.device) -> tuple[torch.optim.AdamW, torch.nn.Parameter]:
        key = (layer, str(device))
        if key not in self._device_opts:
            p = torch.nn.Parameter(torch.empty(0, device=device))
            cfg = self.cfg
            opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=cfg.fused or None)
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=device)}
            self._device_opts[key] = (opt, p)
        return self._device_opts[key]

    # ---- updates made before the step's global norm is known (ScheduleConfig.speculate) ------------------
    def keep_masters(self, layer: int, window: tuple[int, ...] = (), masters: bool = True) -> None:
        """Keep ``layer``'s master weights and Adam step count as they are, for :meth:`restore_masters` (one copy
        per layer, made once and rewritten each time: the host bytes the plan counts for it); ``masters=False``:
        the step count alone (an update into the spare block leaves the masters where they are). ``window``: the
        schedule's layers that keep theirs; copies and spare blocks of others (a plan run before) are let go."""
        for other in [l for l in self._kept if l != layer and window and l not in window]:
            del self._kept[other]
        if window:
            self.store.drop_spares(window if not masters else ())
        kept = self._kept.get(layer)
        if kept is None or (kept[0] is not None) != masters:
            kept = self._kept[layer] = [torch.empty_like(self.store.master(layer)) if masters else None, 0]
        if masters:
            kept[0].copy_(self.store.master(layer))
        kept[1] = self.counts(layer)

    def restore_masters(self, layer: int) -> None:
        """Put back the master weights and step count :meth:`keep_masters` kept (and the bf16 shadow made from
        them), undoing an update that wrote the masters alone (or one into the spare block: the count alone)."""
        master, count = self._kept[layer]
        if master is not None:
            self.store.master(layer).copy_(master)
        self.store.refresh_shadow(layer)
        self.set_counts(layer, count)

    def end_step(self, applied: bool = True) -> None:
        """End the step; one whose updates were not applied (its loss or gradient norm was not finite) does not
        count: the learning rate schedule stays where it was."""
        if applied:
            self.step_index += 1
