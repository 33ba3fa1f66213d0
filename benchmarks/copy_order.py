"""How the copy engines share themselves between streams, measured: a chain of optimizer-state-sized copies on one
stream (each load gated by the store two parts back, as a split update's LOAD_OPT waits for the STORE_OPT that
freed its slot) and one weight load issued on another stream while the chain runs. Prints when the weight load
ran, for stream priorities, chain copy sizes and an SM-driven copy of the chain (a kernel reading pinned host
memory through its device address). GPU only.

    PYTHONPATH=. python3 benchmarks/copy_order.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch


class _HostView:
    """A pinned host tensor as a CUDA array (unified addressing: the device reaches it at the host address)."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<f4", "data": (t.data_ptr(), False),
                                         "version": 3, "strides": None}


def device_view(t: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(_HostView(t), device="cuda")


def run(chain_mb, n_chain, load_mb, prio_chain=0, prio_load=0, gated=True, delay_ms=40.0, sm_copy=False,
        direction="h2d"):
    dev = torch.device("cuda")
    a = torch.cuda.Stream(priority=prio_chain)
    d = torch.cuda.Stream(priority=prio_chain)
    b = torch.cuda.Stream(priority=prio_load)
    el = chain_mb * 2**20 // 4
    src = [torch.empty(el, dtype=torch.float32).pin_memory() for _ in range(2)]
    back = [torch.empty(el // 2, dtype=torch.float32).pin_memory() for _ in range(2)]
    slots = [torch.empty(el, dtype=torch.float32, device=dev) for _ in range(2)]
    views = [device_view(s) for s in src] if sm_copy else None
    w_host = torch.empty(load_mb * 2**20 // 4, dtype=torch.float32).pin_memory()
    w_dev = torch.empty_like(w_host, device=dev)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record(torch.cuda.current_stream())
    marks, stores = [], []
    for i in range(n_chain):
        with torch.cuda.stream(a):
            a.wait_event(t0)
            if gated and i >= 2:
                a.wait_event(stores[i - 2])
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(a)
            if direction == "h2d":
                if sm_copy:
                    torch.mul(views[i % 2], 1.0, out=slots[i % 2])
                else:
                    slots[i % 2].copy_(src[i % 2], non_blocking=True)
            else:
                src[i % 2].copy_(slots[i % 2], non_blocking=True)
            e.record(a)
            marks.append((s, e))
        with torch.cuda.stream(d):
            d.wait_event(e)
            if direction == "h2d":
                back[i % 2].copy_(slots[i % 2][: el // 2], non_blocking=True)
            else:
                slots[i % 2][: el // 2].copy_(back[i % 2], non_blocking=True)
            st = torch.cuda.Event()
            st.record(d)
            stores.append(st)
    with torch.cuda.stream(b):
        b.wait_event(t0)
        torch.cuda._sleep(int(delay_ms * 1.98e6))  # about delay_ms at the H200's clock (cycles)
        ws, we = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ws.record(b)
        if direction == "h2d":
            w_dev.copy_(w_host, non_blocking=True)
        else:
            w_host.copy_(w_dev, non_blocking=True)
        we.record(b)
    torch.cuda.synchronize()
    ok = None
    if sm_copy:
        ok = bool(torch.equal(slots[(n_chain - 1) % 2].cpu(), src[(n_chain - 1) % 2]))
    return {"direction": direction, "chain_mb": chain_mb, "n_chain": n_chain, "load_mb": load_mb,
            "prio_chain": prio_chain, "prio_load": prio_load, "gated": gated, "sm_copy": sm_copy, "sm_copy_exact": ok,
            "load_start_ms": t0.elapsed_time(ws), "load_end_ms": t0.elapsed_time(we), "load_ms": ws.elapsed_time(we),
            "chain_start_ms": t0.elapsed_time(marks[0][0]), "chain_end_ms": t0.elapsed_time(marks[-1][1]),
            "chain_gbps": n_chain * chain_mb * 2**20 / 1e6 / max(t0.elapsed_time(marks[-1][1])
                                                                   - t0.elapsed_time(marks[0][0]), 1e-6)}


CASES = [
    dict(), dict(gated=False), dict(prio_load=-5), dict(prio_load=-1, prio_chain=0), dict(prio_chain=-5),
    dict(chain_mb=64), dict(chain_mb=128), dict(direction="d2h"), dict(direction="d2h", prio_load=-5),
    dict(sm_copy=True), dict(sm_copy=True, prio_load=-5), dict(),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    print("stream priorities (low, high):", torch.cuda.Stream.priority_range())
    run(512, 4, 1024)  # warm-up
    out = []
    for case in CASES:
        kw = {"chain_mb": 512, **case}
        kw["n_chain"] = 16 * 512 // kw["chain_mb"]
        try:
            r = run(load_mb=1024, **kw)
        except Exception as e:  # noqa: BLE001 - a case this device or torch cannot run: say so, go on
            print(f"{case}: {type(e).__name__}: {e}")
            out.append({**kw, "error": str(e)})
            continue
        out.append(r)
        print(f"{r['direction']} chain {r['n_chain']} x {r['chain_mb']} MB gated={r['gated']} sm={r['sm_copy']}"
              f"({r['sm_copy_exact']}) prio chain {r['prio_chain']} load {r['prio_load']}: load {r['load_start_ms']:.1f}"
              f" -> {r['load_end_ms']:.1f} ms ({r['load_ms']:.1f}); chain {r['chain_start_ms']:.1f} -> "
              f"{r['chain_end_ms']:.1f} ms at {r['chain_gbps']:.1f} GB/s")
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
