"""A user's whole journey, measured stage by stage: an HF checkpoint directory in (random weights in bf16 shards, a
ChatML tokenizer), ``megatrain train --model DIR --data chat.jsonl`` fine-tuning it, the weights out, and HF reading
them back (``from_pretrained``, ``apply_chat_template``, ``generate``). Each stage's seconds and peak host memory
come from the run's own summary (megatrain.stages); the run's peak resident set is also read from outside
(sampled from outside), beside the host memory the plan counted.

With ``--kill-after-save N`` it also checks crash and resume: a reference run with ``--save-every``, then a run
killed (SIGKILL) once its step-N state is saved, resumed to the end: the resumed losses and exported weights must
equal the reference's.

    python benchmarks/journey.py --shape qwen2.5-7b --steps 6 --batch 32 --seq 1024 --gpu-gib 24 --work /tmp/j
    python benchmarks/journey.py --shape qwen2.5-1.5b --steps 6 --save-every 2 --kill-after-save 4 --work /tmp/j
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

GiB = 1 << 30
WORDS = ("stream layer weight device host memory batch token plan step save export model train data chat "
         "answer question paris four capital river mountain north south light sound").split()


class RandomTensor:
    """A checkpoint tensor of random values, made a slice at a time (safetensors_stream.Source): norms 1, biases 0,
    other weights uniform with std 0.02, the same for the same name and seed."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int):
        self.name, self.shape = name, tuple(shape)
        self.seed = zlib.crc32(name.encode()) ^ seed

    def __getitem__(self, s: slice) -> torch.Tensor:
        n = s.stop - s.start
        if "norm" in self.name:
            return torch.ones(n)
        if self.name.endswith(".bias"):
            return torch.zeros(n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + s.start)
        bound = 0.02 * math.sqrt(3)
        return torch.empty(n).uniform_(-bound, bound, generator=g)


