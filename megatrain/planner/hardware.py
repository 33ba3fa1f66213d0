"""HardwareSpec: the rates and capacities the cost model uses."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
# Host memory a plan leaves free of the host's (for a run: of what the machine has available when it plans): the
# kernel's page tables for a store that fills the host (8 bytes per 4 KiB page, 0.2%) and its reserves, and what
# no byte count of the plan sees (allocator arenas, libraries' buffers); a share, at most HOST_MARGIN_MAX
HOST_MARGIN_SHARE = 0.02
HOST_MARGIN_MAX = 8 * GiB


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    name: str
    gpu_bytes: int  # device memory
    gpu_reserved_bytes: int  # taken by the CUDA context, allocator slack and kernels' scratch; never planned
    h2d_bytes_per_s: float  # pinned host -> device, alone
    d2h_bytes_per_s: float  # pinned device -> host, alone
    duplex_bytes_per_s: float  # both directions at once, total
    matmul_flops_per_s: float  # dense bf16 matmul rate
    hbm_bytes_per_s: float  # device memory bandwidth (bounds ops without matmuls)
    cpu_adam_params_per_s: float  # host fused AdamW on fp32 master + moments
    cpu_cast_params_per_s: float  # host fp32 -> bf16 copy (refreshing the bf16 shadow after AdamW)
    host_bytes: int  # host RAM the plan may use
    # host time to issue one compute op (Python, autograd, kernel launches): a floor under its duration, which
    # small ops (short sequences, many micro-batches) hit before the GPU is busy. 0: not modelled
    fwd_issue_s: float = 0.0  # FWD, LOSS and a device update
    bwd_issue_s: float = 0.0  # BWD: recompute + backward
    attn_flops_per_s: float = 0.0  # fused attention's rate (its FLOPs as cost.matmul_and_attention_flops counts
    # them); 0: the matmul rate
    route_bytes_per_s: float = 0.0  # the rate a mixture of experts' routing moves its rows at (gathers by expert,
    # gating, weighting, the sum back per token: Layer.route_bytes_per_token); 0: the device memory's
    scan_flops_per_s: float = 0.0  # a linear-attention layer's recurrence (Layer.scan_flops_per_token: the gated
    # delta rule's chunk-local algebra in fp32 and its scan kernel); 0: the matmul rate
    # the share of the host AdamW's rate lost while host-to-device (device-to-host) copies run at their full rate:
    # the copy engines read (write) the host's DRAM, which the update threads stream through; 0: not modelled
    cpu_h2d_slowdown: float = 0.0
    cpu_d2h_slowdown: float = 0.0
    # host AdamW writing the new masters alone (read 16 bytes a parameter, write 4): with clipping the streaming
    # executor's host updates in the update pass, their moments (read 12, write 8) left for the next forward and
    # backward, when the host is otherwise idle (StreamExecutor.defer_moments); 0: not modelled (every host
    # update at cpu_adam_params_per_s)
    cpu_adam_master_params_per_s: float = 0.0
    # the deferred moments' pass alone (cost.moments_s): after the update pass, on the host's update worker, before
    # the next gradient store into each buffer it reads; 0: not modelled (free)
    cpu_moments_params_per_s: float = 0.0
    # the share of a copy direction's rate it loses while the host's AdamW runs (the update threads' DRAM traffic,
    # the other side of cpu_h2d_slowdown / cpu_d2h_slowdown): the weight and state loads of the update window run
    # slower than alone; 0: not modelled
    h2d_cpu_slowdown: float = 0.0
    d2h_cpu_slowdown: float = 0.0
    # device bytes torch's cuBLAS takes from the caching allocator for its workspace, one per thread and stream
    # that run GEMMs (a plan's step: the issuing thread's forwards and recomputes, autograd's backward thread; see
    # cost.GEMM_THREADS); compile() measures it on the device it runs on (the CUBLAS_WORKSPACE_CONFIG in force)
    gpu_gemm_workspace_bytes: int = 0
    # host bytes a plan leaves free of host_bytes; None: HOST_MARGIN_SHARE of them, at most HOST_MARGIN_MAX (0 for
    # a host budget a user gives, which is itself below what the machine has less its margin)
    host_margin_bytes: int | None = None

    @property
    def budget_bytes(self) -> int:
        """Device bytes a plan may fill by default."""
        return self.gpu_bytes - self.gpu_reserved_bytes

    @property
    def host_margin(self) -> int:
        """Host bytes a plan leaves free (:attr:`host_margin_bytes`, or its default)."""
        if self.host_margin_bytes is not None:
            return self.host_margin_bytes
        return int(min(self.host_bytes * HOST_MARGIN_SHARE, HOST_MARGIN_MAX))

    @property
    def host_plan_bytes(self) -> int:
        """Host bytes a plan may take: :attr:`host_bytes` less :attr:`host_margin`."""
        return self.host_bytes - self.host_margin

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        unknown = sorted(set(d) - set(names))
        missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING]
        if unknown or missing:
            raise ValueError(f"hardware spec: unknown keys {unknown}, missing keys {missing}")
        if not isinstance(d["name"], str):
            raise ValueError(f"hardware spec: name must be a string, got {d['name']!r}")
        for f in names[1:]:
            v = d.get(f, 0)
            if f == "host_margin_bytes" and v is None:
                continue
            may_be_zero = f in ("gpu_reserved_bytes", "fwd_issue_s", "bwd_issue_s", "attn_flops_per_s",
                                 "route_bytes_per_s", "scan_flops_per_s", "cpu_h2d_slowdown", "cpu_d2h_slowdown",
                                 "cpu_adam_master_params_per_s", "cpu_moments_params_per_s", "h2d_cpu_slowdown",
                                 "d2h_cpu_slowdown",
                                 "gpu_gemm_workspace_bytes", "host_margin_bytes")
            # a rate of Infinity would make times of inf x 0 = NaN, which the simulator cannot order
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                    not (v >= 0 if may_be_zero else v > 0):
                raise ValueError(f"hardware spec {d['name']!r}: {f} must be a finite number "
                                 f"{'>= 0' if may_be_zero else '> 0'}, got {v!r}")
        spec = cls(**d)
        if spec.host_margin >= spec.host_bytes:
            raise ValueError(f"hardware spec {spec.name!r}: host_margin_bytes ({spec.host_margin}) leaves nothing of "
                             f"host_bytes ({spec.host_bytes})")
        if spec.gpu_reserved_bytes >= spec.gpu_bytes:
            raise ValueError(f"hardware spec {spec.name!r}: gpu_reserved_bytes ({spec.gpu_reserved_bytes}) leaves "
                             f"nothing of gpu_bytes ({spec.gpu_bytes})")
        for f, stops in (("cpu_h2d_slowdown", "the host's AdamW would stop while h2d copies run"),
                         ("cpu_d2h_slowdown", "the host's AdamW would stop while d2h copies run"),
                         ("h2d_cpu_slowdown", "the copies would stop while the host's AdamW runs"),
                         ("d2h_cpu_slowdown", "the copies would stop while the host's AdamW runs")):
            if getattr(spec, f) >= 1:
                raise ValueError(f"hardware spec {spec.name!r}: {f} must be below 1 ({stops}), got "
                                 f"{getattr(spec, f)}")
        return spec

    @classmethod
    def from_json(cls, path: str | Path) -> "HardwareSpec":
        try:
            d = json.loads(Path(path).read_text())
        except ValueError as e:
            raise ValueError(f"hardware spec {path} is not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"hardware spec {path}: expected an object of fields, got a {type(d).__name__}")
        return cls.from_dict(d)


PRESETS: dict[str, HardwareSpec] = {
    # Measured on the project's H200 machine; each figure's measurement is in docs/benchmark-history.md under the
    # section named. Copies: pinned buffers, alone and both ways. Matmul: what streamed 7B decoder ops reach (a lone
    # GEMM reaches 784 TFLOP/s). Issue floors: the host's cost of issuing one FWD / BWD op. Attention: cuDNN through
    # SDPA, fitted to 131K- and 262K-token steps ("Long sequences"). Host AdamW and the shares copies and it take of
    # each other: fitted to timed 7B steps ("Device budgets", "Copies slowed by the host pass"); the masters-alone
    # pass ("Moments after the update pass"); the deferred moments' pass, fitted to GPT-OSS's 2-block steps on the
    # H100 machine's host (3.4-4.1 G params/s beside the next forward's weight loads, "GPT-OSS's 2-block slice"; the
    # H200 machine's 7B steps ran it at 6.05, where it hides behind the step). Routing: fitted to the OLMoE step
    # (docs/benchmarks.md, "Mixture-of-experts shapes").
    # cuBLAS: one 32 MiB workspace per thread and stream (torch 2.11). The reserve: the caching allocator's
    # fragmentation, which plans do not count (their workspaces and rounding they do). The gated delta rule's
    # forward: Qwen3-Next's 32 heads at 32,768 tokens on the H100 (the same chip; docs/kernels.md).
    "h200": HardwareSpec(
        name="h200", gpu_bytes=139 * GiB, gpu_reserved_bytes=int(3.9 * GiB),
        h2d_bytes_per_s=51.6e9, d2h_bytes_per_s=55.3e9, duplex_bytes_per_s=91.7e9,
        matmul_flops_per_s=620e12, hbm_bytes_per_s=4.3e12,
        cpu_adam_params_per_s=3.7e9, cpu_cast_params_per_s=5.2e9, host_bytes=125 * GiB,
        fwd_issue_s=1.2e-3, bwd_issue_s=4.4e-3, attn_flops_per_s=510e12, route_bytes_per_s=1.8e12,
        cpu_h2d_slowdown=0.125, cpu_d2h_slowdown=0.25, cpu_adam_master_params_per_s=4.5e9, h2d_cpu_slowdown=0.2,
        cpu_moments_params_per_s=4.5e9,
        gpu_gemm_workspace_bytes=32 << 20, scan_flops_per_s=9.8e12,
    ),
    # The CPU runtime: "device" memory is host memory, copies are memcpy; rough rates of a 2-core machine.
    "cpu": HardwareSpec(
        name="cpu", gpu_bytes=8 * GiB, gpu_reserved_bytes=1 * GiB,
        h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9, duplex_bytes_per_s=5e9,
        matmul_flops_per_s=5e10, hbm_bytes_per_s=1e10,
        cpu_adam_params_per_s=1e8, cpu_cast_params_per_s=5e8, host_bytes=16 * GiB,
    ),
}
# H100 SXM on the same host: the H200's host, link and issue figures and its streamed matmul rate (the same chip);
# the memory a process finds on the 80 GB card (78.4 GiB after the CUDA context) and the datasheet's HBM rate. A
# preset without the host's figures planned 16 micro-batches where 4 are faster (docs/benchmark-history.md, "The
# same comparison a lease later").
PRESETS["h100"] = dataclasses.replace(PRESETS["h200"], name="h100", gpu_bytes=int(78.25 * GiB),
                                      hbm_bytes_per_s=3.35e12)


def hardware(name_or_path: str) -> HardwareSpec:
    """A preset by name, or a spec from a JSON file with every field of :class:`HardwareSpec`."""
    if name_or_path.lower() in PRESETS:
        return PRESETS[name_or_path.lower()]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        if not p.exists():
            raise ValueError(f"hardware spec file {p} does not exist")
        return HardwareSpec.from_json(p)
    raise ValueError(f"unknown hardware {name_or_path!r}; presets: {', '.join(PRESETS)}, or a JSON file path")
