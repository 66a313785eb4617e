"""Property test: every public collective of hvcomm.torch (and the float16 ring of collectives/)
against a serial reference, over shapes of 0-4 dimensions (empty and non-contiguous included),
every dtype, every op, prescale/postscale and compression.

Every rank draws the same examples (hypothesis, derandomized) and builds every rank's input
from a seed, so each rank computes the reference itself. Each example's verdict is combined
over the ranks before anything is raised, so all ranks fail, and shrink, together."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import hvcomm.torch as hvd
from collectives import icast_allreduce
from collectives.errors import HvcommError

from harness import default_dtype

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
          torch.int32, torch.int64, torch.bool]
REDUCIBLE = [d for d in DTYPES if d is not torch.bool]
OPS = [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # Horovod's scaling math
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


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


def reference_allreduce(xs, op, prescale, postscale, fp16):
    dtype = xs[0].dtype
    if fp16 and dtype.is_floating_point:
        xs = [x.to(torch.float16) for x in xs]
    xs = [scaled(x, prescale) for x in xs]
    stacked = torch.stack([x.double() for x in xs])
    total = {hvd.Sum: stacked.sum(0), hvd.Average: stacked.sum(0), hvd.Min: stacked.min(0)[0],
             hvd.Max: stacked.max(0)[0], hvd.Product: stacked.prod(0)}[op].to(xs[0].dtype)
    out = scaled(total, postscale, len(xs) if op == hvd.Average else 1)
    return out.to(dtype)


def expect_error(call):
    """An unsupported combination: a clear HvcommError (raised on every rank alike)."""
    try:
        call()
    except HvcommError as e:
        return None if "cannot be reduced" in str(e) or "at least one dimension" in str(e) \
            else f"unclear error: {e}"
    return "no error for an unsupported combination"


def differs(got, want):
    """None if equal (exactly for integers and bool, within the dtype's tolerance else)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if want.dtype in TOL:
        tol = TOL[want.dtype]
        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(got, want)
    return None if ok else f"values differ:\n{got}\nexpected\n{want}"


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
    if kind == "ring":  # collectives/: the float16 ring, any shape, NumPy in place
        xs = [make_input(c["seed"], q, shape, torch.float16, hvd.Sum) for q in range(n)]
        buf = xs[r].numpy().copy()
        got = torch.from_numpy(icast_allreduce(MPI.COMM_WORLD, buf).wait())
        return differs(got, torch.stack([x.double() for x in xs]).sum(0).half())
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
        return differs(got, torch.split(want, counts)[r])
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


@settings(max_examples=120, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(cases)
def test_collectives_match_their_serial_reference(case):
    try:
        problem = run_case(case)
    except Exception as e:  # noqa: BLE001 - an exception is this rank's verdict too
        problem = f"{type(e).__name__}: {e}"
    verdicts = MPI.COMM_WORLD.allgather(problem)
    bad = [(q, v) for q, v in enumerate(verdicts) if v is not None]
    assert not bad, f"{case}: " + "; ".join(f"rank {q}: {v}" for q, v in bad)

