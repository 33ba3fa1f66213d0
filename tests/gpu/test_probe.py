"""``megatrain probe`` on a GPU: every case measured, the fit a spec the planner takes, and what the fit reads
reproduced by it."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_probe_measures_every_case_and_writes_a_spec_that_plans(tmp_path, monkeypatch):
    import megatrain.probe
    from megatrain.planner.hardware import HardwareSpec
    from megatrain.planner.measured import CASES, PASSES, predict

    small = megatrain.probe.measure
    monkeypatch.setattr(megatrain.probe, "measure",  # (a short probe: 40M parameters, quarter-GiB copies)
                        lambda seconds, progress: small(numel=20_000_000, layers=2, seconds=0.5, gib=0.25,
                                                        progress=progress))
    lines = []
    spec = megatrain.probe.probe(str(tmp_path / "spec.json"), seconds=0.5, json_path=str(tmp_path / "m.json"),
                                 say=lines.append)
    m = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert list(m) == [name for name, _ in CASES + PASSES]
    # (the rates as measured: which pass is faster is the host's, and a short probe's figures are noisy -- an H100
    # lease measured the moments alone at 3.70 G params/s against 3.81 for the whole AdamW)
    assert spec.cpu_moments_params_per_s == m["AdamW moments alone"]["adam"] > 0
    for name, (h2d, d2h, adam) in CASES + tuple((name, (False, False, True)) for name, _ in PASSES):
        assert set(m[name]) == {k for k, on in (("h2d", h2d), ("d2h", d2h), ("adam", adam)) if on}, name
        assert all(v > 0 for v in m[name].values()), (name, m[name])
    assert 1e9 < spec.h2d_bytes_per_s < 1e12 and 1e9 < spec.d2h_bytes_per_s < 1e12
    assert spec.duplex_bytes_per_s <= spec.h2d_bytes_per_s + spec.d2h_bytes_per_s
    assert HardwareSpec.from_json(tmp_path / "spec.json") == spec
    # the cases the fit reads come back from the spec's model (a copy measured faster beside the AdamW than alone
    # is noise: its share lost is 0, and the model gives it its rate alone)
    assert predict(spec, True, False, False)["h2d"] == pytest.approx(m["h2d alone"]["h2d"])
    assert predict(spec, False, True, True)["d2h"] == pytest.approx(min(m["AdamW + d2h"]["d2h"],
                                                                        m["d2h alone"]["d2h"]))
    assert any(line.startswith("probe: wrote ") for line in lines)
