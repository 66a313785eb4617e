"""The ring allreduce (collectives.ring) against a serial reference, on every kind it sums.

The reference is a plain loop over the simulated ranks, written from the ring's definition and
not from its code: the array is cut as np.array_split cuts it (the first n mod P pieces one
longer); piece c is summed along the ring from rank c, each rank adding its own piece to the
partial sum it receives (``x[c+1] + x[c]``, then ``x[c+2] +`` that, ...), each addition rounded
to the element type (16-bit ones formed in float32, rounded by NumPy's or torch's own casts).
The ring must equal it bitwise; Open MPI's path (small messages) is checked on integer-valued
data, whose sums are exact in any order.
"""
import socket
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from collectives import handle, ring, tcp
from collectives.errors import HvcommError
from hvcomm.torch.sums import add_torch

KINDS = ("float32", "float64", "float16", "bfloat16")


def to_kind(values: np.ndarray, kind: str) -> np.ndarray:
    """float64 values rounded to ``kind`` (bfloat16 as its bits in uint16, by torch)."""
    if kind == "bfloat16":
        return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return values.astype(kind)


def as_float64(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).double().numpy()
    return x.astype(np.float64)


def add_rounded(a: np.ndarray, b: np.ndarray, kind: str) -> np.ndarray:
    """a + b rounded to ``kind`` once (16-bit kinds added in float32)."""
    if kind in ("float32", "float64"):
        return a + b
    wide = as_float64(a, kind).astype(np.float32) + as_float64(b, kind).astype(np.float32)
    return to_kind(wide.astype(np.float64), kind)


def ring_reference(xs, kind):
    p = len(xs)
    flats = [x.reshape(-1) for x in xs]
    pieces = [np.array_split(f, p) for f in flats]
    out = []
    for c in range(p):
        acc = pieces[c][c]
        for q in range(1, p):
            acc = add_rounded(pieces[(c + q) % p][c], acc, kind)
        out.append(acc)
    return np.concatenate(out).reshape(xs[0].shape) if out else flats[0].reshape(xs[0].shape)


def inputs(seed, shape, kind, p, integers=False):
    xs = []
    for q in range(p):
        rng = np.random.default_rng([seed, q])
        v = rng.integers(-8, 9, size=shape).astype(np.float64) if integers else \
            rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, size=shape))
        xs.append(to_kind(v, kind))
    return xs


def run(comm, x, kind, nonblocking, ring_only=True, **kw):
    """The ring (``ring_only``) or the choice of ring and Open MPI, blocking or not."""
    if not ring_only and not nonblocking:
        return ring.allreduce_sum(comm, x, bfloat16=kind == "bfloat16", **kw)
    start = ring.iring_allreduce if ring_only else ring.iallreduce_sum
    h = start(comm, x, bfloat16=kind == "bfloat16", **kw)
    if nonblocking:
        while not h.test():
            pass
    return h.wait()


def lengths(p, per):
    """0, 1, around P, and around the chunk: a segment of one chunk, of one more element,
    and several chunks with a short last one."""
    return sorted({0, 1, 2, p - 1, p, p + 1, per * p - 1, per * p, per * p + 1,
                   3 * per * p + p - 1} - {-1})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("adder", ["numpy", "torch"])
@pytest.mark.parametrize("transport", ring.TRANSPORTS)
def test_ring_equals_the_serial_reference(kind, adder, transport, monkeypatch):
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", transport)
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    itemsize = 8 if kind == "float64" else 4 if kind == "float32" else 2
    per = 5                                     # elements per chunk
    for n in lengths(p, per):
        for shape in ((n,), (n, 3)):
            xs = inputs(n * 7 + len(shape), shape, kind, p)
            x = xs[r].copy()
            got = run(comm, x, kind, nonblocking=n % 2 == 1, chunk_bytes=per * itemsize,
                      add=add_torch if adder == "torch" else None)
            assert got is x
            want = ring_reference(xs, kind)
            assert got.tobytes() == want.tobytes(), (kind, shape, got, want)
            everyone = comm.allgather(got.tobytes())
            assert all(b == everyone[0] for b in everyone)


