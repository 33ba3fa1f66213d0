"""Streamed training matches plain PyTorch training step for step (fp32, CPU).

The reference trains the unmodified model with torch.optim.AdamW, accumulating gradients over the same
micro-batches with the loss normalized over all valid tokens of the step, and clips by the global norm.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import megatrain
from megatrain.ir import OpKind, Stream

from .models import FAMILIES, VOCAB, TinyGPT, compile_cpu, hf_model, hf_param_groups, record_grads

# fused=False: the same per-element AdamW arithmetic as the reference's torch.optim.AdamW on CPU, so parameters
# stay equal even where a gradient is rounding noise (k-projection biases: analytically zero gradient) and
# Adam's normalization would turn a one-ulp difference into an lr-sized one. The fused kernel is tested below.
OPT = megatrain.OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5,
                            warmup_steps=1, total_steps=4, fused=False)


def batches(n_steps=3, B=6, T=12, seed=1, vocab=VOCAB):
    """Random tokens with right padding and some ignored labels in every step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        ids = torch.randint(3, vocab, (B, T), generator=g)
        mask = torch.ones_like(ids)
        mask[1, T - 3:] = 0
        mask[4, T // 2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[2, :4] = -100
        out.append((ids, mask, labels))
    return out


def reference_train(model, data, n_mb, hf=True, opt_cfg=OPT, before_mb=None):
    """Plain PyTorch: AdamW (no weight decay on biases and norm weights, by transformers' rule) + LambdaLR with the
    same warmup/cosine rule, grad accumulation, clip_grad_norm_.
    ``before_mb(step, mb)`` runs before each micro-batch's forward."""
    opt = torch.optim.AdamW(hf_param_groups(model, opt_cfg.weight_decay, opt_cfg.decay_all), lr=opt_cfg.lr,
                            betas=opt_cfg.betas, eps=opt_cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: megatrain.runtime.optim.lr_at(opt_cfg, s) / opt_cfg.lr)
    losses, norms = [], []
    for step, (ids, mask, labels) in enumerate(data):
        nxt = torch.full_like(labels, -100)
        nxt[:, :-1] = labels[:, 1:]
        denom = (nxt != -100).sum()
        opt.zero_grad()
        total = 0.0
        for i in range(n_mb):
            sl = slice(i * len(ids) // n_mb, (i + 1) * len(ids) // n_mb)
            if before_mb is not None:
                before_mb(step, i)
            out = model(input_ids=ids[sl], attention_mask=mask[sl]) if hf else None
            logits = out.logits if hf else model(ids[sl])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), nxt[sl].reshape(-1),
                                   ignore_index=-100, reduction="sum") / denom
            if getattr(out, "aux_loss", None) is not None:  # an MoE's router loss, HF's, as the model adds it to
                # its loss; each micro-batch's loss counts 1 / n_mb of the step's
                loss = loss + model.router_aux_loss_coef * out.aux_loss / n_mb
            loss.backward()
            total += loss.item()
        if opt_cfg.max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)))
        opt.step()
        sched.step()
        losses.append(total)
    return losses, norms


def rel_err(streamed, ref_model):
    sd = streamed.state_dict()
    return {n: float((sd[n] - p.detach()).abs().max() / p.detach().abs().max()) for n, p in ref_model.named_parameters()}


