"""The executor: interprets a Schedule op by op; :class:`InOrderExecutor` issues each op as it comes (the
synchronous issuer; CPU and plain CUDA).

The ops' work is :mod:`megatrain.runtime.ops` (one handler per op kind and stream); the state that outlives a step
is :class:`~megatrain.runtime.memory.device.DeviceState`, a step's is
:class:`~megatrain.runtime.issue.step.StepState`. This issuer keeps, for every slot, the content it holds and how
many of that content's readers have run, and refuses an op that reads the wrong content or overwrites content a
later op still needs; the error shows the schedule around the failing op. How the ops are issued is the issuer's:
a subclass implements :class:`Executor`'s abstract methods (issue an op, begin and end a step or an evaluation,
wait for what was issued) and gives the handlers its :class:`~megatrain.runtime.ops.context.Copies`;
:class:`~megatrain.runtime.issue.streams.StreamExecutor` issues the same handlers on CUDA streams.
"""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from typing import Callable, ContextManager

import torch

from megatrain.capture import Captured
from megatrain.ir import (SLOT_POOL, Op, Schedule, format_table, initial_contents, resident_slots,
                          slot_contents)
from megatrain.layout import UNREAD_PROJECTION
from megatrain.runtime.layers import probe, router_aux
from megatrain.runtime.ops import HANDLERS
from megatrain.runtime.ops.context import Copies, InOrderCopies, OpContext
from megatrain.runtime.memory.device import DeviceState
from megatrain.runtime.issue.data_parallel import DataParallel
from megatrain.runtime.optim import HostAdamW
from megatrain.runtime.layers.rng import StepRng
from megatrain.runtime.issue.step import MicroBatch, StepOutput, StepState
from megatrain.runtime.memory.store import HostStore, grad_host_dtype
from megatrain.runtime.layers.templates import LayerRunner

__all__ = ["ExecutionError", "Executor", "InOrderExecutor", "MicroBatch", "StepOutput"]


class ExecutionError(RuntimeError):
    def __init__(self, schedule: Schedule, op: Op, message: str):
        self.op = op
        table = format_table(schedule, mark=op.id, context=12)
        super().__init__(f"op '{op}': {message}\n{table}")


