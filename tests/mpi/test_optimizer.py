"""DistributedOptimizer: equivalence with one process on the whole batch, accumulation,
LR schedulers, checkpoints, unused parameters, subclassing, and errors raised on every rank."""
import copy

import pytest
import torch

import hvcomm.torch as hvd
from collectives import HvcommError

from harness import default_dtype, expect_everywhere
from training import (BATCH, Net, assert_close, assert_same_everywhere, data, loss_fn,
                      make_opt, shard, train_distributed, train_serial, train_steps)


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="default-buckets"),
    pytest.param(dict(fusion_threshold_bytes=0), id="bucket-per-tensor"),
    pytest.param(dict(groups=2), id="explicit-groups"),
])
def test_matches_serial(kw):
    model, opt = train_distributed(5, **kw)
    assert_same_everywhere(model)
    assert_close(model, train_serial(5))
    assert isinstance(opt, torch.optim.SGD)
    n = hvd.size()
    nbytes = sum(p.numel() * 8 for p in model.parameters())
    assert opt.comm_stats.payload_bytes == nbytes, (opt.comm_stats, nbytes)
    assert abs(opt.comm_stats.sent_bytes - 2 * (n - 1) / n * nbytes) < 1e-6


def test_backward_passes_per_step_2_and_steplr():
    model, _ = train_distributed(4, passes=2)
    assert_close(model, train_serial(4))
    model, opt = train_distributed(5, sched=True)
    assert_close(model, train_serial(5, sched=True))
    assert opt.param_groups[0]["lr"] == 0.1 * 0.25


@pytest.mark.parametrize("ring_from", ["0", "default"], ids=["ring", "open-mpi"])
def test_dense_gradients_are_views_of_their_averaged_bucket(ring_from, monkeypatch):
    """Compression.none: after step() each gradient holds the average of what the ranks had
    (a plain loop over every rank's gradients) and is a view of its bucket's averaged sum,
    not a copy (the parameters of one bucket share one tensor); a backward without zero_grad()
    accumulates into those views, and the next step averages that."""
    if ring_from != "default":
        monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", ring_from)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    r, n = hvd.rank(), hvd.size()
    for s in range(2):  # step 1's backward adds to step 0's averages (no zero_grad)
        x, y = data(s, n)
        loss_fn(model, shard(x, r), shard(y, r)).backward()
        if s == 1:  # accumulated in place: still the bucket's storage
            assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
        gathered = hvd.allgather_object([p.grad.clone() for p in model.parameters()])
        opt.step()
        assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
        for j, p in enumerate(model.parameters()):
            want = sum(ranks[j] for ranks in gathered) / n
            assert torch.allclose(p.grad, want, atol=1e-12, rtol=0), (s, j)


def test_checkpoint_resume():
    full, _ = train_distributed(4)
    model, opt = train_distributed(2)
    state = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    model2 = Net()
    model2.load_state_dict(weights)
    opt2 = hvd.DistributedOptimizer(make_opt(model2), named_parameters=model2.named_parameters())
    opt2.load_state_dict(state)
    train_steps(model2, opt2, range(2, 4))
    assert_close(model2, full, tol=0)


def test_broadcast_optimizer_state():
    r = hvd.rank()
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters())
    if r == 0:  # only rank 0 has momentum buffers and a different lr
        opt.param_groups[0]["lr"] = 0.05
        for p in model.parameters():
            opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
    stats_before = opt.comm_stats
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.05
    for p in model.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, 0.5))
    assert opt.comm_stats is stats_before and not opt._hooks_fired
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert_same_everywhere(model)


def test_unused_branch_on_some_ranks():
    """The extra layer runs only on odd ranks: no hang; its gradient averages with zeros."""
    r, n = hvd.rank(), hvd.size()
    model = Net(branch=True)
    ref = Net(branch=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   fusion_threshold_bytes=1)  # one bucket per tensor
    for s in range(3):
        x, y = data(s, n)
        opt.zero_grad()
        loss_fn(model, shard(x, r), shard(y, r), use_extra=r % 2 == 1).backward()
        opt.step()
        # reference: every rank's gradient (zeros where unused), averaged by hand
        grads = []
        for q in range(n):
            ref.zero_grad()
            loss_fn(ref, shard(x, q), shard(y, q), use_extra=q % 2 == 1).backward()
            grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                          for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / n
    assert_same_everywhere(model)
    assert_close(model, ref)
    moved = not torch.equal(model.extra.weight, Net(branch=True).extra.weight)
    assert moved == (n > 1), "the branch used on odd ranks must train (and only then)"


def test_subclass_and_guards():
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters())

    class Counting(type(opt)):
        steps = 0

        def step(self, closure=None):
            type(self).steps += 1
            return super().step(closure)

    opt.__class__ = Counting
    x, y = data(0, hvd.size())
    opt.zero_grad()
    loss_fn(model, x[:BATCH], y[:BATCH]).backward()
    try:
        opt.zero_grad()
    except HvcommError as e:
        assert "before optimizer.step()" in str(e)
    else:
        raise AssertionError("zero_grad during a pending iteration must raise")
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    assert Counting.steps == 1 and isinstance(opt, torch.optim.SGD)
    opt.zero_grad()
    loss_fn(model, x[:BATCH], y[:BATCH]).backward()
    try:
        loss_fn(model, x[:BATCH], y[:BATCH]).backward()
    except HvcommError as e:
        assert "more than backward_passes_per_step" in str(e)
    else:
        raise AssertionError("a second backward with backward_passes_per_step=1 must raise")
    opt.synchronize()


