"""The stream issuer on the CPU: StreamExecutor with a fake CUDA (tests/runtime/fake_cuda.py) that runs each op when it
is issued and keeps what a GPU would guarantee about order. Checked: every op goes to its queue, no op can start
before its inputs end (a GPU input through the events its stream waited for, an optimizer task's through the host
having waited for it), a slot a step first rewrites only after the step before has done with it, and the run
trains exactly as the program-order executor does."""

import copy
import dataclasses
import time
from concurrent.futures import Future

import pytest
import torch

from megatrain.ir import SLOT_POOL, OpKind, Stream, queue_of
from megatrain.layout import OPT_STATE_ROWS
from megatrain.runtime.issue.streams import StreamExecutor

from .fake_cuda import FakeCuda
from .models import compile_cpu, hf_model
from .test_parity import OPT, batches

BUFFER_POOLS = ("w", "g", "o", "k")  # buffers every step rewrites (activations are fresh tensors)
PLANS = {
    "host": dict(n_mb=3, weight_slots=2),
    "device-and-split": dict(n_mb=3, weight_slots=2, gpu_opt_every=3, resident_opt=0, split_opt=2, opt_part=700,
                             grad_kept="auto"),
    "split": dict(n_mb=3, weight_slots=2, split_opt=2, opt_part=700, grad_kept=1),
    "resident": dict(n_mb=2, weight_slots="all", gpu_opt_every=1, resident_opt="auto"),
    "dropped": dict(n_mb=2, weight_slots=2, host_checkpoints=2, dropped_checkpoints=1),  # a REFWD, a host reload
    "dropped-run": dict(n_mb=2, weight_slots=2, host_checkpoints=1, dropped_checkpoints=2),  # 2, 3 from 1's
}


def _streamed(model, fake, **plan):
    sm = compile_cpu(model, optim=OPT, **plan)
    sm.executor = StreamExecutor(sm.captured, sm.store, sm.optimizer, torch.device("cpu"), sm.compute_dtype,
                                 runner=sm.executor.runner, cuda=fake)
    sm.overlap_steps = True
    return sm


