"""Schedules (WFBP, single, threshold, MG-WFBP, merge rule, P3) change timing, never weights;
profiling replans identically on every rank; unused branches and shared weights; timeline."""
import json
import os
import tempfile

import pytest
import torch

import hvcomm.torch as hvd
from hvcomm.torch import methods
from hvcomm.torch.methods.schedule import PlannedSchedule

from harness import default_dtype, expect_everywhere
from training import (Net, assert_close, assert_same_everywhere, data, make_opt, shard,
                      train_distributed, train_serial)

PLANNED = [m.name for m in methods.REGISTRY.values() if isinstance(m, PlannedSchedule)]

STEPS = 7  # one skipped, three profiled, replanned before step 4


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


@pytest.mark.parametrize("schedule, with_model, kw", [
    *(pytest.param(schedule, False, {}, id=schedule) for schedule in PLANNED),
    pytest.param("p3", False, dict(slice_elems=37), id="p3-no-model"),
    pytest.param("p3", True, dict(slice_elems=37), id="p3-model-deferred-updates"),
    pytest.param(None, True, dict(fusion_threshold_bytes=1), id="buckets-model-deferred"),
    pytest.param(None, True, dict(fusion_threshold_bytes=200,
                                  compression=hvd.Compression.topk(1.0, scope="bucket")),
                 id="topk-density-1-model-deferred"),
])
def test_matches_serial(schedule, with_model, kw):
    kw = dict(kw)  # the parameter's own dict stays as it is
    if with_model:
        kw["model"] = "model"  # train_distributed passes its own model
    steps = 28 if schedule == "mgwfbp" else STEPS  # 4 to plan, up to 4 x 6 to race plans
    model, opt = train_distributed_with(steps, schedule=schedule, **kw)
    opt.finish_pending()
    assert_same_everywhere(model)
    assert_close(model, train_serial(steps))
    if schedule == "mgwfbp":
        assert opt.plan_origin is not None and opt.plan_origin in opt.trial_report, opt.trial_report
        assert "mgwfbp" in opt.trial_report  # and each distinct baseline plan
        assert all(t > 0 for t in opt.trial_report.values())
        agreed = hvd.allgather_object((opt.plan_origin, opt.trial_report))
        assert agreed == [agreed[0]] * hvd.size()
    if schedule in PLANNED:
        names = [p.schedule for p in opt.schedule_report]
        assert names == PLANNED, names
        assert opt.plan_prediction.schedule == schedule
        best = min(p.iteration_s for p in opt.schedule_report)
        mg = next(p for p in opt.schedule_report if p.schedule == "mgwfbp")
        assert mg.iteration_s <= best + 1e-12
        # the plan is identical everywhere and covers every parameter once
        plan = opt.plan
        assert hvd.allgather_object(plan) == [plan] * hvd.size()
        assert sorted(n for b in plan for n in b) == sorted(n for n, _ in model.named_parameters())
    if schedule == "p3":
        nbytes = sum(p.numel() * 8 for p in model.parameters())
        assert opt.comm_stats.payload_bytes == nbytes, (opt.comm_stats, nbytes)
        slices = sum(-(-p.numel() // kw["slice_elems"]) for p in model.parameters())
        assert opt.comm_stats.messages >= slices


def train_distributed_with(steps, model=None, zero="optimizer", net=None, after_step=None,
                           sched=False, **kw):
    """train_distributed, or with ``model="model"`` the same passing model= (``net``, default
    a Net), the gradients zeroed by ``zero``: "optimizer" (its zero_grad()), "model" (the
    model's, which the optimizer does not see) or "model-to-zeros" (the model's,
    set_to_none=False); ``after_step(opt, s)`` after each step; ``sched``: train_distributed's
    StepLR, stepped after each step."""
    if model != "model":
        return train_distributed(steps, sched=sched, **kw)
    r = hvd.rank()
    net = Net() if net is None else net
    opt = hvd.DistributedOptimizer(make_opt(net), named_parameters=net.named_parameters(),
                                   model=net, **kw)
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if sched else None
    for s in range(steps):
        x, y = data(s, hvd.size())
        if zero == "optimizer":
            opt.zero_grad()
        else:
            net.zero_grad(set_to_none=zero == "model")
        torch.nn.functional.cross_entropy(net(shard(x, r)), shard(y, r)).backward()
        opt.step()
        if lr_sched:
            lr_sched.step()
        if after_step is not None:
            after_step(opt, s)
    return net, opt


@pytest.mark.parametrize("zero", ["model", "model-to-zeros"])
@pytest.mark.parametrize("schedule, kw", [("p3", dict(slice_elems=37)),
                                          (None, dict(fusion_threshold_bytes=1))])
def test_deferred_update_with_model_zero_grad(schedule, kw, zero):
    """The update deferred to the next forward leaves .grad as the user left it: gradients
    zeroed by the model between step() and the forward (not through the optimizer) stay
    zeroed, so the next backward starts from zero, as in the serial loop."""
    model, opt = train_distributed_with(STEPS, model="model", zero=zero, schedule=schedule, **kw)
    opt.finish_pending()
    assert_same_everywhere(model)
    assert_close(model, train_serial(STEPS))


def test_deferred_update_waits_for_the_forward():
    """With model= the buckets go nearest-the-output first, then from the input on; step()
    returns before the update, which each module's forward applies to its own parameters
    (the others stay as they were until theirs); the model's state_dict() applies it all."""
    r = hvd.rank()
    net, reference = Net(), Net()
    opt = hvd.DistributedOptimizer(make_opt(net), named_parameters=net.named_parameters(),
                                   model=net, fusion_threshold_bytes=1)
    assert opt.plan == [["head.bias"], ["fc1.weight"], ["fc1.bias"], ["fc2.weight"],
                        ["fc2.bias"], ["head.weight"]]
    x, y = data(0, hvd.size())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(shard(x, r)), shard(y, r)).backward()
    opt.step()
    assert_close(net, reference, tol=0)  # nothing updated yet
    net.fc1(torch.zeros(1, 10))  # fc1's forward alone
    stepped = train_serial(1)
    assert torch.equal(net.fc2.weight, reference.fc2.weight)
    assert torch.allclose(net.fc1.weight, stepped.fc1.weight, atol=1e-10, rtol=0)
    assert not torch.allclose(net.fc1.weight, reference.fc1.weight, atol=1e-6)
    net.state_dict()
    assert_close(net, stepped)


class Tied(torch.nn.Module):
    """A shared weight (used twice per forward) and a branch some ranks never use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.inp = torch.nn.Linear(10, 12)
        self.mid = torch.nn.Linear(12, 12)
        self.unused = torch.nn.Linear(12, 12)
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x, use_branch):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        h = torch.tanh(self.mid(h))  # shared: mid's hooks fire once, after both uses
        if use_branch:
            h = h + torch.tanh(self.unused(h))
        return self.out(h)


@pytest.mark.parametrize("schedule", [*methods.names("schedule"), "model="])
def test_unused_branch_and_shared_weight(schedule):
    """("model=": the fusion threshold's buckets, one tensor each, updated at the forward.)"""
    r = hvd.rank()
    model = Tied()
    kw = ({"model": model, "slice_elems": 50} if schedule == "p3" else
          {"model": model, "fusion_threshold_bytes": 1} if schedule == "model=" else {})
    schedule = None if schedule == "model=" else schedule
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   schedule=schedule, **kw)
    for s in range(STEPS):
        x, y = data(s, hvd.size())
        opt.zero_grad()
        use = (r == 0 and s % 2 == 0)  # rank 0 uses the branch on even steps only
        torch.nn.functional.cross_entropy(model(shard(x, r), use), shard(y, r)).backward()
        opt.step()
    opt.finish_pending()
    assert_same_everywhere(model)
    assert_close(model, tied_serial(STEPS, hvd.size()))


def tied_serial(steps, size):
    """The reference of the Tied runs: one process, each simulated rank's gradient in turn
    (the branch only where that rank used it), their mean as the gradient."""
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        x, y = data(s, size)
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(size):
            model.zero_grad()
            use = (r == 0 and s % 2 == 0)
            torch.nn.functional.cross_entropy(model(shard(x, r), use), shard(y, r)).backward()
            for t, p in zip(total, model.parameters()):
                if p.grad is not None:
                    t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / size
        opt.step()
    return model


class Attending(torch.nn.Module):
    """nn.MultiheadAttention uses its out_proj's parameters without calling out_proj; the
    input layer's spectral norm computes its weight from weight_orig in a forward pre-hook."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp = torch.nn.utils.spectral_norm(torch.nn.Linear(5, 8))
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x.view(len(x), 2, 5)))
        return self.out(self.attn(h, h, h, need_weights=False)[0].mean(1))


def test_deferred_update_learns_which_forward_uses_a_parameter():
    """A parameter used by its module's parent (out_proj's, by the attention) is updated
    before the parent's forward, and a module's own before its other pre-hooks read it (the
    spectral norm's): the weights follow the serial loop, with no in-place error in the
    backward."""
    serial = Attending()
    ref = make_opt(serial)

    def serial_step(_opt, s):
        x, y = data(s, hvd.size())
        ref.zero_grad()
        torch.nn.functional.cross_entropy(serial(x), y).backward()
        ref.step()
    net, opt = train_distributed_with(STEPS, model="model", net=Attending(),
                                      after_step=serial_step, fusion_threshold_bytes=1)
    opt.finish_pending()
    assert_close(net, serial)


def test_deferred_update_keeps_its_steps_learning_rate():
    """A StepLR stepped after step() changes the learning rate of the next step, not of the
    update still waiting for the forward."""
    net, opt = train_distributed_with(STEPS, model="model", sched=True, fusion_threshold_bytes=1)
    opt.finish_pending()
    assert_close(net, train_serial(STEPS, sched=True))


def test_deferred_update_changes_no_compressed_weight():
    """Top-k at density 0.3 with error feedback: updated at the forward, in forward_first
    order, the weights are those of the same run updated in step()."""
    kw = dict(compression=hvd.Compression.topk(0.3, scope="bucket"), fusion_threshold_bytes=200)
    deferred, opt = train_distributed_with(STEPS, model="model", **kw)
    opt.finish_pending()
    assert_close(deferred, train_distributed(STEPS, **kw)[0], tol=1e-12)


def test_residuals_survive_replanning():
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.topk(0.3, scope="bucket"))
    x, y = data(0, hvd.size())
    torch.nn.functional.cross_entropy(model(shard(x, hvd.rank())), shard(y, hvd.rank())).backward()
    opt.step()
    before = opt.state_dict()["hvcomm"]["residuals_by_param"]
    assert before and any(v.abs().sum() > 0 for v in before.values())
    n = len(list(model.parameters()))
    opt._strategy.set_groups([[i] for i in range(n)])  # one bucket per tensor instead
    assert len(opt.plan) == n
    after = opt.state_dict()["hvcomm"]["residuals_by_param"]
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_mgwfbp_topk_density_1_matches_serial():
    """Merge, then compress per bucket: top-k at density 1 is dense, so weights match."""
    model, opt = train_distributed(STEPS, schedule="mgwfbp",
                                   compression=hvd.Compression.topk(1.0, scope="bucket"))
    assert_close(model, train_serial(STEPS))
    assert opt.plan_prediction is not None


def test_timeline():
    tmp = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = os.path.join(tmp, f"tl{hvd.rank()}", "timeline.json")
    hvd.start_timeline(path)
    train_distributed(3, schedule="wfbp")
    hvd.stop_timeline()
    if hvd.rank() > 0:
        path = path.replace("timeline.json", f"timeline.rank{hvd.rank()}.json")
    with open(path) as f:
        events = json.load(f)
    spans = [e for e in events if e.get("ph") == "X"]
    comm = [e for e in spans if e["tid"] == 2]
    main = {e["name"] for e in spans if e["tid"] == 1}
    assert comm and {"wait", "update", "compress+launch"} <= main, main
    assert all(e["pid"] == hvd.rank() and e["dur"] >= 0 for e in spans)


def test_p3_slices_over_the_ring(monkeypatch):
    """With the ring taking every size, each slice is summed (and scaled) in place by
    hvcomm's ring: the same weights as the serial run, the same on every rank."""
    from collectives import ring
    rings = []
    start_ring = ring.iring_allreduce

    def counted(*args, **kw):
        rings.append(args[1].size)
        return start_ring(*args, **kw)
    monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", "0")
    monkeypatch.setattr(ring, "iring_allreduce", counted)
    model, opt = train_distributed_with(STEPS, schedule="p3", model="model", slice_elems=37)
    opt.finish_pending()
    assert_same_everywhere(model)
    assert_close(model, train_serial(STEPS))
    slices = sum(-(-p.numel() // 37) for p in model.parameters())
    assert len(rings) == (STEPS * slices if hvd.size() > 1 else 0), (len(rings), slices)


def test_p3_priority_slices_overtake():
    """A high-priority gradient that becomes ready while a long low-priority one is being
    sent goes next; the order is identical on every rank; the sums are right. Driven without
    thread timing: a and b are handed over by the engine thread itself, right after c's 5th
    slice, so every rank sees them before its 6th choice."""
    from hvcomm.torch.methods.p3 import P3Round
    from hvcomm.torch.runtime import runtime
    n, r = hvd.size(), hvd.rank()
    grads = [torch.full((k,), float(r + 1), dtype=torch.float64) for k in (40, 30, 4000)]

    class HandOverAfterFive(P3Round):
        def _slice_sent(self, i, s):
            super()._slice_sent(i, s)
            if len(self.sent) == 5:
                self.ready(1, grads[1].clone())
                self.ready(0, grads[0].clone())

    rnd = HandOverAfterFive([40, 30, 4000], ["a", "b", "c"], slice_elems=10)
    handle = runtime().engine.submit(rnd.job)
    rnd.ready(2, grads[2].clone())            # lowest priority, 400 slices
    handle.wait()
    total = n * (n + 1) / 2
    for i in range(3):
        assert torch.equal(rnd.wait(i), torch.full_like(grads[i], total)), i
    order = rnd.sent
    assert hvd.allgather_object(order) == [order] * n
    # the readiness allreduce beside c's 6th slice carries the news that a and b are ready
    # everywhere; then a, b, the rest of c
    assert order == ([(2, s) for s in range(6)] + [(0, s) for s in range(4)]
                     + [(1, s) for s in range(3)] + [(2, s) for s in range(6, 400)]), order[:16]
    assert rnd.messages == 4 + 3 + 400


def test_bad_schedules_raise_on_every_rank():
    odd = hvd.rank() == hvd.size() - 1

    def build(**kw):
        m = Net()
        return hvd.DistributedOptimizer(make_opt(m), named_parameters=m.named_parameters(), **kw)

    expect_everywhere(lambda: build(schedule="fastest" if odd else "wfbp"), "schedule must be")
    expect_everywhere(lambda: build(schedule="p3", compression=hvd.Compression.fp16),
                      "takes no compression")
    expect_everywhere(lambda: build(schedule="mgwfbp", compression=hvd.Compression.topk(0.1)),
                      "scope='bucket'")
    expect_everywhere(lambda: build(schedule="p3", slice_elems=0), "slice_elems")
    expect_everywhere(lambda: build(schedule="wfbp", model=Net()), "schedule='p3' or None")
    expect_everywhere(lambda: build(schedule="p3", model=Net()), "must own every parameter")
    expect_everywhere(lambda: build(model=Net()), "must own every parameter")
    expect_everywhere(lambda: build(model=42), "must be a torch.nn.Module")
    expect_everywhere(lambda: build(model=Net(), delay="od-sgd"), "cannot be combined")

    class Scaled(torch.optim.SGD):  # a subclass may do anything in step()
        pass
    m = Net()
    expect_everywhere(lambda: hvd.DistributedOptimizer(Scaled(m.parameters(), lr=0.1), model=m),
                      "per-parameter optimizers")


def test_p3_a_collective_that_would_hang_raises():
    """Between backward and step() a P3 round is open: a blocking collective would wait
    behind it forever (unused parameters are handed over only by step()); it raises."""
    model = Tied()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), schedule="p3")
    x, y = data(0, hvd.size())
    torch.nn.functional.cross_entropy(model(shard(x, hvd.rank()), False),
                                      shard(y, hvd.rank())).backward()
    expect_everywhere(lambda: hvd.allreduce(torch.ones(1)), "round is open")
    expect_everywhere(lambda: hvd.broadcast_object(1), "round is open")
    opt.step()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
