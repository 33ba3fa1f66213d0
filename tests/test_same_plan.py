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
