"""PowerSGD (hvcomm/torch/methods/powersgd.py) against a serial reference written here: plain
NumPy loops over the simulated ranks, Gram-Schmidt for the orthogonalisation (the method uses
QR), the paper's error feedback and warm-started Q; one step and several, in the optimizer and
in the delayed order (the next step encoded before this one is collected), with a gradient that
is zero for a while; the bytes of each step; the checkpoint; bad input."""
import copy
import math
import zlib

import numpy as np
import pytest
import torch

import hvcomm.torch as hvd
from hvcomm.torch.methods.buckets import Bucket
from hvcomm.torch.methods.memory import ErrorFeedback
from hvcomm.torch.methods.reducer import Reducer
from hvcomm.torch.runtime import runtime

from harness import default_dtype, expect_everywhere, with_grads

RANK = 2
# w1, conv: rank-2 factors; b1: a vector; small: 2*(2+2) >= 4, sent dense; late: zero at first
SHAPES = {"w1": (8, 6), "conv": (4, 3, 2), "b1": (8,), "small": (2, 2), "late": (5, 4)}
LATE = 2  # steps in which "late" has a zero gradient
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-3)}


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


class Params(torch.nn.Module):
    def __init__(self, dtype=torch.float64):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))


def gradient(rank, step, name):
    """Integer-valued gradients, different on every rank and step ("late": zero at first)."""
    if name == "late" and step < LATE:
        return np.zeros(SHAPES[name])
    rng = np.random.default_rng([rank, step, zlib.crc32(name.encode())])
    return rng.integers(-9, 10, size=SHAPES[name]).astype(np.float64)


def factors(shape):
    """(n, m, r) of a shape sent as rank-r factors, or None where it is sent dense."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = math.prod(shape) // n
    r = min(RANK, n, m)
    return (n, m, r) if r * (n + m) < n * m else None


def first_q(name, m, r, seed=0):
    """The documented draw of Q (the module's docstring)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn((m, r), generator=gen, dtype=torch.float64).numpy()


def gram_schmidt(p):
    q = np.zeros_like(p)
    for c in range(p.shape[1]):
        v = p[:, c].copy()
        for d in range(c):
            v -= (q[:, d] @ p[:, c]) * q[:, d]
        q[:, c] = v / np.linalg.norm(v)
    return q


def serial_reference(size, steps, lag=0):
    """Each step's average over ``size`` ranks, and each rank's residual at the end, by name.
    ``lag=1``: step t is encoded (its M and Q fixed, the residual taken) before step t-1 is
    settled (its error added back, its Q kept), as under delay=."""
    q = {n: first_q(n, *factors(s)[1:]) for n, s in SHAPES.items() if factors(s)}
    error = {(r, n): np.zeros(s) for r in range(size) for n, s in SHAPES.items()}
    averages, pending = [], []

    def settle(step, ms, qs):
        average = {}
        for name, shape in SHAPES.items():
            f = factors(shape)
            if f is None:
                average[name] = sum(ms[r][name] for r in range(size)) / size
                continue
            n, m, r_ = f
            mats = [ms[r][name].reshape(n, m) for r in range(size)]
            p = sum(mat @ qs[name] for mat in mats)
            p_hat = gram_schmidt(p) if p.any() else np.zeros_like(p)
            q_sum = sum(mat.T @ p_hat for mat in mats)
            approx = p_hat @ q_sum.T / size
            average[name] = approx.reshape(shape)
            for r in range(size):
                error[r, name] += (mats[r] - approx).reshape(shape)
            zero = (np.linalg.norm(q_sum, axis=0) == 0).any()
            q[name] = first_q(name, m, r_) if zero else q_sum
        averages.append((step, average))

    for step in range(steps):
        ms = [{n: gradient(r, step, n) + error[r, n] for n in SHAPES} for r in range(size)]
        for key in error:
            error[key] = np.zeros_like(error[key])
        pending.append((step, ms, dict(q)))
        while len(pending) > lag:
            settle(*pending.pop(0))
    while pending:
        settle(*pending.pop(0))
    return [a for _, a in sorted(averages, key=lambda x: x[0])], error


def backward(model, step):
    loss = sum((p * torch.from_numpy(gradient(hvd.rank(), step, name)).to(p.dtype)).sum()
               for name, p in model.named_parameters())
    loss.backward()


def build(dtype=torch.float64, **kw):
    model = Params(dtype)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=RANK), **kw)
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("grouping", ["one bucket", "one per parameter"])
def test_matches_the_serial_reference_over_steps(grouping, dtype):
    model = Params(dtype)
    groups = [[p] for p in model.parameters()] if grouping == "one per parameter" else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=groups,
                                   compression=hvd.Compression.powersgd(rank=RANK))
    steps = 5
    want, error = serial_reference(hvd.size(), steps)
    for step in range(steps):
        opt.zero_grad()
        backward(model, step)
        opt.synchronize()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.double().numpy(), want[step][name], **TOL[dtype],
                                       err_msg=f"step {step}, {name}")
        with opt.skip_synchronize():
            opt.step()
    residuals = opt.state_dict()["hvcomm"]["residuals_by_param"]
    for name in SHAPES:
        np.testing.assert_allclose(residuals[name].double().reshape(SHAPES[name]).numpy(),
                                   error[hvd.rank(), name], **TOL[dtype], err_msg=name)


