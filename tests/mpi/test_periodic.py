"""Local SGD and DiLoCo (periodic averaging): every step's local and global weights against the
independent serial reference of periodic_reference.py, exactly (warm-up, local steps,
exchanges, outer Nesterov momentum, fragments exchanged in turn while inner steps compute, a
checkpoint reloaded mid-run, finish_pending); the global weights agree on every rank; the bytes
sent; bad settings raise on every rank."""
from fractions import Fraction

import pytest
import torch

import hvcomm.torch as hvd

import periodic_reference as pref
import references as ref
from harness import assert_none_anywhere, default_dtype, expect_everywhere
from training import QUADRATIC_SGD, against_reference, build_quadratic, mismatches

Q = Fraction
# hvcomm's settings and the reference's, alike
REFERENCED = {
    "local-sgd": (hvd.LocalSGD(period=3, warmup_steps=2), pref.PeriodicSpec(3, 2)),
    "local-sgd-no-warmup": (hvd.LocalSGD(period=2), pref.PeriodicSpec(2)),
    "diloco": (hvd.DiLoCo(period=3, warmup_steps=1, outer_lr=0.5, outer_momentum=0.5),
               pref.PeriodicSpec(3, 1, Q(1, 2), Q(1, 2), nesterov=True)),
    "diloco-heavy-ball": (hvd.DiLoCo(period=2, outer_lr=0.75, outer_momentum=0.25,
                                     nesterov=False),
                          pref.PeriodicSpec(2, 0, Q(3, 4), Q(1, 4))),
    "diloco-streaming": (hvd.DiLoCo(period=4, warmup_steps=1, outer_lr=0.5, outer_momentum=0.5,
                                    fragments=3, overlap_steps=1, mix=0.5),
                         pref.PeriodicSpec(4, 1, Q(1, 2), Q(1, 2), True, 3, 1, Q(1, 2))),
    "diloco-streaming-late": (hvd.DiLoCo(period=3, outer_lr=1.0, outer_momentum=0.5,
                                         fragments=2, overlap_steps=2),
                              pref.PeriodicSpec(3, 0, Q(1), Q(1, 2), True, 2, 2)),
}
SHAPES = {"a": (2, 3), "b": (4,), "c": (3,), "d": (1,)}


# through a compressor with error feedback: exact where the average of what the ranks chose
# is (P a power of two)
COMPRESSED = {
    "diloco-topk": (dict(delay=hvd.DiLoCo(period=2, outer_lr=0.5, outer_momentum=0.5,
                                          fragments=2),
                         compression=hvd.Compression.topk(0.25, scope="bucket")),
                    pref.PeriodicSpec(2, 0, Q(1, 2), Q(1, 2), True, 2), ref.TopK(0.25,
                                                                               scope="bucket")),
    "local-sgd-twobit": (dict(delay=hvd.LocalSGD(period=2, warmup_steps=1),
                              compression=hvd.Compression.twobit(1.0)),
                         pref.PeriodicSpec(2, 1), ref.TwoBit(Q(1))),
}


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


@pytest.mark.parametrize("reload_at", [None, 4, 5])
@pytest.mark.parametrize("name", list(REFERENCED))
def test_matches_the_serial_reference(name, reload_at, steps=10):
    """Every step's local weights (this rank's) and global weights equal the reference's
    exactly; before step ``reload_at`` the state is saved and loaded into a new model and
    optimizer (mid-exchange for the overlapped ones); then finish_pending."""
    settings, spec = REFERENCED[name]
    sim = pref.PeriodicSimulation(hvd.size(), SHAPES, ref.SGD(*map(Q, QUADRATIC_SGD)), spec)
    assert_none_anywhere(against_reference(sim, lambda: build_quadratic(SHAPES, delay=settings),
                                           steps, reload_at))


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_differences_match_the_serial_reference(name, steps=9):
    """The differences through top-k / 2-bit with each rank's residual: every step's weights
    equal the reference's, and so do the residuals saved at step 5."""
    P, r = hvd.size(), hvd.rank()
    if P & (P - 1):
        pytest.skip(f"the average over {P} ranks of what each chose is not exact in float64")
    kw, spec, comp = COMPRESSED[name]
    sim = pref.PeriodicSimulation(P, SHAPES, ref.SGD(*map(Q, QUADRATIC_SGD)), spec, comp=comp)

    def residuals_match(s, state):
        residuals = state["hvcomm"]["residuals_by_param"]
        want = sim.snapshot().residuals[r]
        found = [] if set(residuals) == set(want) else [f"residuals of {sorted(residuals)}, "
                                                         f"the reference has {sorted(want)}"]
        return found + [line for n, w in want.items() if n in residuals
                        for line in mismatches(f"step {s}: residual {n}", residuals[n], w)]
    assert_none_anywhere(against_reference(sim, lambda: build_quadratic(SHAPES, **kw), steps,
                                           5, residuals_match))


