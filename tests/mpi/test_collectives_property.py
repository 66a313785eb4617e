"""Property test: every public collective of hvcomm.torch (and the float16 ring of collectives/)
against a serial reference, over shapes of 0-4 dimensions (empty and non-contiguous included),
every dtype, every op, prescale/postscale and compression.

Every rank draws the same examples and builds every rank's input from a seed, so each rank
computes the reference itself. Each example's verdict is combined over the ranks before
anything is raised, so all ranks fail, and shrink, together.

The examples are drawn afresh each run from a seed that rank 0 picks and every rank shares;
a failure names it: HVCOMM_PROPERTY_SEED=<seed> draws the same examples again.
HVCOMM_LONG_PROPERTY=1 draws 5,000 examples instead of 120.

Floating-point results are compared with a tolerance derived from the dtypes' rounding on the
data of each example (:func:`float_reference`): zero where every value on the way is exactly
representable (the small integers here, summed, are), else the bound of the roundings the
documented computation makes (e.g. an average over 3 ranks: one rounding of the quotient).
Integers and bool are compared exactly.
"""
import math
import os
import secrets
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from mpi4py import MPI

import hvcomm.torch as hvd
from collectives.ring import ring_allreduce
from collectives.errors import HvcommError

from harness import default_dtype

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
          torch.int32, torch.int64, torch.bool]
REDUCIBLE = [d for d in DTYPES if d is not torch.bool]
OPS = [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # Horovod's scaling math
LONG = os.environ.get("HVCOMM_LONG_PROPERTY", "") not in ("", "0")
EXAMPLES = 5000 if LONG else 120


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float32):
        hvd.init()
        yield


def make_input(seed, rank, shape, dtype, op):
    """Rank ``rank``'s input: small integers (exact sums in any order); >= 0 for unsigned,
    in [-2, 2] under Product (no overflow)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    lo, hi = (0, 6) if dtype in (torch.uint8, torch.bool) else (-2, 3) if op == hvd.Product \
        else (-9, 10)
    x = torch.randint(lo, hi, shape, generator=g)
    return x.bool() if dtype is torch.bool else x.to(dtype)


def laid_out(x, contiguous):
    """``x`` itself, or a non-contiguous tensor equal to it (a strided view of a larger one)."""
    if contiguous or x.dim() == 0:
        return x.clone()
    big = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    big[..., ::2] = x
    view = big[..., ::2]
    assert not view.is_contiguous() or x.numel() <= 1
    return view


def scaled(t, factor, divisor=1):
    """Horovod's scaling (integers in float64, float16/bfloat16 in float32, cast back), the
    average a division by the size."""
    if factor == 1.0 and divisor == 1:
        return t
    if t.dtype in (torch.float32, torch.float64):
        return t * factor / divisor
    return (t.to(WIDE.get(t.dtype, torch.float64)) * factor / divisor).to(t.dtype)


class Expected(NamedTuple):
    """A floating-point reference: the result rounded to the dtype, its exact value
    (float64) and the error bound of the computation (0: it must be exact)."""
    want: torch.Tensor
    exact: torch.Tensor
    bound: torch.Tensor

    def split(self, counts, r):
        return Expected(*(torch.split(t, counts)[r] for t in self))


def reference_allreduce(xs, op, prescale, postscale, fp16):
    """The integer result as Horovod computes it, exactly (floats: :func:`float_reference`)."""
    dtype = xs[0].dtype
    if dtype.is_floating_point:
        return float_reference(xs, op, prescale, postscale, fp16)
    xs = [scaled(x, prescale) for x in xs]
    stacked = torch.stack([x.double() for x in xs])
    total = {hvd.Sum: stacked.sum(0), hvd.Average: stacked.sum(0), hvd.Min: stacked.min(0)[0],
             hvd.Max: stacked.max(0)[0], hvd.Product: stacked.prod(0)}[op].to(xs[0].dtype)
    return scaled(total, postscale, len(xs) if op == hvd.Average else 1)


# -- the tolerance: the bound of the roundings on the way, from each dtype's unit roundoff ----
def unit_roundoff(dtype):
    """u: the largest relative error of one rounding to nearest in ``dtype`` (eps / 2)."""
    return torch.finfo(dtype).eps / 2


def gamma(n, dtype):
    """Higham's gamma_n = n u / (1 - n u): the relative error of n roundings, each <= u."""
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu)


def rounded(value, err, dtype):
    """The error bound after rounding to ``dtype`` a result whose exact value is ``value``
    (float64) and whose computed value is within ``err`` of it: unchanged where it was exact
    and ``value`` is representable in ``dtype`` (then the rounding is exact), else err + u
    times the computed value's magnitude."""
    exact = (err == 0) & (value.to(dtype).double() == value)
    return torch.where(exact, 0.0, err + unit_roundoff(dtype) * (value.abs() + err))