def _run(name, monkeypatch=None, skip=None):
    """Train the plan ``name`` for 3 steps with the program-order executor and with the stream issuer on the fake;
    the order violations found (strings) and the issuer. ``skip``: an issuer method to replace with a no-op."""
    model, data = hf_model("qwen2"), batches(n_steps=3)
    ref = compile_cpu(copy.deepcopy(model), optim=OPT, **PLANS[name])
    fake = FakeCuda()
    sm = _streamed(copy.deepcopy(model), fake, **PLANS[name])
    ex = sm.executor
    if skip is not None:
        monkeypatch.setattr(*skip)
    steps = []  # per step (and set-up): its schedule, slot contents per op, timing records, the STORE_OPT rows'
    # events, what it carries over from the one before

    def issued():
        steps.append((ex.timer.schedule, ex.tags, ex.timer.records(), dict(ex.order.store_opt_done),
                      ex.order.carried))

    set_up = ex.set_up
    ex.set_up = lambda *a, **k: (set_up(*a, **k), issued())
    for b in data:
        want = ref.train_step(*b)
        got = sm.train_step(*b)
        issued()
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)  # work runs at issue: program order
    has_setup = bool(steps[-1][0].config.gpu_opt)  # the plan's set-up first, where it keeps anything on the device
    assert [s[0].config.setup for s in steps] == [True] * has_setup + [False] * len(data)
    sm.wait()
    ref_sd, sd = ref.state_dict(), sm.state_dict()
    assert all(torch.equal(sd[n], ref_sd[n]) for n in sd)
    bad = []
    last_use: dict[tuple[str, int], list] = {}  # slot -> (op, end) of the previous step's ops that used it
    stored_before: dict = {}  # layer -> (step, row events) of the previous step's STORE_OPT
    prev_ends: dict = {}
    for k, (schedule, tags, records, stored, carried) in enumerate(steps):
        ends = {op.id: t for op, t in records}
        assert (carried is not None) == (k > 0)  # the API's verified pairs: the step after the set-up, after
        # itself
        this_use: dict[tuple[str, int], list] = {}
        for op, t in sorted(records, key=lambda r: r[0].id):
            if isinstance(t, Future):  # an optimizer task: after the GPU ops it reads, synchronized by the host
                start = t.result()[0]
                bad += [f"{op} before {schedule.ops[d]}" for d in op.deps if not isinstance(ends[d], Future)
                        and not (ends[d][1].synced and ends[d][1].t <= start)]
                continue
            begin, end = t
            if begin.stream is not ex.queues[queue_of(op)]:
                bad.append(f"{op} on the wrong queue")
            for d, dep, what in [(d, ends[d], "") for d in op.deps] + [
                    (d, prev_ends[d], "the step before's ") for d in (carried[op.id] if carried else ())]:
                if isinstance(dep, Future):  # the host (or the worker) issued the op after the task ended
                    ok = dep.done() and dep.result()[1] <= begin.t
                elif what and op.kind is OpKind.LOAD_OPT and steps[k - 1][0].ops[d].kind is OpKind.STORE_OPT \
                        and steps[k - 1][0].ops[d].layer == op.layer:
                    continue  # its own state's store: row by row, checked below
                else:
                    ok = fake.happened(dep[1], begin)
                if not ok:
                    bad.append(f"{op} before {what}{(steps[k - 1][0] if what else schedule).ops[d]}")
            writes = tags[op.id][1]
            for role, idx in op.slots:
                key = (SLOT_POOL[role], idx)
                if key[0] not in BUFFER_POOLS:
                    continue
                if role in writes and key not in this_use:  # the step's first use of the slot rewrites it: the
                    # step before is done with it (the step's later users follow this one, as its schedule says)
                    for prev, e in last_use.get(key, []):
                        if (prev.kind, prev.layer) == (OpKind.STORE_OPT, op.layer) and op.kind is OpKind.LOAD_OPT:
                            # its own state's store: the load copies each row after that row is stored
                            rows = stored_before[op.layer][1][:OPT_STATE_ROWS]
                            ok = rows and all(fake.happened(r, end) for r in rows)
                        else:
                            ok = fake.happened(e, begin)
                        if not ok:
                            bad.append(f"{op} rewrites {key} before the step before's {prev}")
                this_use.setdefault(key, []).append((op, end))
        last_use, stored_before, prev_ends = this_use, stored, ends
    return bad, ex, steps


@pytest.mark.parametrize("name", list(PLANS))
def test_stream_issuer_orders_every_op_after_its_inputs(name):
    bad, ex, steps = _run(name)
    assert not bad, bad[:5]
    cfg = steps[-1][0].config
    used = {queue_of(op) for _, _, records, _, _ in steps for op, t in records if not isinstance(t, Future)}
    assert {(Stream.H2D, False), (Stream.COMPUTE, False)} <= used
    if name == "device-and-split":
        assert cfg.gpu_opt and cfg.split_opt and cfg.grad_kept
        assert {(Stream.H2D, True), (Stream.COMPUTE, True), (Stream.D2H, True)} <= used
    if name.startswith("dropped"):  # layer 2's checkpoint (and 3's) made again from layer 1's, which comes
        # back from the host first
        ops, remade = steps[-1][0].ops, {"dropped": {1}, "dropped-run": {1, 2}}[name]
        assert {op.layer for op in ops if op.kind is OpKind.REFWD} == remade
        assert not [op for op in ops if op.kind is OpKind.SAVE_ACT and op.layer - 1 in remade]


