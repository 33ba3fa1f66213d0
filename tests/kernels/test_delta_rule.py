"""The gated delta rule's chunk scan (kernels.delta_rule) against its pure-torch definition, and the whole chunked
rule against transformers' own torch implementation of each family that has one (interpreter on CPU)."""

import importlib

import pytest
import torch

from megatrain.kernels import delta_rule, reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def scan_inputs(bh, nc, c, k, v, seed=0, s0=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(DEV)  # noqa: E731
    decay = torch.rand(bh, nc, generator=g).to(DEV) * 0.5 + 0.4
    p = torch.randn(bh, nc, c, c, generator=g).tril().to(DEV) * 0.2
    return [r(bh, nc, c, k), r(bh, nc, c, k), r(bh, nc, c, v), r(bh, nc, c, k), p, decay,
            r(bh, k, v) if s0 else None]


def grads_of(fn, ins, want_final, seed=1):
    xs = [x.detach().clone().requires_grad_() if x is not None else None for x in ins]
    o, sf = fn(*xs, want_final)
    g = torch.Generator(device="cpu").manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=g).to(DEV)).sum()
    if want_final:
        loss = loss + (sf * torch.randn(sf.shape, generator=g).to(DEV)).sum()
    loss.backward()
    return [o, sf] + [x.grad for x in xs if x is not None]


@pytest.mark.parametrize("nc,c,k,v,block_v,s0,want_final", [
    (3, 16, 16, 32, 16, False, False),  # two V blocks, their shares summed
    (2, 16, 32, 16, None, True, True),  # an initial state and the final one's gradient
    (1, 32, 16, 16, None, False, True),
    (2, 16, 24, 40, 16, True, True),  # head dims that are no power of two (OLMo-hybrid's 96 and 192): masked
])
def test_scan_matches_its_definition(nc, c, k, v, block_v, s0, want_final, monkeypatch):
    if block_v is not None:  # launchers take the block; the autograd Function uses the default
        fwd, bwd = delta_rule.delta_scan_forward, delta_rule.delta_scan_backward
        monkeypatch.setattr(delta_rule, "delta_scan_forward", lambda *a, **kw: fwd(*a, **kw, block_v=block_v))
        monkeypatch.setattr(delta_rule, "delta_scan_backward", lambda *a, **kw: bwd(*a, **kw, block_v=block_v))
    ins = scan_inputs(3, nc, c, k, v, s0=s0)
    got = grads_of(delta_rule.delta_scan, ins, want_final)
    want = grads_of(reference.delta_scan, ins, want_final)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_scan_refuses_a_shape_it_does_not_take():
    ins = scan_inputs(1, 1, 16, 8, 16)
    with pytest.raises(ValueError, match="key and value head dims 8 and 16"):
        delta_rule.delta_scan(*ins)


FAMILIES = ["qwen3_next", "qwen3_5", "olmo_hybrid"]


def scan_rule_inputs(t=40, hk=2, hv=4, state=False, seed=3):
    """q, k, v, g, beta and an initial state (or None) for the whole rule, fp32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [r(2, t, hk, 16), r(2, t, hk, 16), r(2, t, hv, 16), -torch.rand(2, t, hv, generator=g),
            torch.rand(2, t, hv, generator=g)] + ([r(2, hv, 16, 16) * 0.1] if state else [])


def rule_grads(fn, ins, chunk=16):
    """Output, final state and every input's gradient of ``fn`` (the rule) under a random loss of both."""
    xs = [x.detach().clone().requires_grad_() for x in ins]
    out, sf = fn(*xs[:5], chunk_size=chunk, initial_state=xs[5] if len(xs) > 5 else None, output_final_state=True,
                 use_qk_l2norm_in_kernel=True)
    gen = torch.Generator(device="cpu").manual_seed(4)
    ((out * torch.randn(out.shape, generator=gen).to(DEV)).sum()
     + (sf * torch.randn(sf.shape, generator=gen).to(DEV)).sum()).backward()
    return [out, sf] + [x.grad for x in xs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("t,hk,hv,state", [(40, 2, 4, False), (32, 2, 2, True)])
def test_chunked_rule_matches_the_family_torch_implementation(family, t, hk, hv, state):
    """Outputs, final state and every input's gradient (padding to whole chunks, key heads repeated to the value
    heads, an initial state) against the family's own ``torch_chunk_gated_delta_rule``."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    ref = getattr(mod, "torch_chunk_gated_delta_rule", None)
    if ref is None:
        pytest.skip(f"this transformers has no {family} torch_chunk_gated_delta_rule")
    if hk != hv and "repeat_interleave" not in _source(mod):  # older transformers repeat the heads in the layer
        pytest.skip("this transformers' function takes value heads only")
    ins = [x.to(DEV) for x in scan_rule_inputs(t, hk, hv, state)]
    for a, b in zip(rule_grads(delta_rule.chunk_gated_delta_rule, ins), rule_grads(ref, ins)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _source(mod):
    """The text of the module's torch_chunk_gated_delta_rule."""
    import inspect

    text = inspect.getsource(mod)
    start = text.index("def torch_chunk_gated_delta_rule")
    return text[start:text.index("\ndef ", start)]


@pytest.mark.parametrize("k,v,chunk", [(32, 64, 64), (64, 32, 16)])
def test_the_planner_counts_the_bytes_the_rule_keeps_and_a_piece_works_in(k, v, chunk):
    """``planner.hybrid.delta_rule_costs``' bytes per token against what autograd keeps (bf16 inputs, as a block
    computes them) around the whole rule and through one piece's chunk-local algebra and scan, within 5%."""
    from megatrain.planner.hybrid import delta_rule_costs

    b, t, heads = 1, 256, 2
    g = torch.Generator(device="cpu").manual_seed(5)
    ins = [torch.randn(b, t, heads, k, generator=g), torch.randn(b, t, heads, k, generator=g),
           torch.randn(b, t, heads, v, generator=g), -torch.rand(b, t, heads, generator=g),
           torch.rand(b, t, heads, generator=g)]
    ins = [x.to(DEV, torch.bfloat16 if i != 3 else torch.float32).requires_grad_() for i, x in enumerate(ins)]

    def kept_per_token(fn):
        kept = {}

        def pack(x):
            kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        return sum(kept.values()) / (b * t)

    _, kept, piece = delta_rule_costs(heads, k, v, 2, chunk)
    whole = kept_per_token(lambda: delta_rule.chunk_gated_delta_rule(*ins, chunk_size=chunk,
                                                                     use_qk_l2norm_in_kernel=True))
    assert whole == pytest.approx(kept, rel=0.05)
    one = kept_per_token(lambda: reference.delta_scan(*delta_rule._piece(*ins, chunk, True), None))
    assert one == pytest.approx(piece, rel=0.05)


def test_the_rule_runs_in_pieces_with_the_state_handed_on(monkeypatch):
    """Pieces of one chunk each (the state and its gradient handed from piece to piece) give the one-piece result."""
    ins = [x.to(DEV) for x in scan_rule_inputs(seed=6)]
    whole = rule_grads(delta_rule.chunk_gated_delta_rule, ins)
    monkeypatch.setattr(delta_rule.layout, "DELTA_PIECE_TOKENS", 16)
    assert len(delta_rule._pieces(2, 40, 16)) == 3
    for a, b in zip(rule_grads(delta_rule.chunk_gated_delta_rule, ins), whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