def check(streamed, ref_model, losses, ref_losses, norms=None, ref_norms=None, skip=lambda name: False, tol=1e-5):
    """Weights (all but those ``skip`` names, to ``tol`` of each parameter's largest), losses and clipped gradient
    norms against plain PyTorch's."""
    errs = {n: e for n, e in rel_err(streamed, ref_model).items() if not skip(n)}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: relative error {errs[worst]:.2e}"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-6 * abs(b), (losses, ref_losses)
    if norms is not None:
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert max(ref_norms) > OPT.max_grad_norm  # clipping was active


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_matches_plain_pytorch(family):
    model = hf_model(family)
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=2, host_checkpoints=2)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    # the user's model was not touched
    for (n, p), (_, q) in zip(model.named_parameters(), hf_model(family).named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_micro_batch_without_padding_passes_no_mask(family):
    """HF's mask builders read a mask's values to decide whether sdpa can run plain causal (a device-to-host sync
    in every forward on the GPU); a micro-batch without padding passes None instead, which they treat alike. The
    padded micro-batches of `batches()` still pass theirs (their results are compared in the test above)."""
    sm = compile_cpu(hf_model(family), optim=OPT, n_mb=3, weight_slots=2)
    runner = sm.executor.runner
    assert runner.captured.mask_optional
    seen = []
    run = runner.run

    def spy(i, flat, x, *a, **k):
        if i == 0:
            seen.append(None if x[1] is None else int((x[1] == 0).sum()))
        return run(i, flat, x, *a, **k)

    runner.run = spy
    ids, mask, labels = batches(n_steps=1)[0]  # rows 1 and 4 padded: micro-batches 0 and 2
    sm.train_step(ids, mask, labels)
    assert seen and set(seen) == {None, 3, 6}
    assert all(v is None for j, v in enumerate(seen) if j % 3 == 1)  # forward and backward of micro-batch 1


def test_plain_decoder_module_matches_plain_pytorch():
    torch.manual_seed(0)
    model = TinyGPT(tied=False)
    ref = copy.deepcopy(model)
    data = [(ids, torch.ones_like(ids), labels) for ids, _, labels in batches()]  # no attention mask: labels only
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, hf=False)
    sm = compile_cpu(model, optim=OPT, n_mb=3, weight_slots=3, host_checkpoints=1)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def test_plain_decoder_module_with_tied_head_matches_for_a_step():
    """Tied: the streamed run sums the head's and the embedding's gradients in another order than autograd
    (an ulp apart); the k-bias of GPT-2's qkv has an analytically zero gradient, so over several steps AdamW turns
    that ulp into lr-sized noise on it. One step shows the tied gradient and update are right."""
    torch.manual_seed(0)
    model = TinyGPT(tied=True)
    ref = copy.deepcopy(model)
    data = [(ids, torch.ones_like(ids), labels) for ids, _, labels in batches(n_steps=1)]
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3, hf=False)
    sm = compile_cpu(model, optim=OPT, n_mb=3)
    assert sm.graph[len(sm.graph) - 1].tie == 0
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    sd = sm.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()


def test_fused_adamw_matches_too():
    opt = dataclasses.replace(OPT, fused=True)
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=2, opt_cfg=opt)
    sm = compile_cpu(model, optim=opt, n_mb=2)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


@pytest.mark.parametrize("clip", [1.0, None])
def test_updates_on_the_device_match_too(clip):
    """Every second layer updated through LOAD_OPT -> OPT on compute -> STORE_OPT (the device is the CPU here)."""
    opt = dataclasses.replace(OPT, fused=True, max_grad_norm=clip)
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=2, opt_cfg=opt)
    sm = compile_cpu(model, optim=opt, n_mb=2, gpu_opt_every=2)
    assert sm.schedule_for(6, 12).config.gpu_opt == (1, 3, 5)
    stats = [sm.train_step(*b) for b in data]
    norms = ([s.grad_norm for s in stats], ref_norms) if clip else ()
    check(sm, ref, [s.loss for s in stats], ref_losses, *norms)
    host = {n: t.clone() for n, t in sm.state_dict().items()}  # the same updates as all on the host, exactly
    sm2 = compile_cpu(hf_model("llama"), optim=opt, n_mb=2)
    for b in data:
        sm2.train_step(*b)
    assert all(torch.equal(host[n], t) for n, t in sm2.state_dict().items())


def test_a_run_sets_the_device_up_once_then_runs_one_step_schedule():
    """The plan's set-up puts the device-updated layers' weights on the device (KEEP_W); every step then copies them
    there (no load over the wire) and leaves its own updates for the next; new weights from outside send the run
    through the set-up again."""
    data = batches()
    sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=2, gpu_opt_every=2)
    setup, step = sm.setup_for(6, 12), sm.schedule_for(6, 12)
    assert setup.config.setup and step.config.gpu_opt == (1, 3, 5)
    assert [op.layer for op in setup.ops if op.kind is OpKind.KEEP_W] == [1, 3, 5]
    loads = {op.stream for op in step.ops if op.kind is OpKind.LOAD_W and op.layer in step.config.gpu_opt}
    assert loads == {Stream.COMPUTE}
    ran = []
    run, set_up = sm.executor.run, sm.executor.set_up
    sm.executor.run = lambda s, *a, **k: ran.append(s) or run(s, *a, **k)
    sm.executor.set_up = lambda s, *a, **k: ran.append(s) or set_up(s, *a, **k)
    for b in data:
        sm.train_step(*b)
    assert ran == [setup, step, step, step]
    sm.store.load_state({n: t.clone() for n, t in sm.state_dict().items()})
    sm.train_step(*data[0])
    assert ran[-2:] == [setup, step]


