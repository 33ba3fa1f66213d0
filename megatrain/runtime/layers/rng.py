"""Random numbers of stochastic layers (dropout): the same draws in a layer's forward and in its recomputation.

A streamed step runs each layer's forward once per micro-batch and, unless the layer keeps its activations, runs it
again in the backward. Each (layer, micro-batch) of a step therefore draws from its own seed: the step takes one
number from torch's default CPU generator (the user's ``torch.manual_seed`` decides it), and before every forward,
recomputation or loss of a layer the CPU generator and the compute device's generator are seeded from that number,
the layer and the micro-batch (:func:`layer_seed`). A recomputed forward draws what its first forward drew, a layer
that keeps its activations draws the same as one that recomputes, and the draws do not depend on the plan (slots,
device updates, what is saved) or on the order ops run in. After the step the generators are where the step's one
draw left them. The same rule, applied with forward pre-hooks to an untouched model trained by plain PyTorch, gives
the same dropout masks (tests/runtime/test_dropout.py).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def draw_step_seed() -> int:
    """The one number a step takes from torch's default CPU generator."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


def layer_seed(step_seed: int, layer: int, mb: int) -> int:
    """The seed of ``layer``'s draws for micro-batch ``mb`` of the step that drew ``step_seed`` (splitmix64 of the
    three, so neighbouring layers and micro-batches get unrelated streams)."""
    x = (step_seed ^ (layer * 0x9E3779B97F4A7C15) ^ (mb * 0xD1B54A32D192ED03)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and, on CUDA, ``device``'s generator."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None
                                      else torch.cuda.current_device()].manual_seed(seed)


class StepRng:
    """The generators' states around one step: :meth:`begin` draws the step's seed, :meth:`seed` seeds a
    (layer, micro-batch), :meth:`end` puts the generators back where the draw left them."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.step_seed: int | None = None
        self._saved: tuple | None = None

    def begin(self, draw: bool = True) -> None:
        """Before a run: the generators' states kept, and the step's seed drawn (``draw`` False: an evaluation,
        which has no randomness of its own and takes no number)."""
        self.step_seed = draw_step_seed() if draw else 0
        cuda = None
        if self.device.type == "cuda":
            cuda = torch.cuda.get_rng_state(self.device)
        self._saved = (torch.get_rng_state(), cuda)

    def seed(self, layer: int, mb: int) -> None:
        seed_generators(layer_seed(self.step_seed, layer, mb), self.device)

    def end(self) -> None:
        if self._saved is None:
            return
        cpu, cuda = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        self._saved = None