def scaled_bound(value, err, factor, divisor, dtype):
    """Horovod's scaling of (value, err): times ``factor``, divided by ``divisor``, each in
    float32 for float16/bfloat16 and in ``dtype`` itself otherwise, cast back to ``dtype``.
    The exact values are float64's (the test's factors keep them exact but for the
    quotient, whose float64 rounding is float64's own result as well)."""
    if factor == 1.0 and divisor == 1:
        return value, err
    wide = WIDE.get(dtype, dtype)
    value, err = value * factor, err * abs(factor)
    err = rounded(value, err, wide)
    value, err = value / divisor, err / divisor
    err = rounded(value, err, wide)
    return value, err if wide == dtype else rounded(value, err, dtype)


def grid(values):
    """The largest power of two (at most 1) that divides every value: every sum of them is
    a multiple of it."""
    q = 1.0
    while q > 2.0 ** -30 and not torch.equal(torch.round(values / q) * q, values):
        q /= 2
    return q


def reduced_bound(vs, errs, op, dtype):
    """(exact value, error bound) of reducing the P rows of ``vs`` (float64, each computed
    within ``errs``) with ``op``, every operation rounding to ``dtype`` (hvcomm adds float16
    and bfloat16 in float32, a bound no larger). Sums: exact where every partial sum is
    (multiples of the grid q, magnitudes <= 2^p q, p the dtype's precision); else Higham's
    gamma_{P-1} times the sum of magnitudes. Products likewise, exact or within the inputs'
    relative errors and gamma_{P-1} of the product of magnitudes."""
    P, p = vs.shape[0], 1 - math.log2(torch.finfo(dtype).eps)
    q = grid(vs)
    exact_in = (errs == 0).all(0)
    if op in (hvd.Min, hvd.Max):
        return (vs.min(0)[0] if op == hvd.Min else vs.max(0)[0]), errs.max(0)[0]
    if op == hvd.Product:
        exact = exact_in & ((vs.abs() / q).clamp(min=1).prod(0) <= 2 ** p)
        relative = (1 + errs / vs.abs()).nan_to_num(1.0).prod(0) * (1 + gamma(P - 1, dtype)) - 1
        return vs.prod(0), torch.where(exact, 0.0, relative * vs.abs().prod(0))
    magnitude = vs.abs().sum(0) + errs.sum(0)
    exact = exact_in & (magnitude <= 2 ** p * q)
    return vs.sum(0), torch.where(exact, 0.0, errs.sum(0) + gamma(P - 1, dtype) * magnitude)


def float_reference(xs, op, prescale, postscale, fp16) -> Expected:
    """The :class:`Expected` result for floating-point ``xs``: each rank's input (to float16
    first with ``fp16``) prescaled, reduced, postscaled (divided by P for an average) as
    :func:`scaled_bound` and :func:`reduced_bound` describe, then cast to the dtype."""
    dtype = xs[0].dtype
    via = torch.float16 if fp16 else dtype
    vs, errs = [], []
    for x in xs:
        v = x.double()
        v, e = scaled_bound(v, rounded(v, torch.zeros_like(v), via), prescale, 1, via)
        vs.append(v)
        errs.append(e)
    value, err = reduced_bound(torch.stack(vs), torch.stack(errs), op, via)
    value, err = scaled_bound(value, err, postscale, len(xs) if op == hvd.Average else 1, via)
    if via != dtype:
        err = rounded(value, err, dtype)
    return Expected(value.to(dtype), value, err)


def expect_error(call):
    """An unsupported combination: a clear HvcommError (raised on every rank alike)."""
    try:
        call()
    except HvcommError as e:
        return None if "cannot be reduced" in str(e) or "at least one dimension" in str(e) \
            else f"unclear error: {e}"
    return "no error for an unsupported combination"


def differs(got, want):
    """None if ``got`` is ``want``: a tensor (then exactly), or an :class:`Expected`
    (within its bound of the exact value, elementwise; exactly where the bound is 0, and
    infinities must match)."""
    expected = want if isinstance(want, Expected) else None
    if expected is not None:
        want = expected.want
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if expected is None or not expected.bound.any():
        ok = torch.equal(got, want)
    else:
        g, exact, bound = got.double(), expected.exact, expected.bound
        finite = torch.isfinite(want)
        ok = torch.equal(got[~finite], want[~finite]) and bool(
            ((g[finite] - exact[finite]).abs() <= bound[finite]).all())
    return None if ok else f"values differ:\n{got}\nexpected\n{want}" + (
        "" if expected is None else f"\nwithin\n{expected.bound} of\n{expected.exact}")


cases = st.fixed_dictionaries({
    "kind": st.sampled_from(["allreduce", "allreduce_", "grouped_allreduce", "allgather",
                             "broadcast", "broadcast_", "alltoall", "reducescatter", "ring"]),
    "dtype": st.sampled_from(DTYPES),
    "shape": st.lists(st.integers(0, 3), min_size=0, max_size=4).map(tuple),
    "contiguous": st.booleans(),
    "op": st.sampled_from(OPS),
    "prescale": st.sampled_from([1.0, 0.5, 3.0]),
    "postscale": st.sampled_from([1.0, 0.25, 2.0]),
    "fp16": st.booleans(),
    "root": st.integers(0, 7),
    "seed": st.integers(0, 2 ** 20),
})