def test_a_new_plan_frees_the_buffers_of_the_one_before():
    """Switching to a plan with fewer slots and other device updates frees the earlier plan's extra slots and kept
    weights, and training goes on as it would have: the same result as host-only updates throughout."""
    data = batches()
    sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=2, weight_slots="all", gpu_opt_every=1)
    host = compile_cpu(hf_model("llama"), optim=OPT, n_mb=2)
    sm.train_step(*data[0])
    ex = sm.executor.dev
    assert len(ex.w) == len(sm.graph) and len(ex.o) > 1 and len(ex.kept_buf) > 1
    sm.train_step(*data[1], weight_slots=2, gpu_opt_every=2)
    gpu_opt = sm.schedule_for(6, 12, weight_slots=2, gpu_opt_every=2).config.gpu_opt
    assert len(ex.w) == 2 and set(ex.kept_buf) <= set(gpu_opt) and len(ex.o) <= len(gpu_opt)
    for b in data[:2]:
        host.train_step(*b)
    assert all(torch.equal(t, host.state_dict()[n]) for n, t in sm.state_dict().items())


@pytest.mark.parametrize("every,n_mb,slots,offload,clip", [(1, 3, 1, 0, 1.0), (3, 1, 2, 3, None), (2, 6, 4, 1, 1.0),
                                                          (2, 2, "all", 0, 1.0)])
def test_device_updates_equal_host_updates_for_any_plan(every, n_mb, slots, offload, clip):
    """Any set of device updates, with any micro-batching, weight slots and offloaded checkpoints: the program-order
    executor gives bit for bit the parameters and losses of host-only updates (the same AdamW kernel)."""
    opt = dataclasses.replace(OPT, fused=True, max_grad_norm=clip)
    data = batches()
    runs = []
    for k in (0, every):
        sm = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=n_mb, weight_slots=slots, host_checkpoints=offload,
                         gpu_opt_every=k)
        losses = [sm.train_step(*b).loss for b in data]
        runs.append((losses, {n: t.clone() for n, t in sm.state_dict().items()}))
    (host_losses, host), (dev_losses, dev) = runs
    assert dev_losses == host_losses
    assert all(torch.equal(host[n], t) for n, t in dev.items())


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_tied_embedding_updated_on_the_device_equals_host_updates(clip):
    """Tied embedding and head, every layer updated on the device (the embedding too: the head's gradient part
    goes into its optimizer slot first, the embedding's own is added): the same parameters and losses as
    every update on the host, bit for bit."""
    opt = dataclasses.replace(OPT, fused=True, max_grad_norm=clip)
    data = batches()
    runs = []
    for k in (0, 1):
        sm = compile_cpu(hf_model("llama", tie_word_embeddings=True), optim=opt, n_mb=2, gpu_opt_every=k)
        assert sm.captured.tied_names
        gpu_opt = sm.schedule_for(6, 12).config.gpu_opt
        assert (0 in gpu_opt) == bool(k)
        losses = [sm.train_step(*b).loss for b in data]
        runs.append((losses, {n: t.clone() for n, t in sm.state_dict().items()}))
    (host_losses, host), (dev_losses, dev) = runs
    assert dev_losses == host_losses and dev_losses[0] != dev_losses[-1]
    assert all(torch.equal(host[n], t) for n, t in dev.items())


