"""The rest of Horovod's API, in hvcomm's own words: process sets, autograd through the
collectives, join, duplicate names, Adasum, sparse allreduce, the error type, build queries."""
import pytest
import torch

import hvcomm.torch as hvd

from harness import default_dtype, expect_everywhere


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float32):
        hvd.init()
        yield


def test_process_sets():
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    odds = hvd.add_process_set([q for q in range(n) if q % 2 == 1]) if n > 1 else None
    mine, other = (evens, odds) if r % 2 == 0 else (odds, evens)
    got = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=mine)
    assert got.item() == sum(q for q in mine.ranks), (got, mine)
    assert hvd.allgather(torch.tensor([r]), process_set=mine).tolist() == mine.ranks
    root = mine.ranks[-1]  # root ranks are ranks of the world, also within a set
    assert hvd.broadcast(torch.tensor([r]), root, process_set=mine).item() == root
    assert hvd.broadcast_object(r, root, process_set=mine) == root
    if other is not None:
        expect_everywhere(lambda: hvd.allreduce(torch.ones(1), process_set=other),
                          "not in process set")
    expect_everywhere(lambda: hvd.add_process_set([0, 0]), "distinct ranks")
    assert hvd.remove_process_set(evens) and (odds is None or hvd.remove_process_set(odds))
    assert not hvd.remove_process_set(evens)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # the world still works


def test_distributed_optimizer_on_a_process_set():
    """Every rank wraps its optimizer with the set of even ranks: they average among
    themselves; an odd rank steps on its own gradient alone (Horovod's behaviour)."""
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=evens)
    model(torch.full((1, 3), float(r + 1))).sum().backward()
    opt.step()
    ranks = evens.ranks if r % 2 == 0 else [r]
    want = -sum(q + 1.0 for q in ranks) / len(ranks)
    assert torch.allclose(model.weight, torch.full((1, 3), want)), (model.weight, want)
    hvd.remove_process_set(evens)


def test_sparse_gradients():
    """Embedding(sparse=True) trains as the dense Embedding does; the gradient the wrapped
    optimizer sees is sparse again (SparseAdam needs that), with or without sparse_as_dense."""
    r = hvd.rank()
    idx = torch.tensor([[r % 10, 3], [7, (2 * r) % 10]])
    for sparse_as_dense in (False, True):
        weights = []
        for sparse in (True, False):
            torch.manual_seed(3)
            emb = torch.nn.Embedding(10, 3, sparse=sparse)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                           named_parameters=emb.named_parameters(),
                                           sparse_as_dense=sparse_as_dense)
            emb(idx).pow(2).sum().backward()
            opt.step()
            assert emb.weight.grad.is_sparse == sparse
            weights.append(emb.weight.detach().clone())
        assert torch.allclose(weights[0], weights[1], atol=1e-6)
    torch.manual_seed(5)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    before = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1))
    emb(idx).sum().backward()
    opt.step()
    # by hand: the averaged gradient of a row is (its lookups on all ranks) / size, in every
    # column; Adam's first step moves each row with a gradient by lr * g / (|g| + eps)
    lookups = torch.zeros(10)
    for q in range(hvd.size()):
        for row in (q % 10, 3, 7, (2 * q) % 10):
            lookups[row] += 1
    g = (lookups / hvd.size())[:, None].expand(10, 3)
    expected = before - 0.1 * g / (g.abs() + 1e-8)
    assert torch.allclose(emb.weight.detach(), expected, atol=1e-6), emb.weight - expected
    assert not torch.equal(emb.weight.detach(), before)


def test_autograd_through_the_collectives():
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(3, 2, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3, 2))
    assert torch.equal(x.grad, torch.full((3, 2), float(n)))
    x = torch.ones(r + 1, 2, requires_grad=True)  # ranks gather different numbers of rows
    g = hvd.allgather(x)
    rows = torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])
    g.backward(rows)
    assert torch.equal(x.grad, torch.full((r + 1, 2), float(r)))
    x = torch.ones(4, requires_grad=True)
    hvd.broadcast(x, 0).backward(torch.ones(4))
    assert torch.equal(x.grad, torch.ones(4) * (1.0 if r == 0 else 0.0))
    x = torch.ones(2 * n, requires_grad=True)
    out, received = hvd.alltoall(x, torch.full((n,), 2, dtype=torch.int32))
    out.backward(torch.ones_like(out))
    assert received.tolist() == [2] * n and torch.equal(x.grad, torch.ones(2 * n))
    x = torch.ones(2 * n, 3, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).backward(torch.ones(2, 3))
    assert torch.equal(x.grad, torch.full((2 * n, 3), float(n)))


