"""Data parallel over torch.distributed with the gloo backend on the CPU: two ranks, each training on half of every
step's sequences, against one process training on all of them with the same micro-batches (n_mb 2 a rank, 4
alone): the same losses, gradient norms (clipping active) and weights, to the order of the gradient sums (a rank's
micro-batches first, then the ranks'); a tied head; the ranks' states equal bit for bit; a 2-rank run saved after
its second step and resumed by two fresh processes ends where the unbroken one-process run does.
The k part of the qkv biases is left out of the weights compared (see the comment there)."""

import os

import pytest
import torch

from .models import TinyGPT, compile_cpu
from .test_parity import OPT, batches

B, STEPS = 8, 3


def _model():
    torch.manual_seed(0)
    return TinyGPT(tied=True)


def _compile(plan: dict, updated: list):
    """The rank's streamed model, each host update it runs recorded in ``updated`` (layer)."""
    sm = compile_cpu(_model(), optim=OPT, n_mb=2, weight_slots=2, **plan)
    step_layer = sm.optimizer.step_layer

    def recorded(layer, *args, **kw):
        updated.append(layer)
        return step_layer(layer, *args, **kw)

    sm.optimizer.step_layer = recorded
    return sm


# (plan options, the step before which the run is saved and resumed by new processes): host updates, then device
# updates with kept gradients, split updates (each by its layer's owner rank, a kept gradient among them); all run in
# one pair of processes (starting them is most of the test's time)
CASES = [({}, 2), ({"gpu_opt_every": 2, "grad_kept": 1}, None), ({"split_opt": 2, "opt_part": 500, "grad_kept": 1}, 1)]


def _run(rank: int, world: int, out: str, plan: dict, resume_at: int | None) -> None:
    updated: list[int] = []
    sm = _compile(plan, updated)
    assert sm.executor.dp is not None and sm.executor.dp.world == world and sm.store.shared
    share = slice(rank * B // world, (rank + 1) * B // world)
    losses, norms = [], []
    for i, (ids, mask, labels) in enumerate(batches(n_steps=STEPS, B=B)):
        if i == resume_at:  # another process goes on from the saved state
            saved = sm.save_state(os.path.join(out, "state"))
            sm = _compile(plan, updated)
            sm.load_state(saved)
        st = sm.train_step(ids[share], mask[share], labels[share])
        losses.append(st.loss)
        norms.append(st.grad_norm)
    torch.save({"losses": losses, "norms": norms, "state": {n: t.clone() for n, t in sm.state_dict().items()},
                "updated": updated, "steps": {l: sm.optimizer.steps(l) for l in sm.store.owners()}},
               os.path.join(out, f"rank{rank}.pt"))


def _worker(rank: int, world: int, init_file: str, out_dir: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for k, (plan, resume_at) in enumerate(CASES):
            _run(rank, world, os.path.join(out_dir, str(k)), plan, resume_at)
        import gc

        gc.collect()  # the runs' process-group users gone, and both ranks done with every collective, before
        dist.barrier()  # either tears its group down (a rank that exited first once left the other's gloo thread
        # to abort the process at its exit)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_as_one_process_over_the_whole_batch(tmp_path):
    import torch.multiprocessing as mp

    for k in range(len(CASES)):
        (tmp_path / str(k)).mkdir()
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for k, (plan, _) in enumerate(CASES):
        _check(plan, [torch.load(tmp_path / str(k) / f"rank{r}.pt") for r in range(2)])


def _check(plan: dict, ranks: list[dict]) -> None:
    ref = compile_cpu(_model(), optim=OPT, n_mb=4, weight_slots=2, **plan)
    ref_stats = [ref.train_step(*b) for b in batches(n_steps=STEPS, B=B)]
    for n, t in ranks[0]["state"].items():
        assert torch.equal(t, ranks[1]["state"][n]), n  # one store, which both ranks read
    # each host update ran on one rank, once a step (the layer's owner), and every rank counts every layer's steps
    cfg = ref.schedule_for(B, 12).config
    assert len(cfg.split_opt) == plan.get("split_opt", 0)
    host = [l for l in ref.store.owners() if l not in cfg.gpu_opt + cfg.split_opt]
    done = [sorted(set(r["updated"])) for r in ranks]
    assert not set(done[0]) & set(done[1]) and sorted(done[0] + done[1]) == sorted(host), done
    assert all(r["updated"].count(l) == STEPS for r in ranks for l in set(r["updated"]))
    assert ranks[0]["steps"] == ranks[1]["steps"] == {l: ref.optimizer.steps(l) for l in ref.store.owners()}
    out = ranks[0]
    assert out["losses"] == pytest.approx([s.loss for s in ref_stats], rel=1e-6)
    assert out["norms"] == pytest.approx([s.grad_norm for s in ref_stats], rel=1e-6)
    assert min(out["norms"]) > OPT.max_grad_norm  # clipping took part in every step
    d = ref.state_dict()["wte.weight"].shape[1]
    for n, t in ref.state_dict().items():
        got = out["state"][n]
        if n.endswith("qkv.bias"):  # its k part's gradient is analytically zero (softmax ignores a constant added
            # to every key's score): rounding noise, which AdamW turns into lr-sized moves in either run alike but
            # not the same (tests/runtime/test_parity.py says the same)
            keep = torch.cat([torch.arange(d), torch.arange(2 * d, 3 * d)])
            got, t = got[keep], t[keep]
        # to 1e-5 of the parameter's largest element: the ranks' gradients are summed in another order than the
        # one process's micro-batches (1.2e-6 measured on blocks.0.qkv.weight, largest 0.31, on an AMD EPYC CPU)
        torch.testing.assert_close(got, t, rtol=1e-5, atol=max(1e-6, 1e-5 * t.abs().max().item()), msg=n)