def test_auto_device_updates_take_the_fastest_simulated_set():
    from megatrain.planner.choices import choose_grad_kept, device_update_sets
    from megatrain.planner.simulate import simulate

    opt = dataclasses.replace(OPT, fused=True)
    data = batches()
    sm = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2, gpu_opt_every="auto")
    chosen = sm.schedule_for(6, 12).config
    times = {}
    for gpu_opt in device_update_sets(sm.graph, None):  # with clipping each keeps its state on the device, and
        # as many host-updated layers as fit keep their gradients there until the update pass
        cfg = dataclasses.replace(chosen, n_steps=3, gpu_opt=gpu_opt, resident_opt=gpu_opt, grad_kept=())
        times[gpu_opt] = simulate(choose_grad_kept(sm.graph, cfg, "auto"), sm.graph, sm.hardware).steady_step_s
    assert chosen.resident_opt == chosen.gpu_opt
    assert times[chosen.gpu_opt] == min(times.values()) and len(times) > 1
    losses = [sm.train_step(*b).loss for b in data]
    host = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2)
    assert losses == [host.train_step(*b).loss for b in data]
    with pytest.raises(ValueError, match="gpu_opt_every must be"):
        compile_cpu(hf_model("qwen2"), gpu_opt_every="fast")


@pytest.mark.parametrize("gpu_opt_every", [0, 2])
def test_bf16_wire_from_the_host_shadow_equals_casting_on_the_device(gpu_opt_every):
    """bf16 compute: weights sent as the bf16 shadow the optimizer keeps (wire='bf16') or as the fp32 master cast
    where they land (wire='fp32') round the same way (to nearest even), so training is identical; the device
    updates (gpu_opt_every=2) refresh the shadow from their own result."""
    data = batches()
    runs = {}
    for wire in ("fp32", "bf16"):
        sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=2, compute_dtype=torch.bfloat16, wire=wire,
                         gpu_opt_every=gpu_opt_every)
        assert sm.schedule_for(6, 12).config.wire_bytes_per_param == (2 if wire == "bf16" else 4)
        losses = [sm.train_step(*b).loss for b in data]
        runs[wire] = losses, {n: t.clone() for n, t in sm.state_dict().items()}
        if wire == "bf16":
            for layer in sm.store.owners():  # the shadow is the current master, rounded
                master = sm.store.master(layer)
                assert torch.equal(sm.store.shadow(layer), master.to(torch.bfloat16))
    assert runs["fp32"][0] == runs["bf16"][0]
    assert all(torch.equal(runs["fp32"][1][n], t) for n, t in runs["bf16"][1].items())
    assert runs["fp32"][0][0] != runs["fp32"][0][2]  # it trained


def test_bf16_wire_needs_bf16_compute_and_plan_options_are_checked():
    with pytest.raises(ValueError, match="needs bf16 compute"):
        compile_cpu(hf_model("llama"), wire="bf16")
    for bad in (0, "most", 2.5):
        with pytest.raises(ValueError, match="weight_slots must be an integer >= 1, 'all' or 'auto'"):
            compile_cpu(hf_model("llama"), weight_slots=bad)
    with pytest.raises(ValueError, match="wire must be"):
        compile_cpu(hf_model("llama"), wire="fp8")
    with pytest.raises(ValueError, match="unknown plan option.*plan options are: n_mb"):
        compile_cpu(hf_model("llama"), n_microbatches=2)


def test_host_optimizer_thread_count_changes_nothing_but_speed():
    opt = dataclasses.replace(OPT, fused=True, threads=1)
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=2, opt_cfg=opt)
    before = torch.get_num_threads()
    try:
        sm = compile_cpu(model, optim=opt, n_mb=2)
        stats = [sm.train_step(*b) for b in data]
        assert torch.get_num_threads() == 1  # the update ran with the configured thread count
    finally:
        torch.set_num_threads(before)
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)
    with pytest.raises(ValueError, match="threads"):
        dataclasses.replace(OPT, threads=0)


