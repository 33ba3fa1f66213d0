"""Host AdamW rate (parameters per second) under the conditions the optimizer worker meets in a running step.

torch's fused AdamW on fp32 master weights and moments reads 16 and writes 12 bytes per parameter, so on a host whose
DRAM streams ~100 GB/s it cannot pass ~4 G params/s. This measures the rate for layer-sized blocks (a Qwen2.5-7B
block by default) in each variant the worker may differ from a lone kernel in: the calling thread (main or a worker
thread), its OpenMP thread count, pinned (cudaHostRegister) or pageable memory, the chunking HostAdamW applies, the
clip factor as a grad_scale tensor, and copies to and from the GPU running meanwhile (the next step's weight loads,
gradient stores).

    PYTHONPATH=. python3 benchmarks/host_adamw.py [--numel 233000000] [--layers 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import torch

from megatrain.layout import HOST_UPDATE_CHUNK
from megatrain.probe import Traffic, blocks, native_all


def anon_huge_gib() -> float:
    """GiB of this process's anonymous memory backed by transparent huge pages (Linux; 0 where it cannot be read)."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def optimizers(bs: list[torch.Tensor], chunk: int) -> list[tuple[torch.optim.AdamW, list, list]]:
    """One AdamW per block over chunk views of its master row, moments as views of its rows (HostAdamW's layout)."""
    out = []
    for b in bs:
        n = b.shape[1]
        spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
        views = [b[0, a:e] for a, e in spans]
        opt = torch.optim.AdamW([{"params": views, "weight_decay": 0.1}], lr=1e-4, betas=(0.9, 0.95), fused=True)
        for v, (a, e) in zip(views, spans):
            opt.state[v] = {"step": torch.zeros(()), "exp_avg": b[1, a:e], "exp_avg_sq": b[2, a:e]}
        out.append((opt, views, [b[3, a:e] for a, e in spans]))
    return out


def step_all(opts, threads: int | None, scale: torch.Tensor | None) -> float:
    """Seconds for one AdamW step over every block, in the calling thread."""
    if threads:
        torch.set_num_threads(threads)
    t = time.perf_counter()
    for opt, views, grads in opts:
        for v, g in zip(views, grads):
            v.grad = g
        if scale is not None:
            opt.grad_scale = scale
        opt.step()
        if scale is not None:
            del opt.grad_scale
        for v in views:
            v.grad = None
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=233_000_000, help="parameters per block (default: a 7B block)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--native-only", action="store_true",
                    help="only megatrain's host kernel and torch's fused kernel with a clip factor, pinned blocks")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    n_params = args.numel * args.layers
    cores = torch.get_num_threads()
    results = []
    pool = concurrent.futures.ThreadPoolExecutor(1)  # the optimizer worker's shape: one thread, tasks in order

    def run(name, opts, where="main", threads=None, scale=None, traffic=None, fn=step_all):
        def once():
            return (fn(opts, threads, scale) if where == "main"
                    else pool.submit(fn, opts, threads, scale).result())

        once()  # warm: first touch, thread pools
        if traffic is not None:
            with Traffic(2.0, *traffic) as tr:
                secs = min(once() for _ in range(args.reps))
            gbps = tr.gbps
        else:
            secs, gbps = min(once() for _ in range(args.reps)), {}
        rate = n_params / secs
        results.append({"variant": name, "where": where, "threads": threads or cores, "seconds": secs,
                        "params_per_s": rate, "copy_gbps": gbps})
        print(f"{name:55s} {rate / 1e9:6.2f} G params/s  ({secs:.3f} s for {n_params / 1e9:.2f}B)"
              + (f"  copies {', '.join(f'{k} {v:.1f} GB/s' for k, v in gbps.items())}" if gbps else ""), flush=True)

    if args.native_only:
        from megatrain.runtime.optim import cpu_adamw

        cpu_adamw.library()
        print(f"host kernel: form {cpu_adamw._form} (torch's fused AdamW reproduced bit for bit)", flush=True)
        bs = blocks(args.layers, args.numel, cuda)
        print(f"host memory of this process in transparent huge pages: {anon_huge_gib():.1f} GiB", flush=True)
        chunked = optimizers(bs, HOST_UPDATE_CHUNK)
        traffic_cases = [None, (True, True)] if cuda else [None]
        for traffic in traffic_cases:
            tag = ", H2D + D2H running" if traffic else ""
            run(f"torch fused, worker, grad_scale{tag}", chunked, "worker", scale=torch.tensor(1.25), traffic=traffic)
            for mode, what in ((cpu_adamw.FULL, "full"), (cpu_adamw.MASTER, "master only"),
                               (cpu_adamw.MOMENTS, "moments only")):
                for t in (cores, cores - 1):
                    run(f"native {what}, worker, {t} threads{tag}", bs, "worker", threads=t, scale=0.8,
                        traffic=traffic,
                        fn=lambda b, th, sc, mode=mode: native_all(b, HOST_UPDATE_CHUNK, mode, th, sc))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"numel": args.numel, "layers": args.layers, "cores": cores, "form": cpu_adamw._form,
                           "results": results}, f, indent=1)
        return
    for pinned in ([False, True] if cuda else [False]):
        bs = blocks(args.layers, args.numel, pinned)
        mem = "pinned" if pinned else "pageable"
        chunked, whole = optimizers(bs, HOST_UPDATE_CHUNK), optimizers(bs, args.numel)
        run(f"{mem}, main thread, whole blocks", whole)
        run(f"{mem}, main thread, {HOST_UPDATE_CHUNK >> 20}M chunks", chunked)
        run(f"{mem}, worker thread, chunks", chunked, "worker")
        for t in (cores - 1, cores // 2):
            run(f"{mem}, worker thread, chunks, {t} threads", chunked, "worker", threads=t)
        run(f"{mem}, worker thread, chunks, {cores} threads", chunked, "worker", threads=cores)
        run(f"{mem}, worker thread, chunks, grad_scale", chunked, "worker", scale=torch.tensor(1.25))
        if pinned:
            run(f"{mem}, worker, chunks, H2D copies running", chunked, "worker", traffic=(True, False))
            run(f"{mem}, worker, chunks, D2H copies running", chunked, "worker", traffic=(False, True))
            run(f"{mem}, worker, chunks, H2D + D2H copies running", chunked, "worker", traffic=(True, True))
            run(f"{mem}, worker, chunks, {cores - 1} threads, H2D + D2H running", chunked, "worker",
                threads=cores - 1, traffic=(True, True))
        del bs, chunked, whole
    if cuda:  # the copies alone, for comparison
        for traffic in ((True, False), (False, True), (True, True)):
            with Traffic(2.0, *traffic) as tr:
                time.sleep(2.0)
            print(f"copies alone {traffic}: {tr.gbps}")
            results.append({"variant": f"copies alone h2d={traffic[0]} d2h={traffic[1]}", "copy_gbps": tr.gbps})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "layers": args.layers, "cores": cores, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