@pytest.mark.parametrize("kind", KINDS)
def test_either_side_of_the_crossover(kind, monkeypatch):
    """iallreduce_sum: Open MPI below ring_min_bytes (16-bit widened to float32, exact on
    integers), the ring from it (the ring's reference)."""
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    itemsize = 8 if kind == "float64" else 4 if kind == "float32" else 2
    monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", str(64 * itemsize))
    for n in (63, 64, 65):
        xs = inputs(n, (n,), kind, p, integers=True)
        x = xs[r].copy()
        got = run(comm, x, kind, nonblocking=n % 2 == 1, ring_only=False)
        exact = to_kind(sum(as_float64(v, kind) for v in xs), kind)
        assert got.tobytes() == exact.tobytes(), (kind, n)
        assert ring.use_ring(x.nbytes, p, ring.kind_of(x, kind == "bfloat16")) == \
            (p > 1 and n >= 64)
    if p > 1:  # non-integers on the ring side: the ring's own order
        xs = inputs(5, (80,), kind, p)
        x = xs[r].copy()
        assert run(comm, x, kind, False, ring_only=False).tobytes() == \
            ring_reference(xs, kind).tobytes()


@pytest.mark.parametrize("kind", ("float32", "float64"))
@pytest.mark.parametrize("adder", ["numpy", "torch"])
@pytest.mark.parametrize("transport", ring.TRANSPORTS)
def test_scale_multiplies_the_finished_sum_once(kind, adder, transport, monkeypatch):
    """scale=: the reference's sum times the scale rounded to the element type (one rounding
    more), on the ring (each segment's owner scales it) and on Open MPI's path (integer-valued
    data: exact sums); every rank ends with the same values."""
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", transport)
    add = add_torch if adder == "torch" else None
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    itemsize, per = np.dtype(kind).itemsize, 5
    scale = 1 / 3  # not a power of two: its rounding to the element type shows
    factor = np.dtype(kind).type(scale)
    for n in lengths(p, per):
        xs = inputs(n * 5 + 1, (n,), kind, p)
        x = xs[r].copy()
        got = run(comm, x, kind, nonblocking=n % 2 == 1, chunk_bytes=per * itemsize,
                  scale=scale, add=add)
        want = ring_reference(xs, kind) * factor
        assert got.tobytes() == want.tobytes(), (kind, n, got, want)
        assert all(b == got.tobytes() for b in comm.allgather(got.tobytes()))
    monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", str(1 << 30))
    xs = inputs(3, (40,), kind, p, integers=True)
    for nonblocking in (False, True):
        x = xs[r].copy()
        got = run(comm, x, kind, nonblocking, ring_only=False, scale=scale)
        want = sum(v.astype(np.float64) for v in xs).astype(kind) * factor
        assert got.tobytes() == want.tobytes(), (kind, nonblocking, got, want)


def test_bad_input_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    cases = [
        (lambda: ring.ring_allreduce(comm, np.zeros(4 + (r == p - 1) * (p > 1), np.float32)),
         "disagree" if p > 1 else None),
        (lambda: ring.ring_allreduce(comm, np.zeros(4, np.int32)), "cannot sum int32"),
        (lambda: ring.ring_allreduce(comm, np.zeros((4, 4), np.float32)[:, 0]), "contiguous"),
        (lambda: ring.ring_allreduce(comm, np.zeros(4, np.float32), bfloat16=True),
         "bfloat16=True takes uint16"),
        (lambda: ring.ring_allreduce(comm, [1.0, 2.0]), "numpy array"),
        (lambda: ring.ring_allreduce(comm, np.zeros(4, np.float32), chunk_bytes=0),
         "chunk_bytes"),
        (lambda: ring.allreduce_sum(comm, np.zeros(4, np.float16), scale=0.5),
         "scale= is for float32 and float64"),
        (lambda: ring.allreduce_sum(comm, np.zeros(4, np.float32), scale="half"),
         "scale must be a real number"),
        (lambda: ring.ring_allreduce(comm, np.zeros(4, np.float32), scale=0.5 + (r == 0)),
         "disagree" if p > 1 else None),
    ]
    for call, text in cases:
        if text is None:
            call()
            continue
        with pytest.raises(HvcommError, match=text):
            call()
    comm.Barrier()  # nobody is left behind in a collective


