"""What a block's differentiated forward takes besides its input and weights, as leaves whose gradients go back
to where those values came from (the backward's handler: :func:`megatrain.runtime.ops.compute.bwd`)."""

from __future__ import annotations

from megatrain.capture.shared_state import SHARED
from megatrain.runtime.issue.step import StepState


class BlockInputs:
    """A block's side inputs for a differentiated forward, with those computed from parameters
    (``Captured.grad_sides``: Gemma's per-layer inputs, Zamba2's embeddings) and the entries of the micro-batch's
    shared object (``capture.shared_state``: keys and values a Gemma block stores for later ones) as new leaves that
    take a gradient; their gradients are summed for the micro-batch (``StepState.side_grads``). What the block stores
    in the shared object is differentiated against what the later blocks that read it gave back."""

    def __init__(self, ctx, st: StepState, mb: int):
        self.st, self.mb, side = st, mb, st.side[mb]
        self.leaves: list = []  # (key in side_grads, leaf)
        self.read: dict = {}  # shared entry -> the leaves the block was given
        shared = side.get(SHARED)
        if not ctx.captured.grad_sides and shared is None and not ctx.captured.shared_state:
            self.side = side
            return
        side = dict(side)
        for n in ctx.captured.grad_sides:
            side[n] = side[n].detach().requires_grad_()
            self.leaves.append((n, side[n]))
        if shared is not None:
            side[SHARED] = type(shared)()
            for k, v in shared.items():
                side[SHARED][k] = self.read[k] = tuple(t.detach().requires_grad_() for t in v)
                self.leaves += [((SHARED, k, i), t) for i, t in enumerate(self.read[k])]
        self.side = side

    @property
    def inputs(self) -> list:
        return [t for _, t in self.leaves]

    def stored(self) -> dict:
        """The shared entries the block's forward stored (not those it was given)."""
        shared = self.side.get(SHARED)
        return {k: v for k, v in (shared.items() if shared is not None else ()) if v is not self.read.get(k)}

    def outputs(self) -> tuple[list, list]:
        """What the block stored and the gradients the later blocks gave back for it (taken: blocks before this one
        read an earlier entry)."""
        back, outs, dys = self.st.side_grads.get(self.mb, {}), [], []
        for k, v in self.stored().items():
            for i, t in enumerate(v):
                g = back.pop((SHARED, k, i), None)
                if g is not None and t.requires_grad:
                    outs.append(t)
                    dys.append(g)
        return outs, dys

    def commit(self) -> None:
        """A saved forward's stores into the micro-batch's shared object, for the blocks after it."""
        stored = self.stored()
        if stored:
            real = self.st.side[self.mb].setdefault(SHARED, type(self.side[SHARED])())
            real.update({k: tuple(t.detach() for t in v) for k, v in stored.items()})

    def take(self, grads: list) -> list:
        """Sum the gradients of the leaves (the first ``len(self.leaves)`` of ``grads``) into the micro-batch's;
        returns the rest."""
        if self.leaves:
            back = self.st.side_grads.setdefault(self.mb, {})
            for (n, _), g in zip(self.leaves, grads):
                if g is not None:
                    back[n] = g if n not in back else back[n] + g
        return grads[len(self.leaves):]
