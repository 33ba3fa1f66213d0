"""``megatrain.compile(model)``: capture a causal LM, check it fits this machine, move its weights into the host
store, and return the :class:`~megatrain.api.StreamedModel` that trains it streamed."""

from __future__ import annotations

import os
import warnings
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch import nn

from megatrain.api import NONFINITE, StreamedModel
from megatrain.capture import Captured, capture
from megatrain.layout import fmt_bytes
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.request import PlanOptions
from megatrain.planner.limits import GiB
from megatrain.runtime.state import train_state
from megatrain.runtime.state.hf_weights import check_weights_dir
from megatrain.runtime.issue.data_parallel import DataParallel
from megatrain.runtime.state.init import init_seeded
from megatrain.runtime.optim import OptimConfig
from megatrain.runtime.memory.store import HostStore, available_host_bytes, progress_bar, store_nbytes


def compile(model: nn.Module, *, checkpoint: str | Path | None = None, init_seed: int | None = None,
            state: str | Path | None = None,
            optim: OptimConfig | None = None, device: str | torch.device | None = None,
            compute_dtype: torch.dtype | None = None, hardware: str | HardwareSpec | None = None,
            kernels: bool | None = None, streams: bool | None = None, blocks: str | nn.ModuleList | None = None,
            nonfinite: str = "raise", **plan) -> StreamedModel:
    """Capture ``model`` (an HF causal LM or a decoder ``nn.Module`` mapping input_ids to logits) and return a
    :class:`StreamedModel` whose weights live in host memory. ``blocks``: the ``nn.ModuleList`` of decoder blocks
    (or its path, e.g. ``"model.layers"``) where capture would not find it by HF's conventions. ``nonfinite``: what
    ``train_step`` does after a step whose loss or gradient norm is not finite, which applies no update: "raise"
    (:class:`NonFiniteStepError`) or "skip" (returns with ``skipped=True``; see :attr:`StreamedModel.nonfinite`).

    Weights come from the model itself, or, for a model built on the meta device, from ``checkpoint`` (an HF
    safetensors directory) or ``init_seed`` (the model's own initializer, one layer at a time), or ``state`` (a
    training state :meth:`StreamedModel.save_state` wrote: weights, Adam moments and step counts, to go on from).
    Defaults: CUDA with bf16 compute when available, else CPU in fp32. ``kernels`` (default: on with CUDA) puts
    the Triton kernels into the templates (RMSNorm, SwiGLU, RoPE) and runs the loss as the fused linear +
    cross-entropy; ``StreamedModel.kernels`` lists what they replaced. On the CPU they need Triton's interpreter.
    ``streams`` (default: on with CUDA) issues the schedule on separate CUDA streams with a host optimizer thread
    (:mod:`megatrain.runtime.issue.streams`); off, every op runs in program order. ``plan``: :class:`PlanOptions`; with
    CUDA ``gpu_opt_every`` and ``split_opt`` default to "auto" (the planner picks the layers updated on the GPU),
    on the CPU to 0.
    """
    from megatrain.planner.hardware import hardware as hardware_spec

    if isinstance(model, StreamedModel):
        raise ValueError("compile() takes the model to train (an nn.Module); this one is already a StreamedModel")
    if not isinstance(model, nn.Module):
        raise ValueError(f"compile() takes an nn.Module, got {type(model).__name__}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    dev = _device(device)
    dtype = compute_dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    opts = _plan_options(plan, dev)
    spec = hardware if isinstance(hardware, HardwareSpec) else hardware_spec(hardware) if hardware else \
        device_spec(dev)
    host_free = available_host_bytes() if hardware is None else None  # a spec given is taken at its word
    spec = _fitted_spec(spec, opts, dev, host_free)
    if opts.wire == "bf16" and dtype != torch.bfloat16:
        raise ValueError(f"wire='bf16' sends bf16 weights, which needs bf16 compute; compute dtype is {dtype}")
    use_kernels = dev.type == "cuda" if kernels is None else kernels
    if use_kernels and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels=True on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "importing megatrain")
    if sum(x is not None for x in (checkpoint, init_seed, state)) > 1:
        raise ValueError("pass one of checkpoint=, init_seed= and state=")
    cap = capture(model, compute_dtype=dtype, blocks=blocks)
    if dev.type == "cuda" and cap.unfused_attention:
        warnings.warn(cap.unfused_attention, stacklevel=2)
    if checkpoint is not None:
        check_weights_dir(cap, checkpoint)  # names, shapes and readability, before the store takes its memory
    if state is not None:
        train_state.read_manifest(cap, state)  # the same
    need = _check_host(cap, spec, opts, host_free)
    use_streams = dev.type == "cuda" if streams is None else streams
    if use_streams and dev.type != "cuda":
        raise ValueError("streams=True needs a CUDA device")
    dp = _data_parallel(cap, opts, use_streams)
    opts = _speculation(opts, optim or OptimConfig(), dp)
    store = _filled_store(model, cap, need, dev, dp, checkpoint, init_seed, state)
    if dev.type == "cuda":  # autograd's device thread takes the primary context at its first GEMM, and torch says
        # so once per thread (a warning a user could take for a fault)
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    if dev.type == "cuda" and opts.device_budget_gib is not None:  # the caching allocator keeps to the budget too,
        # with the spec's reserve for its rounding and fragmentation: the run behaves as on a card whose plans
        # fill the budget (measured: 2.5 GiB reserved and unallocated at a 48 GiB budget)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec.gpu_bytes / total),
                                                   dev.index if dev.index is not None else torch.cuda.current_device())
    sm = StreamedModel(cap, store, optim or OptimConfig(), dev, dtype, opts, spec, use_kernels, use_streams)
    sm.executor.dp = dp
    sm.nonfinite = nonfinite
    sm.measure_host = host_free is not None
    if state is not None:
        sm.load_state(state)
    return sm


