"""What the peer benchmarks share: the model, the data, the timing and the result record.

Every system trains the same HF Qwen2.5-shaped model (same config, same seeded initial weights where the model fits
in host memory twice), on the same random token batches, with the loss summed over the step's valid tokens and
divided by their count, bf16 compute, fp32 master weights and fp32 AdamW state, clipping at 1.0.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

LR = 1e-4
CLIP = 1.0


def base_parser(doc: str | None = None, several_mb: bool = False) -> argparse.ArgumentParser:
    """The options every peer script and the driver take; the driver (``several_mb``) takes several micro-batch
    counts."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--preset", required=True, help="a planner preset (qwen2.5-1.5b, ...) or tiny")
    ap.add_argument("--tokens", type=int, required=True, help="tokens per optimizer step")
    ap.add_argument("--seq", type=int, default=1024)
    if several_mb:
        ap.add_argument("--mb", type=int, nargs="+", default=[4],
                        help="micro-batches per step; several: every system runs with each, and the summary "
                             "compares each system at its fastest")
    else:
        ap.add_argument("--mb", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=4, help="steps; the first is a warm-up")
    return ap


# from the models' published config.json files
EXTRA_SHAPES = {
    "gemma-2-9b": ("gemma2", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                                  query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, tie_word_embeddings=True)),
}


def hf_config(preset: str, seq: int, layers: int | None = None):
    """The preset's HF config; ``layers``: that many decoder blocks instead of the preset's."""
    from transformers import AutoConfig

    from megatrain.planner.graph import PRESETS

    if layers is not None and layers < 1:
        raise ValueError(f"layers={layers}: a model needs at least one decoder block")
    kind = "llama" if preset.startswith("llama") else "qwen2"
    if preset in EXTRA_SHAPES:  # shapes the planner has no preset for (another architecture)
        kind, shape = EXTRA_SHAPES[preset]
        return AutoConfig.for_model(model_type=kind, max_position_embeddings=max(8192, seq),
                                    **{**shape, **({"num_hidden_layers": layers} if layers else {})})
    if preset == "tiny":  # for smoke runs on a CPU machine
        return AutoConfig.for_model(model_type="qwen2", hidden_size=64, intermediate_size=160,
                                    num_hidden_layers=layers or 2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                    max_position_embeddings=max(seq, 128))
    # the embedding and the head are separate matrices (1.78B parameters at 1.5B, as the benchmarks count it);
    # a model filled in place on the host would have them separate anyway (to_empty gives each its own tensor)
    shape = {**PRESETS[preset], "tie_word_embeddings": False}
    kind = shape.pop("model_type", kind)  # mixture-of-experts presets name their family
    if layers is not None:
        shape["num_hidden_layers"] = layers
        if "layer_types" in shape:  # (a hybrid's list of block kinds, cut with it)
            shape["layer_types"] = shape["layer_types"][:layers]
    return AutoConfig.for_model(model_type=kind, max_position_embeddings=max(4096, seq), **shape)


def build_model(cfg, seed: int = 0, meta: bool = False):
    """The HF model with seeded random weights (or on the meta device).

    The weights are filled in place, parameter by parameter in the model's order, from a generator seeded with
    ``seed`` and the parameter's index: uniform with the std HF's initializer uses (``initializer_range``) for
    matrices and embeddings, ones for norm weights, zeros for biases. Every system gets identical weights, and a
    multi-billion-parameter model fills in seconds rather than the minutes ``normal_`` takes on the host."""
    from transformers import AutoModelForCausalLM

    from megatrain.capture.packed_attention import attention_for

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention_for(cfg))
    if meta:
        return model
    model.to_empty(device="cpu")
    for name, mod in list(model.named_modules()):  # buffers come back uninitialized from to_empty: rebuild
        if hasattr(mod, "inv_freq"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(mod)(config=cfg))
    fill_seeded(model, seed, getattr(cfg, "initializer_range", 0.02))
    return model


@torch.no_grad()
def fill_seeded(model: torch.nn.Module, seed: int, std: float) -> None:
    half_width = std * 3 ** 0.5  # uniform(-a, a) has std a / sqrt(3)
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.endswith("bias"):
            p.zero_()
        elif p.ndim == 1:  # RMSNorm weights
            p.fill_(1.0)
        else:
            p.uniform_(-half_width, half_width, generator=torch.Generator().manual_seed(seed * 100_003 + i))
    for name, b in model.named_buffers():
        if not torch.isfinite(b).all():
            raise ValueError(f"buffer {name} was left unset on the host")


