"""The small model, data and training loops the MPI tests of DistributedOptimizer share
(test_optimizer.py, test_reducer.py, test_delayed.py, test_schedule.py, test_vs_horovod.py,
and the scripts train_resumable.py and check_reproducible.py).

Importing this module makes float64 torch's default dtype, as importing check_optimizer.py
did for every script that used these helpers."""
import torch

import hvcomm.torch as hvd

torch.set_default_dtype(torch.float64)
BATCH = 4  # per rank


class Net(torch.nn.Module):
    def __init__(self, width=16, branch=False):
        super().__init__()
        torch.manual_seed(1234)  # same weights on every rank and in the serial reference
        self.fc1 = torch.nn.Linear(10, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 3)
        self.extra = torch.nn.Linear(width, width) if branch else None

    def forward(self, x, use_extra=False):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        if use_extra:
            h = torch.tanh(self.extra(h))
        return self.head(h)


def data(step, n_ranks):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n_ranks * BATCH, 10, generator=g)
    y = torch.randint(0, 3, (n_ranks * BATCH,), generator=g)
    return x, y


def shard(t, r):
    return t[r * BATCH:(r + 1) * BATCH]


def loss_fn(model, x, y, **kw):
    return torch.nn.functional.cross_entropy(model(x, **kw), y)


def make_opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def assert_same_everywhere(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mx = hvd.allreduce(flat, op=hvd.Max)
    mn = hvd.allreduce(flat, op=hvd.Min)
    assert torch.equal(mx, mn), "ranks hold different weights"


def assert_close(a, b, tol=1e-10):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=tol, rtol=0), f"{n}: max diff {(p - q).abs().max()}"


def train_steps(model, opt, steps):
    """Run ``opt`` on ``model`` for the given steps of the shared data (this rank's shard)."""
    r = hvd.rank()
    for s in steps:
        x, y = data(s, hvd.size())
        opt.zero_grad()
        loss_fn(model, shard(x, r), shard(y, r)).backward()
        opt.step()


def train_serial(steps, sched=False, passes=1):
    model = Net()
    opt = make_opt(model)
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if sched else None
    for s in range(steps):
        x, y = data(s, hvd.size())
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if lr_sched:
            lr_sched.step()
    return model


def train_distributed(steps, sched=False, passes=1, **kw):
    r = hvd.rank()
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kw)
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5) if sched else None
    for s in range(steps):
        x, y = data(s, hvd.size())
        x, y = shard(x, r), shard(y, r)
        opt.zero_grad()
        for c in range(passes):  # split the local batch into `passes` chunks
            part = slice(c * BATCH // passes, (c + 1) * BATCH // passes)
            (loss_fn(model, x[part], y[part]) / passes).backward()
        opt.step()
        if lr_sched:
            lr_sched.step()
    return model, opt


class Quadratic(torch.nn.Module):
    """The model of references.py: float64 parameters of ``shapes`` (initial_weights) and
    the loss size * sum(c*w + h*w*w/2), whose gradient size * (c + h*w) is exact."""

    def __init__(self, shapes, curved=True, spread=4):
        super().__init__()
        self.spread = spread
        from references import curvature, initial_weights
        for name, values in initial_weights(shapes).items():
            w = torch.tensor([float(v) for v in values], dtype=torch.float64)
            self.register_parameter(name, torch.nn.Parameter(w.reshape(shapes[name])))
        self.h = {n: torch.tensor(curvature(n, p.numel(), curved), dtype=torch.float64)
                  .reshape(p.shape) for n, p in self.named_parameters()}

    def loss(self, rank, step, size):
        from references import coefficients
        total = 0
        for name, p in self.named_parameters():
            c = torch.tensor(coefficients(rank, step, name, p.numel(), self.spread),
                             dtype=torch.float64)
            total = total + (size * (c.reshape(p.shape) + 0.5 * self.h[name] * p) * p).sum()
        return total


# The SGD of the reference tests, on both sides (lr, momentum, weight decay): exact in float64
QUADRATIC_SGD = (0.5, 0.5, 0.25)


def build_quadratic(shapes, data=None, **kw):
    """A Quadratic of ``shapes`` (``data``: its keyword arguments) and a DistributedOptimizer
    (``kw``) over torch's SGD with QUADRATIC_SGD; the reference's SGD is
    ``references.SGD(*map(Fraction, QUADRATIC_SGD))``."""
    lr, momentum, weight_decay = QUADRATIC_SGD
    model = Quadratic(shapes, **(data or {}))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay),
        named_parameters=model.named_parameters(), **kw)
    return model, opt


def against_reference(sim, build, steps, reload_at=None, at_reload=None):
    """Train the Quadratic that ``build()`` makes (returns model, optimizer) for ``steps``
    steps beside the serial reference ``sim`` (a references.Simulation or
    PeriodicSimulation), then finish_pending; before step ``reload_at`` the state is saved
    and loaded into a new model and optimizer (``at_reload(step, saved optimizer state)``
    returns problems found in it). Returns where this rank's local weights or the global
    weights ever differed from the reference's."""
    import copy
    P, r = hvd.size(), hvd.rank()
    model, opt = build()
    problems = []

    def compare(when, want):
        W = opt.global_weights()
        for n, p in model.named_parameters():
            problems.extend(mismatches(f"{when}: local weights {n}", p, want.local[r][n]))
            problems.extend(mismatches(f"{when}: global weights {n}", W[n], want.W[n]))
    for s in range(steps):
        if s == reload_at:
            state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
            if at_reload is not None:
                problems.extend(at_reload(s, state))
            model, opt = build()
            model.load_state_dict(weights)
            opt.load_state_dict(state)
        opt.zero_grad()
        model.loss(r, s, P).backward()
        opt.step()
        compare(f"step {s}", sim.step())
    opt.finish_pending()
    compare("finish_pending", sim.finish_pending())
    return problems


def mismatches(what, got, want):
    """Where the float64 tensor ``got`` is not exactly the reference's Fractions ``want``
    (one line, empty if none); a reference value that float64 cannot hold is named as such
    (the data would be at fault, not the code)."""
    from fractions import Fraction
    from references import exact_float
    flat = got.detach().reshape(-1).tolist()
    if len(flat) != len(want):
        return [f"{what}: {len(flat)} elements, the reference has {len(want)}"]
    if not all(exact_float(y) for y in want):
        return [f"{what}: the reference is not exact in float64 (test data too fine)"]
    bad = [i for i, (x, y) in enumerate(zip(flat, want)) if Fraction(x) != y]
    if not bad:
        return []
    return [f"{what}: {len(bad)} of {len(want)} differ, first at {bad[0]}: "
            f"{flat[bad[0]]!r} != {float(want[bad[0]])!r} (got {flat}, want "
            f"{[float(y) for y in want]})"]
