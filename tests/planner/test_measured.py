"""The hardware spec fitted to measured rates (``megatrain probe``): the fields it derives are those that, run through
the simulator's own rate model, give back the rates measured; a spec file it writes plans."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.planner.hardware import PRESETS, HardwareSpec
from megatrain.planner.measured import CASES, PASSES, fit, predict, report, with_fitted

SOME_HOST = dict(h2d_bytes_per_s=40e9, d2h_bytes_per_s=45e9, duplex_bytes_per_s=70e9, cpu_h2d_slowdown=0.3,
                 cpu_d2h_slowdown=0.1, h2d_cpu_slowdown=0.05, d2h_cpu_slowdown=0.35, cpu_adam_params_per_s=2.9e9)


def measured_by(spec: HardwareSpec) -> dict:
    """What a machine behaving exactly as ``spec``'s model says would measure."""
    return {name: predict(spec, *running) for name, running in CASES} | \
        {name: {"adam": getattr(spec, field)} for name, field in PASSES}


@pytest.mark.parametrize("fields", [{}, {**SOME_HOST, "cpu_adam_master_params_per_s": 5.5e9,
                                         "cpu_moments_params_per_s": 6.1e9}])
def test_fit_recovers_the_spec_that_made_the_rates(fields):
    truth = dataclasses.replace(PRESETS["h200"], **fields)
    got = fit(measured_by(truth))
    assert set(got) == {"h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s", "cpu_adam_params_per_s",
                        "cpu_h2d_slowdown", "cpu_d2h_slowdown", "h2d_cpu_slowdown", "d2h_cpu_slowdown",
                        "cpu_adam_master_params_per_s", "cpu_moments_params_per_s"}
    for k, v in got.items():
        assert v == pytest.approx(getattr(truth, k), rel=1e-9, abs=1e-12), k
    spec = with_fitted(PRESETS["h200"], got)
    assert spec.name == "h200-measured" and spec.matmul_flops_per_s == truth.matmul_flops_per_s
    lines = report(measured_by(truth), spec)  # each case: the measured rate and the model's, here the same
    assert [line[:20].strip() for line in lines] == [name for name, _ in CASES + PASSES]
    for line in lines:
        for part in line[21:].split(", "):
            value, model = part.split()[-2:]
            assert value == model.strip("()"), line


def test_the_case_with_everything_running_is_predicted_not_fitted():
    truth = dataclasses.replace(PRESETS["h100"], **SOME_HOST)
    m = measured_by(truth)
    m["AdamW + both ways"] = {"h2d": 30.5e9, "d2h": 20.1e9, "adam": 2.6e9}
    assert fit(m) == fit(measured_by(truth))
    line = report(m, with_fitted(truth, fit(m)))[len(CASES) - 1]
    model = predict(truth, True, True, True)
    assert f"d2h 20.1 ({model['d2h'] / 1e9:.1f})" in line and f"AdamW 2.6 ({model['adam'] / 1e9:.1f})" in line


def test_the_host_keeps_the_product_of_what_each_direction_leaves_it():
    # lease 2 of the H100 machine: 4.08 G params/s alone, 2.2 beside h2d, 1.9 beside d2h, 1.7 beside both (93 GB/s)
    spec = dataclasses.replace(PRESETS["h100"], h2d_bytes_per_s=54.2e9, d2h_bytes_per_s=53.9e9,
                               duplex_bytes_per_s=93.2e9, cpu_adam_params_per_s=4.08e9, cpu_h2d_slowdown=0.46,
                               cpu_d2h_slowdown=0.53)
    use = 93.2 / (54.2 + 53.9)
    both = predict(spec, True, True, True)
    assert both["adam"] == pytest.approx(4.08e9 * (1 - 0.46 * use) * (1 - 0.53 * use))
    assert 1.3e9 < both["adam"] < 1.7e9  # (the sum of the two shares would leave 0.7)
    assert predict(spec, True, False, True)["adam"] == pytest.approx(4.08e9 * 0.54)


