"""Compressors inside the optimizer: every compressor's choice, sum and residual over several
steps against the independent serial reference of references.py (exactly), exactness at
density 1, residual conservation, the result equal to the sum of what every rank had applied,
checkpoint resume, bad input."""
import copy
from fractions import Fraction

import pytest
import torch

import hvcomm
import hvcomm.torch as hvd
from hvcomm.torch.methods.buckets import Bucket
from hvcomm.torch.methods.gtopk import GTopKCompressor
from hvcomm.torch.methods.memory import ErrorFeedback
from hvcomm.torch.methods.reducer import Reducer
from hvcomm.torch.runtime import runtime

import references as ref
from harness import assert_none_anywhere, default_dtype, expect_everywhere, with_grads
from training import (QUADRATIC_SGD, Net, assert_close, assert_same_everywhere,
                      build_quadratic, make_opt, mismatches, train_distributed, train_steps)

C = hvcomm.Compression
SPARSE = [lambda d: C.topk(d), lambda d: C.gtopk(d), lambda d: C.gtopk(d, scope="model"),
          lambda d: C.topk(d, selector="exact", scope="bucket")]


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


def test_density_1_equals_dense():
    dense, _ = train_distributed(4)
    for make in SPARSE:
        model, opt = train_distributed(4, compression=make(1.0))
        assert_same_everywhere(model)
        assert_close(model, dense, tol=1e-12)


# hvcomm's compressor and the reference's description of it, given the number of ranks P
# (2-bit's threshold is a multiple of P so that the average of its codes is exact)
REFERENCED = {
    "topk-layer-exact": lambda P: (C.topk(0.25, selector="exact"), ref.TopK(0.25)),
    "topk-model": lambda P: (C.topk(0.25, scope="model"), ref.TopK(0.25, scope="model")),
    "topk-dgc-warmup": lambda P: (C.topk(0.1, warmup_steps=4), ref.TopK(0.1, warmup_steps=4)),
    "gtopk-layer": lambda P: (C.gtopk(0.1), ref.TopK(0.1, tree=True)),
    "gtopk-model": lambda P: (C.gtopk(0.25, scope="model"),
                              ref.TopK(0.25, scope="model", tree=True)),
    "randomk-unbiased": lambda P: (C.randomk(0.25, seed=3), ref.RandomK(0.25, seed=3)),
    "randomk-error_feedback": lambda P: (C.randomk(0.25, seed=3, variant="error_feedback"),
                                         ref.RandomK(0.25, seed=3, variant="error_feedback")),
    "twobit": lambda P: (C.twobit(2.0 * P), ref.TwoBit(Fraction(2 * P))),
}
SHAPES = {"a": (4, 5), "b": (8,)}


@pytest.mark.parametrize("name", list(REFERENCED))
def test_matches_the_serial_reference(name, steps=6):
    """Six steps of SGD (momentum, weight decay) on integer-valued gradients: each step's
    weights and this rank's residuals equal the reference's exactly (ties in |value|
    abound, so the tie rule is checked too)."""
    P, r = hvd.size(), hvd.rank()
    comp, spec = REFERENCED[name](P)
    sim = ref.Simulation(P, SHAPES, ref.SGD(*map(Fraction, QUADRATIC_SGD)), spec)
    model, opt = build_quadratic(SHAPES, compression=comp)
    problems = []
    for s in range(steps):
        opt.zero_grad()
        model.loss(r, s, P).backward()
        opt.step()
        want = sim.step()
        residuals = opt.state_dict()["hvcomm"]["residuals_by_param"]
        for n, p in model.named_parameters():
            problems += mismatches(f"step {s} weights {n}", p, want.local[r][n])
            if n in want.residuals[r]:
                problems += mismatches(f"step {s} residual {n}",
                                       residuals.get(n, torch.zeros(0)), want.residuals[r][n])
            elif n in residuals:
                problems.append(f"step {s}: a residual for {n}, the reference keeps none")
    assert_none_anywhere(problems)


class Halved(hvd.Compressor):
    """Horovod's interface alone, on a subclass of hvd.Compressor: sends half the gradient
    and doubles the sum back (exact in binary floating point)."""

    @staticmethod
    def compress(tensor, *args):
        return tensor / 2, "halved"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "halved", ctx
        return tensor * 2


def test_horovod_interface_compressor_is_carried_by_a_dense_allreduce():
    dense, _ = train_distributed(4)
    model, opt = train_distributed(4, compression=Halved())
    assert_same_everywhere(model)
    assert_close(model, dense, tol=0)
    assert opt.comm_stats.payload_bytes == sum(p.numel() * 8 for p in model.parameters())


def own_applied(comp, acc, data, payload, result):
    """What this rank's payload (``data``: what it sent) put into the global result, as a
    dense vector."""
    n = acc.numel()
    mine = torch.zeros(n, dtype=acc.dtype)
    if isinstance(data, tuple):  # sparse pairs: Top-k AllGather, gTop-k
        idx, val = torch.from_numpy(data[0].astype("int64")), torch.from_numpy(data[1])
        if isinstance(comp, GTopKCompressor):
            keep = torch.from_numpy(result.reached)
            idx, val = idx[keep], val[keep]
        mine[idx] = val
    elif payload.indices is not None:  # random-k: values at indices every rank chose alike
        mine[payload.indices] = data
    else:
        mine = data.to(acc.dtype) * comp.threshold
    return mine


