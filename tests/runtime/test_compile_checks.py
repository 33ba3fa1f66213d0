"""compile() refuses what it cannot run with one message, before the host store is allocated."""

import dataclasses
import os

import pytest
import torch

import megatrain
from megatrain import compiler
from megatrain.capture import capture
from megatrain.planner.hardware import HOST_MARGIN_SHARE, PRESETS
from megatrain.runtime.memory.store import available_host_bytes, store_nbytes

from .models import hf_config, hf_model

GiB = 1 << 30


def _meta_model(**kw):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config("llama", **kw), attn_implementation="sdpa")


def _no_store(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the host store was allocated")

    monkeypatch.setattr(compiler, "HostStore", refuse)


def test_store_bytes_are_three_fp32_rows_per_parameter():
    model = hf_model("llama")
    n = sum(p.numel() for p in model.parameters())  # untied: every parameter owned once
    cap = capture(model)
    assert store_nbytes(cap) == 12 * n
    assert store_nbytes(cap, shadow=True) == 14 * n
    sm = megatrain.compile(model, device="cpu")
    assert sum(sm.store.nbytes.values()) == store_nbytes(cap)


def test_a_model_larger_than_host_memory_is_refused_before_the_store(monkeypatch):
    model = _meta_model(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000,
                        num_attention_heads=32, num_key_value_heads=32)  # Llama-2-7B's shape, on meta
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(compiler, "available_host_bytes", lambda: 64 * GiB)  # 12 x 6.74B = 75.3 GiB
    _no_store(monkeypatch)
    with pytest.raises(ValueError) as e:
        megatrain.compile(model, device="cpu", init_seed=0)
    msg = str(e.value)
    assert f"needs {12 * n / GiB:.2f} GiB ({n / 1e9:.3f}B parameters x 12 bytes" in msg, msg
    assert "more than the 64.00 GiB this machine has available" in msg
    with pytest.raises(ValueError, match=r"x 14 bytes: .*and the bf16 copy a bf16 wire sends"):
        megatrain.compile(model, device="cpu", init_seed=0, compute_dtype=torch.bfloat16, wire="bf16")


def test_the_limit_is_exact_and_the_plan_gets_this_machines_host_memory(monkeypatch):
    model = hf_model("llama")
    need = store_nbytes(capture(model))
    # the least available memory whose share a plan may take (all but the margin) holds the store
    least = next(a for a in range(int(need / (1 - HOST_MARGIN_SHARE)) - 2, 2 * need)
                 if dataclasses.replace(PRESETS["cpu"], host_bytes=a).host_plan_bytes >= need)
    monkeypatch.setattr(compiler, "available_host_bytes", lambda: least - 1)
    with pytest.raises(ValueError, match=r"host memory: the host store of this model needs .* more than the .* this "
                                         r"machine has available less the .* a plan leaves free"):
        megatrain.compile(model, device="cpu")
    monkeypatch.setattr(compiler, "available_host_bytes", lambda: least)
    sm = megatrain.compile(model, device="cpu")
    assert sm.hardware.host_bytes == least  # what the planner checks host checkpoints against (less the margin)
    assert sm.hardware.host_margin == int(least * HOST_MARGIN_SHARE)
    assert sm.hardware.gpu_bytes == PRESETS["cpu"].gpu_bytes
    # a spec given is taken at its word: its host memory is the limit, whatever the machine reports (a VM whose
    # memory grows as it is used reports too little at first)
    assert megatrain.compile(model, device="cpu", hardware="cpu").hardware == PRESETS["cpu"]
    # a host budget the user sets is the plan's limit (no margin below it), and refused where the machine has less
    # once its margin is left free
    budgeted = megatrain.compile(model, device="cpu", host_budget_gib=need / GiB).hardware
    assert budgeted.host_plan_bytes == budgeted.host_bytes == need
    with pytest.raises(ValueError, match=r"host memory: .* more than the .* host_budget_gib allows"):
        megatrain.compile(model, device="cpu", host_budget_gib=(need - 4096) / GiB)
    with pytest.raises(ValueError, match=r"host_budget_gib=.* is more than the .* of host memory a plan may take "
                                         r"\(of the .* this machine has available, .* left free\)"):
        megatrain.compile(model, device="cpu", host_budget_gib=2 * need / GiB)
    with pytest.raises(ValueError, match="host_budget_gib must be a finite number of GiB > 0, got nan"):
        megatrain.compile(model, device="cpu", host_budget_gib=float("nan"))
    # a device budget likewise: what the plans fill, within what the spec plans with
    assert megatrain.compile(model, device="cpu", device_budget_gib=0.5).hardware.budget_bytes == GiB // 2
    with pytest.raises(ValueError, match=r"device_budget_gib=1e\+06 is more than the .* the hardware spec 'cpu'"):
        megatrain.compile(model, device="cpu", device_budget_gib=1e6)
    with pytest.raises(ValueError, match="device_budget_gib must be a finite number of GiB > 0, got 0"):
        megatrain.compile(model, device="cpu", device_budget_gib=0)
    small = dataclasses.replace(PRESETS["cpu"], name="small", host_bytes=need)
    with pytest.raises(ValueError, match=r"more than the .* of host memory the hardware spec 'small' gives less the "
                                         r".* a plan leaves free"):
        megatrain.compile(model, device="cpu", hardware=small)


@pytest.mark.parametrize("device,msg", [
    ("tpu", "device 'tpu' is not a device name torch knows"),
    ("meta", "device 'meta': megatrain runs on 'cpu' or 'cuda'"),
    pytest.param("cuda", "device 'cuda': torch .* sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")),
])
def test_a_device_that_cannot_run_is_refused(monkeypatch, device, msg):
    _no_store(monkeypatch)
    with pytest.raises(ValueError, match=msg):
        megatrain.compile(hf_model("llama"), device=device)