def test_fit_keeps_shares_the_spec_accepts():
    # a host whose AdamW nearly stops beside either copy direction: each share stays below 1
    m = {"h2d alone": {"h2d": 50e9}, "d2h alone": {"d2h": 50e9}, "both ways": {"h2d": 30e9, "d2h": 30e9},
         "AdamW alone": {"adam": 4e9}, "AdamW + h2d": {"adam": 0.2e9, "h2d": 60e9},
         "AdamW + d2h": {"adam": 0.1e9, "d2h": 10e9}}
    got = fit(m)
    assert got["h2d_cpu_slowdown"] == 0 and got["d2h_cpu_slowdown"] == pytest.approx(0.8)
    assert got["duplex_bytes_per_s"] == 60e9
    assert got["cpu_h2d_slowdown"] == got["cpu_d2h_slowdown"] == 0.9  # (0.95 and 0.975 measured)
    with_fitted(PRESETS["h100"], got)  # (HardwareSpec.from_dict refuses a share of 1 or more)
    with pytest.raises(ValueError, match="cpu_d2h_slowdown must be below 1 .the host's AdamW would stop"):
        with_fitted(PRESETS["h100"], {**got, "cpu_d2h_slowdown": 1.0})


def test_a_fitted_spec_file_plans(tmp_path, capsys):
    from megatrain.cli import main

    spec = with_fitted(PRESETS["h100"], fit(measured_by(dataclasses.replace(PRESETS["h100"], **SOME_HOST))))
    path = tmp_path / "here.json"
    path.write_text(json.dumps(dataclasses.asdict(spec)))
    assert HardwareSpec.from_json(path) == spec
    assert main(["plan", "--preset", "qwen2.5-0.5b", "--tokens", "8192", "--seq", "1024", "--hardware", str(path),
                 "--out", str(tmp_path / "plan")]) == 0
    assert "hardware   h100-measured: 78 GiB device" in capsys.readouterr().out


def test_a_run_plans_for_the_spec_file_it_is_given(tmp_path, capsys):
    """``megatrain train --hardware FILE``: the plan is made for that spec (a CPU spec here, its host AdamW slower
    than the preset's) and the run's first line names it."""
    from megatrain.cli import main

    path = tmp_path / "here.json"
    path.write_text(json.dumps(dataclasses.asdict(dataclasses.replace(PRESETS["cpu"], name="cpu-here"))))
    assert main(["train", "--steps", "1", "--batch", "2", "--seq", "32", "--hardware", str(path), "--out",
                 str(tmp_path / "run")]) == 0
    assert "; plan for the cpu-here spec: " in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA device")
def test_the_probe_needs_a_cuda_device(tmp_path, capsys):
    from megatrain.cli import main

    assert main(["probe", "--out", str(tmp_path / "spec.json")]) == 2
    assert capsys.readouterr().err.strip() == ("megatrain probe: measuring copies between pinned host memory and a "
                                               "GPU needs a CUDA device, and this machine has none (plan for a GPU "
                                               "machine with --hardware h100|h200 or its spec file)")
    assert not (tmp_path / "spec.json").exists()


def test_the_probe_refuses_a_host_without_the_memory_it_pins(monkeypatch):
    import megatrain.probe
    import megatrain.runtime.memory.store as store

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (refused before any CUDA call)
    monkeypatch.setattr(store, "available_host_bytes", lambda *a: 6 << 30)
    with pytest.raises(RuntimeError, match=r"the probe pins 10\.9 GiB of host memory \(2 blocks of 233,000,000 "
                                           r"parameters and two copy buffers of 2 GiB\) and this machine has 6\.0 GiB"):
        megatrain.probe.measure()


@settings(max_examples=60, deadline=None)
@given(h2d=st.floats(1e9, 1e11), d2h=st.floats(1e9, 1e11), duplex_share=st.floats(0.3, 1.0),
       adam=st.floats(1e8, 1e10), shares=st.lists(st.floats(0.0, 0.89), min_size=4, max_size=4),
       passes=st.lists(st.floats(1e8, 1e10), min_size=2, max_size=2))
def test_fit_inverts_the_rate_model_for_any_host(h2d, d2h, duplex_share, adam, shares, passes):
    """Whatever the host (rates, a duplex total at or under the sum of the directions, shares the fit does not
    clamp), what the simulator's model says it measures fits back to its own figures."""
    fields = dict(h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, duplex_bytes_per_s=duplex_share * (h2d + d2h),
                  cpu_adam_params_per_s=adam, cpu_h2d_slowdown=shares[0], cpu_d2h_slowdown=shares[1],
                  h2d_cpu_slowdown=shares[2], d2h_cpu_slowdown=shares[3], cpu_adam_master_params_per_s=passes[0],
                  cpu_moments_params_per_s=passes[1])
    truth = dataclasses.replace(PRESETS["h100"], **fields)
    got = fit(measured_by(truth))
    assert got == pytest.approx(fields, rel=1e-9, abs=1e-9)
    assert with_fitted(truth, got).name == "h100-measured"