def _speculation(opts: PlanOptions, optim: OptimConfig, dp: DataParallel | None) -> PlanOptions:
    """``opts`` with updates before the step's global norm (``speculate``) only where this run can make them: with
    megatrain's host kernel (it writes the masters alone, the moments after the CHECK) in one process; "auto"
    becomes none elsewhere, a count is refused."""
    if not opts.speculate:
        return opts
    from megatrain.runtime.optim import cpu_adamw

    why = ("the host kernel is torch's (OptimConfig host_kernel='torch' or fused=False)"
           if not optim.fused or optim.host_kernel == "torch" else
           "data parallel ranks share one store" if dp is not None else
           "megatrain's host kernel cannot be built here (no C compiler)" if not cpu_adamw.available() else None)
    if why is None:
        return opts
    if opts.speculate != "auto":
        raise ValueError(f"speculate={opts.speculate}: updates before the step's global norm write the masters "
                         f"alone, with megatrain's host kernel, in one process; here {why}")
    return replace(opts, speculate=0)


def _plan_options(plan: dict, dev: torch.device) -> PlanOptions:
    """compile()'s plan options, checked, with the defaults left to the device decided."""
    try:
        opts = PlanOptions(**plan)
    except TypeError as e:
        known = ", ".join(f.name for f in fields(PlanOptions))
        raise ValueError(f"unknown plan option ({e}); plan options are: {known}") from None
    if opts.wire == "auto":
        raise ValueError("wire must be 'fp32' or 'bf16' for compile(): the store keeps a bf16 copy only for the "
                         "latter ('auto', the search's choice of the two, is for megatrain plan)")
    return opts.on_device(dev.type == "cuda")


