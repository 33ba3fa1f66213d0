"""benchmarks/link_rates.py's fit: the spec fields it derives from measured rates are those that, run through the
simulator's own rate model, give back the rates measured."""

import dataclasses

import pytest

from benchmarks.link_rates import fit, predict, report, spec_with, write_spec
from megatrain.planner.hardware import PRESETS, HardwareSpec


def measured_by(spec: HardwareSpec) -> dict:
    """What a machine behaving exactly as ``spec``'s model says would measure."""
    case = lambda *running: predict(spec, *running)  # noqa: E731
    both, adam_h2d, adam_d2h = case(True, True, False), case(True, False, True), case(False, True, True)
    return {"h2d": case(True, False, False)["h2d"], "d2h": case(False, True, False)["d2h"],
            "both": (both["h2d"], both["d2h"]), "adam": case(False, False, True)["adam"],
            "adam_h2d": (adam_h2d["adam"], adam_h2d["h2d"]), "adam_d2h": (adam_d2h["adam"], adam_d2h["d2h"]),
            "all": case(True, True, True)}


@pytest.mark.parametrize("fields", [{}, dict(h2d_bytes_per_s=40e9, d2h_bytes_per_s=45e9, duplex_bytes_per_s=70e9,
                                             cpu_h2d_slowdown=0.3, cpu_d2h_slowdown=0.1, h2d_cpu_slowdown=0.05,
                                             d2h_cpu_slowdown=0.35, cpu_adam_params_per_s=2.9e9)])
def test_fit_recovers_the_spec_that_made_the_rates(fields, tmp_path):
    truth = dataclasses.replace(PRESETS["h200"], **fields)
    got = fit(measured_by(truth))
    for k, v in got.items():
        assert v == pytest.approx(getattr(truth, k), rel=1e-9, abs=1e-12), k
    spec = spec_with("h200", got)
    assert spec.name == "h200-measured" and spec.matmul_flops_per_s == truth.matmul_flops_per_s
    # every case's line shows the measured rate and the model's, here the same figures
    write_spec(spec, tmp_path / "spec.json")
    assert HardwareSpec.from_json(tmp_path / "spec.json") == spec
    lines = report(measured_by(truth), spec)
    assert len(lines) == 7
    for line in lines:
        for part in line[19:].split(", "):
            value, model = part.split()[-2:]
            assert value == model.strip("()"), line


def test_fit_keeps_shares_the_spec_accepts():
    # a host that stalls its AdamW under either copy direction: the fitted shares stay below 1 together
    m = {"h2d": 50e9, "d2h": 50e9, "both": (30e9, 30e9), "adam": 4e9, "adam_h2d": (0.2e9, 60e9),
         "adam_d2h": (0.1e9, 10e9), "all": {}}
    got = fit(m)
    assert got["h2d_cpu_slowdown"] == 0 and got["d2h_cpu_slowdown"] == pytest.approx(0.8)
    assert got["duplex_bytes_per_s"] == 60e9
    assert got["cpu_h2d_slowdown"] == got["cpu_d2h_slowdown"] == pytest.approx(0.45)  # 0.9 each, halved
    spec_with("h100", got)  # (refused by HardwareSpec.from_dict otherwise)
