"""One request, one plan: ``megatrain plan --model``, ``compile()`` and ``megatrain train`` plan the same schedule
for the same model and options (they form the search's arguments in one place, PlanOptions.search_kwargs)."""

import dataclasses
import json

import pytest
import torch

from megatrain.cli import main
from megatrain.ir import Schedule

from .test_finetune import CHATS, chat_model_dir

REQUESTS = [  # (batch, seq, flags of megatrain train and plan, the same as compile() options)
    (4, 64, ["--mb", "2", "--slots", "2", "--saved-acts", "0"], dict(n_mb=2, weight_slots=2, saved_acts=0)),
    (8, 32, ["--mb", "4", "--slots", "all", "--saved-acts", "0", "--grad-kept", "1"],
     dict(n_mb=4, weight_slots="all", saved_acts=0, grad_kept=1)),
]


def _key(schedule_config) -> dict:
    """What a plan decided (the steps it was simulated over aside)."""
    return {k: v for k, v in dataclasses.asdict(schedule_config).items() if k != "n_steps"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("same") / "model"
    chat_model_dir(d)
    return d


@pytest.mark.parametrize("batch,seq,flags,options", REQUESTS)
def test_plan_compile_and_train_pick_the_same_plan(tmp_path, model_dir, batch, seq, flags, options):
    import megatrain
    from transformers import AutoModelForCausalLM, AutoConfig

    # megatrain plan --model: the graph a run captures, on the CPU runtime's spec
    assert main(["plan", "--model", str(model_dir), "--hardware", "cpu", "--tokens", str(batch * seq), "--seq",
                 str(seq), "--wire", "fp32", *flags, "--steps", "1", "--out", str(tmp_path / "plan")]) == 0
    planned = Schedule.from_json((tmp_path / "plan" / "schedule.json").read_text()).config
    # compile() on the CPU, clipping as a run does
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation="sdpa")
    sm = megatrain.compile(meta, checkpoint=model_dir, device="cpu", optim=megatrain.OptimConfig(max_grad_norm=1.0),
                           **options)
    compiled = sm.schedule_for(batch, seq).config
    # megatrain train: the schedule it wrote
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": m}) for m in CHATS * 4))
    out = tmp_path / "run"
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--steps", "1", "--batch", str(batch),
                 "--seq", str(seq), *flags, "--out", str(out)]) == 0
    trained = Schedule.from_text((out / "schedule.txt").read_text()).config
    assert _key(planned) == _key(compiled), "plan vs compile()"
    assert _key(compiled) == _key(trained), "compile() vs train"
    assert _key(planned) == _key(trained), "plan vs train"


def test_a_resumed_run_takes_its_plan_without_searching_unless_the_request_changed(tmp_path, monkeypatch, capsys):
    import megatrain.planner.run_plan as run_plan

    argv = ["--steps", "2", "--batch", "4", "--seq", "32", "--warmup", "0"]
    assert main(["train", *argv, "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert "searched in" in capsys.readouterr().out

    def no_search(*a, **k):
        raise AssertionError("the search ran")

    monkeypatch.setattr(run_plan, "plan", no_search)
    assert main(["train", "--resume", str(tmp_path / "a"), "--steps", "3", "--out", str(tmp_path / "b")]) == 0
    assert f"the plan {tmp_path / 'a'} took, not searched again" in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / "plan.json").read_text()) == first
    # another request (a fixed weight-slot count) searches again
    monkeypatch.undo()
    assert main(["train", "--resume", str(tmp_path / "b"), "--steps", "4", "--slots", "3",
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "searched in" in out and json.loads((tmp_path / "c" / "plan.json").read_text())["key"] != first["key"]


def test_a_known_plan_is_taken_only_for_its_request_and_where_the_host_holds_it():
    from megatrain.planner.graph import preset
    from megatrain.planner.hardware import PRESETS
    from megatrain.planner.request import PlanOptions
    from megatrain.planner.run_plan import plan_run

    g = preset("qwen2.5-0.5b")
    spec = dataclasses.replace(PRESETS["cpu"], host_bytes=16 << 30)
    opts = PlanOptions(n_mb=2, weight_slots=2)
    first = plan_run(g, spec, 4, 256, opts, clip=True, on_gpu=False)
    again = plan_run(g, spec, 4, 256, opts, clip=True, on_gpu=False, known=(first.to_json(),))
    assert again.from_cache and not first.from_cache and again.step.to_text() == first.step.to_text()
    # what the search said it left out comes back with the plan file's plan
    said = json.dumps({**json.loads(first.to_json()), "speculation_left": "a window ... not taken"})
    assert plan_run(g, spec, 4, 256, opts, clip=True, on_gpu=False, known=(said,)).speculation_left == \
        "a window ... not taken" and first.speculation_left is None
    other = plan_run(g, spec, 8, 256, opts, clip=True, on_gpu=False, known=(first.to_json(),))
    assert not other.from_cache  # another batch shape
    from megatrain.planner.cost import host_memory

    need = sum(host_memory(g, first.step).values())
    small = dataclasses.replace(spec, host_bytes=need - 1, host_margin_bytes=0)
    with pytest.raises(ValueError):  # no plan fits such a host: the known one is not taken over the search's word
        plan_run(g, small, 4, 256, opts, clip=True, on_gpu=False, known=(first.to_json(),))