class Executor(ABC):
    """Runs schedules over a captured model, its host store and optimizer; the issuing is the subclass's (its
    abstract methods, below ``run``'s helpers) and so are the copies (``copies``)."""

    def __init__(self, captured: Captured, store: HostStore, optimizer: HostAdamW, device: torch.device,
                 compute_dtype: torch.dtype, head_loss=None, runner: LayerRunner | None = None, *,
                 copies: Copies):
        self.captured, self.store, self.optimizer = captured, store, optimizer
        self.graph = captured.graph
        self.device, self.dtype = torch.device(device), compute_dtype
        # the templates bound to weight views (one runner per captured model: another executor over the same model
        # takes the first one's)
        self.runner = runner if runner is not None else LayerRunner(captured, self.device)
        self.head_loss = head_loss  # HeadLossSpec: the head runs as the fused linear + cross-entropy kernel
        self.dev = DeviceState(self.graph, store, self.device, compute_dtype, self.quiesce)
        self.rng = StepRng(self.device)  # each (layer, micro-batch) draws from its own seed (runtime/layers/rng.py)
        # owner layer -> (parameter name, offset, elements) of each parameter it holds that takes a gradient, in the
        # model's order (the global norm leaves frozen ones out, as clip_grad_norm_ over the model does)
        self.param_spans: dict[int, list[tuple[str, int, int]]] = {o: [] for o in store.owners()}
        for name, (owner, off, shape) in captured.model_param_names.items():
            if name not in captured.frozen:
                self.param_spans[owner].append((name, off, int(torch.Size(shape).numel())))
        store.before_load.append(self._release_resident)  # new masters from outside: the moments stay current
        self._slot_plans: dict[int, tuple] = {}  # id(schedule) -> (schedule, slot contents per op, accesses)
        self._homes: dict[int, tuple] = {}  # id(schedule) -> (schedule, its resident layers' optimizer slots)
        # (layer, optimizer slot) -> the STORE_OPT of a plan's write-back schedule (RunPlan.write_back) that takes
        # that state back to the host: given with each schedule that keeps states on the device
        self._write_back_ops: dict[tuple[int, int], Op] = {}
        # around each op, if set: a context manager (profiling labels, timing); it does not change what runs
        self.on_op: Callable[[Op], ContextManager] | None = None
        self.copies = copies
        # what the handlers use (runtime.ops.context)
        self.ctx = OpContext(captured, store, optimizer, self.dev, self.runner, self.rng, copies, self.device,
                             compute_dtype, head_loss, self.param_spans)
        self._confirm_unread()

    @property
    def dp(self) -> DataParallel | None:
        """Data parallel: the ranks whose gradients and losses each step sums (runtime.issue.data_parallel); None
        alone."""
        return self.ctx.dp

    @dp.setter
    def dp(self, dp: DataParallel | None) -> None:
        self.ctx.dp = dp

    def _confirm_unread(self) -> None:
        """Mark the linears whose product a recomputing backward skips (``LayerRunner.unread``) once a probe on
        this device confirms, per template, that no gradient reads them (``probe.unread_outputs_hold``); where one
        does, the layer recomputes in full, with a warning (the plan counted the skip: its backward is modelled a
        little short)."""
        checked, probed = self.runner.unread_checked, False
        for i, seg in enumerate(self.captured.segments):
            if not self.runner.unread(i) or id(seg.template) in checked:
                continue
            ok = probe.unread_outputs_hold(self.ctx, i)
            checked.add(id(seg.template))
            probed = True
            self.runner.mark_unread(i, ok)
            if not ok:
                warnings.warn(f"layer {seg.name}: a gradient of its backward reads the output of "
                              f"{UNREAD_PROJECTION}, which the layer's form says nothing reads; its backward "
                              f"recomputes that projection (and the plan's model of it is short by as much)")
        if probed and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def deferred_moments(self) -> frozenset[int]:
        """Of the last step issued: :attr:`StepState.deferred_moments`."""
        st = getattr(self, "st", None)
        return st.deferred_moments if st is not None else frozenset()

    def run(self, schedule: Schedule, mbs: list[MicroBatch], denom: int, wait_optimizer: bool = True,
            successions=None, write_back: Schedule | None = None, objective=None) -> StepOutput:
        """One optimizer step. ``denom``: valid (label != -100) tokens of the whole step. ``wait_optimizer``: False
        lets an issuer that overlaps steps return before the step's updates are done (here they always are).
        ``successions``: the verified pairs of schedules and their carried dependencies
        (:mod:`megatrain.runtime.issue.step_order`), for an issuer that overlaps steps (here each step ends first).
        ``write_back``: where the step keeps optimizer states on the device (``resident_opt``), the plan's schedule
        that takes them back to the host (``RunPlan.write_back``). ``objective``: what the head minimizes instead of
        the cross-entropy (:class:`megatrain.objectives.Objective`; ``denom`` divides its sum)."""
        cfg = schedule.config
        if cfg.n_steps != 1 or cfg.n_mb != len(mbs):
            raise ValueError(f"schedule is for {cfg.n_steps} step(s) x {cfg.n_mb} mbs, got 1 step x {len(mbs)} mbs")
        self._take_write_back(schedule, write_back)
        self._settle_resident(schedule)
        self.dev.fit(schedule)
        self.store.grads.fit(self.dev.slot_numels(schedule)["h"], grad_host_dtype(cfg), self.quiesce)
        tags, accesses = self._slot_plan(schedule)
        self.tags = tags  # per op id: (slot role -> content read, slot role -> content written)
        # a micro-batch without padding passes no mask where the model allows it (see Captured.mask_optional):
        # decided here, on the host copy, so the embedding layer does not read the mask back from the device; its
        # LOAD_IN op moves it to the device
        optional = self.captured.mask_optional
        host_mbs = [mb if mb.position_ids is not None or not (optional and bool(mb.attention_mask.all()))
                    else MicroBatch(mb.input_ids, None, mb.next_labels, rows=mb.rows) for mb in mbs]
        st = StepState(schedule, host_mbs, denom, lr=self.begin_step() if cfg.train else 0.0,
                       clip=self.optimizer.cfg.max_grad_norm is not None, loss_sums=[0.0] * len(mbs),
                       deferred_moments=self.deferred_for(schedule) if cfg.train else frozenset(),
                       objective=objective, stats=[None] * len(mbs))
        if self.captured.router_aux is not None:
            st.aux = [router_aux.Stats() for _ in mbs]
        self.st = st
        self.rng.begin(draw=cfg.train)
        modes = self._template_modes(cfg.train)
        try:
            self._interpret(schedule, st, tags, accesses)
        finally:
            self.rng.end()
            for template, mode in modes:
                template.train(mode)
            # every op is issued: the step's activations go now, not when the step's last update task lets go of
            # its state (with steps overlapping, the up to one tensor per activation slot a step leaves, 6 GiB for a
            # 7B model at 32K tokens, stayed allocated under the next step's forward)
            st.act.clear()
            self.copies.release_host_acts(st)
            st.side.clear()
            st.saved.clear()
        if cfg.train:
            self.end_step(st)
            if self.dp is not None:  # the ranks' host updates of the shared store are all done before any loads
                self.dp.barrier()  # a layer for the next step
        else:
            self.end_evaluation()
        for layer, k in self._resident_slots(schedule).items():
            self.dev.resident[layer] = (k, self.store.generation)
        sums = self.copies.loss_values(st)
        if self.dp is not None:  # the step's loss: every rank's micro-batches (denom counts all of their tokens)
            sums = self.dp.gather_floats(sums)
        # (made before the losses on the compute stream, which reading the losses waited for)
        stats = [t.detach().cpu() for t in st.stats] if all(t is not None for t in st.stats) else None
        return StepOutput(sum(sums) / denom, sums, st.norm(), st.lr, st.ok(), stats)

    def _template_modes(self, train: bool) -> list[tuple]:
        """For an evaluation, the templates put in evaluation mode (dropout off); their modes before, to put back.
        A training run leaves them as the model was when captured (a model put in eval mode trains without
        dropout, as it would in plain PyTorch)."""
        seen, modes = set(), []
        for seg in self.captured.segments if not train else ():
            if id(seg.template) not in seen:
                seen.add(id(seg.template))
                modes.append((seg.template, seg.template.training))
                seg.template.train(False)
        return modes

    def _interpret(self, schedule: Schedule, st: StepState, tags, accesses) -> None:
        """Check each op's slot contents against the plan and issue it, in program order."""
        position = {key: 0 for key in accesses}
        contents = initial_contents(schedule, self._resident_slots(schedule))
        for op in schedule.ops:
            reads, writes = tags[op.id]
            for role, idx in op.slots:
                key = (SLOT_POOL[role], idx)
                if role in reads and contents.get(key) != reads[role]:
                    raise ExecutionError(schedule, op, f"reads {role}{idx} expecting {reads[role]}, the slot holds "
                                                       f"{contents.get(key)}")
            for role, idx in op.slots:
                key = (SLOT_POOL[role], idx)
                acc = accesses[key]
                while position[key] < len(acc) and acc[position[key]][0] == op.id:
                    position[key] += 1
                if role not in writes:
                    continue
                nxt = acc[position[key]] if position[key] < len(acc) else None
                old = contents.get(key)
                # (one written with what it holds already loses nothing: the top block's host checkpoint loaded
                # back where it still lies, with one micro-batch)
                if nxt is not None and nxt[1] and old is not None and nxt[2] == old != writes[role]:
                    raise ExecutionError(schedule, op, f"loading {role}{idx} with {writes[role]} while "
                                                       f"'{schedule.ops[nxt[0]]}' still reads {old} from it")
                contents[key] = writes[role]
            try:
                with self.on_op(op) if self.on_op is not None else contextlib.nullcontext():
                    self.issue(op, st)
            except ExecutionError:
                raise
            except Exception as e:
                raise ExecutionError(schedule, op, f"{type(e).__name__}: {e}") from e
            self._release_acts(op, st, accesses, position)

    def _release_acts(self, op: Op, st: StepState, accesses, position) -> None:
        """After ``op``: the activations it was the last to read go (a checkpoint once its layer's backward ran, a
        gradient once the layer below took it), as the plan's memory model frees an activation slot at its last
        read; left in their slots they stayed until the slot was written again, the input gradients of the backward
        all step (3.5 GiB each for a 7B block at 524,288 tokens). A copy still reading one holds it on its stream
        (the copies record the streams they use), so dropping the reference is safe once the op is issued."""
        if not self.issued_now(op):
            return
        for role, idx in op.slots:
            if SLOT_POOL[role] != "a":
                continue
            acc, at = accesses[("a", idx)], position[("a", idx)]
            if at >= len(acc) or not acc[at][1]:  # written next, or not used again this step
                st.act.pop(idx, None)

    def issued_now(self, op: Op) -> bool:
        """Whether ``op`` was issued by the call that issued it (not handed to a worker that issues it later)."""
        return True

    def _slot_plan(self, schedule: Schedule):
        """Per op its slot contents (reads, writes), and every access of every slot in program order: (op id,
        reads?, content). Computed once per schedule (the API reuses schedule objects step after step)."""
        cached = self._slot_plans.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1], cached[2]
        shared = lambda layer: bool(self.graph.tied_to(layer))  # noqa: E731
        resident = set(schedule.config.resident_opt).__contains__
        kept = set(schedule.config.grad_kept).__contains__
        tags = [slot_contents(op, self.graph.owner, schedule.config.n_mb, shared, resident, kept)
                for op in schedule.ops]
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

    # ---- what stays on the device between steps: the set-up, optimizer states kept there -----------------------
    def holds(self, schedule: Schedule) -> bool:
        """Whether the device holds what the step ``schedule`` expects to find there: every device-updated layer's
        weights and every resident layer's state in the slot the schedule keeps it in, from the current store
        (else the plan's set-up runs first)."""
        return self.dev.keeps(schedule.config.gpu_opt) and all(
            self.dev.resident.get(l) == (k, self.store.generation) for l, k in self._resident_slots(schedule).items())

    def set_up(self, setup: Schedule, step: Schedule, write_back: Schedule | None = None) -> None:
        """Run ``setup`` (:func:`~megatrain.planner.passes.setup_schedule`), the set-up of the plan whose steps run
        ``step``: the states kept on the device go back to the host store first (it loads the current ones from
        there), the step's slots are allocated, and its ops issued as a step's are. ``write_back``: as for
        :meth:`run`."""
        self._take_write_back(setup, write_back)
        self._release_resident()
        self.dev.fit(step)
        tags, accesses = self._slot_plan(setup)
        self.tags = tags
        st = StepState(setup, [], 0, lr=0.0, clip=False)
        self._interpret(setup, st, tags, accesses)
        for layer, k in self._resident_slots(setup).items():
            self.dev.resident[layer] = (k, self.store.generation)

    def _resident_slots(self, schedule: Schedule) -> dict[int, int]:
        """:func:`~megatrain.ir.resident_slots` of ``schedule``, computed once per schedule."""
        cached = self._homes.get(id(schedule))
        if cached is None or cached[0] is not schedule:
            cached = self._homes[id(schedule)] = (schedule, resident_slots(schedule, self.graph.owner))
        return cached[1]

    def _settle_resident(self, schedule: Schedule) -> None:
        """Before a step: it finds its resident states where it expects them (else an error, before anything
        runs); every other resident state goes back to the host store, which the step may read (a state that a new
        load of the store made stale is dropped)."""
        keep = self._resident_slots(schedule)
        missing = [l for l, k in keep.items() if self.dev.resident.get(l) != (k, self.store.generation)]
        if missing:
            raise ValueError(f"the schedule expects the state of layers {missing} on the device, which this "
                             f"executor does not hold (run the plan's set-up first)")
        leave = {l: v for l, v in self.dev.resident.items() if keep.get(l) != v[0]}
        if leave:
            self._write_back(leave)
            self.dev.resident = {l: v for l, v in self.dev.resident.items() if l not in leave}

    def set_step(self, steps_done: int) -> None:
        """Go on as if ``steps_done`` steps had been taken (a loaded training state): the learning rate follows."""
        self.optimizer.step_index = steps_done

    def sync_resident(self) -> None:
        """Write every resident state back to the host store, which then holds the current master weights and
        moments (they stay on the device too: the next step continues from there)."""
        self._write_back(self.dev.resident)

    def _take_write_back(self, schedule: Schedule, write_back: Schedule | None) -> None:
        """Keep the ops of ``write_back`` that take back to the host the states ``schedule`` keeps on the device
        (refused where it has none for one of them: the state could not be saved or read)."""
        homes = self._resident_slots(schedule)
        if not homes:
            return
        given = {} if write_back is None else {(op.layer, op.slot("o")): op for op in write_back.ops}
        missing = sorted(l for l, k in homes.items() if (l, k) not in given)
        if missing:
            raise ValueError(f"the schedule keeps the optimizer state of layers {missing} on the device, and no "
                             f"write-back schedule for them was given (its plan's RunPlan.write_back)")
        self._write_back_ops.update(given)

    def _write_back(self, states: dict[int, tuple[int, int]]) -> None:
        """Issue the write-back ops (``RunPlan.write_back``, one STORE_OPT each) of those of ``states`` (owner ->
        (slot, generation)) that belong to the store's current generation, once every update is done, and wait for
        their copies."""
        homes = {l: k for l, (k, gen) in states.items() if gen == self.store.generation}
        if not homes:
            return
        self.quiesce()
        for l in sorted(homes):
            op = self._write_back_ops[(l, homes[l])]
            with self.on_op(op) if self.on_op is not None else contextlib.nullcontext():
                HANDLERS[(op.kind, op.stream)](self.ctx, op, None)
        self.quiesce()

    def _release_resident(self) -> None:
        """Write every resident state back and keep none (the store's masters are about to change)."""
        self.sync_resident()
        self.dev.resident.clear()

    def measure_saved_bytes(self, layer: int, seq_len: int, lean: bool = False) -> int:
        """See :func:`megatrain.runtime.layers.probe.saved_bytes`."""
        return probe.saved_bytes(self.ctx, layer, seq_len, lean)

    # ---- the issuer: what a subclass implements ---------------------------------------------------------------
    @abstractmethod
    def issue(self, op: Op, st: StepState) -> None:
        """Issue ``op`` of step ``st``: its handler (``HANDLERS``) with :attr:`ctx`, now or once what it waits for
        is done."""

    @abstractmethod
    def begin_step(self) -> float:
        """Before a training step's ops: the optimizer's step begun; the step's learning rate."""

    @abstractmethod
    def end_step(self, st: StepState) -> None:
        """After every op of training step ``st`` is issued: the optimizer's step ended (``st.ok()``: applied)."""

    @abstractmethod
    def end_evaluation(self) -> None:
        """After every op of an evaluation (no optimizer step) is issued."""

    @abstractmethod
    def drain(self) -> None:
        """Return once everything issued, every step's updates included, is done."""

    @abstractmethod
    def quiesce(self) -> None:
        """Return once no op issued can still touch a device buffer."""

    @abstractmethod
    def deferred_for(self, schedule: Schedule) -> frozenset[int]:
        """The host OPTs of ``schedule`` that write the masters alone, their moments left for later, and the split
        updates' STORE_OPTs that store the masters alone (:attr:`StepState.deferred_moments`)."""


class InOrderExecutor(Executor):
    """Each op issued as the schedule lists it, its handler run to the end before the next (the CPU, and a plain
    CUDA device): nothing overlaps, nothing is deferred."""

    def __init__(self, captured: Captured, store: HostStore, optimizer: HostAdamW, device: torch.device,
                 compute_dtype: torch.dtype, head_loss=None, runner: LayerRunner | None = None):
        super().__init__(captured, store, optimizer, device, compute_dtype, head_loss, runner,
                         copies=InOrderCopies(torch.device(device)))

    def issue(self, op: Op, st: StepState) -> None:
        HANDLERS[(op.kind, op.stream)](self.ctx, op, st)

    def begin_step(self) -> float:
        return self.optimizer.begin_step()

    def end_step(self, st: StepState) -> None:
        self.optimizer.end_step(applied=st.ok())

    def end_evaluation(self) -> None:
        pass  # no optimizer step

    def drain(self) -> None:
        pass  # each step's work is done when ``run`` returns

    def quiesce(self) -> None:
        pass  # every op has run by the time it returns

    def deferred_for(self, schedule: Schedule) -> frozenset[int]:
        return frozenset()  # every update is one pass
