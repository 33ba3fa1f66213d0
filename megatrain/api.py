"""The streamed model ``megatrain.compile(model)`` returns (megatrain.compiler): one optimizer step, an evaluation, the
weights and the training state of a model whose state lives in the host store, each planned from one request."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from megatrain import step_inputs
from megatrain.capture import Captured
from megatrain.ir import LayerGraph, Schedule
from megatrain.planner.cost import device_memory, fmt_bytes, host_memory, slot_params
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.request import PlanOptions
from megatrain.planner.run_plan import plan_eval, plan_run
from megatrain.runtime.state import train_state
from megatrain.runtime.issue.executor import InOrderExecutor, StepOutput
from megatrain.runtime.layers.kernel_rewrite import can_keep_less
from megatrain.runtime.optim import HostAdamW, OptimConfig
from megatrain.runtime.issue.step_order import Successions
from megatrain.runtime.memory.store import HostStore, available_host_bytes, grad_host_dtype, progress_bar

# Sequence lengths at which saved bytes are measured for longer sequences (see StreamedModel._saved_per_token)
SAVED_PROBE_TOKENS = (256, 512)


@dataclass
class StepStats:
    step: int  # steps applied so far (a skipped step does not count)
    loss: float
    tokens: int  # valid (predicted) tokens in the step
    lr: float
    grad_norm: float | None
    seconds: float
    skipped: bool = False  # the loss or the gradient norm was not finite: no update was applied (nonfinite="skip")
    clipped: bool = False  # the clip factor scaled the step's gradients (its global norm above the threshold)
    metrics: dict = field(default_factory=dict)  # the objective's statistics (megatrain.objectives)


@dataclass
class EvalStats:
    loss: float  # the loss summed over the batch's valid tokens, divided by their count
    tokens: int  # valid (predicted) tokens
    seconds: float
    row_logps: torch.Tensor | None = None  # per row: the sum of its labels' log-probabilities


class NonFiniteStepError(ValueError):
    """A step's loss or global gradient norm was not finite; no update was applied (the weights and Adam moments
    are those before the step)."""

    def __init__(self, message: str, stats: StepStats):
        super().__init__(message)
        self.stats = stats


NONFINITE = ("raise", "skip")


class StreamedModel:
    """A model whose weights and optimizer state live in a :class:`HostStore` and whose layers run on a schedule.

    Memory contract: ``compile`` copies a materialized model's parameters into the store (so both exist until the
    caller drops the model: build it on the meta device to avoid that). The user's module is never modified;
    the trained weights are in ``state_dict()`` (views into the store) and ``copy_to(model)`` writes them back.
    """

    def __init__(self, captured: Captured, store: HostStore, optim: OptimConfig, device: torch.device,
                 compute_dtype: torch.dtype, plan: PlanOptions, hardware: HardwareSpec, kernels: bool = False,
                 streams: bool = False):
        self.captured, self.store, self.graph = captured, store, captured.graph
        self.kernels: dict[str, list[str]] = {}  # what the Triton kernels replaced (empty: kernels off)
        head_loss = None
        if kernels:
            from megatrain.runtime.layers.kernel_rewrite import head_loss_spec, use_kernels

            self.kernels = use_kernels(captured)
            head_loss = head_loss_spec(captured)
        self.device, self.compute_dtype, self.plan_options, self.hardware = device, compute_dtype, plan, hardware
        self.measure_host = False  # check plans' host buffers against the memory the machine has available
        self.optimizer = HostAdamW(store, optim)
        if streams:
            from megatrain.runtime.issue.streams import StreamExecutor

            self.executor = StreamExecutor(captured, store, self.optimizer, device, compute_dtype, head_loss)
        else:
            self.executor = InOrderExecutor(captured, store, self.optimizer, device, compute_dtype, head_loss)
        self._schedules: dict[tuple, tuple[Schedule | None, Schedule]] = {}  # plan key -> (set-up, step)
        self._successions: Successions = {}  # (id(prev), id(next)) -> the verified pair and its carried dependencies
        self._graphs: dict[int, LayerGraph] = {}  # sequence length -> the planner's layer graph (planning_graph)
        self._run_plans: dict[int, object] = {}  # id of a step's schedule -> the RunPlan it is the step of
        self.planned_s = 0.0  # seconds the last schedule_for took (a run's header says)
        self.plan_files: tuple[str, ...] = ()  # earlier plans offered (RunPlan.to_json): one for the same request is
        # taken without a search
        self.step = 0
        # streams: let a step's optimizer work run on while the next step starts (each layer's next load waits for
        # its own update); train_step then returns before the step's weights are all updated (its loss and gradient
        # norm are final; state_dict() waits for the updates). On by default: measured faster on the H200, with the
        # same results bit for bit (tests/gpu/test_streams.py). False: each train_step returns with its step done.
        self.overlap_steps = streams
        # a step whose loss or gradient norm is not finite applies no update at all; "raise": train_step raises
        # NonFiniteStepError; "skip": it returns StepStats(skipped=True) and training goes on (skipped_steps counts)
        self._nonfinite = "raise"
        self.skipped_steps = 0
        # steps, saves and reads of the weights exclude each other (save_state from another thread while steps run
        # would write weights of no step)
        self._lock = threading.RLock()

    @property
    def nonfinite(self) -> str:
        """What ``train_step`` does after a step whose loss or gradient norm is not finite (no update is applied
        either way): "raise" (:class:`NonFiniteStepError`) or "skip" (``StepStats.skipped``; counted in
        ``skipped_steps``)."""
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, value: str) -> None:
        if value not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {value!r}")
        self._nonfinite = value

    # ---- planning -----------------------------------------------------------------------------------------
    def schedule_for(self, batch_size: int, seq_len: int, **overrides) -> Schedule:
        """The verified schedule every step of ``batch_size`` sequences of ``seq_len`` tokens runs (cached)."""
        return self._plans(batch_size, seq_len, overrides)[1]

    def setup_for(self, batch_size: int, seq_len: int, **overrides) -> Schedule | None:
        """The verified set-up of that plan (``ScheduleConfig.setup``: what its steps find on the device, run before
        the first of them), or None where it keeps nothing on the device."""
        return self._plans(batch_size, seq_len, overrides)[0]

    def run_plan(self, schedule: Schedule):
        """The :class:`~megatrain.planner.run_plan.RunPlan` whose step ``schedule`` is (one :meth:`schedule_for`
        gave): its set-up, pairs, whether it came from a plan file, and its ``margin_taken`` (where the fastest
        plan would have taken some of the host memory a plan leaves free: in words)."""
        return self._run_plans[id(schedule)]

    def _plans(self, batch_size: int, seq_len: int, overrides: dict) -> tuple[Schedule | None, Schedule]:
        """(the plan's set-up or None, the schedule of each of its steps): the plan search's choice
        (:func:`megatrain.planner.search.plan`, the one ``megatrain plan`` runs) with the plan options as fixed
        decisions ("auto": searched), for one step."""
        opts = replace(self.plan_options, **overrides)
        if opts.wire == "bf16" and self.compute_dtype != torch.bfloat16:
            raise ValueError(f"wire='bf16' sends bf16 weights, which needs bf16 compute; compute dtype is "
                             f"{self.compute_dtype}")
        clip = self.optimizer.cfg.max_grad_norm is not None
        key = (batch_size, seq_len, opts, clip)
        if key not in self._schedules:
            graph = self.graph if opts.saved_acts == 0 else self.planning_graph(seq_len)
            run = plan_run(graph, self.hardware, batch_size, seq_len, opts, clip=clip,
                           on_gpu=self.device.type == "cuda", known=self.plan_files)
            self._check_grad_buffers(run.step, batch_size, seq_len)
            self._run_plans[id(run.step)] = run
            self._schedules[key] = (run.setup, run.step)
            self._successions.update({(id(a), id(b)): (a, b, carried) for a, b, carried in run.pairs})
        return self._schedules[key]

    def _check_grad_buffers(self, schedule: Schedule, batch_size: int, seq_len: int) -> None:
        """Refuse, before a plan's first step allocates them, host gradient buffers that this machine's host memory
        cannot hold besides what is allocated already (the plan was made for the host memory free before the
        store; a later plan may need more buffers than the ones before)."""
        if not self.measure_host:
            return
        numels = slot_params(self.graph, schedule)["h"]
        extra = self.store.grads.extra_nbytes(numels, grad_host_dtype(schedule.config))
        free = available_host_bytes()
        if free is not None and extra > free:
            raise ValueError(f"host memory: the plan for {batch_size} x {seq_len}-token sequences needs "
                             f"{fmt_bytes(extra)} more of host gradient buffers, and this machine has "
                             f"{fmt_bytes(free)} available (a plan with more gradients kept on the GPU, or "
                             f"grad_host_dtype='bf16', needs less)")

    def planning_graph(self, seq_len: int):
        """The layer graph the planner gets for sequences of ``seq_len`` tokens: the captured one, with each
        layer's saved bytes per token (what a layer in ``saved_acts`` keeps on the device) measured at ``seq_len``
        on this device with these templates (once per template; attention that stores its probabilities saves
        more per token at longer sequences)."""
        if seq_len not in self._graphs:
            measured: dict[str, int] = {}
            layers = []
            for i, lay in enumerate(self.graph.layers):
                if lay.saved_bytes_per_token and lay.template not in measured:
                    full = self._saved_per_token(i, seq_len)
                    lean = self._saved_per_token(i, seq_len, lean=True) if can_keep_less(
                        self.captured.segments[i].template) else full
                    measured[lay.template] = (full, lean)
                layers.append(replace(lay, saved_bytes_per_token=measured[lay.template][0],
                                      lean_saved_bytes_per_token=measured[lay.template][1])
                              if lay.saved_bytes_per_token else lay)
            if self.device.type == "cuda":  # the probes ran on the default stream: cuBLAS's workspaces there go
                # (the steps' own, on the compute stream, are taken again at their first GEMM)
                torch.cuda.synchronize(self.device)
                torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
            self._graphs[seq_len] = LayerGraph(layers, name=self.graph.name)
        return self._graphs[seq_len]

    def graph_for(self, schedule: Schedule) -> LayerGraph:
        """The layer graph ``schedule`` was planned with (the measured saved bytes matter only where it saves
        activations)."""
        return self.planning_graph(schedule.config.seq_len) if schedule.config.saved_acts else self.graph

    def _saved_per_token(self, layer: int, seq_len: int, lean: bool = False) -> int:
        """Bytes per token ``layer`` saves for sequences of ``seq_len`` tokens. Up to :data:`SAVED_PROBE_TOKENS`
        tokens measured as they are; beyond, from two measurements at the probe lengths: what a layer saves grows
        linearly with the tokens (activations) plus quadratically (attention that stores its probabilities), so
        two lengths determine it, and the probe does not need a long sequence's memory (the plan in use may hold
        most of the device)."""
        t1, t2 = SAVED_PROBE_TOKENS
        if seq_len <= t2:
            return -(-self.executor.measure_saved_bytes(layer, seq_len, lean) // seq_len)
        m1, m2 = (self.executor.measure_saved_bytes(layer, t, lean) / t for t in (t1, t2))  # per token: a + b * t
        b = max((m2 - m1) / (t2 - t1), 0.0)
        return math.ceil(m1 + b * (seq_len - t1))

    # ---- training -----------------------------------------------------------------------------------------
    def train_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
                   objective=None, rows: dict[str, torch.Tensor] | None = None, **plan_overrides) -> StepStats:
        """One optimizer step on a batch of sequences (B, T), right-padded where ``attention_mask`` is 0. ``labels``
        default to ``input_ids`` with padding ignored; as in HF, position t is trained to predict label t + 1; the
        loss is the sum over the step's valid tokens divided by their count. Integer tensors of any width are taken
        (as int64).

        ``position_ids``: rows that each hold several documents, their positions restarting at 0 at each one (as HF
        packs sequences): every document attends to itself alone and is placed as if it were a row of its own, so
        the loss and gradients are those of the documents run one by one; labels then default to ignoring each
        document's first token (it is not predicted from the document before). Padding at a row's end is one more
        such document, its labels ignored. A hybrid's recurrences run the documents apart (capture.documents).

        ``objective``: what the head minimizes instead (:class:`megatrain.objectives.Objective`: a preference loss
        such as DPO, or an RL loop's per-sequence weights), reading each position's log-probability of its label
        and ``rows`` (per-row tensors, e.g. reference log-probabilities or advantages); its statistics come back
        as ``StepStats.metrics``. A step whose loss or global gradient norm is not finite applies no update (see
        ``nonfinite``)."""
        with self._lock:
            return self._train_step(input_ids, attention_mask, labels, position_ids, plan_overrides, objective, rows)

    def evaluate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> "EvalStats":
        """The loss on a batch (as :meth:`train_step` takes one) without training on it: each layer's forward and
        the loss, dropout off, nothing updated (an evaluation schedule: forwards and EVAL ops); with each row's
        log-probability sum of its labels (``EvalStats.row_logps``: a reference model's, for DPO)."""
        with self._lock:
            ids, mask, nxt, pos, denom = step_inputs.complete(self.captured, input_ids, attention_mask, labels,
                                                              position_ids)
            denom = self._all_tokens(denom)
            schedule = self._eval_plan(*ids.shape)
            t0 = time.perf_counter()
            out = self.executor.run(schedule, step_inputs.micro_batches(schedule, ids, mask, nxt, pos), denom)
            return EvalStats(out.loss, denom, time.perf_counter() - t0, torch.cat(out.stats))

    def _eval_plan(self, batch_size: int, seq_len: int) -> Schedule:
        """The evaluation schedule for a batch shape: the training plan's micro-batches and weight slots (where
        those are "auto": the fewest micro-batches of at most choices.MAX_MB_TOKENS tokens, 2 slots), every
        checkpoint on the device (an evaluation keeps none beyond the next layer), the MLPs over tiles for
        micro-batches longer than a tile."""
        key = ("eval", batch_size, seq_len, self.plan_options)
        if key not in self._schedules:
            self._schedules[key] = (None, plan_eval(self.graph, self.hardware, batch_size, seq_len, self.plan_options))
        return self._schedules[key][1]

    def _train_step(self, input_ids, attention_mask, labels, position_ids, plan_overrides, objective=None,
                    rows=None) -> StepStats:
        input_ids, attention_mask, nxt, position_ids, denom = step_inputs.complete(
            self.captured, input_ids, attention_mask, labels, position_ids, rows)
        if objective is not None and self.executor.dp is not None:
            raise ValueError("an objective other than the cross-entropy runs in one process (not data parallel)")
        denom = self._all_tokens(denom) if objective is None else objective.denominator(nxt, rows or {})
        B, T = input_ids.shape
        setup, schedule = self._plans(B, T, plan_overrides)
        mbs = step_inputs.micro_batches(schedule, input_ids, attention_mask, nxt, position_ids, rows)
        t0 = time.perf_counter()
        # the plan's set-up before its first step, and again where something took what the steps keep on the
        # device away (new weights in the store, an evaluation, another plan)
        run = self._run_plans.get(id(schedule))  # (None: a schedule put in the cache by hand, as tests do)
        write_back = run.write_back if run is not None else None
        if setup is not None and not self.executor.holds(schedule):
            self.executor.set_up(setup, schedule, write_back)
        if self.overlap_steps:
            out: StepOutput = self.executor.run(schedule, mbs, denom, wait_optimizer=False,
                                                successions=self._successions, write_back=write_back,
                                                objective=objective)
        else:
            out = self.executor.run(schedule, mbs, denom, write_back=write_back, objective=objective)
        if out.applied:
            self.step += 1
        limit = self.optimizer.cfg.max_grad_norm
        stats = StepStats(self.step, out.loss, denom, out.lr, out.grad_norm, time.perf_counter() - t0,
                          skipped=not out.applied, clipped=out.applied and out.grad_norm is not None
                          and limit is not None and out.grad_norm + 1e-6 > limit,
                          metrics={} if objective is None else objective.metrics(sum(out.stats), denom))
        if not out.applied:
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                what = ", ".join(f"{k} {v}" for k, v in (("loss", out.loss), ("gradient norm", out.grad_norm))
                                 if v is not None and not math.isfinite(v))
                raise NonFiniteStepError(f"step {self.step + 1}: {what}; no update was applied (the weights and "
                                         f"Adam moments are those after step {self.step})", stats)
        return stats

    def _all_tokens(self, denom: int) -> int:
        """The step's trained tokens: this process's, or with data parallel every rank's (the loss's denominator; a
        rank's share may have none)."""
        dp = self.executor.dp
        total = denom if dp is None else dp.sum_int(denom)
        if total == 0:
            raise ValueError("the batch has no token to predict (every label is ignored)")
        return total

    # ---- weights ------------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait until every step's work is done (with ``overlap_steps``, the last step's updates run on after
        ``train_step`` returns)."""
        self.executor.drain()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current master weights by parameter name (views into the host store: no memory beyond it; casting
        them all, ``{k: v.to(torch.bfloat16)}``, would allocate the model again, where
        :func:`megatrain.export.export_pretrained` streams them). With ``overlap_steps`` the last step's updates
        may still be running: they finish first; states kept on the device (``resident_opt``) are written back to
        the store first."""
        with self._lock:
            self.wait()
            self.executor.sync_resident()
            return self.store.state_dict()

    # ---- training state ---------------------------------------------------------------------------------
    def save_state(self, directory: str | Path, extra: dict | None = None) -> Path:
        """Save what training needs to go on exactly from here: master weights, Adam moments, step counts, and
        ``extra`` (JSON, e.g. the data order) into ``directory`` (:mod:`megatrain.runtime.state.train_state`). Waits for
        the last step's updates; a state saved there before is replaced only once the new one is complete (see
        :mod:`megatrain.runtime.state.train_state`: a crash at any moment leaves one to go on from). A state whose
        weights or moments are not finite is refused. Returns the new state's own directory."""
        with self._lock:
            self.wait()
            self.executor.sync_resident()
            opt = self.optimizer
            steps = {l: opt.steps(l) for l in self.store.owners()}
            dp = self.executor.dp
            if dp is None:
                return train_state.save(self.store, directory, step=self.step, optimizer_steps=steps, extra=extra,
                                        parameter_steps=opt.parameter_steps())
            # data parallel: every rank's device copies are written back to the one store, then rank 0 writes it
            dp.barrier()
            saved = dp.after_rank0(lambda: train_state.save(self.store, directory, step=self.step,
                                                            optimizer_steps=steps, extra=extra))
            return Path(dp.from_rank0(str(saved) if saved is not None else None))

    def load_state(self, directory: str | Path) -> dict:
        """Go on from a state :meth:`save_state` wrote (for this model: checked before anything changes); returns
        its ``extra``. The next ``train_step`` is the saved step's successor, with the same learning rate and
        Adam bias corrections as an unbroken run."""
        with self._lock:
            self.wait()
            dp = self.executor.dp
            if dp is None:
                with progress_bar("loading the training state", self.graph.n_params) as bar:
                    m = train_state.load(self.store, directory, progress=bar.update)
            else:  # one store for the ranks: each lets go of its device copies, then rank 0 reads the files
                m = train_state.read_manifest(self.captured, directory)
                with self.store.loading():
                    dp.barrier()
                    if dp.rank == 0:
                        m = train_state.load(self.store, directory)
                    dp.barrier()
            opt = self.optimizer
            for l in self.store.owners():
                opt.set_steps(l, m["optimizer_steps"][str(l)])
            opt.set_parameter_steps(m["parameter_steps"])
            self.step = m["step"]
            self.executor.set_step(m["step"])
            return m["extra"]

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the trained weights into ``model`` (same architecture), in place (into the model's own memory:
        nothing beyond it is allocated)."""
        with self._lock:
            sd = self.state_dict()
            for name, p in model.named_parameters():
                p.copy_(sd[name])

    def memory_report(self, batch_size: int | None = None, seq_len: int | None = None) -> dict[str, int]:
        """Bytes by kind: host store rows; with a batch shape, the host gradient buffers, device slots and working
        set of its schedule (and the rest of its device memory: weights kept, activations saved, cuBLAS's
        workspaces, the allocator's rounding)."""
        out = {f"host.{k}": v for k, v in self.store.nbytes.items()}
        if batch_size and seq_len:
            step = self._plans(batch_size, seq_len, {})[1]
            out["host.gradients"] = host_memory(self.graph_for(step), step)["gradients"]
            mem = device_memory(self.graph_for(step), step)
            out.update({f"device.{p}_slots": v for p, v in mem.pool_nbytes.items()})
            out["device.working_set"] = mem.workspace_nbytes
            out["device.kept_weights"] = mem.kept_nbytes
            out["device.saved_activations"] = mem.saved_nbytes
            out["device.gemm_workspaces"] = mem.gemm_nbytes
            out["device.allocator_rounding"] = mem.slack_nbytes
            out["device.wire_stage"] = mem.stage_nbytes
        return out