def test_bad_input_raises_on_every_rank():
    r, n = hvd.rank(), hvd.size()
    odd = r == n - 1  # the last rank alone is wrong: the others must not hang

    def build(named=None, passes=1, model=None):
        model = model or Net()
        named = model.named_parameters() if named is None else named
        return hvd.DistributedOptimizer(make_opt(model), named_parameters=named,
                                        backward_passes_per_step=passes)

    m = Net()
    expect_everywhere(lambda: build(named=list(m.parameters()) if odd else None, model=m),
                      "tuples (name, parameter)")
    expect_everywhere(lambda: build(named=[("w", p) for p in m.parameters()] if odd else None,
                                    model=m), "must be unique")
    expect_everywhere(lambda: build(named=list(m.named_parameters())[1:] if odd else None,
                                    model=m), "not named")
    expect_everywhere(lambda: build(passes=0 if odd else 1), "backward_passes_per_step")
    expect_everywhere(lambda: hvd.DistributedOptimizer(
        make_opt(m), named_parameters=m.named_parameters(), op=hvd.Max), "op must be")
    if n > 1:
        wide = Net(width=17) if odd else Net()
        expect_everywhere(lambda: build(model=wide), "ranks hold different models")
        renamed = [(("x." if odd else "") + k, p) for k, p in m.named_parameters()]
        expect_everywhere(lambda: build(named=renamed, model=m), "ranks hold different models")
        # options that change the buckets: one rank bucketing otherwise would pair other
        # tensors in each sum
        expect_everywhere(lambda: hvd.DistributedOptimizer(
            make_opt(m), named_parameters=m.named_parameters(),
            fusion_threshold_bytes=64 if odd else None), "('option', 'fusion_threshold_bytes'")
        params = list(m.parameters())
        expect_everywhere(lambda: hvd.DistributedOptimizer(
            make_opt(m), named_parameters=m.named_parameters(),
            groups=[params[:1], params[1:]] if odd else [params[:2], params[2:]]), "or options")
        expect_everywhere(lambda: hvd.DistributedOptimizer(
            make_opt(m), named_parameters=m.named_parameters(), groups=2 if odd else 3),
            "or options")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # still usable afterwards



def test_the_options_are_the_signatures_keywords_and_all_but_two_are_agreed():
    """DistributedOptimizer builds its Options from its parameters of the same names, so the
    two must list the same names; every field but the parameters and the process set is in
    the key the ranks compare, and changing one changes the key."""
    import dataclasses
    import inspect
    from hvcomm.torch.options import Options
    fields = [f.name for f in dataclasses.fields(Options)]
    assert list(inspect.signature(hvd.DistributedOptimizer).parameters) == ["optimizer", *fields]
    m = Net()
    params = list(m.parameters())
    base = Options(named_parameters=list(m.named_parameters()),
                   compression=hvd.Compression.none, backward_passes_per_step=1,
                   op=hvd.Average, gradient_predivide_factor=1.0, groups=None,
                   sparse_as_dense=False, process_set=None, fusion_threshold_bytes=1024,
                   schedule=None, profile_steps=3, slice_elems=50_000, model=None,
                   trial_steps=5, delay=None)
    other = dict(named_parameters=list(m.named_parameters())[::-1],
                 compression=hvd.Compression.fp16, backward_passes_per_step=2, op=hvd.Sum,
                 gradient_predivide_factor=2.0, groups=[params[:1], params[1:]],
                 sparse_as_dense=True, process_set=hvd.global_process_set,
                 fusion_threshold_bytes=64, schedule="wfbp", profile_steps=4, slice_elems=10,
                 model=m, trial_steps=6, delay="od-sgd")
    assert sorted(other) == sorted(fields)
    name_of = {p: n for n, p in m.named_parameters()}
    key = base.agreement_key(name_of)
    not_agreed = ("named_parameters", "process_set")  # the parameter and process set objects
    assert [entry[1] for entry in key] == [f for f in fields if f not in not_agreed]
    for field, value in other.items():
        changed = dataclasses.replace(base, **{field: value}).agreement_key(name_of)
        assert (changed == key) == (field in not_agreed), field


# torch.optim's optimizers that update each parameter on its own, as this file builds them;
# fusion_threshold_bytes=0 gives Net's six tensors a bucket each
OPTIMIZERS = {
    torch.optim.SGD: dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    torch.optim.Adam: dict(lr=0.01),
    torch.optim.AdamW: dict(lr=0.01, amsgrad=True),
    torch.optim.Adamax: dict(lr=0.01),
    torch.optim.NAdam: dict(lr=0.01),
    torch.optim.RAdam: dict(lr=0.01),
    torch.optim.Adagrad: dict(lr=0.05),
    torch.optim.Adadelta: dict(lr=0.5),
    torch.optim.RMSprop: dict(lr=0.01, momentum=0.5),
    torch.optim.Rprop: dict(lr=0.01),
    torch.optim.ASGD: dict(lr=0.05, t0=2),
}
STEPS = 4