def run_case(c):
    """This rank's problem with the case, or None."""
    n, r = hvd.size(), hvd.rank()
    kind, dtype, shape, op = c["kind"], c["dtype"], c["shape"], c["op"]
    if kind == "ring":  # collectives/: the float16 ring, any shape, in place, 2-element chunks
        xs = [make_input(c["seed"], q, shape, torch.float16, hvd.Sum) for q in range(n)]
        buf = xs[r].numpy().copy()
        got = torch.from_numpy(ring_allreduce(MPI.COMM_WORLD, buf, chunk_bytes=4))
        return differs(got, float_reference(xs, hvd.Sum, 1.0, 1.0, False))
    if kind == "allgather":  # the first dimension differs between ranks
        shape = (shape[0] + 1 if shape else 1,) + shape[1:]
        xs = [make_input(c["seed"], q, (shape[0] + q,) + shape[1:], dtype, op) for q in range(n)]
        return differs(hvd.allgather(laid_out(xs[r], c["contiguous"])), torch.cat(xs))
    if kind == "alltoall":  # rank q sends (q + i) % 3 rows to rank i
        rows = [[(q + i) % 3 for i in range(n)] for q in range(n)]
        xs = [make_input(c["seed"], q, (sum(rows[q]),) + shape[1:], dtype, op) for q in range(n)]
        got, received = hvd.alltoall(laid_out(xs[r], c["contiguous"]), splits=rows[r])
        parts = [torch.split(x, rw)[r] for x, rw in zip(xs, rows)]
        return differs(got, torch.cat(parts)) or (
            None if received.tolist() == [rows[q][r] for q in range(n)] else "received splits")
    xs = [make_input(c["seed"], q, shape, dtype, op) for q in range(n)]
    mine = laid_out(xs[r], c["contiguous"])
    if kind == "reducescatter":
        if dtype not in REDUCIBLE or not shape:
            return expect_error(lambda: hvd.reducescatter(mine, op=hvd.Sum))
        rs_op = hvd.Sum if op in (hvd.Min, hvd.Max, hvd.Product) else op
        want = reference_allreduce(xs, rs_op, c["prescale"], c["postscale"], False)
        counts = [shape[0] // n + (q < shape[0] % n) for q in range(n)]
        got = hvd.reducescatter(mine, op=rs_op, prescale_factor=c["prescale"],
                                postscale_factor=c["postscale"])
        return differs(got, want.split(counts, r) if isinstance(want, Expected)
                       else torch.split(want, counts)[r])
    if kind.startswith("broadcast"):
        root = c["root"] % n
        out = hvd.broadcast_(mine, root) if kind == "broadcast_" else hvd.broadcast(mine, root)
        bad = differs(out, xs[root])
        if kind == "broadcast_":
            bad = bad or (None if out is mine else "broadcast_ did not return its input")
        return bad
    kw = dict(op=op, prescale_factor=c["prescale"], postscale_factor=c["postscale"])
    if dtype not in REDUCIBLE:
        return expect_error(lambda: hvd.allreduce(mine, **kw))
    want = reference_allreduce(xs, op, c["prescale"], c["postscale"], False)
    if kind == "grouped_allreduce":  # with a second, differently shaped tensor
        other = [x.reshape(-1)[:1].clone() for x in xs]
        got = hvd.grouped_allreduce([mine, other[r]], **kw)
        return differs(got[0], want) or differs(
            got[1], reference_allreduce(other, op, c["prescale"], c["postscale"], False))
    if kind == "allreduce_":
        out = hvd.allreduce_(mine, **kw)
        fp16 = False
        if out is not mine:
            return "allreduce_ did not return its input"
    else:
        fp16 = c["fp16"]
        comp = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        out = hvd.allreduce(mine, compression=comp, **kw)
        if not torch.equal(mine, xs[r]):
            return "allreduce changed its input"
    return differs(out, reference_allreduce(xs, op, c["prescale"], c["postscale"], fp16))


def shared_seed():
    """HVCOMM_PROPERTY_SEED, else a fresh seed from rank 0; the same on every rank (they
    must draw the same examples: each one's collectives involve them all)."""
    mine = os.environ.get("HVCOMM_PROPERTY_SEED") or secrets.randbits(32)
    return int(MPI.COMM_WORLD.bcast(mine, root=0))


def test_collectives_match_their_serial_reference():
    drawn_from = shared_seed()
    again = (f"HVCOMM_PROPERTY_SEED={drawn_from} draws these examples again"
             + (" (with HVCOMM_LONG_PROPERTY=1)" if LONG else ""))
    print(again)  # shown with a failure's captured output

    @seed(drawn_from)
    @settings(max_examples=EXAMPLES, derandomize=False, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def every_rank_agrees(case):
        try:
            problem = run_case(case)
        except Exception as e:  # noqa: BLE001 - an exception is this rank's verdict too
            problem = f"{type(e).__name__}: {e}"
        verdicts = MPI.COMM_WORLD.allgather(problem)
        bad = [(q, v) for q, v in enumerate(verdicts) if v is not None]
        assert not bad, f"{case}: " + "; ".join(f"rank {q}: {v}" for q, v in bad) + \
            f"\n{again}"

    every_rank_agrees()
