"""Host store: per layer one contiguous fp32 block holding master weights, exp_avg and exp_avg_sq; and the host
gradient buffers a schedule's gradients pass through (as many and as large as its plan says)."""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from megatrain.capture import Captured
from megatrain.layout import HOST_UPDATE_CHUNK, STORE_ROWS
from megatrain.runtime.state.hf_weights import checkpoint_plan
from megatrain.runtime.state.safetensors_stream import chunk_buffer, read_header, read_into

ROWS = STORE_ROWS


def available_host_bytes(root: Path = Path("/")) -> int | None:
    """Host memory this process can still allocate: the kernel's ``MemAvailable``, less where a cgroup (a container's
    limit) leaves less. None where neither can be read (not Linux). ``root``: where /proc and /sys are (tests)."""
    found = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("memory.max", "memory.current"),  # cgroup v2
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # cgroup v1
        try:
            cap = (root / "sys/fs/cgroup" / limit).read_text().strip()
            used = (root / "sys/fs/cgroup" / usage).read_text().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit() and int(cap) < 1 << 60:  # "max" or a huge number: no limit
            found.append(max(0, int(cap) - int(used)))
    return min(found) if found else None


def host_rss_bytes(root: Path = Path("/")) -> int | None:
    """This process's resident host memory (``/proc/self/statm``), None where it cannot be read (not Linux)."""
    import os

    try:
        return int((root / "proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes(reset: bool = False) -> int | None:
    """This process's peak resident host memory since it started or since the last reset (``VmHWM``); ``reset``:
    start the peak again from the current resident set (``/proc/self/clear_refs``) after reading it. None where
    it cannot be read (not Linux)."""
    try:
        status = Path("/proc/self/status").read_text()
        peak = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        return peak
    except (OSError, ValueError, StopIteration):
        return None


def store_nbytes(captured: Captured, *, shadow: bool = False) -> int:
    """Host bytes a :class:`HostStore` of ``captured`` takes: three fp32 rows per owned parameter, and with
    ``shadow`` the bf16 copy of the masters a bf16 wire sends (gradient buffers come with a plan: see
    :class:`GradBuffers`)."""
    from megatrain.layout import store_bytes

    return store_bytes(captured.graph) + (captured.graph.n_params * 2 if shadow else 0)


def progress_bar(what: str, n_params: int):
    """A progress bar over ``n_params`` parameters on stderr, shown on a terminal only (building the store of a 7B
    model and filling it take minutes); ``update(n)`` advances it."""
    from tqdm import tqdm

    return tqdm(total=n_params, desc=f"megatrain: {what}", unit=" params", unit_scale=True, file=sys.stderr,
                disable=None, leave=False, dynamic_ncols=True, mininterval=0.5)


def pinned_zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros in page-locked host memory of exactly the requested size.

    ``torch.zeros(..., pin_memory=True)`` goes through the CUDA host caching allocator, which rounds every block up to
    a power of two (a 3.7 GB block of a 7B model takes 4 GiB, an 8.7 GB one 16 GiB): a 7.6B model's 113 GiB store
    would need far more than a 125 GiB host. Registering an ordinary allocation with cudaHostRegister pins it as is.
    """
    return _pin(torch.zeros(*shape, dtype=dtype))


def pinned_empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`pinned_zeros` without the zeros (a buffer every use writes whole before it reads)."""
    return _pin(torch.empty(*shape, dtype=dtype))


def _pin(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory page-locked where it is (cudaHostRegister), until ``t`` goes."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / (1 << 30):.2f} GiB failed with error {int(err)}")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def _rows(f: torch.Tensor, n: int, t: int) -> tuple[torch.Tensor, ...]:
    """A layer's rows in block ``f``: its ``n`` masters, then the moments of its ``t`` elements that train."""
    return (f[:n],) if not t else (f[:n], f[n: n + t], f[n + t:])


def grad_host_dtype(cfg) -> torch.dtype:
    """The dtype of a schedule's host gradient buffers (``ScheduleConfig.grad_host_bytes``)."""
    return torch.bfloat16 if cfg.grad_host_bytes == 2 else torch.float32


class GradBuffers:
    """The host gradient buffers (the ``h`` slots of schedules): buffer k as large as the largest layer any schedule
    run puts in it, in that schedule's dtype (fp32, or bf16 where the plan sends bf16 gradients), pinned like the
    store. Grown as schedules need, never shrunk; :meth:`extra_nbytes` says beforehand what a schedule would add."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.bufs: list[torch.Tensor] = []
        # where a host update reads a bf16 gradient back into fp32 (one update at a time): as large as the largest
        # bf16 buffer
        self.fp32: torch.Tensor = torch.empty(0)

    def _missing(self, numels: list[int], dtype: torch.dtype) -> list[tuple[int, int]]:
        return [(k, n) for k, n in enumerate(numels) if k >= len(self.bufs) or self.bufs[k].numel() < n
                or self.bufs[k].dtype != dtype]

    def _fp32_numel(self, numels: list[int], dtype: torch.dtype) -> int:
        """Elements the fp32 read-back buffer needs beyond what it has (none for fp32 buffers): a chunk of the
        largest buffer (the host update reads a bf16 gradient back a chunk at a time)."""
        need = min(max(numels, default=0), HOST_UPDATE_CHUNK) if dtype != torch.float32 else 0
        return need if need > self.fp32.numel() else 0

    def extra_nbytes(self, numels: list[int], dtype: torch.dtype) -> int:
        """Host bytes :meth:`fit` would allocate (the buffers it replaces are freed after)."""
        return sum(n * dtype.itemsize for _, n in self._missing(numels, dtype)) + 4 * self._fp32_numel(numels, dtype)

    def fit(self, numels: list[int], dtype: torch.dtype, quiesce: Callable[[], None]) -> None:
        """Buffers for a schedule whose buffer k holds up to ``numels[k]`` elements; ``quiesce`` first waits until
        nothing uses a buffer that is replaced."""
        missing = self._missing(numels, dtype)
        grow = self._fp32_numel(numels, dtype)
        if any(k < len(self.bufs) for k, _ in missing) or (grow and self.fp32.numel()):
            quiesce()
        for k, n in missing:
            buf = pinned_zeros(n, dtype=dtype) if self.pinned else torch.zeros(n, dtype=dtype)
            if k < len(self.bufs):
                self.bufs[k] = buf
            else:
                self.bufs.append(buf)
        if grow:
            self.fp32 = torch.empty(grow, dtype=torch.float32)

    def view(self, k: int, numel: int) -> torch.Tensor:
        return self.bufs[k][:numel]

    def as_fp32(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (a chunk of at most HOST_UPDATE_CHUNK elements of a bf16 buffer) read back into the fp32
        buffer; an fp32 one as it is."""
        if grad.dtype == torch.float32:
            return grad
        return self.fp32[: grad.numel()].copy_(grad)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs) + self.fp32.numel() * 4


class HostStore:
    """Every layer that owns weights (n_l > 0) has one fp32 buffer, allocated in layer order and pinned when CUDA is
    available so copies to and from the device run at full rate: its master weights (n_l), then the Adam moments
    exp_avg and exp_avg_sq of the t_l elements that train (``Layer.moment_params``: all n_l, none in a layer frozen
    whole, the first t_l in a layer frozen in part). ``rows(l)`` gives them as views; ``block(l)`` as a (3, n_l) or
    (1, n_l) tensor where the moments cover all weights or none. ``grads``: the host gradient buffers
    (:class:`GradBuffers`)."""

    def __init__(self, captured: Captured, *, pin: bool | None = None, progress: Callable[[int], None] | None = None,
                 shared=None):
        self.captured = captured
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self.flats: list[torch.Tensor | None] = []  # per layer: master, exp_avg, exp_avg_sq end to end
        sizes = [seg.numel + 2 * captured.graph[seg.index].moment_params if seg.numel else 0
                 for seg in captured.segments]
        # data parallel (``shared``: runtime.issue.data_parallel.DataParallel): one memory for the ranks of this host
        base = shared.shared_zeros(sum(sizes)) if shared is not None else None
        if base is not None and self.pinned:
            _pin(base)
        off = 0
        for seg, n in zip(captured.segments, sizes):
            if n:
                self.flats.append(base[off: off + n] if base is not None else
                                  pinned_zeros(n) if self.pinned else torch.zeros(n))
                off += n
                if progress is not None:
                    progress(seg.numel)
            else:
                self.flats.append(None)
        self.shared = base is not None
        self.grads = GradBuffers(self.pinned)
        self.shadows: dict[int, torch.Tensor] | None = None  # bf16 copies of the masters (plans with a bf16 wire)
        self.spares: dict[int, torch.Tensor] = {}  # layer -> a block of its size (:meth:`spare`)
        self.generation = 0  # counts loads of new weights from outside (copies made of the masters go stale)
        # called before new weights come in from outside: whoever holds a newer copy of any row (an executor
        # keeping states on the device) writes it back first, so the moments survive as they do in the store
        self.before_load: list[Callable[[], None]] = []

    def row(self, layer: int, what: str) -> torch.Tensor:
        return self.rows(layer)[ROWS.index(what)]

    def flat(self, layer: int) -> torch.Tensor:
        """The layer's buffer: master weights, then the moments of the elements that train."""
        f = self.flats[layer]
        if f is None:
            raise KeyError(f"layer {layer} owns no weights (it is tied to layer {self.captured.segments[layer].owner})")
        return f

    def _split(self, layer: int) -> tuple[torch.Tensor, int, int]:
        """(the layer's buffer, its weights n, the elements with moments t)."""
        f, t = self.flat(layer), self.captured.graph[layer].moment_params
        return f, f.numel() - 2 * t, t

    def rows(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Views of the layer's rows in ``ROWS`` order: the master weights (n), exp_avg and exp_avg_sq (t, the
        elements that train); the master alone for a layer frozen whole."""
        f, n, t = self._split(layer)
        return _rows(f, n, t)

    # ---- spare blocks: where an update made before the step's global norm writes the layer's new state ---------
    def spare(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Rows (as :meth:`rows`) of a block the size of ``layer``'s, made on first use and pinned like the store:
        where an update made before the step's guard writes (``ScheduleConfig.speculate_keeps`` "state")."""
        f, n, t = self._split(layer)
        b = self.spares.get(layer)
        if b is None:
            b = self.spares[layer] = pinned_empty(f.numel()) if self.pinned else torch.empty(f.numel())
        return _rows(b, n, t)

    def take_spare(self, layer: int) -> None:
        """The spare becomes the layer's block (the update written there stands) and its block the spare."""
        self.flats[layer], self.spares[layer] = self.spares[layer], self.flats[layer]

    def drop_spares(self, keep: tuple[int, ...]) -> None:
        """Let the spares of layers not in ``keep`` go (a plan with another window)."""
        for layer in [l for l in self.spares if l not in keep]:
            del self.spares[layer]

    def row_pairs(self, layer: int, block: torch.Tensor, lo: int = 0):
        """(host row, ``block`` row) pairs of the same elements: ``block`` (an optimizer slot's, rows as
        :meth:`rows`) holds the layer's elements from ``lo`` on (one part of them, or all); a moment row holds the
        elements that train, a prefix of the layer's."""
        hi = lo + block.shape[1]
        for r, host in enumerate(self.rows(layer)):
            end = min(hi, host.numel())
            yield host[lo:end], block[r, : max(0, end - lo)]

    def block(self, layer: int) -> torch.Tensor:
        """The layer's rows as one (3, n) fp32 tensor (master, exp_avg, exp_avg_sq); (1, n), the master alone, for
        a layer frozen whole. A layer frozen in part has shorter moments than masters: see :meth:`rows`."""
        f, n, t = self._split(layer)
        if t not in (0, n):
            raise ValueError(f"layer {layer} is frozen in part: its moments cover {t} of its {n} weights (use rows)")
        return f.view(-1, n)

    def master(self, layer: int) -> torch.Tensor:
        return self.row(layer, "master")

    # ---- the bf16 shadow: what goes on the wire when a plan sends weights as bf16 --------------------------
    def shadow(self, layer: int) -> torch.Tensor:
        """The layer's master weights rounded to bf16 (made from the masters on first use; pinned like the
        store). The optimizer refreshes it after each update."""
        if self.shadows is None:
            self.shadows = {}
            for i in self.owners():
                master = self.master(i)
                t = pinned_zeros(master.numel(), dtype=torch.bfloat16) if self.pinned else \
                    torch.zeros(master.numel(), dtype=torch.bfloat16)
                t.copy_(master)
                self.shadows[i] = t
        return self.shadows[layer]

    def refresh_shadow(self, layer: int, lo: int = 0, hi: int | None = None) -> None:
        """The shadow of the layer's masters [lo, hi) made again after an update of them."""
        if self.shadows is not None:
            self.shadows[layer][lo:hi].copy_(self.master(layer)[lo:hi])

    def owners(self) -> list[int]:
        return [i for i, b in enumerate(self.flats) if b is not None]

    # ---- weights in and out, by the model's parameter names ------------------------------------------------
    def param_view(self, name: str, row: str = "master") -> torch.Tensor:
        name = self.captured.tied_names.get(name, name)
        layer, off, shape = self.captured.model_param_names[name]
        n = 1
        for d in shape:
            n *= d
        return self.row(layer, row)[off: off + n].view(shape)

    @contextlib.contextmanager
    def loading(self):
        """Around writing new master weights from outside: whoever holds newer rows writes them back first; after,
        copies made of the old masters are stale (the shadow is made again when next needed)."""
        for hook in self.before_load:
            hook()
        yield
        self.shadows = None
        self.generation += 1

    def load_state(self, tensors: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Copy tensors named as in the model's state_dict into the master weights."""
        names = self.captured.model_param_names
        with self.loading():
            for name, t in tensors.items():
                canon = self.captured.tied_names.get(name, name)
                if canon not in names:
                    if strict:
                        raise KeyError(f"checkpoint tensor {name!r} is not a parameter of the captured model")
                    continue
                view = self.param_view(canon)
                if tuple(t.shape) != tuple(view.shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                                     f"{tuple(view.shape)}")
                view.copy_(t)

    def load_from_module(self, model: nn.Module) -> None:
        """The master weights from ``model``'s parameters, and from its persistent buffers that the capture holds as
        frozen parameters (a router's bias: ``capture.meta.block_buffers_as_parameters``)."""
        held = self.captured.model_param_names
        with self.loading():
            tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in held)]
            for name, p in tensors:
                if p.is_meta:
                    raise ValueError(f"parameter {name!r} is on the meta device: pass checkpoint= or init_seed= to "
                                     f"compile")
                self.param_view(name).copy_(p.detach())

    def load_safetensors(self, directory: str | Path, progress: Callable[[int], None] | None = None) -> None:
        """Fill the master weights from an HF weights directory (model.safetensors, or shards with an index) in
        any float dtype, each tensor read straight into its place in the store a chunk at a time
        (:func:`megatrain.runtime.state.safetensors_stream.read_into`): host memory holds one chunk beyond the store.
        The directory is checked first (:func:`megatrain.runtime.state.hf_weights.check_weights_dir`).
        ``progress(n)``: called with each tensor's size."""
        files, placement = checkpoint_plan(self.captured, directory)  # checked first, from the headers
        buf = chunk_buffer()
        with self.loading():
            for f in files:
                entries = read_header(f)[1]
                with open(f, "rb") as fh:
                    for key, entry in entries.items():
                        name, expert, row = placement[key]
                        dest = self.param_view(name)
                        if expert is not None:  # one expert's matrix, into its rows of the parameter that holds
                            # every expert's
                            dest = dest[expert, row: row + entry.shape[0]]
                        read_into(fh, entry, dest, buf)
                        if progress is not None:
                            progress(entry.numel)
                    if hasattr(os, "posix_fadvise"):  # read once: the page cache need not keep it
                        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The master weights under the model's own names (tied names included), as views into the store."""
        out = {name: self.param_view(name) for name in self.captured.model_param_names}
        for alias, canon in self.captured.tied_names.items():
            out[alias] = out[canon]
        return out

    @property
    def nbytes(self) -> dict[str, int]:
        """Host bytes of the store's rows (the gradient buffers: ``grads.nbytes``)."""
        return {r: sum(rows[i].numel() for rows in map(self.rows, self.owners()) if len(rows) > i) * 4
                for i, r in enumerate(ROWS)}
