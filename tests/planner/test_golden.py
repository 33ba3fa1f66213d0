"""The schedule of a small graph, as text. Regenerate with `pytest --update-golden` after a deliberate change."""

from pathlib import Path

from megatrain.planner.passes import build_schedule
from megatrain.planner.verify import verify

from .helpers import config, tiny_graph

GOLDEN = Path(__file__).parent / "golden" / "tiny_2blocks_2mb_2steps.txt"


def test_golden_schedule(request):
    g = tiny_graph()
    s = build_schedule(g, config(g, n_steps=2, n_mb=2, weight_slots=2, host_checkpoints=1))
    verify(s, g)
    text = s.to_text()
    if request.config.getoption("--update-golden"):
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"{GOLDEN} is missing: run pytest --update-golden"
    assert text == GOLDEN.read_text(), "schedule changed; if deliberate, run pytest --update-golden and review the diff"
