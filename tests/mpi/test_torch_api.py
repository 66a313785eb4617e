"""hvcomm.torch's Horovod-named collectives, checked against values computed from (rank, size)."""
import pytest
import torch
from mpi4py import MPI

import hvcomm.torch as hvd
from collectives import HvcommError

from harness import default_dtype


@pytest.fixture(scope="module", autouse=True)
def started():
    """hvcomm started for the module's tests and shut down after them."""
    with default_dtype(torch.float32):
        hvd.init()
        yield
        hvd.shutdown()


def test_initialized():
    assert hvd.is_initialized() and hvd.size() == MPI.COMM_WORLD.Get_size()


def test_allreduce():
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + r
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    assert torch.equal(hvd.allreduce(x), base + (n - 1) / 2)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), n * base + n * (n - 1) / 2)
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), base + n - 1)
    assert torch.equal(hvd.allreduce(x, op=hvd.Min), base)
    assert torch.equal(hvd.allreduce(x, average=False, prescale_factor=2.0, postscale_factor=0.5),
                       n * base + n * (n - 1) / 2)
    assert torch.equal(x, base + r), "allreduce must not modify its input"
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, n * base + n * (n - 1) / 2)
    h = hvd.allreduce_async(torch.full((3,), float(r)), name="async")
    while not hvd.poll(h):
        pass
    assert torch.equal(hvd.synchronize(h), torch.full((3,), (n - 1) / 2))
    half = hvd.allreduce(torch.full((4,), 1.0 + r), compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32 and torch.equal(half, torch.full((4,), 1.0 + (n - 1) / 2))
    t = torch.ones(3, requires_grad=True)
    assert torch.equal(hvd.allreduce(t), torch.ones(3))


def test_allgather_broadcast_objects():
    r, n = hvd.rank(), hvd.size()
    g = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64))
    assert g.shape == (n * (n + 1) // 2, 2)
    assert g[:, 0].tolist() == [q for q in range(n) for _ in range(q + 1)]
    b = torch.full((3,), float(r))
    assert hvd.broadcast(b, root_rank=n - 1).tolist() == [n - 1.0] * 3 and b[0] == r
    hvd.broadcast_(b, root_rank=0)
    assert b.tolist() == [0.0] * 3
    assert hvd.broadcast_object({"r": r}, root_rank=n - 1) == {"r": n - 1}
    assert hvd.allgather_object(r * 10) == [q * 10 for q in range(n)]
    hvd.barrier()
    assert hvd.local_size() * hvd.cross_size() == n and 0 <= hvd.local_rank() < hvd.local_size()


def test_mismatch_errors():
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        return
    for fn, text in (
        (lambda: hvd.allreduce(torch.ones(3 if r else 4)), "ranks submitted different"),
        (lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if r else torch.float32)),
         "ranks submitted different"),
        (lambda: hvd.broadcast(torch.ones(2, 2 + (r == n - 1)), 0), "ranks submitted different"),
        (lambda: hvd.allgather(torch.ones(1, 2 + (r == n - 1))), "differ beyond dimension 0"),
    ):
        try:
            fn()
        except HvcommError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"no error for {text}")
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    for bad, exc in ((lambda: hvd.allreduce(torch.ones(2), op="Median"), ValueError),
                     (lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)), HvcommError),
                     (lambda: hvd.synchronize(12345), ValueError)):
        try:
            bad()
        except exc:
            continue
        raise AssertionError(f"expected {exc.__name__}")



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_allreduce_over_tcp_links(monkeypatch, dtype):
    """HVCOMM_RING_TRANSPORT=tcp: every sum on the ring (HVCOMM_RING_MIN_BYTES=0) over
    collectives.tcp's links; integer values, so every partial sum is exact in any order."""
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "tcp")
    monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", "0")
    r, n = hvd.rank(), hvd.size()
    base = torch.arange(3001, dtype=torch.float64) % 7
    got = hvd.allreduce((base + r).to(dtype), op=hvd.Sum)
    assert got.dtype == dtype and torch.equal(got.double(), n * base + n * (n - 1) / 2)
    if n > 1:  # (the engine's communicator carries the links)
        from collectives import tcp
        from hvcomm.torch import runtime
        assert runtime._runtime.engine.comm.Get_attr(tcp._KEYVAL) is not None


def test_tcp_links_refused_under_fault_tolerance(monkeypatch):
    """Revoking a communicator does not reach collectives.tcp's links: init() refuses them."""
    from hvcomm.torch import fault, runtime
    monkeypatch.setattr(fault, "_enabled", True)
    monkeypatch.setattr(runtime, "_runtime", None)
    monkeypatch.setenv("HVCOMM_RING_TRANSPORT", "tcp")
    with pytest.raises(HvcommError, match="tcp does not work under fault tolerance"):
        runtime.init()