def two_groups(cls, model):
    """``cls`` over two parameter groups (the head's learning rate halved)."""
    kw = OPTIMIZERS[cls]
    head = set(model.head.parameters())
    return cls([{"params": [p for p in model.parameters() if p not in head]},
                {"params": list(model.head.parameters()), "lr": kw["lr"] / 2}], **kw)


def update_spans(train) -> int:
    """Run ``train()`` under a timeline; the "update" spans this rank recorded."""
    import json
    import os
    import tempfile
    from hvcomm.torch.timeline import rank_path
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    hvd.start_timeline(path)
    try:
        train()
    finally:
        hvd.stop_timeline()
    with open(rank_path(path, hvd.rank())) as f:
        return sum(1 for e in json.load(f) if e.get("ph") == "X" and e["name"] == "update")


def trained(make, steps=STEPS, **kw):
    """Net trained ``steps`` steps by a DistributedOptimizer around ``make(model)``, a bucket
    per tensor; (the model, the "update" spans)."""
    model = Net()
    opt = hvd.DistributedOptimizer(make(model), named_parameters=model.named_parameters(),
                                   fusion_threshold_bytes=0, **kw)
    spans = update_spans(lambda: train_steps(model, opt, range(steps)))
    return model, spans


def test_the_optimizers_here_are_the_ones_updated_in_parts():
    from hvcomm.torch.methods.strategy import PER_PARAMETER
    assert set(OPTIMIZERS) == set(PER_PARAMETER)


@pytest.mark.parametrize("cls", list(OPTIMIZERS), ids=lambda c: c.__name__)
def test_each_bucket_is_updated_as_soon_as_it_is_averaged(cls):
    """A torch.optim optimizer that updates each parameter on its own is stepped bucket by
    bucket, each as soon as it is averaged (an "update" span per bucket and step), to the
    weights of one process on the whole batch, and bit for bit to those of the same
    optimizer updated whole: a subclass, whose step() hvcomm cannot see into."""
    model, spans = trained(lambda m: two_groups(cls, m))
    assert spans == STEPS * len(list(model.parameters())), spans
    serial = Net()
    opt = two_groups(cls, serial)
    for s in range(STEPS):
        x, y = data(s, hvd.size())
        opt.zero_grad()
        loss_fn(serial, x, y).backward()
        opt.step()
    assert_close(model, serial)

    def subclassed(m):
        o = two_groups(cls, m)
        o.__class__ = type("Subclass", (cls,), {})
        return o
    whole, spans = trained(subclassed)
    assert spans == STEPS, spans
    for (n, p), q in zip(model.named_parameters(), whole.parameters()):
        assert torch.equal(p, q), n


def test_what_is_not_averaged_hooks_and_closures_update_whole():
    """Stepped a bucket at a time, a parameter the optimizer holds but does not average (one
    frozen when it was wrapped, or added since) would never be updated; a step hook would run
    once per bucket; a closure's loss is the whole step's. Each keeps the update whole (one
    "update" span a step), and the parameter added later is updated."""
    def with_hook(m):
        opt = two_groups(torch.optim.Adam, m)
        opt.register_step_pre_hook(lambda *a: None)
        return opt
    _, spans = trained(with_hook)
    assert spans == STEPS, spans

    model = Net()
    model.head.bias.requires_grad_(False)
    opt = hvd.DistributedOptimizer(two_groups(torch.optim.SGD, model),
                                   named_parameters=model.named_parameters(),
                                   fusion_threshold_bytes=0)
    model.head.bias.requires_grad_(True)  # unfrozen after wrapping: held, not averaged
    spans = update_spans(lambda: train_steps(model, opt, range(2)))
    assert spans == 2 and not torch.equal(model.head.bias, Net().head.bias), spans

    model = Net()
    extra = torch.nn.Parameter(torch.ones(3))
    opt = hvd.DistributedOptimizer(two_groups(torch.optim.SGD, model),
                                   named_parameters=model.named_parameters(),
                                   fusion_threshold_bytes=0)
    opt.add_param_group({"params": [extra]})
    x, y = data(0, hvd.size())
    x, y = shard(x, hvd.rank()), shard(y, hvd.rank())
    opt.zero_grad()
    (loss_fn(model, x, y) + extra.sum()).backward()
    spans = update_spans(opt.step)
    assert spans == 1 and (extra.detach() < 1).all(), (spans, extra)

    model = Net()
    opt = hvd.DistributedOptimizer(two_groups(torch.optim.Adam, model),
                                   named_parameters=model.named_parameters(),
                                   fusion_threshold_bytes=0)

    def closure():
        return loss_fn(model, x, y)
    loss_fn(model, x, y).backward()
    spans = update_spans(lambda: opt.step(closure))
    assert spans == 1, spans
