import json
import re
from pathlib import Path

import pytest

from megatrain.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def test_plan_cli_matches_the_hand_derived_bound_in_the_docs(tmp_path, capsys):
    assert main(["plan", "--preset", "qwen2.5-7b", "--tokens", "32768", "--seq", "1024", "--hardware", "h200",
                 "--split-opt", "0",  # (the docs derive the plan of every update on the host or resident)
                 "--one-pass-updates",  # (and each host update in one pass)
                 "--speculate", "off",  # (after the step's global norm)
                 "--gpu-opt-every", "0", "--saved-acts", "0", "--grad-kept", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    doc_line = re.search(r"^bound .*$", DOCS.read_text(), re.M).group(0)
    cli_line = re.search(r"^bound .*$", out, re.M).group(0)
    assert cli_line == doc_line
    hand = float(re.search(r"\*\*Bound = ([\d.]+) s/step", DOCS.read_text()).group(1))
    assert f"bound      {hand:.3f} s/step (backward+cpu-bound" in out
    for name in ("plan.png", "plan.trace.json", "schedule.txt", "schedule.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_cli_on_a_24_gib_budget_gives_the_docs_chain_bound(tmp_path, capsys):
    """docs/planner.md derives the bound of Qwen2.5-7B at 32,768 tokens on a 24 GiB device budget by hand: the
    backward plus the host update pass that follows it."""
    assert main(["plan", "--preset", "qwen2.5-7b", "--tokens", "32768", "--seq", "1024", "--hardware", "h200",
                 "--split-opt", "0",  # (the docs derive the plan of every update on the host or resident)
                 "--speculate", "off", "--one-pass-updates", "--gpu-gib", "24", "--mb", "8", "--slots", "2", "--wire", "fp32", "--host-checkpoints", "29",
                 "--gpu-opt-every", "auto", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "budget 24.0 GiB" in out and "layers [0, 1] updated on the GPU" in out
    hand = re.search(r"\*\*Bound = ([\d.]+) s/step, backward\+cpu\*\*;\s+the\s+simulation", DOCS.read_text())
    assert f"bound      {hand.group(1)} s/step (backward+cpu-bound" in out


def test_plan_cli_trace_has_every_op(tmp_path, capsys):
    import json

    from megatrain.ir import Schedule

    assert main(["plan", "--preset", "qwen2.5-0.5b", "--tokens", "8192", "--seq", "1024", "--steps", "1",
                 "--gpu-opt-every", "2", "--out", str(tmp_path)]) == 0
    s = Schedule.from_text((tmp_path / "schedule.txt").read_text())
    trace = json.loads((tmp_path / "plan.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(s.ops)
    assert {e["args"]["op"] for e in spans} == {str(op) for op in s.ops}


def test_plan_cli_device_updates_shorten_the_predicted_7b_step(tmp_path, capsys):
    """The numbers docs/planner.md quotes for --gpu-opt-every 3 on Qwen2.5-7B at 32,768 tokens (every backward
    recomputing its whole forward, and every device update's state crossing the bus each step, as those numbers were
    made)."""
    # the micro-batches, slots, wire and checkpoints the full search picks for both requests, pinned: the same
    # plans, in a quarter of the time
    pinned = ["--mb", "2", "--slots", "all", "--wire", "fp32", "--host-checkpoints", "0", "--split-opt", "0",
              "--speculate", "off", "--one-pass-updates", "--full-recompute"]
    assert main(["plan", "--preset", "qwen2.5-7b", "--tokens", "32768", "--gpu-opt-every", "3", "--saved-acts", "0",
                 "--resident-opt", "0", "--grad-kept", "0", *pinned, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layers [2, 5, 8, 11, 14, 17, 20, 23, 26, 29] updated on the GPU" in out
    assert re.search(r"^predicted  4\.099 s/step", out, re.M), out
    assert re.search(r"^bound      3\.690 s/step \(backward\+cpu-bound.*cpu 1\.491\)", out, re.M), out
    assert "optimizer 31.26" in out
    s = (tmp_path / "schedule.txt").read_text()
    assert "LOAD_OPT" in s and "STORE_OPT" in s and "OPT s0 L2 @compute" in s and "STORE_G s0 L2 @compute" in s
    text = DOCS.read_text()
    assert "4.099 s, the cpu stream down to 1.491 s (bound 3.690 s" in text
    # auto: the search tries every 4th, 3rd and 2nd layer (each also with the first eligible layer), all, and the
    # first 2, 4, ...: the first 20 win (the next forward starts on layers whose weights are on the device)
    assert main(["plan", "--preset", "qwen2.5-7b", "--tokens", "32768", "--gpu-opt-every", "auto", "--saved-acts",
                 "0", "--resident-opt", "0", "--grad-kept", "0", *pinned, "--out", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out
    assert f"layers {list(range(20))} updated on the GPU" in out
    assert "optimizer 74.10" in out
    assert re.search(r"^predicted  3\.369 s/step", out, re.M) and "(3.369 s)" in text and "74.10 GiB" in text


def test_plan_cli_defaults_to_what_compile_does_on_the_device(tmp_path, capsys):
    """Device updates searched ("auto") for a GPU, none for the cpu preset, as compile() decides on each device."""
    fixed = ["plan", "--preset", "qwen2.5-0.5b", "--tokens", "8192", "--mb", "2", "--slots", "3", "--wire", "fp32",
             "--host-checkpoints", "0", "--steps", "2", "--split-opt", "0", "--speculate", "off"]
    for name, extra in [("default", []), ("auto", ["--gpu-opt-every", "auto"]), ("none", ["--gpu-opt-every", "0"])]:
        assert main([*fixed, *extra, "--out", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    text = {name: (tmp_path / name / "schedule.txt").read_text() for name in ("default", "auto", "none")}
    assert text["default"] == text["auto"] != text["none"]
    assert "OPT s0 L1 @compute" in text["default"] and "OPT s0 L1 @compute" not in text["none"]
    assert out.count("updated on the GPU") == 2 and out.count(" processes)") == 3
    cpu = ["--hardware", "cpu", "--tokens", "1024", "--steps", "1"]
    assert main([*fixed[:3], *cpu, "--out", str(tmp_path / "cpu")]) == 0
    assert main([*fixed[:3], *cpu, "--gpu-opt-every", "0", "--out", str(tmp_path / "cpu0")]) == 0
    assert (tmp_path / "cpu" / "schedule.txt").read_text() == (tmp_path / "cpu0" / "schedule.txt").read_text()
    assert "updated on the GPU" not in capsys.readouterr().out


def test_plan_cli_plans_for_a_larger_host(tmp_path, capsys):
    """72B needs 813 GiB of host store: refused on the h200 preset's 125 GiB host, planned with --host-gib."""
    one = ["plan", "--preset", "qwen2.5-72b", "--tokens", "16384", "--mb", "1", "--slots", "3", "--wire", "fp32",
           "--host-checkpoints", "81", "--gpu-opt-every", "0", "--saved-acts", "0", "--steps", "2", "--split-opt", "0",
           "--speculate", "off"]
    assert main([*one, "--out", str(tmp_path / "a")]) == 2
    assert "72.71B parameters x 12 B (fp32 master, exp_avg, exp_avg_sq) = 812.56 GiB, the h200 host has 125.00 GiB" \
        in capsys.readouterr().err
    assert main([*one, "--host-gib", "1500", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "host 1500 GiB" in out and "1 micro-batch x 16384 tokens" in out and "searched   1 of 1 candidate plan (descent) in" in out
    # the device holds 31 layers' gradients until their update (the embedding's, 29 blocks', and past the blocks that
    # no longer fit the final norm's); the other 52 have host buffers of their own
    assert re.search(r"^gradients  31 layers' \(26\.70B params\) kept on the GPU until their update in fp32 "
                     r"\(99\.46 GiB of kept-gradient slots\).*"
                     r"52 layers' \(46\.01B params\) to host buffers during the backward.*54 host buffers \(fp32\), "
                     r"171\.89 GiB$", out, re.M), out
    assert re.search(r"^host       1006\.5 GiB needed \(store 812\.6, process 1\.7, stages 0\.1, checkpoints 20\.2, "
                     r"gradients 171\.9\) of 1500 GiB less 8\.0 left free: fits; 14\.86 bytes per parameter all in$",
                     out, re.M), out


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "qwen2.5-72b"], "does not fit host memory"),
    (["--gpu-opt-every", "-1"], "gpu_opt_every must be an integer >= 0 (0: every update on the host) or 'auto', "
                                "got -1"),
    (["--gpu-gib", "1"], "too small for one layer"),
    (["--tokens", "1000"], "multiple of the sequence length"),
    (["--preset", "gpt-5"], "unknown model preset"),
    (["--mb", "5"], "cannot split 32 sequences evenly"),
    (["--gpu-opt-every", "0", "--resident-opt", "3"],
     "resident_opt=3 keeps the state of layers updated on the GPU there, but gpu_opt_every=0"),
    (["--hardware", "cpu", "--preset", "qwen2.5-0.5b", "--tokens", "1024", "--resident-opt", "3"],
     "but gpu_opt_every=0"),  # the cpu's default: no device updates
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--gpu-opt-every", "2", "--resident-opt", "-2"], "resident_opt must be an integer >= 0 (0: every device "
                                                        "update's state goes back to the host each step) or 'auto', "
                                                        "got -2"),
    (["--host-gib", "-3"], "--host-gib must be a finite number of GiB > 0, got -3.0"),
    (["--host-gib", "inf"], "--host-gib must be a finite number of GiB > 0, got inf"),
    (["--gpu-gib", "nan"], "--gpu-gib must be a finite number of GiB > 0, got nan"),
    (["--gpu-gib", "inf"], "--gpu-gib must be a finite number of GiB > 0, got inf"),
    (["--gpu-gib", "0"], "--gpu-gib must be a finite number of GiB > 0, got 0.0"),
    (["--host-gib", "80"], "7.62B parameters x 12 B (fp32 master, exp_avg, exp_avg_sq) = 85.11 GiB, the h200 host has "
                           "80.00 GiB"),
])
def test_plan_cli_refuses_with_one_clear_message(tmp_path, capsys, argv, msg):
    assert main(["plan", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_bad_files_are_named_in_one_line(tmp_path, capsys):
    notjson, alist = tmp_path / "n.json", tmp_path / "l.json"
    notjson.write_text("nope")
    alist.write_text("[1]")
    for argv, msg in [
        (["plan", "--config", str(notjson)], f"model config {notjson} is not JSON (Expecting value"),
        (["plan", "--config", str(alist)], f"model config {alist}: expected an object of fields, got a list"),
        (["plan", "--hardware", str(notjson)], f"hardware spec {notjson} is not JSON"),
        (["plan", "--hardware", str(alist)], f"hardware spec {alist}: expected an object of fields, got a list"),
        (["plan", "--steps", "0"], "steps to simulate must be a positive integer, got 0"),
        (["viz", "--schedule", str(notjson)], f"{notjson}: not a megatrain schedule"),
        (["viz", "--timeline", str(alist)], f"{alist}: not a timeline this megatrain reads"),
    ]:
        assert main([*argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x").exists()


def test_viz_draws_simulated_and_measured_on_one_picture(tmp_path, capsys):
    import dataclasses
    import json

    from megatrain.ir import Schedule
    from megatrain.planner.simulate import Timeline

    assert main(["plan", "--preset", "qwen2.5-0.5b", "--tokens", "8192", "--steps", "1", "--gpu-opt-every", "0",
                 "--out", str(tmp_path)]) == 0
    sim_text = (tmp_path / "plan.trace.json").read_text()
    s = Schedule.from_text((tmp_path / "schedule.txt").read_text())
    # a "measured" timeline: the simulated one stretched by 1.3 (what a recorder on the GPU writes)
    from megatrain.planner.graph import preset
    from megatrain.planner.hardware import hardware
    from megatrain.planner.simulate import simulate

    sim = simulate(s, preset("qwen2.5-0.5b"), hardware("h200"))
    measured = dataclasses.replace(sim, source="measured", start_s=[1.3 * t for t in sim.start_s],
                                   end_s=[1.3 * t for t in sim.end_s], memory=[])
    assert Timeline.from_json(measured.to_json()) == measured
    (tmp_path / "m.json").write_text(measured.to_json())
    out = tmp_path / "viz"
    assert main(["viz", "--schedule", str(tmp_path / "schedule.txt"), "--preset", "qwen2.5-0.5b",
                 "--timeline", str(tmp_path / "m.json"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "simulated" in printed and "measured" in printed
    trace = json.loads((out / "timelines.trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"simulated", "measured"} and sim_text
    assert (out / "timelines.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["viz", "--out", str(out)]) == 2


def test_bad_model_and_hardware_fields_are_one_line(tmp_path, capsys):
    """Fields of the wrong type or an absurd size are refused before anything is built (a config asking for 10**8
    layers used to grow past 6 GB), and a rate of Infinity before the simulator (inf x 0 = NaN there: a search that
    never ended)."""
    import json

    from megatrain.planner.graph import PRESETS
    from megatrain.planner.hardware import PRESETS as HW

    base = dict(PRESETS["qwen2.5-0.5b"], model_type="qwen2")
    cases = [(dict(num_hidden_layers=100_000_000), "num_hidden_layers must be a positive integer of at most 4,096, "
                                                   "got 100,000,000"),
             (dict(hidden_size=[896]), "hidden_size must be a positive integer, got [896]"),
             (dict(vocab_size=None), "vocab_size must be a positive integer, got None"),
             (dict(intermediate_size="abc"), "intermediate_size must be a positive integer, got 'abc'")]
    for edit, msg in cases:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps({**base, **edit}))
        assert main(["plan", "--config", str(cfg), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    spec = {**HW["h200"].to_dict(), "h2d_bytes_per_s": float("inf")}
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(spec))  # json writes Infinity, which json reads back
    assert main(["plan", "--hardware", str(hw), "--out", str(tmp_path / "x")]) == 2
    assert "h2d_bytes_per_s must be a finite number > 0, got inf" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_compile_and_megatrain_plan_choose_the_same_plan(tmp_path, capsys):
    """One planner: compile() plans a captured model with the search `megatrain plan` runs on the same config, so the
    same request (hardware, tokens, fixed decisions; the rest searched) gets the same schedule."""
    import json

    import torch

    import megatrain
    from megatrain.planner.hardware import hardware

    from ..runtime.models import hf_config, hf_model

    cfg = hf_config("qwen2", num_hidden_layers=6)
    cfg.to_json_file(tmp_path / "config.json")
    fixed = dict(n_mb=2, weight_slots=3, host_checkpoints=1, saved_acts=0)
    for every, split in (("auto", "auto"), (2, 0)):
        sm = megatrain.compile(hf_model("qwen2", num_hidden_layers=6), device="cpu", compute_dtype=torch.bfloat16,
                               hardware=hardware("h200"), gpu_opt_every=every, split_opt=split, **fixed)
        mine = sm.schedule_for(8, 64).config
        assert main(["plan", "--config", str(tmp_path / "config.json"), "--hardware", "h200", "--tokens", "512",
                     "--seq", "64", "--mb", "2", "--slots", "3", "--wire", "fp32", "--host-checkpoints", "1",
                     "--saved-acts", "0", "--gpu-opt-every", str(every), "--split-opt", str(split), "--jobs", "1",
                     "--out", str(tmp_path / f"plan-{every}")]) == 0
        cli = json.loads((tmp_path / f"plan-{every}" / "schedule.json").read_text())["config"]
        assert {**cli, "n_steps": 1} == mine.to_dict()
        searched, of = map(int, re.search(r"searched\s+(\d+) of (\d+) candidate plan", capsys.readouterr().out)
                           .groups())
        assert searched > 1 if every == "auto" else searched == of == 1  # with a choice to make, the same one made


DENSE = dict(model_type="llama", hidden_size=12288, num_attention_heads=96, num_key_value_heads=8,
             intermediate_size=28672, vocab_size=32768, tie_word_embeddings=False)


def test_plan_cli_puts_100b_dense_models_on_one_h200_with_a_1536_gib_host(tmp_path, capsys):
    """On paper: 12 bytes per parameter of store and gradients kept on the GPU until their update (the rest in
    host buffers) fit a 106B dense model with fp32 gradients; the 123B shape needs bf16 ones (refused without,
    naming the host bytes), and without clipping gradients only pass through the host: over 130B fit."""
    shapes = {}
    for name, layers in (("dense-106b", 76), ("dense-123b", 88)):
        shapes[name] = tmp_path / f"{name}.json"
        shapes[name].write_text(json.dumps({**DENSE, "num_hidden_layers": layers}))
    fixed = ["--tokens", "16384", "--seq", "4096", "--hardware", "h200", "--host-gib", "1536", "--mb", "4",
             "--slots", "2", "--wire", "fp32", "--gpu-opt-every", "0", "--saved-acts", "0", "--steps", "1",
             "--split-opt", "0"]
    assert main(["plan", "--config", str(shapes["dense-106b"]), *fixed, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "106.000B params" in out and re.search(
        r"^host .* of 1536 GiB less 8\.0 left free: fits; 1[45]\.\d\d bytes per parameter", out, re.M), out
    assert re.search(r"^gradients  \d+ layers' .* kept on the GPU until their update in fp32", out, re.M), out
    assert main(["plan", "--config", str(shapes["dense-123b"]), *fixed, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"no plan fits: host memory 1\d{3}\.\d\d GiB > 1528\.00 GiB .* the host has 1536\.00 GiB, of "
                     r"which a plan leaves 8\.00 GiB free\)", err) and len(
        err.strip().splitlines()) == 2, err  # the progress line, then the refusal
    assert main(["plan", "--config", str(shapes["dense-123b"]), *fixed, "--grad-host-dtype", "bf16",
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "122.6" in out and re.search(r"^host .* of 1536 GiB less 8\.0 left free: fits; 13\.\d\d bytes per "
                                        r"parameter", out, re.M), out
    assert re.search(r"kept on the GPU until their update in bf16 .* host buffers \(bf16\)", out), out
    assert main(["plan", "--config", str(shapes["dense-123b"]), *fixed, "--no-clip", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    m = re.search(r"^largest    (\d+) blocks \(([\d.]+)B params\) of this shape fit 1528\.00 GiB", out, re.M)
    assert m and float(m.group(2)) > 130 and "12 bytes per parameter on the host" in out, out
    assert re.search(r"^host .* fits; 12\.\d\d bytes per parameter all in", out, re.M), out


def test_a_plan_for_a_preset_imports_neither_torch_nor_transformers(tmp_path):
    """The plan command of a preset needs the planner alone: torch (1.4 s) and transformers (0.7 s more) are
    left unimported (a family's config aliases are read only where a name may be missing)."""
    import subprocess
    import sys

    code = ("import sys\nfrom megatrain.cli import main\n"
            f"rc = main(['plan', '--preset', 'qwen2.5-0.5b', '--tokens', '4096', '--seq', '1024', '--hardware', "
            f"'h200', '--mb', '1', '--slots', '2', '--out', {str(tmp_path / 'p')!r}])\n"
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "p" / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_cli_names_the_longest_sequence_that_plans(tmp_path, capsys):
    """A sequence over the device budget is refused with the longest that plans under the same options (found by
    searching shorter ones): that one plans, one SEQ_STEP longer does not."""
    from megatrain.planner.limits import SEQ_STEP

    fixed = ["--preset", "qwen2.5-0.5b", "--hardware", "h100", "--gpu-gib", "2", "--steps", "1", "--slots", "2",
             "--gpu-opt-every", "0", "--split-opt", "0", "--speculate", "off"]  # (fewer candidates: a search a probe)
    assert main(["plan", *fixed, "--tokens", "262144", "--seq", "262144", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    m = re.search(r"too small for one 262,144-token sequence: .*; the longest sequence that plans is ([\d,]+) tokens "
                  r"\(--seq (\d+) --tokens (\d+)\)$", err.strip(), re.M)
    assert m and int(m.group(1).replace(",", "")) == int(m.group(2)) == int(m.group(3)), err
    longest = int(m.group(2))
    assert longest % SEQ_STEP == 0 and 0 < longest < 262144
    assert main(["plan", *fixed, "--tokens", str(longest), "--seq", str(longest), "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    over = longest + SEQ_STEP
    assert main(["plan", *fixed, "--tokens", str(over), "--seq", str(over), "--out", str(tmp_path / "c")]) == 2
    assert "no plan fits" in capsys.readouterr().err
