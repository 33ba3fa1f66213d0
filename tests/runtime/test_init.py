"""Filling the host store of a model built on the meta device."""

import pytest
import torch

import megatrain

from .models import TinyGPT, compile_cpu, hf_config


def meta_model(family="llama", **kw):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(family, **kw), attn_implementation="eager")


def test_seeded_init_is_deterministic_per_layer_and_follows_the_architecture():
    cfg = hf_config("llama")
    a = compile_cpu(meta_model(), init_seed=3).state_dict()
    b = compile_cpu(meta_model(), init_seed=3).state_dict()
    c = compile_cpu(meta_model(), init_seed=4).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    w = a["model.layers.1.self_attn.q_proj.weight"]
    assert abs(float(w.std()) - cfg.initializer_range) < 0.1 * cfg.initializer_range and abs(float(w.mean())) < 2e-3
    assert torch.equal(a["model.norm.weight"], torch.ones(64))  # RMSNorm weights start at one
    # a layer's values depend on its index and the seed, not on how many layers come after it
    deeper = compile_cpu(meta_model(num_hidden_layers=4), init_seed=3).state_dict()
    assert torch.equal(deeper["model.layers.1.mlp.down_proj.weight"], a["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_seeded_init_writes_the_store_in_place_with_the_values_of_whole_modules(family, monkeypatch):
    """Each fp32 parameter is initialized as a view of the store (no second copy of a large embedding), with the
    values the initializer gives a module materialized on its own under the same seed (the reference below)."""
    from megatrain.runtime.state import init as init_mod

    model = meta_model(family)
    ptrs = set()
    real_init = init_mod._initializer(model)

    def spy(mod):
        real_init(mod)
        ptrs.update(p.data_ptr() for p in mod.parameters())

    monkeypatch.setattr(init_mod, "_initializer", lambda m: spy)
    sm = compile_cpu(model, init_seed=5)
    for name in sm.captured.model_param_names:
        assert sm.store.param_view(name).data_ptr() in ptrs, name  # written where it lives
    # the reference: every module materialized whole on the CPU, initialized, its values read
    expected = {}
    with torch.no_grad():
        for seg in sm.captured.segments:
            if not seg.numel:  # a tied head: its weight is the embedding's, initialized there
                continue
            torch.manual_seed(5 * 1_000_003 + seg.index)
            done = set()
            for ref in seg.params:
                path = ref.model_name.rpartition(".")[0]
                if path in done:
                    continue
                done.add(path)
                mod = megatrain.capture.meta_copy(model.get_submodule(path)).to_empty(device="cpu")
                real_init(mod)
                for n, p in mod.named_parameters(recurse=False):
                    full = f"{path}.{n}" if path else n
                    if full in sm.captured.model_param_names or full in sm.captured.tied_names:
                        expected[sm.captured.tied_names.get(full, full)] = p.detach().clone()
    assert expected.keys() == sm.captured.model_param_names.keys()
    for name, value in expected.items():
        assert torch.equal(sm.store.param_view(name), value), name


def test_a_parameter_its_module_leaves_is_initialized_as_its_holder_does():
    """Qwen3-Next's router weight is set by the initializer's call on the MoE block that holds the router, not by the
    call on the router: it gets the block's draw (normal, the config's std) instead of a refusal."""
    cfg = hf_config("qwen3_next")
    model = meta_model("qwen3_next")
    state = compile_cpu(model, init_seed=7).state_dict()
    w = state["model.layers.0.mlp.gate.weight"]
    assert w.shape == (cfg.num_experts, cfg.hidden_size) and not torch.isnan(w).any()
    assert abs(float(w.std()) - cfg.initializer_range) < 0.25 * cfg.initializer_range
    assert not torch.equal(w, state["model.layers.1.mlp.gate.weight"])  # each layer its own seed


def test_seeded_init_trains():
    sm = compile_cpu(meta_model(), init_seed=0, optim=megatrain.OptimConfig(lr=3e-3), n_mb=2)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = [sm.train_step(ids).loss for _ in range(8)]
    assert losses[-1] < 0.9 * losses[0]


def test_meta_model_needs_weights_from_somewhere(tmp_path):
    with pytest.raises(ValueError, match="meta device: pass checkpoint= or init_seed="):
        compile_cpu(meta_model())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        compile_cpu(meta_model(), checkpoint=tmp_path)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    from .models import hf_model

    hf_model("llama", hidden_size=32, intermediate_size=48).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has shape \(97, 32\), the model expects \(97, 64\)"):
        compile_cpu(meta_model(), checkpoint=tmp_path)


def test_a_bad_checkpoint_is_refused_from_its_headers_before_the_store(tmp_path, monkeypatch):
    import json

    from safetensors.torch import save_file

    from megatrain import compiler

    from .models import hf_model

    good = tmp_path / "good"
    hf_model("llama").save_pretrained(good)
    blob = (good / "model.safetensors").read_bytes()

    def refuse(*a, **k):
        raise AssertionError("the host store was allocated")

    monkeypatch.setattr(compiler, "HostStore", refuse)
    cases = {
        "truncated": (blob[:1000], ValueError, "model.safetensors is not a whole safetensors file"),
        "cut": (blob[:-100], ValueError, r"model.safetensors: tensor '.*' is not described as a safetensors tensor"),
        "garbage": (b"hello\n", ValueError, "model.safetensors is not a whole safetensors file"),
    }
    for name, (data, err, msg) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(data)
        with pytest.raises(err, match=msg):
            compile_cpu(meta_model(), checkpoint=tmp_path / name)
    sd = hf_model("llama").state_dict()
    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({k: v for k, v in sd.items() if "layers.2." not in k}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint lacks 9 parameters, e\.g\. \['model\.layers\.2\."):
        compile_cpu(meta_model(), checkpoint=partial)
    extra = tmp_path / "extra"
    extra.mkdir()
    save_file({**sd, "model.layers.9.foo": torch.zeros(2)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor 'model.layers.9.foo' is not a parameter of the captured model"):
        compile_cpu(meta_model(), checkpoint=extra)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="names model-1.safetensors, which .* does not hold"):
        compile_cpu(meta_model(), checkpoint=sharded)
    (sharded / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a safetensors index with a weight_map"):
        compile_cpu(meta_model(), checkpoint=sharded)


def test_plain_module_seeded_init_uses_reset_parameters():
    with torch.device("meta"):
        m = TinyGPT()
    sd = compile_cpu(m, init_seed=1).state_dict()
    assert torch.equal(sd["ln_f.weight"], torch.ones(48)) and float(sd["blocks.0.fc.weight"].abs().max()) > 0