@pytest.mark.parametrize("skip", ["dependencies", "earlier steps"])
def test_the_order_check_catches_a_missing_wait(monkeypatch, skip):
    """The issuer with its waits on dependencies' events, or its waits for the step before, taken out: the check
    finds ops that could start too soon."""
    from megatrain.runtime.issue import step_order, streams

    if skip == "dependencies":
        class NoWaits:
            def __init__(self, stream):
                self.stream = stream

            def __getattr__(self, name):
                return getattr(self.stream, name)

            def wait_event(self, event):
                pass

        real = streams.StreamExecutor._queue
        target = (streams.StreamExecutor, "_queue", lambda self, op: NoWaits(real(self, op)))
    else:
        target = (step_order.StepOrder, "on_prev", lambda *a, **k: step_order.PrevDeps(None, ()))
    bad, _, _ = _run("device-and-split", monkeypatch, target)
    assert bad, "no violation found with the waits taken out"
    assert any((" before " in b) if skip == "dependencies" else (" rewrites " in b) for b in bad), bad[:5]


@pytest.mark.parametrize("paced", [True, False])
def test_split_state_loads_leave_the_copy_engine_a_gap(monkeypatch, paced):
    """Each state load of a split update waits for the split update issued before it (the copy engine is idle for
    that long, and a weight load waiting on the other queue goes first); unpaced, the check fails."""
    if not paced:
        monkeypatch.setattr(StreamExecutor, "pace_split", False)
    _, ex, steps = _run("split")
    last_opt, early, loads = None, [], 0
    for op, (begin, end) in (r for _, _, rec, _, _ in steps for r in rec if not isinstance(r[1], Future)):
        # (each step's records in the order its ops were issued)
        q = queue_of(op)
        if q == (Stream.COMPUTE, True):
            last_opt = (op, end)
        elif q == (Stream.H2D, True):
            loads += 1
            if last_opt is not None and last_opt[1] not in begin.stream.waited[:begin.after_waits]:
                early.append(f"{op} does not wait for {last_opt[0]}")
    assert loads and bool(early) != paced, early[:3]


def test_the_checks_see_a_missing_wait():
    """The same run with the issuer's waits for dependencies dropped fails the order check it should fail."""
    fake = FakeCuda()
    a, b = fake.new_stream(), fake.new_stream()
    e1, e2 = fake.new_event(), fake.new_event()
    e1.record(a)
    e2.record(b)
    assert not fake.happened(e1, e2)
    b.wait_event(e1)
    e3 = fake.new_event()
    e3.record(b)
    assert fake.happened(e1, e3) and fake.happened(e2, e3) and not fake.happened(e3, e1)
    c = fake.new_stream()
    e4 = fake.new_event()
    e4.record(c)
    assert not fake.happened(e3, e4)
    e3.synchronize()  # the host saw it end: what it issues next starts after
    e5 = fake.new_event()
    e5.record(c)
    assert fake.happened(e3, e5)