def chat_texts(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    chats = []
    for _ in range(n):
        turns = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": sentence(rng.randint(5, 40)) + " Why?"})
            turns.append({"role": "assistant", "content": " ".join(sentence(rng.randint(5, 30))
                                                                   for _ in range(rng.randint(1, 6)))})
        chats.append(turns)
    return chats


def make_checkpoint(d: Path, shape: str, layers: int | None, shards: int, chats: list, seed: int) -> dict:
    """An HF model directory: the preset's config (``layers`` blocks where given), random bf16 weights in
    ``shards`` safetensors files with their index, a ChatML tokenizer built from the chats (eos <|im_end|>)."""
    from transformers import AutoModelForCausalLM

    from megatrain.data import build_tokenizer
    from megatrain.export import export_pretrained
    from megatrain.inputs import model_source

    cfg = model_source(shape, 1024, 1024).config
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):  # (transformers checks one type per layer)
            cfg.layer_types = cfg.layer_types[:layers]
    texts = [t["content"] for c in chats for t in c]
    tok = build_tokenizer(texts, 4096)
    tok.eos_token = "<|im_end|>"
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    names = {n: p.shape for n, p in meta.named_parameters()}  # (tied names once)
    total = sum(math.prod(s) for s in names.values()) * 2
    t0 = time.perf_counter()
    export_pretrained({n: RandomTensor(n, s, seed) for n, s in names.items()}, cfg, tok, d, torch.bfloat16,
                      shard_bytes=-(-total // shards))
    return {"params": total // 2, "bytes": total, "seconds": time.perf_counter() - t0}


def _sample_rss(pid: int, peak: list[int]) -> None:
    """``peak[0]``: the most resident memory ``pid`` held, sampled every 0.1 s until it ends (the run resets its
    own high-water mark between stages, so getrusage would miss peaks)."""
    status = Path(f"/proc/{pid}/status")
    while True:
        try:
            text = status.read_text()
        except OSError:
            return
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.1)


def run_train(argv: list[str], log: Path, kill_after: str | None = None) -> dict:
    """``megatrain train`` in a process of its own: its exit status, wall seconds, peak resident set (sampled from
    outside), and whether it was killed (SIGKILL once a line containing ``kill_after`` appeared)."""
    import threading

    cmd = [sys.executable, "-m", "megatrain", "train", *argv]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    peak = [0]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        sampler = threading.Thread(target=_sample_rss, args=(p.pid, peak), daemon=True)
        sampler.start()
        killed = False
        for line in p.stdout:
            f.write(line)
            f.flush()
            if kill_after and kill_after in line and not killed:
                p.send_signal(signal.SIGKILL)
                killed = True
        rc = p.wait()
        sampler.join()
    return {"rc": rc, "killed": killed, "wall_s": time.perf_counter() - t0, "sampled_peak_rss_gib": peak[0] / GiB,
            "cmd": " ".join(cmd)}


def read_back(run: Path, chat: list[dict]) -> dict:
    """HF reads the exported directory: from_pretrained, the chat template, a few generated tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(run, dtype=torch.bfloat16).to(dev)
    tok = AutoTokenizer.from_pretrained(run)
    ids = tok.apply_chat_template(chat[:1], add_generation_prompt=True, return_tensors="pt")
    ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to(dev)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return {"seconds": time.perf_counter() - t0, "generated": int(out.shape[1] - ids.shape[1]),
            "eos_token_id": model.generation_config.eos_token_id, "dtype": str(model.dtype)}


def digests(run: Path) -> dict[str, str]:
    """SHA-256 of each exported weights file of ``run`` (read a MiB at a time)."""
    out = {}
    for p in sorted(run.glob("model*.safetensors")):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        out[p.name] = h.hexdigest()
    return out


def losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", help="a planner preset (its HF config)")
    ap.add_argument("--layers", type=int, help="cut the preset to this many blocks")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--chats", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gpu-gib", type=float)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--kill-after-save", type=int, help="also: killed after this step's save, resumed to the end")
    ap.add_argument("--extra", default="", help="more megatrain train flags, space-separated")
    ap.add_argument("--work", required=True, help="a directory for the checkpoint, data and runs (emptied)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    chats = chat_texts(args.chats, 0)
    data = work / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    res = {"date": time.strftime("%Y-%m-%d"), "shape": args.shape, "layers": args.layers,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip(),
           "disk_free_gib": shutil.disk_usage(work).free / GiB}
    res["checkpoint"] = make_checkpoint(work / "model", args.shape, args.layers, args.shards, chats, 0)
    print(f"checkpoint: {res['checkpoint']['params'] / 1e9:.2f}B params, {res['checkpoint']['bytes'] / GiB:.2f} GiB "
          f"in {args.shards} shards, {res['checkpoint']['seconds']:.1f} s", flush=True)
    common = ["--model", str(work / "model"), "--data", str(data), "--steps", str(args.steps), "--batch",
              str(args.batch), "--seq", str(args.seq), *(["--gpu-gib", str(args.gpu_gib)] if args.gpu_gib else []),
              *(["--save-every", str(args.save_every)] if args.save_every else []), *args.extra.split()]
    ref = work / "run"
    res["train"] = run_train([*common, "--out", str(ref)], work / "run.log")
    summary_file = ref / "summary.json"
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        res["summary"] = {k: s.get(k) for k in ("tokens_per_s", "host_planned_gib", "host_rss_peak_run_gib",
                                                "device_planned_gib",
                                                "stages", "export_s", "state_save_s", "state_refused",
                                                "gpu_peak_gib", "mfu")}
    res["log_tail"] = (work / "run.log").read_text().splitlines()[-4:]
    if (ref / "config.json").is_file() and any(ref.glob("model*.safetensors")):
        res["read_back"] = read_back(ref, chats[0])
    if args.kill_after_save:
        ref_losses = losses(ref)
        ref_weights = digests(ref)
        # the disk holds two states of the shapes measured, and the reference's are no longer needed
        shutil.rmtree(ref / "state", ignore_errors=True)
        for p in ref.glob("model*.safetensors"):
            p.unlink()
        killed = work / "killed"
        res["killed"] = run_train([*common, "--out", str(killed)], work / "killed.log",
                                  kill_after=f"step {args.kill_after_save}: training state saved")
        resumed = work / "resumed"
        res["resumed"] = run_train(["--resume", str(killed), "--out", str(resumed)], work / "resumed.log")
        got = losses(killed)[: args.kill_after_save] + losses(resumed)
        res["resume_exact"] = {
            "losses": got == ref_losses,
            "weights": digests(resumed) == ref_weights,
            "ref_losses": ref_losses, "resumed_losses": got}
    res["logs"] = {p.stem: p.read_text().splitlines() for p in sorted(work.glob("*.log"))}
    print(json.dumps({k: v for k, v in res.items() if k != "logs"}, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