@pytest.mark.parametrize("n_mb,slots,offload", [(1, 1, 0), (2, 2, 3), (3, 3, 1), (6, 4, 4), (2, "all", 0)])
def test_one_step_is_the_same_for_any_micro_batching_and_slots(n_mb, slots, offload):
    """Gradients and loss of one step equal the whole-batch reference for any micro-batching, slot count and
    checkpoint placement; parameters equal a reference that accumulates over the same micro-batches.

    (Parameters across different micro-batch counts differ by up to ~2e-4 relative after one step in plain
    PyTorch too: summation order changes gradients by an ulp, and AdamW normalizes an element whose gradient is
    near eps into an lr-sized step. The gradients are what micro-batching must not change.)"""
    model = hf_model("qwen2")
    whole, same_split = copy.deepcopy(model), copy.deepcopy(model)
    data = batches(n_steps=1)
    ids, mask, labels = data[0]
    nxt = torch.full_like(labels, -100)
    nxt[:, :-1] = labels[:, 1:]
    logits = whole(input_ids=ids, attention_mask=mask).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), nxt.reshape(-1), ignore_index=-100, reduction="sum")
    (loss / (nxt != -100).sum()).backward()
    no_clip = dataclasses.replace(OPT, max_grad_norm=None)
    ref_losses, _ = reference_train(same_split, data, n_mb=n_mb, opt_cfg=no_clip)
    sm = compile_cpu(model, optim=no_clip, n_mb=n_mb, weight_slots=slots, host_checkpoints=offload)
    grads = record_grads(sm)
    stats = sm.train_step(*data[0])
    assert abs(stats.loss - float(loss.detach() / (nxt != -100).sum())) <= 1e-6 * stats.loss
    for n, p in whole.named_parameters():
        g = grads[n]
        assert float((g - p.grad).abs().max() / p.grad.abs().max()) <= 1e-5, n
    check(sm, same_split, [stats.loss], ref_losses)


def test_meta_model_with_safetensors_checkpoint_matches(tmp_path):
    from transformers import AutoModelForCausalLM

    from .models import hf_config

    real = hf_model("llama")
    real.save_pretrained(tmp_path)
    ref = copy.deepcopy(real)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config("llama"), attn_implementation="eager")
    data = batches()
    ref_losses, ref_norms = reference_train(ref, data, n_mb=3)
    sm = compile_cpu(meta, checkpoint=tmp_path, optim=OPT, n_mb=3)
    stats = [sm.train_step(*b) for b in data]
    check(sm, ref, [s.loss for s in stats], ref_losses, [s.grad_norm for s in stats], ref_norms)


def test_weights_kept_after_a_device_update_serve_the_next_load_until_the_host_copy_changes():
    """A device update leaves the layer's new weights on the device and the next step loads them from there; new
    weights loaded into the store from outside make those copies stale, and the next step reads the host. (States
    sent back to the host every step, so that the host master can be compared; see test_resident.py for states
    kept on the device.)"""
    opt = dataclasses.replace(OPT, fused=True)
    data = batches()
    sm = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2, gpu_opt_every=2, resident_opt=0)
    dev = set(sm.schedule_for(6, 12).config.gpu_opt)
    sm.train_step(*data[0])
    assert dev and set(sm.executor.dev.kept) == dev
    for layer in dev:  # fp32 compute on the CPU: the kept copy is the updated master itself
        assert torch.equal(sm.executor.dev.kept_weights(layer), sm.store.master(layer))
    new = {n: t.clone() * 0.5 for n, t in sm.state_dict().items()}
    sm.store.load_state(new)
    assert all(sm.executor.dev.kept_weights(layer) is None for layer in dev)
    ref = compile_cpu(hf_model("qwen2"), optim=opt, n_mb=2)
    ref.store.load_state(new)
    # a step's loss is computed from the weights it loads: the halved ones, not the kept copies
    assert sm.train_step(*data[1]).loss == ref.train_step(*data[1]).loss
    assert set(sm.executor.dev.kept) == dev  # and this step's device updates keep theirs again


def test_every_checkpoint_on_the_host_with_one_micro_batch_trains_as_none():
    """Layers 1..L-2's checkpoints all offloaded, one micro-batch: the top block's comes back from the host into the
    slot that still holds it, a write the executor once refused as a loss of what the backward reads; losses and
    weights bit for bit those of every checkpoint kept on the device."""
    data = batches(n_steps=2)
    runs = []
    for host in (0, 4):
        sm = compile_cpu(hf_model("llama"), optim=OPT, n_mb=1, weight_slots=1, host_checkpoints=host)
        assert sm.schedule_for(*data[0][0].shape).config.host_checkpoints == host and len(sm.graph) - 2 == 4
        runs.append(([sm.train_step(*b).loss for b in data], sm.state_dict()))
    (l0, w0), (l1, w1) = runs
    assert l1 == l0 and all(torch.equal(w1[n], t) for n, t in w0.items())
