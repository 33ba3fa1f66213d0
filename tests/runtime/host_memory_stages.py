"""Run as a script (by tests/runtime/test_host_memory.py, in a process of its own): the host memory each stage of a
run's journey adds to a filled store of a ~200M-parameter model, as the peak resident set (VmHWM, reset before
each stage) less the resident set before it. Prints one JSON object: stage -> {"added": bytes, "bound": bytes,
"seconds": s}."""

import ctypes
import json
import sys
import time
from pathlib import Path

import torch


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def measure(results: dict, stage: str, bound: int, fn) -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier stages freed goes back: this stage's is its own
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before, t0 = rss(), time.perf_counter()
    fn()
    results[stage] = {"added": peak() - before, "bound": bound, "seconds": time.perf_counter() - t0}


def main(work: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    import megatrain
    from megatrain.export import EXPORT_HOST_BYTES, export_pretrained
    from megatrain.runtime.state import train_state
    from megatrain.runtime.state.safetensors_stream import CHUNK_BYTES

    from tests.data.tokenizers import chatml_tokenizer

    work = Path(work)
    cfg = AutoConfig.for_model(model_type="qwen2", hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                               num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                               max_position_embeddings=1024, tie_word_embeddings=False)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    sm = megatrain.compile(meta, init_seed=0, device="cpu", kernels=False, streams=False)
    store = sm.store
    for layer in store.owners():  # every page of the store resident, moments as a run has them
        rows = store.rows(layer)
        if len(rows) == 3:
            torch.mul(rows[0], 1e-3, out=rows[1])
            torch.mul(rows[0], rows[0], out=rows[2])
    sd = sm.state_dict()
    params = {n: sd[n] for n in sm.captured.model_param_names}
    tok = chatml_tokenizer()
    results = {"params": sm.graph.n_params}
    # (slack for what Python and torch allocate along the way: file objects, thread stacks, the tokenizer's save)
    measure(results, "export (bf16, from the store)", EXPORT_HOST_BYTES,
            lambda: export_pretrained(params, meta.config, tok, work / "export", torch.bfloat16,
                                      shard_bytes=200 * 10**6))
    measure(results, "state save", train_state.STATE_IO_HOST_BYTES,
            lambda: sm.save_state(work / "state"))
    measure(results, "state load", train_state.STATE_IO_HOST_BYTES, lambda: sm.load_state(work / "state"))
    measure(results, "checkpoint load (bf16 shards)", CHUNK_BYTES,
            lambda: store.load_safetensors(work / "export"))
    measure(results, "export (fp32, from the state's files)", EXPORT_HOST_BYTES + train_state.STATE_IO_HOST_BYTES,
            lambda: export_pretrained(train_state.master_sources(work / "state"), meta.config, tok,
                                      work / "export-state", torch.float32, shard_bytes=400 * 10**6))
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