@pytest.mark.parametrize("comp", [
    pytest.param(C.topk(0.05), id="topk-0.05"),
    pytest.param(C.gtopk(0.05), id="gtopk-0.05"),
    pytest.param(C.gtopk(0.01, selector="exact"), id="gtopk-0.01-exact"),
    pytest.param(C.randomk(0.1, variant="error_feedback"), id="randomk-0.1-error_feedback"),
    pytest.param(C.twobit(0.5), id="twobit-0.5"),
    pytest.param(C.topk(0.3, warmup_steps=2), id="topk-0.3-warmup_steps=2"),
])
def test_conservation(comp, steps=4):
    """acc == residual + applied on every rank, and the reduced result == sum of applied.
    Every rank runs every collective first and asserts last, so a failure cannot leave the
    ranks in different collectives."""
    r = hvd.rank()
    memory = ErrorFeedback()
    red = Reducer(runtime().engine, comp, memory)
    bucket = Bucket([0], ["b"], [997])
    problems = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + r)
        flat = torch.randn(997, generator=g)
        acc_before = flat + memory.state_dict().get("b", torch.zeros(997))
        job = red.start(bucket, with_grads(flat.clone()), step)
        if torch.is_tensor(job.payload.data):  # summed in place by now: compress again
            own, _ = comp.compress(acc_before.clone(), step, "b")  # (deterministic)
        else:
            own = job.payload.data
        dense, sent, _ = red.finish(job)
        result = job.handle.wait()[0]
        applied = own_applied(comp, acc_before, own, job.payload, result)
        total = hvd.allreduce(applied, op=hvd.Sum)
        gap = (memory.state_dict()["b"] + applied - acc_before).abs().max().item()
        if gap > 1e-12:
            problems.append(f"step {step}: residual + applied != accumulated (max gap {gap:.3g})")
        gap = (dense - total).abs().max().item()
        if gap > 1e-10:
            problems.append(f"step {step}: result != sum of applied (max gap {gap:.3g})")
        if comp.collective in ("allgather", "gtopk"):
            most = comp.k_for(997, step) * (hvd.size() if comp.collective == "allgather" else 1)
            if (dense != 0).sum() > most:
                problems.append(f"step {step}: {(dense != 0).sum()} nonzeros, more than {most}")
    assert not problems, "; ".join(problems)


def test_randomk_unbiased():
    """The unbiased random-k sends n/k times the gradient at k common indices and keeps no
    residual; averaged over many steps its output is the gradient."""
    comp, n = C.randomk(0.1), 997
    k = int(0.1 * n)
    memory = ErrorFeedback()
    red = Reducer(runtime().engine, comp, memory)
    bucket = Bucket([0], ["b"], [n])
    for step in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + hvd.rank()))
        job = red.start(bucket, with_grads(g.clone()), step)
        dense, _, _ = red.finish(job)
        idx = job.payload.indices
        want = torch.zeros(n)
        want[idx] = hvd.allreduce(g, op=hvd.Sum)[idx] * (n / k)
        assert torch.allclose(dense, want, rtol=1e-12, atol=1e-12), step
        assert memory.state_dict() == {}, "the unbiased variant keeps no residual"
    g = torch.randn(n, generator=torch.Generator().manual_seed(7))
    mean = sum(comp.decompress(*comp.compress(g, step, "b")) for step in range(4000)) / 4000
    # each coordinate is the mean of ~400 draws of n/k*g (variance (n/k - 1) g^2): 6 sigma
    assert ((mean - g).abs() <= 6 * g.abs() * ((n / k - 1) / (4000 * k / n)) ** 0.5 + 1e-12).all()


def test_checkpoint_resume():
    """Each rank saves its own state (residuals differ) mid-run; resuming gives the same."""
    comp = C.gtopk(0.05, warmup_steps=2)
    full, _ = train_distributed(5, compression=comp)
    model, opt = train_distributed(2, compression=comp)
    state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    assert state["hvcomm"]["step"] == 2 and state["hvcomm"]["residuals_by_param"]
    model2 = Net()
    model2.load_state_dict(weights)
    opt2 = hvd.DistributedOptimizer(make_opt(model2), named_parameters=model2.named_parameters(),
                                    compression=comp)
    opt2.load_state_dict(state)
    train_steps(model2, opt2, range(2, 5))
    assert_close(model2, full, tol=0)
    # broadcast_optimizer_state leaves every rank's own residuals alone
    before = opt2.state_dict()["hvcomm"]["residuals_by_param"]
    assert before
    hvd.broadcast_optimizer_state(opt2, root_rank=0)
    after = opt2.state_dict()["hvcomm"]["residuals_by_param"]
    assert sorted(after) == sorted(before)
    for k, v in after.items():
        assert torch.equal(v, before[k])


def test_warm_up_schedule():
    comp = C.topk(0.001, warmup_steps=8)
    assert [comp.density_at(s) for s in range(10)] == [0.25, 0.25, 0.0625, 0.0625, 0.015625,
                                                        0.015625, 0.004, 0.004, 0.001, 0.001]


def test_bad_input():
    for bad in (0, 1.5, -0.1, "0.1"):
        expect_everywhere(lambda: C.gtopk(bad), "density must be in (0, 1]")
    expect_everywhere(lambda: C.twobit(threshold=0), "threshold must be > 0")
    expect_everywhere(lambda: C.topk(0.1, selector="fast"), "selector must be")
    half = torch.nn.Linear(4, 4).to(torch.float16)
    expect_everywhere(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(half.parameters(), lr=0.1), named_parameters=half.named_parameters(),
        compression=C.topk(0.1)), "needs float32 or float64")
    if hvd.size() > 1:  # ranks asking for different compression are caught
        m = Net()
        comp = C.topk(0.1 if hvd.rank() else 0.2)
        expect_everywhere(lambda: hvd.DistributedOptimizer(
            make_opt(m), named_parameters=m.named_parameters(), compression=comp),
            "ranks hold different models")
