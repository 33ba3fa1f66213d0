"""Objects a model hands every decoder block (transformers' KVSharingDict: Gemma 3n, Gemma 4), as the capture
records them in a block's call and the runtime makes them.

Where no block reads what another left there, each call gets a new one (:class:`FreshPerCall`). Where blocks
reuse the keys and values an earlier block stored (``num_kv_shared_layers``), the blocks of one micro-batch share
one (:class:`PerMicroBatch`, kept among its side inputs under :data:`SHARED`): its entries are state carried from
block to block, whose gradients the runtime takes back from the blocks that read them to the block that stored
them (:mod:`megatrain.runtime.ops.compute`)."""

from __future__ import annotations

from collections import UserDict

SHARED = "shared_state"  # the side-input name of a micro-batch's shared object


def kv_sharing(v) -> bool:
    """Whether ``v`` is transformers' object through which blocks share keys and values: its ``KVSharingDict``, or
    the plain ``collections.UserDict`` the same models hand their blocks in transformers before it (5.17)."""
    return type(v).__name__ == "KVSharingDict" or type(v) is UserDict


class FreshPerCall:
    """A block argument made new for each call (``kind()``)."""

    def __init__(self, kind: type):
        self.kind = kind

    def __call__(self):
        return self.kind()

    def __repr__(self) -> str:  # (in the traced root's code, which is compiled, never run)
        return f"{type(self).__name__}({self.kind.__name__})"


class PerMicroBatch(FreshPerCall):
    """A block argument one per micro-batch: made by the first block call of the micro-batch, then the same."""

    def of(self, side: dict):
        if SHARED not in side:
            side[SHARED] = self.kind()
        return side[SHARED]
