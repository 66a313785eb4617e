"""MPI checks of the collectives against the serial references, on several communicators."""
import numpy as np
import pytest
from mpi4py import MPI

import collectives as C
from collectives.reference import gtopk_ref, topk_allgather_ref

# every check runs on three communicators; the seeded ones with 40 seeds on the world, 8 else
COMMS = ("world", "split", "dup")
SEEDED = [pytest.param(name, seed, id=f"{name}-seed{seed}")
          for name in COMMS for seed in (range(40) if name == "world" else range(8))]


@pytest.fixture(scope="module")
def comms():
    world = MPI.COMM_WORLD
    split = world.Split(world.Get_rank() % 2, world.Get_rank())
    dup = world.Dup()
    return {"world": world, "split": split, "dup": dup}


@pytest.fixture
def comm(request, comms):
    """The communicator the test is parametrized with (by name)."""
    return comms[request.param]


def rank_input(seed, r, d, k, spread, fewer=False):
    """Integer-valued float32 pairs of rank r; indices drawn from [0, spread) to force overlap."""
    rng = np.random.default_rng([seed, r])
    n = int(rng.integers(1, k + 1)) if fewer else k
    idx = rng.choice(spread, size=n, replace=False).astype(C.index_dtype(d))
    if spread < d:  # push some indices to the far end too
        idx = np.where(rng.random(n) < 0.2, d - 1 - idx, idx)
        idx = np.unique(idx)
    val = rng.integers(-6, 7, size=idx.size).astype(np.float32)
    return rng.permutation(idx), val[: idx.size]


def case_params(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.choice([1, 7, 100, 5000, 2**33]))
    k = int(rng.integers(1, min(d, 300) + 1))
    spread = int(min(d, rng.choice([k, 2 * k, 10 * k])))
    return d, k, spread


@pytest.mark.parametrize("comm, seed", SEEDED, indirect=["comm"])
def test_gtopk(comm, seed):
    nonblocking = seed % 2 == 1
    p, r = comm.Get_size(), comm.Get_rank()
    d, k, spread = case_params(seed)
    inputs = [rank_input(seed, q, d, k, spread, fewer=seed % 3 == 0) for q in range(p)]
    idx, val = inputs[r]
    if nonblocking:
        h = C.igtopk_allreduce(comm, idx, val, d, k, tag=100 + seed % 50)
        while not h.test():
            pass
        res = h.wait()
    else:
        res = C.gtopk_allreduce(comm, idx, val, d, k)
    ref_idx, ref_val, ref_reached = gtopk_ref(inputs, k)
    assert res.indices.dtype == C.index_dtype(d), res.indices.dtype
    np.testing.assert_array_equal(res.indices, ref_idx)
    np.testing.assert_array_equal(res.values, ref_val.astype(np.float32))
    np.testing.assert_array_equal(res.reached, ref_reached[r])
    # residual property, from every rank's reported bookkeeping: what reached the result
    # sums to the result exactly, and the rest is exactly what each rank keeps back
    reached_all = comm.allgather(res.reached)
    total = {}
    for q in range(p):
        for j, v, ok in zip(inputs[q][0], inputs[q][1], reached_all[q]):
            if ok:
                total[int(j)] = total.get(int(j), 0.0) + float(v)
    assert sorted(total) == [int(j) for j in res.indices if int(j) in total]
    for j, v in zip(res.indices, res.values):
        assert total.get(int(j), 0.0) == float(v), (j, v, total.get(int(j)))
    assert len(res.indices) == min(k, len({int(j) for i, _ in inputs for j in i}))


@pytest.mark.parametrize("comm, seed", SEEDED, indirect=["comm"])
def test_allgather(comm, seed):
    p, r = comm.Get_size(), comm.Get_rank()
    d, k, spread = case_params(seed)
    inputs = [rank_input(seed, q, d, k, spread, fewer=True) for q in range(p)]
    res = C.topk_allgather(comm, *inputs[r], d, k)
    ref_idx, ref_val = topk_allgather_ref(inputs)
    np.testing.assert_array_equal(res.indices, ref_idx)
    np.testing.assert_array_equal(res.values, ref_val.astype(np.float32))
    assert res.reached.all()


@pytest.mark.parametrize("comm", COMMS, indirect=True)
def test_dense_and_merged(comm):
    seed = 3
    p, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(seed)
    shapes = [tuple(rng.integers(1, 6, size=rng.integers(1, 3))) for _ in range(7)]
    mine = [np.random.default_rng([seed, r, i]).integers(-9, 9, s).astype(np.float32)
            for i, s in enumerate(shapes)]
    expect = [sum(np.random.default_rng([seed, q, i]).integers(-9, 9, s).astype(np.float32)
                  for q in range(p)) for i, s in enumerate(shapes)]
    np.testing.assert_array_equal(C.allreduce(comm, mine[0]), expect[0])
    for dtype in (np.float16, np.float32):  # ring with fp16 wire: integers stay exact
        for n in (1, p - 1, 1000 + seed):
            x = np.random.default_rng([seed, r, n]).integers(-9, 9, n).astype(dtype)
            want = sum(np.random.default_rng([seed, q, n]).integers(-9, 9, n) for q in range(p))
            C.icast_allreduce(comm, x).wait()
            np.testing.assert_array_equal(x, want.astype(dtype))
    plan = C.BucketPlan.by_threshold([a.nbytes for a in mine], 40, order=reversed(range(7)))
    arrays = [a.copy() for a in mine]
    C.merged_allreduce(comm, arrays, plan)
    for got, want in zip(arrays, expect):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("comm", COMMS, indirect=True)