def _fitted_spec(spec: HardwareSpec, opts: PlanOptions, dev: torch.device, host_free: int | None) -> HardwareSpec:
    """The spec plans are made with: this machine's host memory (``host_free``: None where a spec was given, which
    is taken at its word), or the host and device budgets asked for, each refused where more than there is; on a
    GPU, checked against the device and with its cuBLAS workspace measured."""
    if host_free is not None:  # plan with this machine's host memory, not the preset's
        spec = replace(spec, host_bytes=host_free)
    if opts.host_budget_gib is not None:
        asked = int(opts.host_budget_gib * GiB)
        if asked > spec.host_plan_bytes:
            raise ValueError(f"host_budget_gib={opts.host_budget_gib:g} is more than the "
                             f"{fmt_bytes(spec.host_plan_bytes)} of host memory a plan may take (of the "
                             f"{fmt_bytes(spec.host_bytes)} "
                             f"{'this machine has available' if host_free is not None else 'the hardware spec gives'}"
                             f", {fmt_bytes(spec.host_margin)} left free)")
        spec = replace(spec, host_bytes=asked, host_margin_bytes=0)  # within the machine's margin already
    if opts.device_budget_gib is not None:
        budget = int(opts.device_budget_gib * GiB)
        if budget > spec.budget_bytes:
            raise ValueError(f"device_budget_gib={opts.device_budget_gib:g} is more than the "
                             f"{fmt_bytes(spec.budget_bytes)} the hardware spec {spec.name!r} plans with")
        spec = replace(spec, gpu_bytes=budget + spec.gpu_reserved_bytes)  # its budget_bytes: the one asked for
    if dev.type == "cuda":
        _check_device_memory(dev, spec)
        spec = replace(spec, gpu_gemm_workspace_bytes=_gemm_workspace(dev))
    return spec


def _check_host(cap: Captured, spec: HardwareSpec, opts: PlanOptions, host_free: int | None) -> int:
    """The host store's bytes, refused where the host memory a plan may take cannot hold them."""
    need, n = store_nbytes(cap, shadow=opts.wire == "bf16"), cap.graph.n_params
    if need > spec.host_plan_bytes:
        left = f" less the {fmt_bytes(spec.host_margin)} a plan leaves free" if spec.host_margin else ""
        have = (f"the {fmt_bytes(spec.host_bytes)} host_budget_gib allows" if opts.host_budget_gib is not None else
                f"the {fmt_bytes(spec.host_bytes)} this machine has available{left}" if host_free is not None else
                f"the {fmt_bytes(spec.host_bytes)} of host memory the hardware spec {spec.name!r} gives{left}")
        raise ValueError(
            f"host memory: the host store of this model needs {fmt_bytes(need)} ({n / 1e9:.3f}B parameters x "
            f"{need // n} bytes: fp32 master weights and two Adam moments"
            f"{', and the bf16 copy a bf16 wire sends' if opts.wire == 'bf16' else ''}), more than {have}")
    return need


def _filled_store(model: nn.Module, cap: Captured, need: int, dev: torch.device, dp: DataParallel | None,
                  checkpoint, init_seed: int | None, state) -> HostStore:
    """The host store (pinned on a GPU), with the weights from the checkpoint, the seeded initializer or the model
    (a state is loaded after, by the StreamedModel)."""
    n = cap.graph.n_params
    with progress_bar(f"host store ({fmt_bytes(need)}{', pinned' if dev.type == 'cuda' else ''}"
                      f"{f', shared by {dp.world} ranks' if dp is not None else ''})", n) as bar:
        store = HostStore(cap, pin=dev.type == "cuda", progress=bar.update, shared=dp)
    if dp is None or dp.rank == 0:  # data parallel: the store is one memory, rank 0 fills it
        if checkpoint is not None:
            with progress_bar(f"loading {checkpoint}", n) as bar:
                store.load_safetensors(checkpoint, progress=bar.update)
        elif init_seed is not None:
            with progress_bar("initializing", n) as bar:
                init_seeded(model, cap, store, init_seed, progress=bar.update)
        elif state is None:
            store.load_from_module(model)
    if dp is not None:
        dp.barrier()
    return store