def test_join():
    r, n = hvd.rank(), hvd.size()
    for first in range(n):
        t = torch.arange(6, dtype=torch.int64).reshape(2, 3) * 33 - 99  # multiples of 3 too
        if r == first:
            last = hvd.join()
        else:
            avg = hvd.allreduce(t, op=hvd.Average)
            # the joined rank contributed zeros; integers are truncated, as in Horovod
            assert torch.equal(avg, torch.div(t * (n - 1), n, rounding_mode="trunc")), avg
            f = t.double() * 3.3
            assert torch.equal(hvd.allreduce(f, op=hvd.Average), f * (n - 1) / n)
            if n > 1:
                expect_everywhere(lambda: hvd.allgather(t), "join()")
            last = hvd.join()
        assert hvd.allgather_object(last) == [last] * n
        assert n == 1 or last != first


def test_duplicate_names():
    h = hvd.allreduce_async(torch.ones(2), name="same")
    try:  # Horovod's tests catch a ValueError: HvcommError is one
        hvd.allreduce_async(torch.ones(2), name="same")
    except ValueError as e:
        assert "still in flight" in str(e)
    else:
        raise AssertionError("a second op of the same name in flight did not raise")
    hvd.synchronize(h)
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="same"))  # free again


def test_adasum():
    r, n = hvd.rank(), hvd.size()
    vecs = [torch.tensor([1.0 + q, 2.0 * q - 1, 0.5], dtype=torch.float64) for q in range(n)]
    level = list(vecs)
    while len(level) > 1:  # the same tree, written out serially
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            d = a @ b
            nxt.append((1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b)
        level = nxt + ([level[-1]] if len(level) % 2 else [])
    got = hvd.allreduce(vecs[r], op=hvd.Adasum)
    assert torch.allclose(got, level[0], atol=1e-12), (got, level[0])
    # DistributedOptimizer(op=Adasum): the step takes the Adasum of the ranks' gradients
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   op=hvd.Adasum)
    (w * vecs[r]).sum().backward()
    opt.step()
    assert torch.allclose(w.detach(), -level[0], atol=1e-12), (w, level[0])
    if n == 2:  # orthogonal vectors add; equal vectors stay (Adasum's defining cases)
        e = torch.eye(2, dtype=torch.float64)
        assert torch.allclose(hvd.allreduce(e[r], op=hvd.Adasum), e[0] + e[1])
        assert torch.allclose(hvd.allreduce(e[0], op=hvd.Adasum), e[0])


def test_sparse_allreduce():
    r, n = hvd.rank(), hvd.size()
    t = torch.sparse_coo_tensor(torch.tensor([[r, 5]]), torch.tensor([1.0, 2.0]), (8,))
    got = hvd.sparse_allreduce_async(t, op=hvd.Sum)().to_dense()  # a handle to call
    want = torch.zeros(8)
    for q in range(n):
        want[q] += 1.0
        want[5] += 2.0
    assert torch.equal(got, want), got


def test_sync_batch_norm():
    """Against torch's BatchNorm1d on the concatenated batch (ranks hold 1..n rows)."""
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(n * (n + 1) // 2, 4, 3, generator=g, dtype=torch.float64)
    lo = r * (r + 1) // 2
    mine = full[lo:lo + r + 1].clone().requires_grad_()
    ref_in = full.clone().requires_grad_()
    sbn, bn = hvd.SyncBatchNorm(4).double(), torch.nn.BatchNorm1d(4).double()
    with torch.no_grad():
        for m in (sbn, bn):
            m.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
            m.bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.3]))
    dy = torch.randn(full.shape, generator=g, dtype=torch.float64)
    out, ref = sbn(mine), bn(ref_in)
    out.backward(dy[lo:lo + r + 1])
    ref.backward(dy)
    assert torch.allclose(out, ref[lo:lo + r + 1], atol=1e-10)
    assert torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-12)
    assert torch.allclose(sbn.running_var, bn.running_var, atol=1e-12)
    assert torch.allclose(mine.grad, ref_in.grad[lo:lo + r + 1], atol=1e-10)
    assert torch.allclose(hvd.allreduce(sbn.weight.grad, op=hvd.Sum), bn.weight.grad, atol=1e-10)
    sbn.eval()
    bn.eval()
    assert torch.allclose(sbn(full), bn(full), atol=1e-10)


def test_errors_and_build_queries():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.nccl_built()
    assert not (hvd.gloo_built() or hvd.ccl_built() or hvd.cuda_built() or hvd.rocm_built())
    expect_everywhere(lambda: hvd.alltoall(torch.ones(3), torch.tensor([5] * hvd.size())),
                      "splits")

