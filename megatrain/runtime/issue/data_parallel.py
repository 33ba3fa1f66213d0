"""Data parallel training over ``torch.distributed`` (launched by ``torchrun``): each rank runs the same schedule on
its own share of the step's sequences, and the ranks' gradients are summed where each becomes complete -- before
its norms are taken, so every rank sees the step's gradient, global norm, clip factor and loss exactly as one
process running all the micro-batches would, up to the order of the sums (a rank's micro-batches accumulate
first, then the ranks' sums are added).

The ranks of one host share one host store (:func:`DataParallel.shared_zeros`: a file in ``/dev/shm`` every rank
maps), so host memory does not grow with their number; rank 0 fills it. Each host update runs once, on the rank
that owns its layer (:meth:`DataParallel.owns`), the others counting the step alone; a step ends with a barrier, so
no rank loads a layer's weights for the next step before its owner has updated them. Device updates run on every
rank alike (from the same summed gradient; their write-back to the shared store writes the same values).

What is summed across ranks, in the order every rank issues it (all ranks run one schedule, in program order):
the step's count of trained tokens (the loss's denominator) before the step; each owner layer's complete gradient
(a tied gradient once its parts are summed; ``update_ops``); the micro-batches' loss sums at the step's guard and
its end (each micro-batch's, in rank order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DataParallel:
    """The process group a streamed model trains over: this process's rank among ``world`` ranks."""

    rank: int
    world: int
    group: object = None  # the torch.distributed group (None: the default one)

    @classmethod
    def from_env(cls) -> "DataParallel | None":
        """The default process group where ``torch.distributed`` is initialized with more than one rank, else
        None."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(rank=dist.get_rank(), world=dist.get_world_size())

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def sum_int(self, n: int) -> int:
        # NCCL reduces device tensors only; gloo takes host ones
        nccl = dist.get_backend(self.group) == "nccl"
        return int(self.sum_(torch.tensor([n], dtype=torch.int64, device="cuda" if nccl else "cpu")).item())

    def gather_floats(self, values: list[float]) -> list[float]:
        """Every rank's ``values``, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, list(values), group=self.group)
        return [v for part in out for v in part]

    def owns(self, layer: int) -> bool:
        """Whether this rank runs ``layer``'s host update."""
        return layer % self.world == self.rank

    def shared_zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Zeros every rank of this host sees as one memory: a file in ``/dev/shm`` rank 0 makes, every rank maps,
        removed once all have (the mapping stays)."""
        import os
        import uuid

        path = self.from_rank0(f"/dev/shm/megatrain-{os.getpid()}-{uuid.uuid4().hex}" if self.rank == 0 else None)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.rank == 0:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        self.barrier()
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self.barrier()
        if self.rank == 0:
            os.unlink(path)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def after_rank0(self, fn):
        """``fn()`` run on rank 0 alone (what only one process may do: make the run directory, write a state), the
        others waiting for its outcome: its result on rank 0, None on the others; an exception it raises is raised
        on every rank."""
        if self.rank != 0:
            failed = self.from_rank0(None)
            if failed is not None:
                raise failed
            return None
        try:
            out = fn()
        except Exception as e:
            self.from_rank0(e)
            raise
        self.from_rank0(None)
        return out

    def from_rank0(self, obj):
        """``obj`` as rank 0 has it, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