def _fake_root(tmp_path, meminfo_kb=None, v2=None, v1=None):
    if meminfo_kb is not None:
        (tmp_path / "proc").mkdir(parents=True)
        (tmp_path / "proc/meminfo").write_text(f"MemTotal: {2 * meminfo_kb} kB\nMemFree: 1 kB\n"
                                               f"MemAvailable: {meminfo_kb} kB\n")
    cg = tmp_path / "sys/fs/cgroup"
    if v2 is not None:
        cg.mkdir(parents=True)
        (cg / "memory.max").write_text(f"{v2[0]}\n")
        (cg / "memory.current").write_text(f"{v2[1]}\n")
    if v1 is not None:
        (cg / "memory").mkdir(parents=True)
        (cg / "memory/memory.limit_in_bytes").write_text(f"{v1[0]}\n")
        (cg / "memory/memory.usage_in_bytes").write_text(f"{v1[1]}\n")
    return tmp_path


def test_available_host_bytes_takes_the_tighter_of_the_kernel_and_the_cgroup(tmp_path):
    assert available_host_bytes(_fake_root(tmp_path / "a", meminfo_kb=10 * 1024 * 1024)) == 10 * GiB
    assert available_host_bytes(_fake_root(tmp_path / "b", 10 * 1024 * 1024, v2=(4 * GiB, GiB))) == 3 * GiB
    assert available_host_bytes(_fake_root(tmp_path / "c", 10 * 1024 * 1024, v2=("max", GiB))) == 10 * GiB
    assert available_host_bytes(_fake_root(tmp_path / "d", 1024 * 1024, v1=(4 * GiB, GiB))) == GiB
    assert available_host_bytes(_fake_root(tmp_path / "e", 1024 * 1024, v1=(2**63 - 4096, GiB))) == GiB
    assert available_host_bytes(_fake_root(tmp_path / "f", v2=(4 * GiB, 5 * GiB))) == 0
    (tmp_path / "g").mkdir()
    assert available_host_bytes(tmp_path / "g") is None


def test_available_host_bytes_on_this_machine():
    got = available_host_bytes()
    if os.path.exists("/proc/meminfo"):
        total = int(next(x for x in open("/proc/meminfo") if x.startswith("MemTotal:")).split()[1]) * 1024
        assert 0 < got <= total
    else:
        assert got is None


@pytest.mark.parametrize("plan,msg", [
    (dict(n_mb=0), "n_mb must be an integer >= 1 or 'auto', got 0"),
    (dict(grad_slots=0), "grad_slots must be an integer >= 1 or 'auto', got 0"),
    (dict(n_mb=2.0), "n_mb must be an integer >= 1 or 'auto', got 2.0"),
    (dict(weight_slots="most"), "weight_slots must be an integer >= 1, 'all' or 'auto', got 'most'"),
    (dict(host_checkpoints=-1), "host_checkpoints must be .auto. or an integer >= 0, got -1"),
    (dict(seq_tile=-5), "seq_tile must be .auto. or a number of tokens >= 0 \\(0: untiled\\), got -5"),
])
def test_plan_options_out_of_range_are_refused(monkeypatch, plan, msg):
    _no_store(monkeypatch)
    with pytest.raises(ValueError, match=msg):
        megatrain.compile(hf_model("llama"), device="cpu", **plan)


def test_batches_of_the_wrong_dtype_are_refused_before_running():
    sm = megatrain.compile(hf_model("llama"), device="cpu", n_mb=2)
    ids = torch.randint(0, 97, (4, 16))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor, got torch.float32"):
        sm.train_step(ids.float())
    with pytest.raises(ValueError, match="labels must be an integer tensor, got torch.bool"):
        sm.train_step(ids, labels=ids > 3)
    assert sm.step == 0
    sm.train_step(ids, torch.ones(4, 16, dtype=torch.bool))  # a boolean mask is a mask
    assert sm.step == 1


