"""``megatrain probe``: this machine's host link and host AdamW measured, as a hardware spec the planner reads.

Cards of one kind sit in hosts that differ: on two leases of the same H100 machine type the same GPT-OSS slice ran
16% apart, and one host's copies both ways at once reached 65 GB/s where the presets (measured on the H200 machine)
say 91.7. The probe times each copy direction alone and both at once, megatrain's host AdamW alone, beside each and
beside both, and the update's two passes (masters, then moments) alone, in pinned memory as a step runs them; fits
the spec's link and host fields to them (``planner.measured``) and writes the card's preset with those in place;
``megatrain plan|train --hardware FILE`` then plan with it. About a minute, 11 GiB of pinned host memory and 4 GiB
of device memory on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import torch

from megatrain.layout import HOST_UPDATE_CHUNK


def blocks(layers: int, numel: int, pinned: bool) -> list[torch.Tensor]:
    """``layers`` (4, numel) fp32 blocks: master, exp_avg, exp_avg_sq, gradient (the host store's rows and a
    gradient buffer), random where AdamW reads them."""
    from megatrain.runtime.memory.store import pinned_zeros

    out = []
    for _ in range(layers):
        b = pinned_zeros(4, numel) if pinned else torch.zeros(4, numel)
        b[0].normal_()
        b[3].normal_()
        out.append(b)
    return out


def native_all(bs: list[torch.Tensor], chunk: int, mode: int, threads: int | None, scale: float | None) -> float:
    """Seconds for one update of every block by megatrain's host kernel (``cpu_adamw``) in ``mode``, a chunk at a
    time, in the calling thread."""
    from megatrain.runtime.optim import cpu_adamw

    t = time.perf_counter()
    for b in bs:
        n = b.shape[1]
        for a in range(0, n, chunk):
            e = min(a + chunk, n)
            cpu_adamw.adamw(b[0, a:e], b[1, a:e], b[2, a:e], b[3, a:e], lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, step=1, grad_scale=scale, mode=mode, threads=threads)
    return time.perf_counter() - t


class Traffic:
    """Copies between pinned host buffers and the GPU in a loop on side streams (the named directions), as a step's
    weight loads and gradient stores run; ``gbps`` (per direction, GB/s) once stopped."""

    def __init__(self, gib: float, h2d: bool, d2h: bool):
        n = int(gib * (1 << 30)) // 4
        from megatrain.runtime.memory.store import pinned_zeros

        self.host = [pinned_zeros(n), pinned_zeros(n)]
        self.dev = [torch.empty(n, device="cuda"), torch.empty(n, device="cuda")]
        self.dirs = [d for d, on in (("h2d", h2d), ("d2h", d2h)) if on]
        self.stop, self.bytes = threading.Event(), {d: 0 for d in self.dirs}
        self.threads = [threading.Thread(target=self._loop, args=(d,), daemon=True) for d in self.dirs]

    def _loop(self, d: str):
        s = torch.cuda.Stream()
        i = 0 if d == "h2d" else 1
        with torch.cuda.stream(s):
            while not self.stop.is_set():
                if d == "h2d":
                    self.dev[i].copy_(self.host[i], non_blocking=True)
                else:
                    self.host[i].copy_(self.dev[i], non_blocking=True)
                s.synchronize()
                self.bytes[d] += self.host[i].numel() * 4

    def __enter__(self):
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()
        dt = time.perf_counter() - self.t0
        self.gbps = {d: b / dt / 1e9 for d, b in self.bytes.items()}


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("measuring copies between pinned host memory and a GPU needs a CUDA device, and this "
                           "machine has none (plan for a GPU machine with --hardware h100|h200 or its spec file)")


def measure(numel: int = 233_000_000, layers: int = 2, seconds: float = 3.0, gib: float = 2.0,
            progress=None) -> dict[str, dict[str, float]]:
    """Each case of ``planner.measured.CASES`` and ``PASSES`` for about ``seconds``: {case: {queue: rate}} (copies
    in bytes/s, "adam" in parameters/s: megatrain's host kernel over ``layers`` blocks of ``numel`` parameters,
    every thread)."""
    from megatrain.planner.measured import CASES, PASSES
    from megatrain.runtime.memory.store import available_host_bytes
    from megatrain.runtime.optim import cpu_adamw

    _need_cuda()
    need = layers * numel * 16 + 2 * int(gib * (1 << 30))  # the blocks' four fp32 rows, the two copy buffers
    free = available_host_bytes()
    if free is not None and need > free:
        raise RuntimeError(f"the probe pins {need / (1 << 30):.1f} GiB of host memory ({layers} blocks of {numel:,} "
                           f"parameters and two copy buffers of {gib:g} GiB) and this machine has "
                           f"{free / (1 << 30):.1f} GiB available")
    cpu_adamw.library()
    bs = blocks(layers, numel, True)
    n_params = numel * layers

    def adam_rate(mode: int = cpu_adamw.FULL) -> float:  # whole passes over the blocks until the time is up
        t0, done = time.perf_counter(), 0
        while True:
            native_all(bs, HOST_UPDATE_CHUNK, mode, None, 0.8)
            done += n_params
            if time.perf_counter() - t0 >= seconds:
                return done / (time.perf_counter() - t0)

    adam_rate()  # warm: first touch, the kernel's threads
    out = {}
    for name, (h2d, d2h, adam) in CASES:
        if progress is not None:
            progress(name)
        if not (h2d or d2h):
            out[name] = {"adam": adam_rate()}
            continue
        with Traffic(gib, h2d, d2h) as tr:
            rate = adam_rate() if adam else time.sleep(seconds)
        torch.cuda.synchronize()
        out[name] = {d: g * 1e9 for d, g in tr.gbps.items()} | ({"adam": rate} if adam else {})
    for (name, _), mode in zip(PASSES, (cpu_adamw.MASTER, cpu_adamw.MOMENTS)):
        if progress is not None:
            progress(name)
        out[name] = {"adam": adam_rate(mode)}
    return out


def probe(out_path: str | None = None, device: str = "cuda", seconds: float = 3.0, json_path: str | None = None,
          say=print):
    """Measure, fit and (``out_path``) write the spec: the card's preset (``compiler.device_spec``) with the fitted
    link and host fields and the host memory available now. Returns the spec."""
    from megatrain.compiler import device_spec
    from megatrain.planner.measured import fit, report, with_fitted
    from megatrain.runtime.memory.store import available_host_bytes

    _need_cuda()
    base = device_spec(torch.device(device))
    t0 = time.perf_counter()
    with torch.cuda.device(torch.device(device)):  # (the copies and their buffers on the card named)
        m = measure(seconds=seconds, progress=lambda name: say(f"probe: {name} ..."))
    fields = fit(m)
    host = available_host_bytes()
    spec = with_fitted(base, fields, **({"host_bytes": host} if host else {}))
    say(f"probe: measured in {time.perf_counter() - t0:.0f} s; GB/s for copies, G params/s for AdamW (the fitted "
        f"spec's model in brackets):")
    for line in report(m, spec):
        say("  " + line)
    say("probe: fitted " + ", ".join(f"{k}={v:.4g}" for k, v in fields.items()))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(dataclasses.asdict(spec), f, indent=1)
        say(f"probe: wrote {out_path} ({base.name}'s other fields; plan with --hardware {out_path})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"measured": m, "fitted": fields, "base": base.name, "seconds": seconds}, f, indent=1)
    return spec