def batches(vocab: int, tokens: int, seq: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """``steps`` batches of random tokens, (tokens / seq, seq) each; the same for every system."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (tokens // seq, seq), generator=g) for _ in range(steps)]


def next_labels(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    nxt = torch.full_like(ids, -100)
    nxt[:, :-1] = ids[:, 1:]
    return nxt, int((nxt != -100).sum())


def loss_sum(logits: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), nxt.reshape(-1), ignore_index=-100,
                           reduction="sum")


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


@dataclass
class Result:
    system: str
    preset: str
    params: int
    tokens_per_step: int
    seq: int
    n_mb: int
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    gpu_peak_gib: float = 0.0
    host_peak_gib: float = 0.0
    setup_s: float = 0.0
    timed_s: float = 0.0  # wall time per step over the steps after the first, optimizer included
    notes: str = ""
    error: str = ""

    @property
    def step_s(self) -> float:
        if self.timed_s:
            return self.timed_s
        return self.step_times_s[0] if self.step_times_s else float("nan")

    @property
    def median_step_s(self) -> float:
        """The median of the timed steps' own times (the first step untimed): unlike the mean, not moved by one
        slow step, such as a peer's first timed one or the last one's drain of work left running."""
        timed = self.step_times_s[1:]
        return statistics.median(timed) if timed else self.step_s

    def finish(self, path: str | None) -> dict:
        import transformers

        d = asdict(self)
        d["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        d["step_s"] = self.step_s
        d["median_step_s"] = self.median_step_s
        d["tokens_per_s"] = self.tokens_per_step / self.step_s if self.step_times_s else 0.0
        d["tflops_6nt"] = 6 * self.params * self.tokens_per_step / self.step_s / 1e12 if self.step_times_s else 0.0
        print(json.dumps(d, indent=1))
        if path:
            with open(path, "w") as f:
                json.dump(d, f, indent=1)
        return d


def device_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_peer(res: Result, args, cfg, t0: float, setup: Callable[[], Callable | tuple[Callable, Callable]]) -> None:
    """``setup()`` builds the system and returns ``step(ids, next_labels, denom) -> loss``, or ``(step, drain)``
    for a system whose step may return before its optimizer work ends (``drain()`` waits for it). Each step of the
    shared batches is timed on the host, from the return of the step before to its own return (a system may let
    its device work run on past that; no device sync is added between timed steps, as it would cut the overlap
    a system builds between steps). The step time reported is the wall time of the steps after the first (which
    is finished, optimizer and device work included, before they start), up to the end of the last one's device
    and optimizer work, divided by their number. Running out of GPU or host memory (setup included) is recorded as
    the result."""
    cuda = torch.cuda.is_available()
    try:
        made = setup()
        step, drain = made if isinstance(made, tuple) else (made, lambda: None)
        res.setup_s = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        data = batches(cfg.vocab_size, args.tokens, args.seq, args.steps)
        t_timed = None
        for i, ids in enumerate(data):
            nxt, denom = next_labels(ids)
            if i == 1:
                t_timed = time.perf_counter()
            t = time.perf_counter()
            loss = step(ids, nxt, denom)
            if i in (0, len(data) - 1):  # the warm-up step's tail is not timed; the last one's is
                drain()
                device_sync()
            res.step_times_s.append(time.perf_counter() - t)
            res.losses.append(loss)
            print(f"{res.system} step {i}: loss {loss:.4f}, {res.step_times_s[-1]:.3f} s", flush=True)
        if t_timed is not None:
            res.timed_s = (time.perf_counter() - t_timed) / (len(data) - 1)
    except torch.OutOfMemoryError as e:
        res.error = f"out of GPU memory: {e}"
    except MemoryError as e:
        res.error = f"out of host memory: {e}"
    res.gpu_peak_gib = torch.cuda.max_memory_allocated() / (1 << 30) if cuda else 0.0
    res.host_peak_gib = host_peak_gib()
    res.finish(args.json)