def test_an_evaluation_after_a_step_is_fenced_and_training_goes_on_as_in_program_order():
    """An evaluation after a training step is no verified pair with it: it waits for all of that step (every
    queue's last event, the host for its worker tasks) before its first op; the results stay program order's."""
    model, data = hf_model("qwen2"), batches(n_steps=3)
    ref = compile_cpu(copy.deepcopy(model), optim=OPT, **PLANS["device-and-split"])
    fake = FakeCuda()
    sm = _streamed(copy.deepcopy(model), fake, **PLANS["device-and-split"])
    ex = sm.executor
    for k, b in enumerate(data):
        if k == 2:
            trained = ex.order.prev
            assert trained is not None and trained.last and trained.tail is not None
            assert ref.evaluate(*b).loss == sm.evaluate(*b).loss
            assert ex.order.carried is None  # fenced
            _, (begin, _) = min(ex.timer.records(), key=lambda r: r[0].id)
            assert all(fake.happened(e, begin) for e in trained.last.values())
            assert trained.tail.done()
        want, got = ref.train_step(*b), sm.train_step(*b)
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    sm.wait()
    assert all(torch.equal(a, b) for a, b in zip(sm.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("drop_pending_waits", [False, True])
def test_without_clipping_ops_the_worker_issues_keep_their_queue_order(monkeypatch, drop_pending_waits):
    """Without clipping the updates run during the backward: a gradient store into a host buffer an update still
    reads is issued by the worker after that update, and so is the backward op that rewrites the store's gradient
    slot; the ops this thread issues after them that rewrite their slots wait for those issues. Trains exactly as
    program order; with those waits taken out it does not."""
    from megatrain.runtime.issue import step_order

    model, data = hf_model("qwen2"), batches(n_steps=3)
    opt = dataclasses.replace(OPT, max_grad_norm=None)
    plan = dict(n_mb=3, weight_slots=2)
    ref = compile_cpu(copy.deepcopy(model), optim=opt, **plan)
    sm = compile_cpu(copy.deepcopy(model), optim=opt, **plan)
    sm.executor = StreamExecutor(sm.captured, sm.store, sm.optimizer, torch.device("cpu"), sm.compute_dtype,
                                 runner=sm.executor.runner, cuda=FakeCuda())
    sm.overlap_steps = True
    issued_by_worker = []
    real = step_order.StepOrder.worker_issues
    monkeypatch.setattr(step_order.StepOrder, "worker_issues",
                        lambda self, op, fut: (issued_by_worker.append(op), real(self, op, fut))[1])
    if drop_pending_waits:
        from megatrain.runtime.optim.adamw import HostAdamW

        monkeypatch.setattr(step_order.StepOrder, "wait_for_pending", lambda *a, **k: None)
        update = HostAdamW.step_layer  # (the worker's updates made slow: this thread then surely rewrites a slot
        # before the worker has issued the op that reads it, whatever else the machine runs)
        monkeypatch.setattr(HostAdamW, "step_layer", lambda *a, **k: (time.sleep(0.05), update(*a, **k))[1])
    same = True
    try:
        for b in data:
            want, got = ref.train_step(*b), sm.train_step(*b)
            same = same and (got.loss == want.loss)
        sm.wait()
        same = same and all(torch.equal(a, b) for a, b in zip(sm.state_dict().values(), ref.state_dict().values()))
    except Exception:  # an op issued after its slot's content was gone
        same = False
    assert {op.kind for op in issued_by_worker} >= {OpKind.STORE_G, OpKind.BWD}
    assert same != drop_pending_waits


def test_steps_of_two_batch_shapes_in_turn_are_fenced_and_train_as_in_program_order():
    """Batches of two shapes in turn run two plans' schedules, no verified pair between them: each step waits for
    all of the step before (fenced), and the run trains exactly as program order does."""
    model = hf_model("qwen2")
    data = [b for pair in zip(batches(n_steps=2, T=12), batches(n_steps=2, T=8, seed=2)) for b in pair]
    ref = compile_cpu(copy.deepcopy(model), optim=OPT, **PLANS["device-and-split"])
    fake = FakeCuda()
    sm = _streamed(copy.deepcopy(model), fake, **PLANS["device-and-split"])
    ex = sm.executor
    for b in data:
        before = ex.order.prev
        want, got = ref.train_step(*b), sm.train_step(*b)
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
        if before is not None:
            assert ex.order.carried is None  # another shape than the step before: fenced
            _, (begin, _) = min(ex.timer.records(), key=lambda r: r[0].id)
            assert all(fake.happened(e, begin) for e in before.last.values())
    sm.wait()
    assert all(torch.equal(a, b) for a, b in zip(sm.state_dict().values(), ref.state_dict().values()))


def test_host_checkpoints_wait_in_one_steps_buffers_reused_after_their_reloads():
    """Offloaded checkpoints wait in pinned host buffers of their exact size, made in the first step and reused
    after: the host holds one step's checkpoints (what the planner's host accounting, cost.host_floor, charges;
    kept to the end of the step after, as they once were, they were two), and an offload into a buffer waits on
    its stream for the reload that read it last."""
    plan = dict(n_mb=2, weight_slots=2, host_checkpoints=3)
    model, data = hf_model("qwen2"), batches(n_steps=3)
    ref = compile_cpu(copy.deepcopy(model), optim=OPT, **plan)
    fake = FakeCuda()
    sm = _streamed(copy.deepcopy(model), fake, **plan)
    ex = sm.executor
    made, offloads, late = [], [], []
    last_read: dict[int, object] = {}  # buffer -> the event after its last reload
    exact = fake.pinned_exact
    fake.pinned_exact = lambda shape, dtype: made.append(exact(shape, dtype)) or made[-1]
    to_host, to_device = ex.copies.to_host, ex.copies.to_device

    def offload(t):
        host = to_host(t)
        offloads.append(host)
        read = last_read.get(id(host))
        clock = fake.current_stream().clock
        if read is not None and clock.get(read.stream.name, -1) < read.clock[read.stream.name]:
            late.append(id(host))  # this offload's copy could start before the reload before it had read
        return host

    def reload(host):
        t = to_device(host)
        key = (tuple(host.shape), host.dtype)
        buf, read = ex.checkpoint_bufs.free[key][-1]
        assert buf is host
        last_read[id(host)] = read
        return t

    ex.copies.to_host, ex.copies.to_device = offload, reload
    for b in data:
        want, got = ref.train_step(*b), sm.train_step(*b)
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    sm.wait()
    assert all(torch.equal(a, b) for a, b in zip(sm.state_dict().values(), ref.state_dict().values()))
    per_step = plan["n_mb"] * plan["host_checkpoints"]
    assert len(offloads) == per_step * len(data)  # every checkpoint of every step went through the host
    assert len(made) == per_step  # made in the first step, reused in the others
    assert {id(h) for h in offloads} == {id(h) for h in made}
    assert not late


def test_a_marked_steps_timeline_is_its_own_after_the_next_step_ran():
    """OpTimer.mark(): the timeline and host-thread times of one step, read after later steps ran (the throughput
    harness reads its last timed step's after a cool-down step): every op of that step once, timed from that step's
    start, and the next step's timeline apart from it."""
    model, data = hf_model("qwen2"), batches(n_steps=2)
    sm = _streamed(model, FakeCuda(), **PLANS["split"])
    ex = sm.executor
    sm.train_step(*data[0])
    marked, issue = ex.timer.mark(), dict(ex.timer.host_issue_s)
    first = {op.id for op in ex.timer.schedule.ops}
    sm.train_step(*data[1])
    assert ex.timer.host_issue_s is not marked.host_issue_s
    one, two = ex.timeline(marked), ex.timeline()
    assert one.ops[0].step == two.ops[0].step  # each a step's own schedule (one step each)
    assert {op.id for op in one.ops} == first and len(one.ops) == len(first)
    assert marked.timing is not ex.timer.records()  # the first step's records, not the second's
    # timed from the first step's start (from the second's, every op of the first would start before 0; from an
    # earlier origin, its first op would start well into the span: a quarter of it is a margin a loaded 2-core
    # machine keeps, where 5% once failed at 3.5 of 56 ms)
    assert all(0 <= a <= b for a, b in zip(one.start_s, one.end_s))
    assert min(one.start_s) < 0.25 * max(one.end_s)
    assert marked.host_issue_s == issue and sum(issue.values()) > 0


def test_a_drain_while_a_step_is_issued_leaves_it_nothing_of_the_step_before_to_wait_for():
    """A drain after a step's begin (a device buffer replaced before its first op) forgets the step before; the
    current step's carried dependencies on it go too, instead of pointing at a step no longer kept."""
    from megatrain.runtime.issue.step_order import Issued, StepOrder

    prev_s, next_s = object(), object()
    op = dataclasses.make_dataclass("FakeOp", ["id"])(0)
    order = StepOrder(waited=lambda fut: fut.result())
    order.current = Issued(prev_s)
    order.current.futures[7] = Future()
    order.end()
    order.begin(next_s, {(id(prev_s), id(next_s)): (prev_s, next_s, {0: (7,)})}, queues=[])
    assert order.on_prev(op).ids == (7,) and order.on_prev(op).tasks() == [order.prev.futures[7]]
    order.drained()
    assert order.on_prev(op).ids == () and order.on_prev(op).tasks() == []