def test_progress_counts_every_parameter_once(tmp_path, monkeypatch):
    """The progress bars compile() and load_state() show (on a terminal) advance by each layer's parameters: the
    store's allocation, the seeded initializer, a checkpoint's tensors and a training state each count all."""
    from megatrain.runtime.state import train_state
    from megatrain.runtime.state.init import init_seeded
    from megatrain.runtime.memory.store import HostStore

    model = hf_model("llama")
    cap = capture(model)
    n = sum(seg.numel for seg in cap.segments)
    counts = {}

    def count(name):
        counts[name] = 0

        def add(k):
            counts[name] += k
        return add

    store = HostStore(cap, progress=count("store"))
    init_seeded(model, cap, store, 0, progress=count("init"))
    model.save_pretrained(tmp_path / "hf")
    store.load_safetensors(tmp_path / "hf", progress=count("checkpoint"))
    sm = megatrain.compile(model, device="cpu")
    sm.save_state(tmp_path / "s")
    train_state.load(sm.store, tmp_path / "s", progress=count("state"))
    assert counts == {"store": n, "init": n, "checkpoint": n, "state": n}


def test_batches_of_other_integer_widths_train_as_int64_and_bad_batches_are_one_line():
    data = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(data)
    mask[1, 8:] = 0
    runs = []
    for ids_dtype, mask_dtype in ((torch.int64, torch.int64), (torch.int32, torch.bool), (torch.uint8, torch.int32)):
        sm = megatrain.compile(hf_model("llama"), device="cpu", n_mb=2)
        runs.append(sm.train_step(data.to(ids_dtype), mask.to(mask_dtype)).loss)
    assert runs[0] == runs[1] == runs[2]
    sm = megatrain.compile(hf_model("llama"), device="cpu", n_mb=2)
    for args, msg in [
        ((torch.zeros(0, 8, dtype=torch.long),), "the batch is empty (input_ids of shape (0, 8))"),
        ((data, torch.ones(4, 1, dtype=torch.long)), "attention_mask must have input_ids' shape (4, 12), got (4, 1)"),
        ((data, None, data[:, :5]), "labels must have input_ids' shape (4, 12), got (4, 5)"),
        ((data.tolist(),), "input_ids must be a torch.Tensor, got list"),
        ((data.float(),), "input_ids must be an integer tensor, got torch.float32"),
    ]:
        with pytest.raises(ValueError) as e:
            sm.train_step(*args)
        assert str(e.value) == msg
    assert sm.step == 0
    with pytest.raises(ValueError, match="compile\\(\\) takes the model to train .*already a StreamedModel"):
        megatrain.compile(sm, device="cpu")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        megatrain.compile(hf_model("llama"), device="cpu", nonfinite="warn")


def test_micro_batches_and_weight_slots_left_to_the_planner():
    """n_mb / weight_slots "auto": the plan search picks them for the step's shape; the steps then train exactly as
    with those values given, and the choice simulates no slower than the defaults'."""
    from megatrain.planner.simulate import simulate

    ids = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(3))
    auto = megatrain.compile(hf_model("llama"), device="cpu", hardware="cpu", n_mb="auto", weight_slots="auto")
    c = auto.schedule_for(8, 16).config
    # the cpu spec's choice for this shape: every count of micro-batches simulates alike here, and of plans as fast
    # the fewest micro-batches are taken
    assert c.n_mb == 1 and c.weight_slots == 2
    eight = megatrain.compile(hf_model("llama"), device="cpu", hardware="cpu", n_mb=8, weight_slots="auto")
    assert simulate(eight.schedule_for(8, 16), eight.graph, eight.hardware).steady_step_s == pytest.approx(
        simulate(auto.schedule_for(8, 16), auto.graph, auto.hardware).steady_step_s, rel=0.01)
    fixed = megatrain.compile(hf_model("llama"), device="cpu", hardware="cpu", n_mb=c.n_mb,
                              weight_slots=c.weight_slots)
    default = megatrain.compile(hf_model("llama"), device="cpu", hardware="cpu")
    assert fixed.schedule_for(8, 16).config == c and default.schedule_for(8, 16).config.n_mb == 1
    sim = lambda sm: simulate(sm.schedule_for(8, 16), sm.graph, sm.hardware).steady_step_s  # noqa: E731
    assert sim(auto) <= sim(default)
    for _ in range(2):
        assert auto.train_step(ids).loss == fixed.train_step(ids).loss
    assert all(torch.equal(t, fixed.state_dict()[n]) for n, t in auto.state_dict().items())
    # its evaluation plan: the fewest micro-batches of up to MAX_MB_TOKENS tokens (here one), the loss the same to
    # the rounding of another split
    assert auto._eval_plan(8, 16).config.n_mb == 1
    assert abs(auto.evaluate(ids).loss - fixed.evaluate(ids).loss) < 1e-5