def test_delayed_order_sends_each_gradient_once():
    """The next step encoded before this one is collected (as delay= runs the buckets)."""
    size, steps = hvd.size(), 5
    want, error = serial_reference(size, steps, lag=1)
    names = list(SHAPES)
    memory = ErrorFeedback()
    red = Reducer(runtime().engine, hvd.Compression.powersgd(rank=RANK), memory)
    bucket = Bucket(list(range(len(names))), names, [math.prod(SHAPES[n]) for n in names],
                    [SHAPES[n] for n in names])
    got, job = [], None
    for step in range(steps + 1):
        nxt = None
        if step < steps:
            nxt = red.start(bucket, with_grads(*[torch.from_numpy(gradient(hvd.rank(), step, n))
                                                 for n in names]), step)
        if job is not None:
            got.append(red.finish(job)[0] / size)
        job = nxt
    for step, flat in enumerate(got):
        for (name, shape), part in zip(SHAPES.items(), torch.split(flat, bucket.numels)):
            np.testing.assert_allclose(part.reshape(shape).numpy(), want[step][name],
                                       rtol=1e-9, atol=1e-9, err_msg=f"step {step}, {name}")
    for name in names:
        np.testing.assert_allclose(memory.state_dict()[name].reshape(SHAPES[name]).numpy(),
                                   error[hvd.rank(), name], rtol=1e-9, atol=1e-9, err_msg=name)


def test_bytes_per_step():
    model, opt = build()
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    first = second = 0
    for shape in SHAPES.values():
        f = factors(shape)
        first += f[0] * f[2] if f else math.prod(shape)
        second += f[1] * f[2] if f else 0
    stats = opt.comm_stats
    assert stats.payload_bytes == 8 * (first + second), stats
    size = hvd.size()
    assert stats.sent_bytes == pytest.approx(2 * (size - 1) / size * 8 * (first + second)), stats


def test_checkpoint_resumes_exactly():
    """Q (warm start) and the residuals are in the checkpoint: the resumed run equals the
    uninterrupted one bitwise."""
    model, opt = build()
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["hvcomm"]["compressor"]["q"], "Q is in the checkpoint"
    for step in range(3, 6):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    resumed, opt2 = build()
    resumed.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for step in range(3, 6):
        opt2.zero_grad()
        backward(resumed, step)
        opt2.step()
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_optimizers_do_not_share_q():
    """One Compression.powersgd(...) object given to two optimizers: each keeps its own Q."""
    comp = hvd.Compression.powersgd(rank=RANK)
    models = [Params(), Params()]
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters(), compression=comp)
            for m in models]
    for step, (model, opt) in enumerate(zip(models, opts)):  # different gradients each
        opt.zero_grad()
        backward(model, step + 3)
        opt.step()
    q0, q1 = (o.state_dict()["hvcomm"]["compressor"]["q"] for o in opts)
    assert not torch.equal(q0["w1"], q1["w1"])
    assert comp.state_dict()["q"] == {}, "the object passed in keeps no state"


def test_bad_input():
    expect_everywhere(lambda: hvd.Compression.powersgd(rank=0), "rank must be a positive")
    expect_everywhere(lambda: hvd.Compression.powersgd(rank=True), "rank must be a positive")
    expect_everywhere(lambda: hvd.Compression.powersgd(seed=2 ** 60), "seed must be an integer")
    half = torch.nn.Linear(4, 4).half()
    expect_everywhere(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(half.parameters(), lr=0.1), named_parameters=half.named_parameters(),
        compression=hvd.Compression.powersgd()), "needs float32 or float64")
    expect_everywhere(lambda: hvd.Compression.powersgd().compress(torch.ones(4, 4)),
                      "needs its own collective")
    model, opt = build()
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    state = opt.state_dict()
    other_model = Params()
    other_rank = hvd.DistributedOptimizer(
        torch.optim.SGD(other_model.parameters(), lr=0.1),
        named_parameters=other_model.named_parameters(), compression=hvd.Compression.powersgd(3))
    expect_everywhere(lambda: other_rank.load_state_dict(state), "of rank 2")
    dense_model = Params()
    dense = hvd.DistributedOptimizer(torch.optim.SGD(dense_model.parameters(), lr=0.1),
                                     named_parameters=dense_model.named_parameters())
    expect_everywhere(lambda: dense.load_state_dict(state), "keeps none")