def _data_parallel(cap: Captured, opts: PlanOptions, streams: bool) -> DataParallel | None:
    """The data-parallel ranks where torch.distributed is initialized with several (None: one process), refused
    where this runtime cannot train them yet, in one line."""
    dp = DataParallel.from_env()
    if dp is None:
        return None
    import torch.distributed as dist

    why = ("its steps run in program order: pass streams=False (the stream executor does not order the ranks' "
           "collectives yet)" if streams else
           "the router's auxiliary loss (output_router_logits) is computed per micro-batch on one rank; set "
           "output_router_logits=False or train on one process" if cap.router_aux is not None else
           "the ranks share one host store, which a bf16 wire's host copy is not part of yet: use wire='fp32'"
           if opts.wire == "bf16" else
           "the ranks must share one host (their store is one memory): several nodes are not supported yet"
           if int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) != dist.get_world_size() else None)
    if why is not None:
        raise ValueError(f"data parallel over {dp.world} ranks (torch.distributed is initialized): {why}")
    return dp



def _device(device: str | torch.device | None) -> torch.device:
    """The device to run on (default: CUDA when present), refused with one message where it cannot be used."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device name torch knows ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: megatrain runs on 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {device!r}: torch {torch.__version__} ({build}) sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def device_spec(dev: torch.device) -> HardwareSpec:
    """The hardware spec of ``dev`` where none is given: the preset of its card (H100, H200), or for another card
    the H200's rates with this card's memory; the CPU's preset on the CPU."""
    from megatrain.planner.hardware import PRESETS

    if dev.type != "cuda":
        return PRESETS["cpu"]
    name = torch.cuda.get_device_name(dev)
    for preset in ("h100", "h200"):
        if preset in name.lower():
            return PRESETS[preset]
    return replace(PRESETS["h200"], name=f"{name} (h200 rates)",
                   gpu_bytes=torch.cuda.get_device_properties(dev).total_memory)


def _gemm_workspace(dev: torch.device) -> int:
    """Device bytes cuBLAS takes from the caching allocator for one thread's workspace on one stream, measured on
    ``dev``: what a thread's first GEMMs on a new stream (a plain product, and one with a bias, which may take
    cuBLASLt's path) allocate besides their results. The workspaces are released after."""
    torch.cuda.synchronize(dev)
    torch._C._cuda_clearCublasWorkspaces()
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
        a = torch.ones(64, 64, device=dev, dtype=torch.bfloat16)
        bias = torch.ones(64, device=dev, dtype=torch.bfloat16)
        before = torch.cuda.memory_allocated(dev)
        outs = [a @ a, torch.nn.functional.linear(a, a, bias)]
        torch.cuda.synchronize(dev)
        taken = torch.cuda.memory_allocated(dev) - before - sum(o.untyped_storage().nbytes() for o in outs)
        del outs
        torch.cuda.synchronize(dev)
        torch._C._cuda_clearCublasWorkspaces()
    return max(taken, 0)


def _check_device_memory(dev: torch.device, spec: HardwareSpec) -> None:
    """Refuse a hardware spec whose plan budget is more than the device has for this process (free memory plus
    what this process's caching allocator already holds): plans fill the budget (saved activations take what the
    rest leaves), so they would run out of memory mid-step."""
    free, total = torch.cuda.mem_get_info(dev)
    have = free + torch.cuda.memory_reserved(dev)
    if spec.budget_bytes > have:
        raise ValueError(
            f"hardware spec {spec.name!r} plans for {fmt_bytes(spec.budget_bytes)} of device memory, but "
            f"{torch.cuda.get_device_name(dev)} ({dev}) has {fmt_bytes(have)} available of {fmt_bytes(total)}: pass "
            f"hardware= the spec of this card (a preset such as 'h100', or a JSON file), or a spec with less "
            f"gpu_bytes (dataclasses.replace(megatrain.planner.hardware.PRESETS['{spec.name}'], gpu_bytes=...))")
