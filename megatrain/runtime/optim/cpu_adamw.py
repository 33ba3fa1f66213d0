"""The host's AdamW kernel (``cpu_adamw.c``): torch's fused CPU AdamW arithmetic in one pass that writes only what
it must, built on first use with the machine's C compiler and loaded with ctypes (which lets go of the GIL while it
runs, so the optimizer worker's update does not hold up the thread that issues GPU work).

Bytes per parameter, fp32 rows: torch's fused kernel with a clip factor reads 16 and writes 16 (it writes the
scaled gradient back), and a bf16 shadow of the new weights costs another pass (read 4, write 2); this kernel
reads 16 and writes 12 (+2 for the shadow) -- ``FULL`` -- or splits the update in two: ``MASTER`` (read 16, write
4 (+2)), what the next forward waits for, and ``MOMENTS`` (read 12, write 8), which can run later."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from megatrain.adamw_scalars import scalars

FULL, MASTER, MOMENTS = 0, 1, 2
_SOURCE = Path(__file__).with_suffix(".c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")


class KernelUnavailable(RuntimeError):
    """The host kernel cannot be built here (no C compiler, or it failed)."""


class _Args(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_float) for name in
                  ("decay", "w1", "beta2", "w2", "neg_step", "bc2_sqrt", "eps", "scale")),
                ("v_fma", ctypes.c_int32)]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_form: tuple[int, int] = (1, 16)  # (v_fma, the vector width of torch's loop here): found by :func:`_calibrate`


def cache_dir() -> Path:
    """Where built kernels are kept: ``$MEGATRAIN_CACHE``, else ``~/.cache/megatrain``."""
    return Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain")


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc)")
    return cc


def _cpu_key() -> bytes:
    """What the build depends on besides its source and flags: the CPU's instruction sets (-march=native)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    import platform

    return platform.machine().encode()