def test_ring_min_bytes_setting(monkeypatch):
    monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", "many")
    with pytest.raises(HvcommError, match="HVCOMM_RING_MIN_BYTES"):
        ring.ring_min_bytes()
    monkeypatch.delenv("HVCOMM_RING_MIN_BYTES")
    assert ring.ring_min_bytes(np.dtype(np.float64)) == ring.RING_MIN_BYTES["wide"]
    assert ring.ring_min_bytes(ring.BFLOAT16) == ring.RING_MIN_BYTES["16-bit"]


class _Clock:
    """Stands in for the time module in collectives.handle: records each sleep; ``on_sleep``
    runs before the first."""

    def __init__(self, on_sleep=None):
        self.sleeps, self.on_sleep, self.perf_counter = [], on_sleep, time.perf_counter

    def sleep(self, seconds):
        if self.on_sleep is not None and not self.sleeps:
            self.on_sleep()
        self.sleeps.append(seconds)
        time.sleep(seconds)


@pytest.mark.parametrize("longest_us", ["1000", "5"])
def test_wait_sleeps_between_polls_until_complete(monkeypatch, longest_us):
    """Rank P-1 starts only once rank 0 has slept in wait() (rank 0 receives from it, so
    its first wait cannot end before): the waits go through the sleeping polls, and the sum
    is still the reference's. The first sleep is FIRST_SLEEP_S, each later one the first again
    (a new wait) or twice the one before, never over HVCOMM_WAIT_SLEEP_US."""
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    longest = float(longest_us) * 1e-6
    monkeypatch.setenv("HVCOMM_WAIT_SLEEP_US", longest_us)
    signal = comm.Dup()
    clock = _Clock(lambda: signal.send("rank 0 sleeps", dest=p - 1) if r == 0 else None)
    monkeypatch.setattr(handle, "time", clock)
    arrived = True
    try:
        if r == p - 1 and p > 1:  # (if rank 0 never sleeps: a failure below, not a hang)
            started, request = time.monotonic(), signal.irecv(source=0)
            while not (arrived := request.test()[0]) and time.monotonic() - started < 60:
                time.sleep(0.01)
            if not arrived:
                request.Cancel()
        xs = inputs(11, (40 * p,), "float32", p)
        # check=False: the agreement's allgather would wait for rank P-1 before any message
        got = ring.ring_allreduce(comm, xs[r].copy(), chunk_bytes=40, check=False)
    finally:
        signal.Free()
    assert arrived, "rank 0's wait() never slept: rank P-1 gave up waiting for it after 60 s"
    assert got.tobytes() == ring_reference(xs, "float32").tobytes()
    sleeps, first = clock.sleeps, min(20e-6, longest)
    if r == 0 and p > 1:
        assert sleeps and sleeps[0] == first, sleeps
    for before, now in zip(sleeps, sleeps[1:]):
        assert now in (first, min(2 * before, longest)), sleeps


def test_wait_sleep_zero_waits_in_mpi(monkeypatch):
    """HVCOMM_WAIT_SLEEP_US=0: MPI_Waitall, never a sleep."""
    def refuse(seconds):
        raise AssertionError("slept with HVCOMM_WAIT_SLEEP_US=0")
    monkeypatch.setenv("HVCOMM_WAIT_SLEEP_US", "0")
    clock = _Clock()
    clock.sleep = refuse
    monkeypatch.setattr(handle, "time", clock)
    comm = MPI.COMM_WORLD
    xs = inputs(12, (30,), "float64", comm.Get_size())
    got = ring.ring_allreduce(comm, xs[comm.Get_rank()].copy(), chunk_bytes=16)
    assert got.tobytes() == ring_reference(xs, "float64").tobytes()


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf", "2e6"])
def test_wait_sleep_setting(monkeypatch, text):
    """A bad setting raises as the collective starts, before any message."""
    monkeypatch.setenv("HVCOMM_WAIT_SLEEP_US", text)
    with pytest.raises(HvcommError, match="HVCOMM_WAIT_SLEEP_US must be"):
        ring.iring_allreduce(MPI.COMM_WORLD, np.ones(8, np.float32), check=False)
    for setting, seconds in (("250", 250e-6), ("0", 0.0), ("1000000", 1.0)):
        monkeypatch.setenv("HVCOMM_WAIT_SLEEP_US", setting)
        assert handle.longest_sleep_s() == seconds
    monkeypatch.delenv("HVCOMM_WAIT_SLEEP_US")
    assert handle.longest_sleep_s() == 500e-6