def test_concurrent(comm):
    """Two gTop-k calls in flight with distinct tags, progressed in the opposite order."""
    p, r = comm.Get_size(), comm.Get_rank()
    d, k = 1000, 20
    ins = [[rank_input(s, q, d, k, 60) for q in range(p)] for s in (11, 12)]
    h1 = C.igtopk_allreduce(comm, *ins[0][r], d, k, tag=501)
    h2 = C.igtopk_allreduce(comm, *ins[1][r], d, k, tag=502)
    res2, res1 = h2.wait(), h1.wait()
    for res, inp in ((res1, ins[0]), (res2, ins[1])):
        np.testing.assert_array_equal(res.indices, gtopk_ref(inp, k)[0])


@pytest.mark.parametrize("comm", COMMS, indirect=True)
def test_results_kept(comm):
    """A result stays as it was when later calls run (the calls reuse scratch buffers)."""
    p, r = comm.Get_size(), comm.Get_rank()
    d, k = 1000, 20
    ins = [[rank_input(s, q, d, k, 60) for q in range(p)] for s in (21, 22)]
    first = [C.gtopk_allreduce(comm, *ins[0][r], d, k), C.topk_allgather(comm, *ins[0][r], d, k)]
    copies = [(x.indices.copy(), x.values.copy(), x.reached.copy()) for x in first]
    C.gtopk_allreduce(comm, *ins[1][r], d, k)
    C.topk_allgather(comm, *ins[1][r], d, k)
    for res, (idx, val, reached) in zip(first, copies):
        np.testing.assert_array_equal(res.indices, idx)
        np.testing.assert_array_equal(res.values, val)
        np.testing.assert_array_equal(res.reached, reached)


def expect_error_everywhere(comm, fn, text):
    try:
        fn()
    except C.HvcommError as e:
        assert text in str(e), f"error {e!s} lacks {text!r}"
        return
    raise AssertionError(f"no HvcommError (wanted one mentioning {text!r})")


@pytest.mark.parametrize("comm", COMMS, indirect=True)
def test_bad_input(comm):
    r = comm.Get_rank()
    idx, val = np.array([1, 5, 7], np.int32), np.array([1.0, -2.0, 3.0], np.float32)
    idx5, val5 = np.array([0, 1, 5, 7, 9], np.int32), np.arange(5, dtype=np.float32)
    last = comm.Get_size() - 1
    bad = lambda cond, a, b: a if cond else b  # noqa: E731
    cases = [
        (lambda: C.gtopk_allreduce(comm, idx, val, bad(r == last, 11, 10), 3), "ranks disagree"),
        (lambda: C.gtopk_allreduce(comm, idx, val.astype(bad(r == last, np.float64, np.float32)),
                                   10, 3), "ranks disagree"),
        (lambda: C.gtopk_allreduce(comm, idx, val, 10, bad(r == last, 0, 3)), "k must be"),
        # a rank with a larger k sends more pairs than the others expect: still an error
        (lambda: C.gtopk_allreduce(comm, bad(r == last, idx5, idx), bad(r == last, val5, val),
                                   10, bad(r == last, 5, 3)), "ranks disagree"),
        (lambda: C.topk_allgather(comm, idx, val.astype(bad(r == last, np.float64, np.float32)),
                                  10), "ranks disagree"),
        (lambda: C.topk_allgather(comm, idx, val, bad(r == last, 11, 10)), "ranks disagree"),
        (lambda: C.topk_allgather(comm, idx, bad(r == last, val * np.inf, val), 10), "NaN"),
        (lambda: C.gtopk_allreduce(comm, idx, val, 2, 3), "k must be"),
        (lambda: C.gtopk_allreduce(comm, bad(r == last, -idx, idx), val, 10, 3), "must lie in"),
        (lambda: C.gtopk_allreduce(comm, bad(r == last, idx + 5, idx), val, 10, 3), "must lie in"),
        (lambda: C.gtopk_allreduce(comm, idx, bad(r == last, val * np.nan, val), 10, 3), "NaN"),
        (lambda: C.gtopk_allreduce(comm, idx.astype(np.float32), val, 10, 3), "int32 or int64"),
        (lambda: C.topk_allgather(comm, np.array([1, 5, 7, 2, 3, 4], np.int32)[::2], val, 10),
         "contiguous"),
        (lambda: C.topk_allgather(comm, np.array([1, 1, 2], np.int32), val, 10), "unique"),
        (lambda: C.gtopk_allreduce(comm, idx, val.astype(np.float16), 10, 3), "float32 or float64"),
        (lambda: C.allreduce(comm, np.zeros(bad(r == last, 4, 5), np.float32)), "ranks disagree"),
    ]
    for fn, text in cases:
        if text == "ranks disagree" and comm.Get_size() == 1:
            continue  # one rank cannot disagree with itself
        expect_error_everywhere(comm, fn, text)
    # and the communicator still works afterwards
    assert comm.allreduce(1) == comm.Get_size()

