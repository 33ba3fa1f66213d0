"""Host bytes per parameter the planner needs for dense models from 7B to 123B on one H200, by host size: the table
in docs/planner.md ("Host memory"). Runs on the CPU (plans only).

    PYTHONPATH=. python benchmarks/host_table.py [--tokens 16384 --seq 4096]

Each cell: the plan with fp32 gradients where one fits the host, else the one with bf16 gradients where that fits,
else the host memory the smallest plan tried would need. The plans pin what does not change the host figure much
(4 micro-batches, 2 weight slots, fp32 on the wire, every update on the host, no saved activations) so the whole
table takes seconds; the search's own choices (device updates above all) need fewer host bytes, not more.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from megatrain.planner.cost import host_memory
from megatrain.planner.graph import PRESETS, from_config
from megatrain.planner.hardware import hardware
from megatrain.planner.search import PlanError, plan

GiB = 1 << 30
DENSE = dict(hidden_size=12288, intermediate_size=28672, num_attention_heads=96, num_key_value_heads=8,
             vocab_size=32768, tie_word_embeddings=False, attention_bias=False)
MODELS = {  # shapes from the models' published config.json files
    "Qwen2.5-7B": PRESETS["qwen2.5-7b"],
    "Llama-3.1-8B": PRESETS["llama-3-8b"],
    "Gemma-2-9B": dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
                       attention_bias=False),
    "Llama-3.1-70B": PRESETS["llama-3-70b"],
    "Qwen1.5-110B": dict(hidden_size=8192, intermediate_size=49152, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, attention_bias=True),
    "Mistral-Large-2 (123B)": {**DENSE, "num_hidden_layers": 88},
}
HOSTS_GIB = (125, 256, 1536)
PINNED = dict(n_mb=4, weight_slots=2, wire_bytes=4, gpu_opt_every=0)


def cell(graph, spec, tokens: int, seq: int, clip: bool) -> str:
    last = None
    for dtype in ("fp32", "bf16"):
        try:
            p = plan(graph, spec, tokens, seq, clip=clip, n_steps=1, saved_acts=0, grad_host_dtype=dtype, **PINNED)
        except PlanError as e:
            last = e
            continue
        host = sum(host_memory(graph, p.schedule).values())
        kind = "" if p.schedule.config.grad_host_bytes == 4 else ", bf16 gradients"
        return f"{host / graph.n_params:.2f} B/param ({host / GiB:,.0f} GiB{kind})"
    text = str(last)
    if "model does not fit host memory" in text:  # the store alone: 12 bytes per parameter
        return f"no: the store alone is {graph.n_params * 12 / GiB:,.0f} GiB"
    needs = [float(w.split()[2]) for w in text.replace("no plan fits: ", "").split("; ") if w.startswith("host")]
    return f"no: needs {min(needs):,.0f} GiB" if needs else f"no ({text})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    h200 = hardware("h200")
    print("| model | params | " + " | ".join(f"{h} GiB host" for h in HOSTS_GIB) + f" | no clipping, "
          f"{HOSTS_GIB[-1]} GiB |")
    print("|---|---|" + "---|" * (len(HOSTS_GIB) + 1))
    for name, shape in MODELS.items():
        graph = from_config(shape, name=name)
        cells = [cell(graph, replace(h200, host_bytes=h * GiB), args.tokens, args.seq, True) for h in HOSTS_GIB]
        cells.append(cell(graph, replace(h200, host_bytes=HOSTS_GIB[-1] * GiB), args.tokens, args.seq, False))
        print(f"| {name} | {graph.n_params / 1e9:.2f}B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
