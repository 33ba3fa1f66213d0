"""Capture-time rewrite: put the Triton kernels into the templates of the layers they match.

Only megatrain's own weightless templates change; the user's model is never touched. Parameter names stay the
same, so binding is unaffected. What is rewritten:

- RMSNorm modules (class name ending in ``RMSNorm``; the ``1 + w`` form of Gemma, Qwen3-Next and Qwen3.5 included,
  told apart by running the module) -> the RMSNorm kernel;
- MLPs of the form ``down_proj(silu(gate_proj(x)) * up_proj(x))`` -> the SwiGLU kernel between the projections;
- the blocks' ``apply_rotary_pos_emb`` (HF rotate-half, full head dim) -> the RoPE kernel, substituted in the
  block's modeling module only while megatrain calls the template;
- the blocks' ``torch_chunk_gated_delta_rule`` (the linear-attention layers of Qwen3-Next, Qwen3.5, OLMo-hybrid)
  -> the chunked rule with its scan over chunks in the kernels (``kernels.delta_rule``), substituted the same way;
- a head that is a bias-free linear, optionally soft-capped (Gemma 2) -> the fused linear + cross-entropy
  (see :func:`head_loss_spec`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.capture import Captured
from megatrain.capture.blocks import delta_nets
from megatrain.runtime.layers.grad_sink import param_grads


class KernelRMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float, offset: float):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, x):
        from megatrain.kernels import rms_norm

        return rms_norm(x, self.weight, self.eps, self.offset)


_keep_less = [False]


@contextlib.contextmanager
def keep_less(on: bool = True):
    """While a forward runs whose saved tensors wait for a later backward (a saved layer's, in a plan with
    ``ScheduleConfig.saved_lean``), a kernel MLP keeps gate and up for it but not their product, the down
    projection's input: the backward computes that again (one elementwise pass) and the layer keeps
    ``intermediate_size`` x 2 bytes per token less."""
    before = _keep_less[0]
    _keep_less[0] = on
    try:
        yield
    finally:
        _keep_less[0] = before


class _SwiGLUDownFunction(torch.autograd.Function):
    """``linear(silu(gate) * up, weight, bias)``, saving gate, up and the weight (see :func:`keep_less`)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, offsets):
        from megatrain.kernels.swiglu import swiglu_forward

        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up, weight)
        ctx.offsets, ctx.has_bias = offsets, bias is not None
        return F.linear(swiglu_forward(gate, up), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        from megatrain.kernels.swiglu import swiglu_backward, swiglu_forward

        gate, up, weight = ctx.saved_tensors
        dw, db = param_grads(ctx, dy, swiglu_forward(gate, up), 2, ctx.offsets, ctx.has_bias)
        dg, du = swiglu_backward(dy @ weight, gate, up)
        return dg, du, dw, db, None


def can_keep_less(module: nn.Module) -> bool:
    """Whether ``module`` holds a kernel MLP, whose saved forward keeps less under :func:`keep_less`."""
    return any(isinstance(m, KernelSwiGLUMLP) for m in module.modules())


class KernelSwiGLUMLP(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        from megatrain.kernels import swiglu

        gate, up, down = self.gate_proj(x), self.up_proj(x), self.down_proj
        if _keep_less[0] and torch.is_grad_enabled() and down.weight.requires_grad:
            return _SwiGLUDownFunction.apply(gate, up, down.weight, down.bias, getattr(down, "offsets", None))
        return down(swiglu(gate, up))


def _norm_offset(mod: nn.Module, eps: float) -> float | None:
    """Whether the norm scales by ``w`` (0.0) or ``1 + w`` (1.0; Gemma's, Qwen3-Next's and Qwen3.5's zero-centred
    weights), found by running a CPU copy of the module with random weights; None where it computes neither."""
    probe = copy.deepcopy(mod).to_empty(device="cpu").float()
    hidden = probe.weight.shape[-1]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(hidden, generator=g))
        x = torch.randn(3, hidden, generator=g)
        try:
            y = probe(x)
        except Exception:
            return None
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        for offset in (0.0, 1.0):
            if torch.allclose(y, normed * (offset + probe.weight), rtol=1e-5, atol=1e-5):
                return offset
    return None


def _rms_norm_replacement(mod: nn.Module) -> nn.Module | None:
    if not type(mod).__name__.endswith("RMSNorm") or not isinstance(getattr(mod, "weight", None), nn.Parameter):
        return None
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if eps is None:
        return None
    offset = _norm_offset(mod, float(eps))
    return KernelRMSNorm(mod.weight, float(eps), offset) if offset is not None else None


def _swiglu_replacement(mod: nn.Module) -> nn.Module | None:
    act = getattr(mod, "act_fn", None)
    if all(isinstance(getattr(mod, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) and (
            isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return KernelSwiGLUMLP(mod)
    return None


def _rewrite_modules(root: nn.Module, replaced: dict[str, list[str]], prefix: str) -> None:
    for name, child in list(root.named_children()):
        for kind, make in (("rmsnorm", _rms_norm_replacement), ("swiglu", _swiglu_replacement)):
            new = make(child)
            if new is not None:
                setattr(root, name, new)
                replaced.setdefault(kind, []).append(f"{prefix}{name}")
                child = new
                break
        _rewrite_modules(child, replaced, f"{prefix}{name}.")


def rotary_halves_equal(captured: Captured) -> bool:
    """Whether every rotary embedding module of the model returns cos and sin whose two halves are equal (HF's
    rotary embeddings build them as ``cat(freqs, freqs)``), probed at positions 0..255 and a few large ones: the
    RoPE kernel then reads only the first halves. False when the model has none or one differs."""
    found = False
    for seg in captured.segments:
        for mod in seg.template.modules():
            if not type(mod).__name__.endswith("RotaryEmbedding") or not hasattr(mod, "inv_freq"):
                continue
            found = True
            pos = torch.cat([torch.arange(256), torch.tensor([4095, 32767, 131071, 524287])])[None]
            try:
                with torch.no_grad():
                    cos, sin = mod(torch.zeros(1, dtype=torch.float32, device=mod.inv_freq.device), pos.to(
                        mod.inv_freq.device))
            except Exception:
                return False
            h = cos.shape[-1] // 2
            if cos.shape[-1] % 2 or not (torch.equal(cos[..., :h], cos[..., h:]) and
                                         torch.equal(sin[..., :h], sin[..., h:])):
                return False
    return found


def _rotates_q_and_k(fn) -> bool:
    """Whether ``fn`` rotates a query and a key together, ``(q, k, cos, sin, ...)``, as the RoPE kernel does (a
    wrapper that hides its parameters counts: each call is checked again). Gemma 3n and Gemma 4 rotate one tensor,
    ``(x, cos, sin)``."""
    try:
        params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return [p.name for p in params[:4]] == ["q", "k", "cos", "sin"]


def _rope_patch(block: nn.Module, halves_equal: bool = False):
    """(module, name, replacement) substituting the RoPE kernel for the block module's apply_rotary_pos_emb; None
    where the module has none or its function rotates another way (:func:`_rotates_q_and_k`)."""
    mod = sys.modules.get(type(block).__module__)
    original = getattr(mod, "apply_rotary_pos_emb", None)
    if original is None or not _rotates_q_and_k(original):
        return None

    def apply_rotary_pos_emb(*args, **kwargs):
        if len(args) < 4 or not all(isinstance(t, torch.Tensor) for t in args[:4]):
            return original(*args, **kwargs)  # not a (q, k, cos, sin) call
        q, k, cos, sin, *rest = args
        unsqueeze_dim = kwargs.get("unsqueeze_dim", rest[-1] if rest else 1)
        if unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1] or q.dim() != 4:
            return original(*args, **kwargs)  # partial rotary or another layout: not this kernel
        from megatrain.kernels import rope

        return rope(q, k, cos, sin, halves_equal=halves_equal)

    return (mod, "apply_rotary_pos_emb", apply_rotary_pos_emb)


def _delta_rule_patch(block: nn.Module):
    """((module, name, replacement), None) substituting the kernels' chunked gated delta rule for the block module's
    ``torch_chunk_gated_delta_rule``; (None, why) where the layers' head dims are not the kernels'; (None, None)
    where the block has none. A call with a chunk the kernels do not take runs the original."""
    from megatrain.kernels import delta_rule

    mod = sys.modules.get(type(block).__module__)
    original = getattr(mod, "torch_chunk_gated_delta_rule", None)
    nets = delta_nets(block)
    if original is None or not nets:
        return None, None
    why = next((w for w in (delta_rule.supported(64, m.head_k_dim, m.head_v_dim) for m in nets) if w), None)
    if why is not None:
        return None, why

    def torch_chunk_gated_delta_rule(*args, chunk_size: int = 64, **kwargs):
        if delta_rule.supported(chunk_size, 16, 16) is not None:
            return original(*args, chunk_size=chunk_size, **kwargs)
        return delta_rule.chunk_gated_delta_rule(*args, chunk_size=chunk_size, **kwargs)

    return (mod, "torch_chunk_gated_delta_rule", torch_chunk_gated_delta_rule), None


@dataclass(frozen=True)
class HeadLossSpec:
    weight_name: str  # template parameter name of the head weight
    softcap: float | None


def head_loss_spec(captured: Captured) -> HeadLossSpec | None:
    """The head as ``linear(x)`` or ``cap * tanh(linear(x) / cap)`` (what the fused loss computes), else None."""
    head = captured.segments[-1]
    gm = head.template
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not nodes or nodes[0].op != "call_module":
        return None
    lin = gm.get_submodule(nodes[0].target)
    if not isinstance(lin, nn.Linear) or lin.bias is not None:
        return None
    rest = [(n.op, n.target) for n in nodes[1:]]
    softcap = None
    if rest:
        if rest != [("call_function", operator.truediv), ("call_function", torch.tanh),
                    ("call_function", operator.mul)]:
            return None
        div, _, mul = nodes[1:]
        cap, cap2 = div.args[1], (mul.args[1] if isinstance(mul.args[1], float) else mul.args[0])
        if not isinstance(cap, float) or cap != cap2:
            return None
        softcap = cap
    return HeadLossSpec(f"{nodes[0].target}.weight", softcap)


def use_kernels(captured: Captured) -> dict[str, list[str]]:
    """Rewrite every template of ``captured`` in place (templates are megatrain's own). Returns what changed."""
    replaced: dict[str, list[str]] = {}
    seen: set[int] = set()
    halves = rotary_halves_equal(captured)
    for seg in captured.segments:
        if id(seg.template) in seen:
            seg.patches = next(s.patches for s in captured.segments if s.template is seg.template)
            continue
        seen.add(id(seg.template))
        _rewrite_modules(seg.template, replaced, f"{seg.name}:")
        if seg.kind == "block":
            patches = []
            patch = _rope_patch(seg.template, halves)
            if patch is not None:
                patches.append(patch)
                replaced.setdefault("rope", []).append(seg.name + (" (cos/sin halves equal)" if halves else ""))
            patch, why = _delta_rule_patch(seg.template)
            if patch is not None:
                patches.append(patch)
            if patch is not None or why is not None:
                replaced.setdefault("gated_delta_rule", []).append(
                    seg.name + (f" (transformers' loop kept: {why})" if why else ""))
            if patches:
                seg.patches = patches
    spec = head_loss_spec(captured)
    if spec is not None:
        replaced["linear_cross_entropy"] = [captured.segments[-1].name + (f" (softcap {spec.softcap})"
                                                                         if spec.softcap else "")]
    return replaced