def library() -> ctypes.CDLL:
    """The built kernel, compiled once per source, compiler, flags and CPU into :func:`cache_dir`."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        cc = _compiler()
        try:
            version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"the C compiler {cc} does not run: {e}") from e
        key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(),
                                         _cpu_key()])).hexdigest()[:16]
        path = cache_dir() / f"cpu_adamw-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                r = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                   timeout=300)
                if r.returncode != 0:
                    raise KernelUnavailable(f"building {_SOURCE.name} with {cc} failed:\n{r.stderr.strip()}")
                os.replace(tmp, path)  # atomic: another process building the same key gets a whole file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
        lib.mt_adamw.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.POINTER(_Args), ctypes.c_int,
                                                         ctypes.c_int, ctypes.c_int64]
        lib.mt_adamw.restype = ctypes.c_double
        lib.mt_adamw_to.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.POINTER(_Args), ctypes.c_int,
                                                            ctypes.c_int64]
        lib.mt_adamw_to.restype = ctypes.c_double
        _calibrate(lib)
        _lib = lib
        return lib


def _calibrate(lib: ctypes.CDLL) -> None:
    """How this build of torch's fused AdamW computes exp_avg_sq in its vector loop, and that loop's width (its
    remainder, computed otherwise, is left to torch): the kernel must give torch's bits, compared here on random
    values with a clip factor and weight decay."""
    global _form
    gen = torch.Generator().manual_seed(0)
    n = 37 * 16 + 5
    rows = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3,
            torch.rand(n, generator=gen) * 1e-5, torch.randn(n, generator=gen)]
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    want = [r.clone() for r in rows]
    _torch_step(*want, hp, 2, 1.7)
    for form in ((1, 16), (1, 8), (0, 16), (0, 8)):
        got = [r.clone() for r in rows]
        _run(lib, *got, None, hp, 2, 1.7, FULL, 1, form)
        if all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])):
            _form = form
            return
    raise KernelUnavailable(f"{_SOURCE.name} does not give torch {torch.__version__}'s fused AdamW results bit for "
                            f"bit on this machine")


def _torch_step(master, exp_avg, exp_avg_sq, grad, hp, step, grad_scale) -> None:
    """torch's fused AdamW, update ``step``, in place of the first three (and of ``grad``, which it scales)."""
    opt = torch.optim.AdamW([master], **hp, fused=True)
    opt.state[master] = {"step": torch.full((), float(step - 1)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    master.grad = grad
    if grad_scale is not None:
        opt.grad_scale = torch.tensor(grad_scale, dtype=torch.float32)
    opt.step()
    master.grad = None


def _run(lib, master, exp_avg, exp_avg_sq, grad, out, hp, step, grad_scale, mode, threads, form,
         whole=False, block=0, to=None) -> float:
    """The update over the rows' first multiple of the vector width in the kernel, the rest (fewer than the width)
    by torch on copies, of which ``mode``'s rows are kept; ``whole``: every element in the kernel; ``to``: three
    rows the new master and moments go to instead (``FULL``; the rows read stay as they were). Returns the seconds
    the kernel's pass took by its own clock."""
    v_fma, width = form
    n = master.numel()
    main = n if whole else n - n % width
    secs = 0.0
    if main:
        args = _Args(**scalars(hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"], step),
                     scale=0.0 if grad_scale is None else grad_scale, v_fma=v_fma)
        ptrs = [t.data_ptr() for t in (master, exp_avg, exp_avg_sq, grad)]
        out_ptr = out.data_ptr() if out is not None else None
        if to is not None:
            secs = lib.mt_adamw_to(*ptrs, *(t.data_ptr() for t in to), out_ptr, main, ctypes.byref(args), threads,
                                   block)
        else:
            secs = lib.mt_adamw(*ptrs, out_ptr, main, ctypes.byref(args), mode, threads, block)
    if main < n:
        rest = [t[main:].clone() for t in (master, exp_avg, exp_avg_sq, grad)]
        _torch_step(*rest, hp, step, grad_scale)
        keep = {FULL: (0, 1, 2), MASTER: (0,), MOMENTS: (1, 2)}[mode]
        for i in keep:
            (to or (master, exp_avg, exp_avg_sq))[i][main:].copy_(rest[i])
        if out is not None and mode != MOMENTS:
            out[main:].copy_(rest[0])
    return secs


def v_fma() -> bool:
    """Whether exp_avg_sq's new value is ``fma(w2 * g, g, exp_avg_sq * beta2)`` in torch's fused CPU AdamW here
    (the form :func:`_calibrate` finds where the kernel builds; else torch's from 2.13 on, this project's pin)."""
    if available():
        return bool(_form[0])
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def available() -> bool:
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def _check(name: str, t: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.numel() != n or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"cpu_adamw: {name} must be a contiguous {dtype} CPU tensor of {n} elements, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *, lr: float,
          betas: tuple[float, float], eps: float, weight_decay: float, step: int, grad_scale: float | None = None,
          out: torch.Tensor | None = None, mode: int = FULL, threads: int | None = None, whole: bool = False,
          block: int = 0, to: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> float:
    """AdamW's update ``step`` (1 for the first) of fp32 ``master`` / ``exp_avg`` / ``exp_avg_sq`` in place from
    ``grad`` (divided by ``grad_scale`` as it is read; ``grad`` is not written), as torch.optim.AdamW(fused=True)
    computes it; ``out``: the new master rounded to bf16 (not in ``MOMENTS``); ``mode``: which rows are written
    (``FULL``, ``MASTER``, ``MOMENTS``); ``threads``: OpenMP threads (None: torch's count). ``whole``: the last
    ``n % width`` elements too in torch's vector-loop arithmetic, not in its remainder loop's (which may round
    differently): every element as the GPU's kernel computes it (``kernels.adamw``). ``block``: 0, each thread
    updates one equal contiguous share; N > 0, threads take runs of N elements as they come free (the same bits).
    ``to``: (master, exp_avg, exp_avg_sq) rows of other memory the new values go to (``FULL`` only), the three
    rows read left as they were: the same bits as the update in place.
    Returns the seconds the kernel's pass took by its own clock (torch's share, the remainder, not counted)."""
    n = master.numel()
    named = (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad))
    if to is not None:
        if mode != FULL:
            raise ValueError("cpu_adamw: an update into other rows writes every row (mode FULL)")
        named += tuple(zip(("to master", "to exp_avg", "to exp_avg_sq"), to))
        if len({t.data_ptr() for _, t in named}) < len(named):
            raise ValueError("cpu_adamw: the rows an update reads and those it writes to must be separate memory")
    for name, t in named:
        _check(name, t, n, torch.float32)
    if out is not None:
        _check("out", out, n, torch.bfloat16)
    if mode not in (FULL, MASTER, MOMENTS):
        raise ValueError(f"cpu_adamw: unknown mode {mode}")
    if step < 1:
        raise ValueError(f"cpu_adamw: step counts updates from 1, got {step}")
    if block < 0:
        raise ValueError(f"cpu_adamw: block must be 0 (static) or a positive run of elements, got {block}")
    if n == 0:
        return 0.0
    lib = library()
    hp = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return _run(lib, master, exp_avg, exp_avg_sq, grad, out, hp, step, grad_scale, mode,
                threads or torch.get_num_threads(), _form, whole, block, to)
