"""What lives on the compute device from one step to the next: the slots a schedule uses, the weights device updates
left there, the optimizer states kept there, and the sums of tied gradients."""

from __future__ import annotations

from typing import Callable

import torch

from megatrain.ir import Op, Schedule
from megatrain.layout import WIRE_STAGE_PARAMS
from megatrain.ir import slot_params
from megatrain.ir import LayerGraph
from megatrain.layout import OPT_SLOT_ROWS
from megatrain.runtime.memory.store import HostStore, grad_host_dtype


class DeviceState:
    """``w`` / ``g`` / ``o``: the weight (compute dtype), gradient (fp32) and optimizer (fp32, ``OPT_SLOT_ROWS``) slots,
    each as large as the largest layer a schedule puts in it. ``kept``: owner -> (its weights in the compute dtype
    as its last device update left them, the store generation they belong to). ``resident``: owner -> (the
    optimizer slot holding its current master weights and moments, the store generation); the host block holds an
    older copy. ``quiesce()`` waits until no earlier op can touch a device buffer (the issuer's)."""

    def __init__(self, graph: LayerGraph, store: HostStore, device: torch.device, dtype: torch.dtype,
                 quiesce: Callable[[], None]):
        self.graph, self.store, self.device, self.dtype, self.quiesce = graph, store, device, dtype, quiesce
        self.w: list[torch.Tensor] = []
        self.g: list[torch.Tensor] = []
        self.o: list[torch.Tensor] = []
        self.k: list[torch.Tensor] = []  # kept-gradient slots (fp32 or bf16, as the schedule's host gradients)
        self.kept: dict[int, tuple[torch.Tensor, int]] = {}
        self.kept_buf: dict[int, torch.Tensor] = {}
        self.resident: dict[int, tuple[int, int]] = {}
        self.tied_sums: dict[int, torch.Tensor] = {}  # owner -> its tied gradient's parts summed
        self.stage: torch.Tensor | None = None  # fp32 weights from the host pass through here on their way to a
        # weight slot of the compute dtype (:meth:`load_cast`)
        self.stage_params = WIRE_STAGE_PARAMS  # its elements at most; 0: none, torch's copy_ (benchmarks compare;
        # set while no op is in flight, with ``stage`` dropped)
        self._numels: dict[int, tuple] = {}  # id(schedule) -> (schedule, elements of each slot by pool)

    # ---- slots ------------------------------------------------------------------------------------------------
    def fit(self, schedule: Schedule) -> None:
        """Allocate the slots ``schedule`` uses, each of the size the plan counts. Slots of another size or dtype
        (another plan's), slots beyond what the schedule uses, and weights kept for layers it does not update on
        the device are freed first, once nothing uses them, then the missing ones allocated: another plan's
        buffers would otherwise stay allocated next to this one's (measured on the H200: a 7B plan for 32K tokens
        left too little device memory for the 131K-token plan after it; at 48 GiB, a plan with fewer split layers
        after one with more ran out of memory in its first forward, its slots kept at the larger plan's sizes)."""
        sizes = self.slot_numels(schedule)
        kept = grad_host_dtype(schedule.config)
        dtypes = {"w": self.dtype, "g": torch.float32, "o": torch.float32, "k": kept}
        extra = [p for p in dtypes if len(getattr(self, p)) > len(sizes[p])]
        stale = [l for l in self.kept_buf if l not in schedule.config.gpu_opt]
        homes = {k for k, _ in self.resident.values()}  # optimizer slots holding a state the step keeps there
        other = [(p, k) for p in dtypes for k, t in enumerate(getattr(self, p)[:len(sizes[p])])
                 if t is None or t.dtype != dtypes[p] or t.numel() < sizes[p][k] or
                 (t.numel() > sizes[p][k] and not (p == "o" and k in homes))]
        lost = [k for p, k in other if p == "o" and k in homes]
        if lost:
            raise RuntimeError(f"optimizer slots {lost} hold states kept on the device that the new plan's slots "
                               f"cannot hold (write them back before a plan that moves them)")
        if extra or stale or other:
            self.quiesce()  # nothing may still use the old buffers
            for p in extra:
                del getattr(self, p)[len(sizes[p]):]
            for l in stale:
                del self.kept_buf[l]
                self.kept.pop(l, None)
            for p, k in other:  # freed before any new one is allocated
                getattr(self, p)[k] = None
            if self.device.type == "cuda" and (extra or stale):
                torch.cuda.empty_cache()
        self._fit_stage(schedule)
        for pool, dtype in dtypes.items():
            slots: list = getattr(self, pool)
            for k, n in enumerate(sizes[pool]):
                if k == len(slots):
                    slots.append(None)
                if slots[k] is None:
                    slots[k] = torch.empty(n, dtype=dtype, device=self.device)

    def _fit_stage(self, schedule: Schedule) -> None:
        """The staging buffer of :meth:`load_cast`, where ``schedule`` sends fp32 weights to a GPU that computes in
        another dtype: ``stage_params`` elements, or the largest layer's if smaller (sized by the model, not the
        schedule, so that it never grows under a running step)."""
        if self.stage is not None or not (self.stage_params and self.device.type == "cuda" and
                                          self.dtype != torch.float32 and schedule.config.wire_bytes_per_param == 4):
            return
        self.stage = torch.empty(min(self.graph.largest_weights(), self.stage_params), dtype=torch.float32, device=self.device)

    def load_cast(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """``dst`` (on the device) <- ``src`` (host), rounded to ``dst``'s dtype. An fp32 ``src`` bound for a GPU slot
        of another dtype goes through the staging buffer a part at a time, each part copied and then cast on the
        current stream (whose order makes the buffer's reuse safe): torch's own ``copy_`` would allocate an fp32
        temporary of the whole layer from the caching allocator (an embedding or head of 545M parameters: 2 GiB)
        outside every planned slot, and temporaries of the head's and the blocks' sizes left side by side in its
        cache ran a 24 GiB plan out of memory on the H200."""
        if self.stage is None or dst.dtype == src.dtype or src.device.type != "cpu":
            dst.copy_(src, non_blocking=non_blocking)
            return
        step = self.stage.numel()
        for a in range(0, src.numel(), step):
            part = self.stage[: min(step, src.numel() - a)]
            part.copy_(src[a: a + part.numel()], non_blocking=non_blocking)
            dst[a: a + part.numel()].copy_(part)

    def slot_numels(self, schedule: Schedule) -> dict[str, list[int]]:
        """Elements of each weight, gradient and optimizer slot (``OPT_SLOT_ROWS`` rows) ``schedule`` uses."""
        cached = self._numels.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1]
        params = slot_params(self.graph, schedule)
        out = {"w": params["w"], "g": params["g"], "o": [n * len(OPT_SLOT_ROWS) for n in params["o"]],
               "k": params["k"], "h": params["h"]}
        self._numels[id(schedule)] = (schedule, out)
        return out

    def weights(self, op: Op) -> torch.Tensor:
        """The weights ``op``'s layer reads, in its weight slot."""
        return self.w[op.slot("w")][: self.graph.weight_params(op.layer)]

    def opt_block(self, op: Op) -> torch.Tensor:
        """The (4, n) block of ``op``'s optimizer slot, contiguous like the host block (copies need no staging)."""
        return self.state_block(self.graph.owner(op.layer), op.slot("o"))

    def part_block(self, op: Op, numel: int) -> torch.Tensor:
        """The (4, numel) block of ``op``'s optimizer slot that one part of a split update uses."""
        return self._rows_of(op.slot("o"), numel)

    def state_block(self, owner: int, k: int) -> torch.Tensor:
        return self._rows_of(k, self.graph[owner].params)

    def _rows_of(self, k: int, n: int) -> torch.Tensor:
        return self.o[k][: len(OPT_SLOT_ROWS) * n].view(len(OPT_SLOT_ROWS), n)

    def tied_sum(self, owner: int, numel: int) -> torch.Tensor:
        """The buffer a tied gradient's parts are summed in on the device before it goes to the host."""
        buf = self.tied_sums.get(owner)
        if buf is None or buf.numel() != numel:
            buf = self.tied_sums[owner] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return buf

    # ---- weights left by device updates -------------------------------------------------------------------
    def kept_weights(self, owner: int) -> torch.Tensor | None:
        """The layer's weights as its last device update left them, if the host master is still those."""
        kept = self.kept.get(owner)
        if kept is None or kept[1] != self.store.generation:
            return None
        return kept[0]

    def keeps(self, owners) -> bool:
        """Whether every one of ``owners`` (at least one) has its weights kept on the device."""
        owners = tuple(owners)
        return bool(owners) and all(self.kept_weights(o) is not None for o in owners)

    def kept_buffer(self, layer: int, numel: int) -> torch.Tensor:
        """Where a device update of ``layer`` leaves its new weights in the compute dtype."""
        buf = self.kept_buf.get(layer)
        if buf is None or buf.numel() != numel:
            buf = self.kept_buf[layer] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return buf

    def keep(self, layer: int, master: torch.Tensor | None, written: bool = False) -> None:
        """The updated ``master`` kept on the device in the compute dtype; ``written``: already in the layer's
        kept buffer (the update or a set-up wrote it there; ``master`` may then be None)."""
        buf = self.kept_buf[layer] if written else self.kept_buffer(layer, master.numel())
        if not written:
            buf.copy_(master)  # rounded to the compute dtype as a load would (to nearest even)
        self.kept[layer] = (buf, self.store.generation)

