"""The GPU presets: an H100 on the same host plans with every host, link and issue figure measured for the H200
machine (a preset that left the issue floors at zero planned 16 micro-batches where 4 run faster), and its memory is
what a process finds on the 80 GB card."""

import dataclasses

from megatrain.planner.hardware import GiB, PRESETS

CARD_FIELDS = {"name", "gpu_bytes", "hbm_bytes_per_s"}  # what differs between the cards themselves


def test_the_h100_preset_keeps_the_hosts_figures_and_the_cards_memory():
    h100, h200 = PRESETS["h100"], PRESETS["h200"]
    for f in dataclasses.fields(h200):
        if f.name not in CARD_FIELDS:
            assert getattr(h100, f.name) == getattr(h200, f.name), f.name
    assert h200.fwd_issue_s > 0 and h200.bwd_issue_s > 0 and h200.attn_flops_per_s > 0
    assert 75 * GiB < h100.gpu_bytes <= 78.4 * GiB < h200.gpu_bytes