def test_tcp_rings_in_flight_together(monkeypatch):
    """Two rings on distinct tags at once over collectives.tcp, polled together: each on its
    own links (were they shared, their chunks would mix), each the serial reference."""
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "tcp")
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    xs, ys = inputs(21, (50 * p + 1,), "float32", p), inputs(22, (70 * p,), "float16", p)
    x, y = xs[r].copy(), ys[r].copy()
    hx = ring.iring_allreduce(comm, x, chunk_bytes=40, tag=11)
    hy = ring.iring_allreduce(comm, y, chunk_bytes=40, tag=12)
    while not all([h.test() for h in (hx, hy)]):  # (a list: both polled each time)
        pass
    assert x.tobytes() == ring_reference(xs, "float32").tobytes()
    assert y.tobytes() == ring_reference(ys, "float16").tobytes()


def test_transport_setting(monkeypatch):
    """A bad HVCOMM_RING_TRANSPORT raises on every rank as the ring starts; ranks that
    disagree all raise (the agreement's allgather), none waits on a link."""
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "infiniband")
    with pytest.raises(HvcommError, match="HVCOMM_RING_TRANSPORT must be one of mpi, tcp"):
        ring.iring_allreduce(comm, np.ones(8, np.float32))
    if p > 1:
        monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "tcp" if r == 0 else "mpi")
        with pytest.raises(HvcommError, match="disagree"):
            ring.ring_allreduce(comm, np.ones(8, np.float32))
    comm.Barrier()


def test_tcp_link_errors_raise_on_every_rank(monkeypatch):
    """A rank without the interfaces asked for, then a peer that cannot be reached (rank 0's
    port as rank P-1 knows it refused), then a link that fails between two rings: every rank
    raises, none waits, and the failed links are refused after."""
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return  # (no ring, no links)
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "tcp")
    monkeypatch.setattr(tcp, "CONNECT_TIMEOUT_S", 1.0)
    lonely = comm.Dup()
    with monkeypatch.context() as m:
        if r == 0:
            m.setenv("HVCOMM_SOCKET_IFNAME", "nosuch0")
        with pytest.raises(HvcommError, match="rank 0: HVCOMM_SOCKET_IFNAME='nosuch0'"):
            ring.ring_allreduce(lonely, np.ones(8 * p, np.float32))
    lonely.Free()
    unreachable = comm.Dup()
    links = tcp.links_of(unreachable)
    with socket.socket() as spare:  # bound, never listening: a connection to it is refused
        spare.bind(("0.0.0.0", 0))
        if r == p - 1:
            links._where[0] = (links._where[0][0], spare.getsockname()[1])
        with pytest.raises(HvcommError, match=f"rank {p - 1}: TCP link {p - 1}->0 tag .* "
                                              "cannot reach rank 0"):
            ring.ring_allreduce(unreachable, np.ones(8 * p, np.float32))
    unreachable.Free()
    broken = comm.Dup()
    xs = inputs(31, (8 * p,), "float32", p)
    assert ring.ring_allreduce(broken, xs[r].copy()).tobytes() == \
        ring_reference(xs, "float32").tobytes()
    if r == 0:  # its link to rank 1 fails under the next ring
        tcp.links_of(broken)._out[(1, ring.RING_TAG)]._sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(HvcommError, match="TCP link"):
        ring.ring_allreduce(broken, np.ones(1000 * p, np.float32), chunk_bytes=64)
    with pytest.raises(HvcommError, match="use a new communicator"):
        ring.ring_allreduce(broken, np.ones(8 * p, np.float32), check=False)
    broken.Free()


def test_tcp_communicator_freed_with_a_ring_in_flight(monkeypatch):
    """MPI lets a communicator be freed with operations pending: the ring still completes,
    then its links close."""
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "tcp")
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    freed = comm.Dup()
    xs = inputs(32, (50 * p,), "float64", p)
    x = xs[r].copy()
    handle = ring.iring_allreduce(freed, x, chunk_bytes=64)
    links = tcp.links_of(freed) if p > 1 else None
    freed.Free()
    assert handle.wait() is x and x.tobytes() == ring_reference(xs, "float64").tobytes()
    if links is not None:
        assert links._broken == "the communicator was freed"
