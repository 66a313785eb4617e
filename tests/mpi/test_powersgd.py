"""PowerSGD (hvcomm/torch/methods/powersgd.py) against a serial reference written here: plain
NumPy loops over the simulated ranks, Gram-Schmidt for the orthogonalisation (the method uses
QR), one step and several with error feedback and warm-started Q; the bytes of each step; the
checkpoint; bad input."""
import copy
import math
import zlib

import numpy as np
import pytest
import torch

import hvcomm.torch as hvd

from harness import default_dtype, expect_everywhere

RANK = 2
SHAPES = {"w1": (8, 6), "conv": (4, 3, 2), "b1": (8,), "small": (2, 2)}  # small: 2*(2+2) >= 4


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


class Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))


def gradient(rank, step, name):
    """Integer-valued gradients, different on every rank and step."""
    rng = np.random.default_rng([rank, step, zlib.crc32(name.encode())])
    return rng.integers(-9, 10, size=SHAPES[name]).astype(np.float64)


def low_rank(shape):
    n = shape[0] if len(shape) >= 2 else 0
    m = math.prod(shape) // n if n else 0
    return n and min(RANK, n, m) * (n + m) < n * m, n, m


def first_q(key, j, m, r, seed=0):
    """The documented first draw of Q (the module's docstring)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{key}#{j}".encode()))
    return torch.randn((m, r), generator=gen, dtype=torch.float64).numpy()


def gram_schmidt(p):
    q = np.zeros_like(p)
    for c in range(p.shape[1]):
        v = p[:, c].copy()
        for d in range(c):
            v -= (q[:, d] @ p[:, c]) * q[:, d]
        q[:, c] = v / np.linalg.norm(v)
    return q


def serial_reference(buckets, size, steps):
    """Each step's average over ``size`` ranks and each rank's residual, by name."""
    q, error, averages = {}, {}, []
    for names in buckets:
        j = 0
        for name in names:
            small, n, m = low_rank(SHAPES[name])
            if small:
                q[name] = first_q("|".join(names), j, m, min(RANK, n, m))
                j += 1
    for step in range(steps):
        average = {}
        for name, shape in SHAPES.items():
            small, n, m = low_rank(shape)
            grads = [gradient(r, step, name) for r in range(size)]
            if not small:
                average[name] = sum(grads) / size
                for r in range(size):
                    error[r, name] = np.zeros(shape)
                continue
            ms = [(grads[r] + error.get((r, name), 0)).reshape(n, m) for r in range(size)]
            p_hat = gram_schmidt(sum(mat @ q[name] for mat in ms))
            q[name] = sum(mat.T @ p_hat for mat in ms)
            approx = p_hat @ q[name].T / size
            average[name] = approx.reshape(shape)
            for r in range(size):
                error[r, name] = (ms[r] - approx).reshape(shape)
        averages.append(average)
    return averages, error


def build(**kw):
    model = Params()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=RANK), **kw)
    return model, opt


def backward(model, step):
    loss = sum((p * torch.from_numpy(gradient(hvd.rank(), step, name))).sum()
               for name, p in model.named_parameters())
    loss.backward()


@pytest.mark.parametrize("grouping", ["one bucket", "one per parameter"])
def test_matches_the_serial_reference_over_steps(grouping):
    model = Params()
    groups = [[p] for p in model.parameters()] if grouping == "one per parameter" else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=groups,
                                   compression=hvd.Compression.powersgd(rank=RANK))
    steps = 5
    want, error = serial_reference(opt.plan, hvd.size(), steps)
    for step in range(steps):
        opt.zero_grad()
        backward(model, step)
        opt.synchronize()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), want[step][name], rtol=1e-9, atol=1e-9,
                                       err_msg=f"step {step}, {name}")
        with opt.skip_synchronize():
            opt.step()
    residuals = opt.state_dict()["hvcomm"]["residuals_by_param"]
    for name in SHAPES:
        np.testing.assert_allclose(residuals[name].reshape(SHAPES[name]).numpy(),
                                   error[hvd.rank(), name], rtol=1e-9, atol=1e-9, err_msg=name)


def test_bytes_per_step():
    model, opt = build()
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    first = second = 0
    for shape in SHAPES.values():
        small, n, m = low_rank(shape)
        first += n * RANK if small else math.prod(shape)
        second += m * RANK if small else 0
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


def test_bad_input():
    expect_everywhere(lambda: hvd.Compression.powersgd(rank=0), "rank must be a positive")
    model = torch.nn.Linear(4, 4).half()
    expect_everywhere(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        compression=hvd.Compression.powersgd()), "needs float32 or float64")
