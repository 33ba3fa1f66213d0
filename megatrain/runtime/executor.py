"""The executor: interprets a Schedule, op by op, in program order (the synchronous mode; CPU and plain CUDA).

It keeps, for every slot, the content it holds and how many of that content's readers have run, and refuses an op
that reads the wrong content or overwrites content a later op still needs; the error shows the schedule around the
failing op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from megatrain.ir import (SLOT_POOL, Op, OpKind, Schedule, Stream, format_table, initial_contents, resident_slots,
                          slot_contents)
from megatrain.capture import Captured
from megatrain.planner.cost import OPT_STATE_ROWS, slot_params
from megatrain.runtime.grad_sink import GradSink, sink_to
from megatrain.runtime.kernel_rewrite import keep_less
from megatrain.runtime.optim import HostAdamW
from megatrain.runtime.rng import StepRng
from megatrain.runtime.store import ROWS, HostStore
from megatrain.runtime.templates import LayerRunner

IGNORE_INDEX = -100


class ExecutionError(RuntimeError):
    def __init__(self, schedule: Schedule, op: Op, message: str):
        self.op = op
        table = format_table(schedule, mark=op.id, context=12)
        super().__init__(f"op '{op}': {message}\n{table}")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (b, T) int64
    attention_mask: torch.Tensor  # (b, T) int64, 1 = real token
    next_labels: torch.Tensor  # (b, T) int64: the label each position predicts (the next token), or -100


@dataclass
class StepOutput:
    loss: float  # summed over micro-batches, normalized by the step's valid tokens
    mb_loss_sums: list[float]  # un-normalized cross-entropy sum per micro-batch
    grad_norm: float | None  # global gradient norm before clipping (None without clipping)
    lr: float
    applied: bool = True  # False: the loss or the gradient norm was not finite and no update was applied


class Executor:
    non_blocking = False  # host <-> device copies: synchronous here, asynchronous on the streaming executor

    def __init__(self, captured: Captured, store: HostStore, optimizer: HostAdamW, device: torch.device,
                 compute_dtype: torch.dtype, head_loss=None):
        self.captured, self.store, self.optimizer = captured, store, optimizer
        self.graph = captured.graph
        self.device, self.dtype = torch.device(device), compute_dtype
        self.runner = LayerRunner(captured, self.device)
        self.head_loss = head_loss  # HeadLossSpec: the head runs as the fused linear + cross-entropy kernel
        self.slot_numel = max(self.graph.weight_params(i) for i in range(len(self.graph)))  # the largest layer
        self.w: list[torch.Tensor] = []
        self.g: list[torch.Tensor] = []
        self.o: list[torch.Tensor] = []  # optimizer slots: (4, n) fp32 blocks for the device updates
        # a device update leaves the layer's new weights (compute dtype) here for the next step's load, which then
        # copies them on the device instead of loading the host master: owner -> (buffer, store generation)
        self.kept: dict[int, tuple[torch.Tensor, int]] = {}
        self.kept_buf: dict[int, torch.Tensor] = {}
        # layers whose state stays on the device (ScheduleConfig.resident_opt): owner -> (optimizer slot, store
        # generation); the slot holds the layer's current master weights and moments, the host block an older copy
        self.resident: dict[int, tuple[int, int]] = {}
        store.before_load.append(self._release_resident)  # new masters from outside: the moments stay current
        self._slot_plans: dict[int, tuple] = {}  # id(schedule) -> (schedule, slot contents per op, accesses)
        self._numels: dict[int, tuple] = {}  # id(schedule) -> (schedule, elements of each slot by pool)
        self._homes: dict[int, tuple] = {}  # id(schedule) -> (schedule, its resident layers' optimizer slots)
        self.saved_layers: frozenset[int] = frozenset()  # the running schedule's saved_acts
        self.saved_lean = False  # and its saved_lean
        self._bwd_weights: torch.Tensor | None = None  # the weights a BWD of a saved layer finds its saved ones in
        self.rng = StepRng(self.device)  # each (layer, micro-batch) draws from its own seed (runtime/rng.py)

    def _pools(self, schedule: Schedule) -> None:
        """Allocate the weight, gradient and optimizer slots the schedule uses, each as large as the largest layer
        the schedule puts in it; a slot that a later schedule needs larger is replaced once nothing uses it. Slots
        beyond what the schedule uses, and weights kept for layers it does not update on the device, are freed
        first (once nothing uses them): another plan's buffers would otherwise stay allocated next to this one's
        (measured: a 7B plan for 32K tokens left too little device memory for the 131K-token plan after it)."""
        sizes = self._slot_numels(schedule)
        extra = [p for p in ("w", "g", "o") if len(getattr(self, p)) > len(sizes[p])]
        stale = [l for l in self.kept_buf if l not in schedule.config.gpu_opt]
        if extra or stale:
            self._quiesce()
            for p in extra:
                del getattr(self, p)[len(sizes[p]):]
            for l in stale:
                del self.kept_buf[l]
                self.kept.pop(l, None)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        for pool, dtype in (("w", self.dtype), ("g", torch.float32), ("o", torch.float32)):
            slots: list[torch.Tensor] = getattr(self, pool)
            for k, n in enumerate(sizes[pool]):
                if k < len(slots) and slots[k].numel() >= n:
                    continue
                if k < len(slots):
                    self._quiesce()  # nothing may still use the old buffer
                    slots[k] = torch.empty(n, dtype=dtype, device=self.device)
                else:
                    slots.append(torch.empty(n, dtype=dtype, device=self.device))

    def _slot_numels(self, schedule: Schedule) -> dict[str, list[int]]:
        """Elements of each weight (compute dtype), gradient (fp32) and optimizer (fp32, ROWS rows) slot."""
        cached = self._numels.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1]
        params = slot_params(self.graph, schedule)
        out = {"w": params["w"], "g": params["g"], "o": [n * len(ROWS) for n in params["o"]]}
        self._numels[id(schedule)] = (schedule, out)
        return out

    def run(self, schedule: Schedule, mbs: list[MicroBatch], denom: int) -> StepOutput:
        """One optimizer step. ``denom``: valid (label != -100) tokens of the whole step."""
        cfg = schedule.config
        if cfg.n_steps != 1 or cfg.n_mb != len(mbs):
            raise ValueError(f"schedule is for {cfg.n_steps} step(s) x {cfg.n_mb} mbs, got 1 step x {len(mbs)} mbs")
        self._settle_resident(schedule)
        self._pools(schedule)
        self.wire = cfg.wire_bytes_per_param
        tags, accesses = self._slot_plan(schedule)
        self.tags = tags  # per op id: (slot role -> content read, slot role -> content written)
        self.contents: dict[tuple[str, int], tuple] = initial_contents(schedule, self._resident_slots(schedule))
        self.act: dict[int, torch.Tensor] = {}
        self.host_act: dict[tuple[int, int], torch.Tensor] = {}
        self.side: dict[int, dict] = {}
        self.saved_layers, self.saved_lean = frozenset(cfg.saved_acts), cfg.saved_lean
        self.saved: dict[tuple[int, int], tuple] = {}  # (layer, mb) -> (output, input, weight views): see _forward_saved
        self.stored: set[int] = set()
        self.loss_sums: list[torch.Tensor | float] = [0.0] * len(mbs)  # tensors until the step ends (no syncs)
        # a micro-batch without padding passes no mask where the model allows it (see Captured.mask_optional):
        # decided here, on the host copy, so the embedding layer does not read the mask back from the device
        optional = self.runner.captured.mask_optional
        dense = [optional and bool(mb.attention_mask.all()) for mb in mbs]
        self.mbs = [MicroBatch(*(self._to_device(t) for t in (mb.input_ids, mb.attention_mask, mb.next_labels)))
                    for mb in mbs]
        self.masks = [None if d else mb.attention_mask for d, mb in zip(dense, self.mbs)]
        self.denom = denom
        self.step_ok: bool | None = None  # whether the step's updates may run, decided at its first OPT
        lr = self._begin_step()
        self.rng.begin()
        try:
            self._interpret(schedule, tags, accesses)
        finally:
            self.rng.end()
        self._end_step()
        for layer, k in self._resident_slots(schedule).items():
            self.resident[layer] = (k, self.store.generation)
        sums = self._loss_values()
        return StepOutput(sum(sums) / denom, sums, self.optimizer.last_grad_norm, lr, self.step_ok is not False)

    def _interpret(self, schedule: Schedule, tags, accesses) -> None:
        """Check each op's slot contents against the plan and issue it, in program order."""
        position = {key: 0 for key in accesses}
        for op in schedule.ops:
            reads, writes = tags[op.id]
            for role, idx in op.slots:
                key = (SLOT_POOL[role], idx)
                if role in reads:
                    have = self.contents.get(key)
                    if have != reads[role]:
                        raise ExecutionError(schedule, op, f"reads {role}{idx} expecting {reads[role]}, "
                                                           f"the slot holds {have}")
            for role, idx in op.slots:
                key = (SLOT_POOL[role], idx)
                acc = accesses[key]
                while position[key] < len(acc) and acc[position[key]][0] == op.id:
                    position[key] += 1
                if role not in writes:
                    continue
                nxt = acc[position[key]] if position[key] < len(acc) else None
                old = self.contents.get(key)
                if nxt is not None and nxt[1] and old is not None and nxt[2] == old:
                    raise ExecutionError(schedule, op, f"loading {role}{idx} with {writes[role]} while "
                                                       f"'{schedule.ops[nxt[0]]}' still reads {old} from it")
                self.contents[key] = writes[role]
            try:
                self._issue(op)
            except ExecutionError:
                raise
            except Exception as e:
                raise ExecutionError(schedule, op, f"{type(e).__name__}: {e}") from e

    # ---- resident optimizer state ----------------------------------------------------------------------------
    def can_continue(self, schedule: Schedule) -> bool:
        """Whether the continuing ``schedule`` can run now: every device-updated layer's new weights are kept here
        and every resident layer's state is in the slot the schedule expects it in, from the current store."""
        return (self.keeps(schedule.config.gpu_opt) and all(self.resident.get(l) == (k, self.store.generation)
                                                            for l, k in self._resident_slots(schedule).items()))

    def _resident_slots(self, schedule: Schedule) -> dict[int, int]:
        """:func:`~megatrain.ir.resident_slots` of ``schedule``, computed once per schedule."""
        cached = self._homes.get(id(schedule))
        if cached is None or cached[0] is not schedule:
            cached = self._homes[id(schedule)] = (schedule, resident_slots(schedule, self.graph.owner))
        return cached[1]

    def _settle_resident(self, schedule: Schedule) -> None:
        """Before a step: a continuing schedule finds its resident states where it expects them (else an error,
        before anything runs); every other resident state goes back to the host store, which the step may read
        (a state that a new load of the store made stale is dropped)."""
        keep = self._resident_slots(schedule) if schedule.config.continues else {}
        missing = [l for l, k in keep.items() if self.resident.get(l) != (k, self.store.generation)]
        if missing:
            raise ValueError(f"the continuing schedule expects the state of layers {missing} on the device, which "
                             f"this executor does not hold (run the plan's first-step schedule first)")
        leave = {l: v for l, v in self.resident.items() if keep.get(l) != v[0]}
        if leave:
            self._write_back(leave)
            for l in leave:
                del self.resident[l]

    def set_step(self, steps_done: int) -> None:
        """Go on as if ``steps_done`` steps had been taken (a loaded training state): the learning rate follows."""
        self.optimizer.step_index = steps_done

    def sync_resident(self) -> None:
        """Write every resident state back to the host store, which then holds the current master weights and
        moments (they stay on the device too: the next step continues from there)."""
        self._write_back(self.resident)

    def _release_resident(self) -> None:
        """Write every resident state back and keep none (the store's masters are about to change)."""
        self.sync_resident()
        self.resident.clear()

    def _write_back(self, states: dict[int, tuple[int, int]]) -> None:
        states = {l: k for l, (k, gen) in states.items() if gen == self.store.generation}
        if not states:
            return
        self._quiesce()  # the last updates are done
        for l, k in states.items():
            n = self.graph[l].params
            self._store_state(l, self.o[k][: len(ROWS) * n].view(len(ROWS), n))
        self._quiesce()  # and the copies

    def _slot_plan(self, schedule: Schedule):
        """Per op its slot contents (reads, writes), and every access of every slot in program order: (op id,
        reads?, content). Computed once per schedule (the API reuses schedule objects step after step)."""
        cached = self._slot_plans.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1], cached[2]
        shared = lambda layer: bool(self.graph.tied_to(layer))  # noqa: E731
        resident = set(schedule.config.resident_opt).__contains__
        tags = [slot_contents(op, self.graph.owner, schedule.config.n_mb, shared, resident) for op in schedule.ops]
        accesses: dict[tuple[str, int], list[tuple[int, bool, tuple]]] = {}
        for op in schedule.ops:
            reads, writes = tags[op.id]
            for role, idx in op.slots:
                acc = accesses.setdefault((SLOT_POOL[role], idx), [])
                if role in reads:
                    acc.append((op.id, True, reads[role]))
                if role in writes:
                    acc.append((op.id, False, writes[role]))
        self._slot_plans[id(schedule)] = (schedule, tags, accesses)
        return tags, accesses

    # ---- hooks the streaming executor overrides --------------------------------------------------------------
    def _quiesce(self) -> None:
        """Wait until no earlier op can still touch a device buffer (here every op has run by the time it returns)."""

    def _begin_step(self) -> float:
        return self.optimizer.begin_step()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """An input tensor on the compute device; from pinned memory on a GPU, so the host does not wait for the
        copy (a copy from pageable memory does)."""
        if self.device.type != "cuda" or t.device.type != "cpu":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _loss_values(self) -> list[float]:
        """Each micro-batch's loss sum, as floats (waits for the losses)."""
        return [float(t) for t in self.loss_sums]

    def _end_step(self) -> None:
        self.optimizer.end_step(applied=self.step_ok is not False)

    def _updates_allowed(self) -> bool:
        """Whether this step's updates may run: its loss, and with clipping its global gradient norm, finite. Decided
        at the step's first OPT, before anything is updated (every LOSS has run by then; with clipping every
        gradient is stored); a step that fails applies no update at all."""
        if self.step_ok is None:
            losses = torch.stack([torch.as_tensor(t, dtype=torch.float32).reshape(()).cpu() for t in self.loss_sums])
            ok = bool(torch.isfinite(losses).all())
            if self.optimizer.cfg.max_grad_norm is not None:
                ok = ok and math.isfinite(self.optimizer.grad_norm())
            self.step_ok = ok
        return self.step_ok

    def _issue(self, op: Op) -> None:
        self._execute(op)

    # ---- ops ------------------------------------------------------------------------------------------------
    def _weights(self, op: Op) -> torch.Tensor:
        return self.w[op.slot("w")][: self.graph.weight_params(op.layer)]

    def _grad_sink(self, op: Op) -> GradSink:
        """Where the backward of ``op`` puts its parameter gradients: the fp32 gradient slot, which the first
        micro-batch writes instead of adding to (cleared first where the layer's parameters do not tile it)."""
        g = self.g[op.slot("g")]
        first = op.mb == 0
        numel = self.graph.weight_params(op.layer)
        if first and not self.runner.tiles(op.layer, numel):  # gaps, shared or unused spans: clear, then add
            g[:numel].zero_()
            first = False
        return GradSink(g, accumulate=not first)

    @staticmethod
    def _grads(sink: GradSink, out, inputs: list, dy=None) -> tuple:
        """``autograd.grad`` of ``out`` (against ``dy``) for ``inputs``, the templates' linears sending their
        weight gradients to ``sink``; None for an input the output does not depend on (or whose gradient went
        there)."""
        with sink_to(sink):
            return torch.autograd.grad(out, inputs, dy, allow_unused=True)

    @staticmethod
    def _accumulate(sink: GradSink, views: list, grads) -> None:
        """The gradients autograd returned (compute dtype) into the sink's slot, next to those its linears wrote."""
        for (off, n, _), dw in zip(views, grads):
            sink.put(off, n, dw)

    def _execute(self, op: Op) -> None:
        k, l = op.kind, op.layer
        if k is OpKind.FWD or k is OpKind.BWD or k is OpKind.LOSS:  # a forward (again): this (layer, mb)'s draws
            self.rng.seed(l, op.mb)
        if k is OpKind.LOAD_W:  # the weights a device update left here, or from the host: the fp32 master (cast
            # where it lands) or the bf16 shadow; all three hold the same values in the compute dtype
            o = self.graph.owner(l)
            kept = self.kept_weights(o)
            src = kept if kept is not None else self._wire(o)
            self.w[op.slot("w")][: src.numel()].copy_(src, non_blocking=self.non_blocking)
        elif k is OpKind.FWD and l in self.saved_layers:
            self._forward_saved(op)
        elif k is OpKind.FWD:
            with torch.no_grad():
                if l == 0:
                    mb = self.mbs[op.mb]
                    h, self.side[op.mb] = self.runner.run(0, self._weights(op),
                                                          (mb.input_ids, self.masks[op.mb]))
                else:
                    h = self.runner.run(l, self._weights(op), self.act[op.slot("x")], self.side[op.mb])
            self.act[op.slot("y")] = h
        elif k is OpKind.LOSS:
            self._loss(op)
        elif k is OpKind.BWD:
            self._backward(op)
        elif k is OpKind.SAVE_ACT:
            t = self.act[op.slot("a")]
            self.host_act[(l, op.mb)] = t.to("cpu", copy=True)
        elif k is OpKind.LOAD_ACT:
            self.act[op.slot("a")] = self.host_act.pop((l, op.mb)).to(self.device)
        elif k is OpKind.STORE_G and op.stream is Stream.COMPUTE:  # into the optimizer slot of a device update
            src = self.g[op.slot("g")][: self.graph.weight_params(l)]
            # and to the host row too: this executor's clipping takes the global norm over the host gradients
            for dst in (self._opt_block(op)[3], self.store.grad(self.graph.owner(l))):
                self._put_part(dst, src, l)
        elif k is OpKind.STORE_G:
            o = self.graph.owner(l)
            dst = self.store.grad(o)
            src = self.g[op.slot("g")][: dst.numel()]
            if o in self.stored:
                dst.add_(src.to(dst.device))
            else:
                dst.copy_(src)
                self.stored.add(o)
        elif k is OpKind.OPT and not self._updates_allowed():  # nothing changes; a device update's layer keeps
            if op.stream is Stream.COMPUTE:  # its unchanged weights for the next load, as an update would
                self._keep(l, self._opt_block(op)[0])
        elif k is OpKind.OPT and op.stream is Stream.COMPUTE:
            self._update_on_device(op)
        elif k is OpKind.OPT:
            self.kept.pop(l, None)  # the host master changes: a kept copy would be stale
            self.optimizer.step_layer(l)
        elif k is OpKind.LOAD_OPT:
            self._load_opt(op)
        elif k is OpKind.STORE_OPT:
            self._store_opt(op)
        else:
            raise AssertionError(k)

    def _load_opt(self, op: Op, before_row=None) -> None:
        """Master weights and moments into the optimizer slot, a row at a time (``before_row(r)`` runs before row
        r is copied); the gradient row is filled by the layer's STORE_G."""
        block, host = self._opt_block(op), self.store.block(op.layer)
        for r in range(OPT_STATE_ROWS):
            if before_row is not None:
                before_row(r)
            block[r].copy_(host[r], non_blocking=self.non_blocking)

    def _store_opt(self, op: Op, after_row=None) -> None:
        """Updated master weights and moments back to the host block, a row at a time (``after_row(r)`` runs after
        row r's copy is issued); the gradient row stays as stored."""
        self._store_state(op.layer, self._opt_block(op), after_row)

    def _store_state(self, layer: int, block: torch.Tensor, after_row=None) -> None:
        host = self.store.block(layer)
        for r in range(OPT_STATE_ROWS):
            host[r].copy_(block[r], non_blocking=self.non_blocking)
            if after_row is not None:
                after_row(r)
        if self.store.shadows is not None:  # kept current whichever wire this schedule uses; rounded where the
            # update ran, to nearest even as the host would
            self.store.shadow(layer).copy_(block[0].to(torch.bfloat16), non_blocking=self.non_blocking)

    def kept_weights(self, owner: int) -> torch.Tensor | None:
        """The layer's weights as its last device update left them, if the host master is still those."""
        kept = self.kept.get(owner)
        if kept is None or kept[1] != self.store.generation:
            return None
        return kept[0]

    def keeps(self, owners) -> bool:
        """Whether every one of ``owners`` (at least one) has its weights kept on the device (``kept_weights``)."""
        owners = tuple(owners)
        return bool(owners) and all(self.kept_weights(o) is not None for o in owners)

    def _update_on_device(self, op: Op, **step_args) -> None:
        """AdamW of ``op``'s layer in its optimizer slot (``step_args``: lr, coef of ``step_layer_on``); its new
        weights kept here in the compute dtype, written by the update where it can."""
        block = self._opt_block(op)
        written = self.optimizer.step_layer_on(op.layer, block, out=self._kept_buffer(op.layer, block.shape[1]),
                                               **step_args)
        self._keep(op.layer, block[0], written)

    def _kept_buffer(self, layer: int, numel: int) -> torch.Tensor:
        """Where a device update of ``layer`` leaves its new weights in the compute dtype."""
        buf = self.kept_buf.get(layer)
        if buf is None or buf.numel() != numel:
            buf = self.kept_buf[layer] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return buf

    def _keep(self, layer: int, master: torch.Tensor, written: bool = False) -> None:
        """The updated ``master`` kept on the device in the compute dtype; ``written``: the update wrote it."""
        buf = self._kept_buffer(layer, master.numel())
        if not written:
            buf.copy_(master)  # rounded to the compute dtype as a load would (to nearest even)
        self.kept[layer] = (buf, self.store.generation)

    def _wire(self, owner: int) -> torch.Tensor:
        """What LOAD_W sends: the bf16 shadow (plans with a bf16 wire) or the fp32 master (cast on the device)."""
        return self.store.shadow(owner) if self.wire == 2 else self.store.master(owner)

    def _put_part(self, dst: torch.Tensor, src: torch.Tensor, layer: int) -> None:
        """A STORE_G into an optimizer slot: the first or only part of the gradient is written, the owner's own
        part of a tied gradient (which comes last, after the tied layer's) added."""
        if self.graph.owner(layer) != layer or not self.graph.tied_to(layer):
            dst.copy_(src)
        else:
            dst.add_(src)

    def _opt_block(self, op: Op) -> torch.Tensor:
        """The (4, n) block of an optimizer slot, contiguous like the host block (copies need no staging)."""
        n = self.graph[self.graph.owner(op.layer)].params
        return self.o[op.slot("o")][: len(ROWS) * n].view(len(ROWS), n)

    def _loss(self, op: Op) -> None:
        if self.head_loss is not None:
            return self._fused_loss(op)
        x = self.act[op.slot("x")].detach().requires_grad_()
        views: list = []
        with torch.enable_grad():
            logits = self.runner.run(op.layer, self._weights(op), x, self.side[op.mb], grad_views=views)
            labels = self.mbs[op.mb].next_labels
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            sink = self._grad_sink(op)
            dx, *dws = self._grads(sink, loss_sum / self.denom, [x, *(v for *_, v in views)])
        self.loss_sums[op.mb] = loss_sum.detach()
        self._accumulate(sink, views, dws)
        self.act[op.slot("x")] = dx

    def _fused_loss(self, op: Op) -> None:
        from megatrain.kernels.linear_ce import linear_cross_entropy_forward
        from megatrain.runtime.templates import bind

        seg = self.captured.segments[op.layer]
        spec = self.head_loss
        ref = next(r for r in seg.params if r.name == spec.weight_name)
        weight = bind(seg, self._weights(op))[spec.weight_name]  # (V, H)
        g = self.g[op.slot("g")]
        if op.mb == 0:
            g[: self.graph.weight_params(op.layer)].zero_()
        grad_w = g[ref.offset: ref.offset + weight.numel()].view(weight.shape)
        x = self.act[op.slot("x")]
        loss, dh, _ = linear_cross_entropy_forward(x.reshape(-1, x.shape[-1]), weight,
                                                   self.mbs[op.mb].next_labels.reshape(-1), self.denom,
                                                   grad_weight=grad_w, softcap=spec.softcap)
        self.loss_sums[op.mb] = loss * self.denom
        self.act[op.slot("x")] = dh.view_as(x)

    def _forward_saved(self, op: Op) -> None:
        """The forward of a layer in ``saved_acts``: with autograd on, keeping what its backward needs. The
        weights it saves are views of this weight slot, which other layers overwrite before the backward: they
        are saved as their place in the layer's weights and found again in the slot the BWD reads
        (:class:`_WeightRef`); activations stay as they are (on the device, until the BWD)."""
        flat = self._weights(op)
        x = self.act[op.slot("x")].detach().requires_grad_()
        views: list = []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_WeightRef.packer(flat), self._unpack), \
                keep_less(self.saved_lean):
            out = self.runner.run(op.layer, flat, x, self.side[op.mb], grad_views=views)
        self.saved[(op.layer, op.mb)] = (out, x, views)
        self.act[op.slot("y")] = out.detach()

    def measure_saved_bytes(self, layer: int, seq_len: int, lean: bool = False) -> int:
        """Bytes that ``layer``'s forward saves for its backward on this device with these templates (kernels or
        not, whatever attention the model uses), for one sequence of ``seq_len`` tokens: activations only, not
        the weights (views of the slot), the layer's input (its checkpoint, counted apart) or the side inputs
        every layer shares; ``lean``: keeping less (``ScheduleConfig.saved_lean``). Runs the embedding and the
        layer once on random tokens, with weights copied from the host store into temporary buffers; the random
        generators are left as they were (a seeded run draws the same whether it measures or not)."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            return self._measure_saved_bytes(layer, seq_len, lean)

    def _measure_saved_bytes(self, layer: int, seq_len: int, lean: bool) -> int:
        vocab = self.captured.vocab_size
        ids = torch.randint(0, vocab, (1, seq_len), device=self.device)
        mask = None if self.captured.mask_optional else torch.ones_like(ids)
        first = self.store.master(self.graph.owner(0)).to(self.device, self.dtype)
        with torch.no_grad():
            h, side = self.runner.run(0, first, (ids, mask))
        del first
        flat = self.store.master(self.graph.owner(layer)).to(self.device, self.dtype)
        x = h.detach().requires_grad_()
        skip = {flat.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
        skip |= {v.untyped_storage().data_ptr() for v in tree_leaves(side)
                 if isinstance(v, torch.Tensor)}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip:
                kept[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                keep_less(lean):
            out = self.runner.run(layer, flat, x, side, grad_views=[])
        del out
        return sum(kept.values())

    def _unpack(self, packed):
        return packed.view_of(self._bwd_weights) if isinstance(packed, _WeightRef) else packed

    def _backward(self, op: Op) -> None:
        sink = self._grad_sink(op)
        if op.layer in self.saved_layers:
            out, x, views = self.saved.pop((op.layer, op.mb))
            self._bwd_weights = self._weights(op)
            try:
                dx, *dws = self._grads(sink, out, [x, *(v for *_, v in views)], self.act[op.slot("dy")])
            finally:
                self._bwd_weights = None
            self.act[op.slot("x")] = dx
            self._accumulate(sink, views, dws)
            return
        flat = self._weights(op)
        dy = self.act[op.slot("dy")]
        views: list = []
        with torch.enable_grad():
            if op.layer == 0:
                mb = self.mbs[op.mb]
                h, _ = self.runner.run(0, flat, (mb.input_ids, self.masks[op.mb]), grad_views=views)
                dws = self._grads(sink, h, [v for *_, v in views], dy)
            else:
                x = self.act[op.slot("x")].detach().requires_grad_()
                out = self.runner.run(op.layer, flat, x, self.side[op.mb], grad_views=views)
                dx, *dws = self._grads(sink, out, [x, *(v for *_, v in views)], dy)
                self.act[op.slot("x")] = dx
        self._accumulate(sink, views, dws)
        if op.layer == 0:
            self.side.pop(op.mb, None)


class _WeightRef:
    """A weight tensor autograd saved in a forward (see :meth:`Executor._forward_saved`): where it lies in the
    layer's flat weights (element offset, shape, strides), to be viewed again in whichever slot holds them later."""

    __slots__ = ("offset", "shape", "stride")

    def __init__(self, offset: int, shape: tuple, stride: tuple):
        self.offset, self.shape, self.stride = offset, shape, stride

    @staticmethod
    def packer(flat: torch.Tensor):
        """A pack hook: tensors on ``flat``'s storage become references into it, others are kept as they are."""
        ptr, base = flat.untyped_storage().data_ptr(), flat.storage_offset()

        def pack(t: torch.Tensor):
            if t.device == flat.device and t.untyped_storage().data_ptr() == ptr:
                return _WeightRef(t.storage_offset() - base, tuple(t.shape), t.stride())
            return t

        return pack

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.stride, flat.storage_offset() + self.offset)