def test_the_fragments_split_as_documented():
    from hvcomm.torch.methods.periodic import fragments_of
    for sizes in ([6, 4, 3, 1], [1, 1, 1, 9], [9, 1, 1, 1], [5] * 7, [2, 100]):
        for count in range(1, len(sizes) + 1):
            assert fragments_of(sizes, count) == pref.split_fragments(sizes, count), (sizes, count)


def test_an_exchange_sends_the_model_once_per_period():
    """Local SGD, period 3: nothing on the wire between exchanges; the whole model at each."""
    model, opt = build_quadratic(SHAPES, delay=hvd.LocalSGD(period=3))
    dense = sum(p.numel() * 8 for p in model.parameters())
    sent = []
    for s in range(6):
        opt.zero_grad()
        model.loss(hvd.rank(), s, hvd.size()).backward()
        opt.step()
        sent.append(opt.comm_stats.payload_bytes)
    assert sent == [0, 0, dense, 0, 0, dense], sent


def test_the_difference_travels_in_16_bits():
    """DiLoCo with Compression.fp16: half the bytes, and the global weights within float16's
    rounding of the exact reference's."""
    settings, spec = REFERENCED["diloco"]
    P, r = hvd.size(), hvd.rank()
    sim = pref.PeriodicSimulation(P, SHAPES, ref.SGD(*map(Q, QUADRATIC_SGD)), spec)
    model, opt = build_quadratic(SHAPES, delay=settings, compression=hvd.Compression.fp16)
    for s in range(4):
        opt.zero_grad()
        model.loss(r, s, P).backward()
        opt.step()
        want = sim.step()
    assert opt.comm_stats.payload_bytes == sum(p.numel() * 2 for p in model.parameters())
    problems, gaps = [], []
    for n, w in opt.global_weights().items():
        expect = torch.tensor([float(v) for v in want.W[n]], dtype=torch.float64)
        gaps.append((w.reshape(-1) - expect).abs().max().item())
        if gaps[-1] > 1e-2 * expect.abs().max().item():
            problems.append(f"{n}: differs from the exact reference by {gaps[-1]}")
    if max(gaps) == 0:
        problems.append("no rounding at all: the difference did not travel in 16 bits")
    assert_none_anywhere(problems)


def test_bad_settings_raise_on_every_rank():
    odd = hvd.rank() == hvd.size() - 1

    def build(**kw):
        return build_quadratic(SHAPES, **kw)
    expect_everywhere(lambda: build(delay=hvd.LocalSGD(period=0 if odd else 2)),
                      "period must be")
    expect_everywhere(lambda: build(delay=hvd.LocalSGD(period=2, outer_lr=0.5)),
                      "cannot be set")
    expect_everywhere(lambda: build(delay=hvd.DiLoCo(outer_momentum=1.0)), "outer_momentum")
    expect_everywhere(lambda: build(delay=hvd.DiLoCo(outer_momentum=0.0)), "nesterov=True")
    expect_everywhere(lambda: build(delay=hvd.DiLoCo(period=4, fragments=5)), "fragments")
    expect_everywhere(lambda: build(delay=hvd.DiLoCo(period=4, overlap_steps=4)),
                      "overlap_steps")
    expect_everywhere(lambda: build(delay=hvd.DiLoCo(mix=0)), "mix must be")
    expect_everywhere(lambda: build(delay=hvd.DiLoCo(period=8, fragments=5)),
                      "at most one fragment per parameter")
    expect_everywhere(lambda: build(delay=hvd.Delay("diloco")), "takes hvcomm.torch.DiLoCo")
    expect_everywhere(lambda: build(delay="diloco", schedule="wfbp"), "cannot be combined")
    expect_everywhere(lambda: build(delay="local-sgd", op=hvd.Sum), "leave op=Average")
    _, saved = build(delay=hvd.LocalSGD(period=2))
    _, other = build(delay=hvd.DiLoCo(period=2))
    expect_everywhere(lambda: other.load_state_dict(saved.state_dict()), "make it as it was")


def test_finish_pending_twice_changes_nothing():
    model, opt = build_quadratic(SHAPES, delay=hvd.DiLoCo(period=2, outer_lr=0.5,
                                                          outer_momentum=0.5))
    for s in range(3):
        opt.zero_grad()
        model.loss(hvd.rank(), s, hvd.size()).backward()
        opt.step()
    opt.finish_pending()
    first = [p.detach().clone() for p in model.parameters()]
    opt.finish_pending()
    assert all(torch.equal(a, b) for a, b in zip(first, model.parameters()))


def test_a_name_selects_the_defaults():
    _, opt = build_quadratic(SHAPES, delay="diloco")
    assert opt._hvcomm_options.delay == hvd.DiLoCo()
    _, opt = build_quadratic(SHAPES, delay="local-sgd")
    assert opt._hvcomm_options.delay == hvd.LocalSGD()
