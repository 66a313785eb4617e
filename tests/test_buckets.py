"""Gathering a bucket's gradients (the residual added and the cast to the wire's dtype done on
the way) and writing the averaged sums back (cast and scaled): each result against the plain
step-by-step computation, bit for bit."""
import pytest
import torch

from hvcomm.torch.methods import Compression
from hvcomm.torch.methods.buckets import flat_grad, scaled_in, set_grad, split


def _params(*dtypes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n, dtype in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(3, n + 2, dtype=dtype))
        p.grad = (torch.randn(3, n + 2, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("wire", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("predivide", [1.0, 3.0])
@pytest.mark.parametrize("residual", [False, True])
def test_flat_grad_is_cat_divide_add_then_cast(wire, predivide, residual):
    params = _params(torch.float32, torch.float32, torch.float32)
    gen = torch.Generator().manual_seed(2)
    plus = torch.randn(sum(p.numel() for p in params), generator=gen) if residual else None
    want = torch.cat([p.grad.reshape(-1) for p in params]) / predivide
    want = want + plus if residual else want
    want = want if wire is None else want.to(wire)
    got = flat_grad(params, predivide, wire, None if plus is None else plus.clone())
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_flat_grad_promotes_mixed_dtypes_and_fills_missing_and_sparse_gradients():
    params = _params(torch.float32, torch.float64, torch.float32)
    params[2].grad = None
    sparse = torch.nn.Parameter(torch.zeros(4, 2))
    sparse.grad = torch.sparse_coo_tensor([[1, 3]], torch.tensor([[1.5, 2.0], [-1.0, 4.0]]),
                                          (4, 2), check_invariants=True)
    got = flat_grad(params + [sparse])
    want = torch.cat([params[0].grad.double().reshape(-1), params[1].grad.reshape(-1),
                      torch.zeros(params[2].numel(), dtype=torch.float64),
                      torch.tensor([0, 0, 1.5, 2.0, 0, 0, -1.0, 4.0], dtype=torch.float64)])
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(params[2].grad, torch.zeros_like(params[2]))


@pytest.mark.parametrize("total_dtype,grad_dtype", [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32), (torch.float64, torch.float32),
    (torch.float16, torch.float16)])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_set_grad_and_scaled_in_scale_in_the_wider_dtype(total_dtype, grad_dtype, scale):
    p = _params(grad_dtype)[0]
    gen = torch.Generator().manual_seed(1)
    total = (torch.randn(p.numel(), generator=gen, dtype=torch.float64) * 50).to(total_dtype)
    wide = total_dtype if torch.promote_types(total_dtype, grad_dtype) == total_dtype \
        else grad_dtype
    want = (total.to(wide) * scale).to(grad_dtype).view(p.shape)

    got = scaled_in(total.clone(), grad_dtype, scale)
    assert got.dtype == grad_dtype and torch.equal(got.view(p.shape), want)

    grad = p.grad
    set_grad(p, total.clone(), scale)
    assert p.grad is grad and torch.equal(p.grad, want)  # in place


def test_set_grad_keeps_a_sparse_gradient_sparse():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.sparse_coo_tensor([[0]], torch.ones(1, 2), (4, 2), check_invariants=True)
    total = torch.arange(8, dtype=torch.float16)
    set_grad(p, total, 0.5)
    assert p.grad.is_sparse
    assert torch.equal(p.grad.to_dense(), (total.float() * 0.5).view(4, 2))


F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.mark.parametrize("dtypes", [(F32, F32), (F64, F64), (F32, F64), (F16, F32), (BF16, F32),
                                    (F16, F16)])
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_a_bucket_trip_equals_the_step_by_step_one(dtypes, compression, scale):
    """Gather, encode, decode (one rank: the sum is the payload) and write back, against:
    concatenate in the common dtype, cast float32/float64 to the wire's dtype, cast back,
    scale in the common dtype, round into each gradient's dtype."""
    params = _params(*dtypes)
    comp = getattr(Compression, compression)
    common = torch.cat([p.grad.reshape(-1) for p in params])
    wire = {"none": common.dtype, "fp16": F16, "bf16": BF16}[compression]
    sent = common.to(wire) if common.dtype in (F32, F64) else common
    back = sent.to(common.dtype) * scale
    want = [part.view(p.shape).to(p.dtype)
            for (_, part), p in zip(split(back, [p.numel() for p in params]), params)]

    flat = flat_grad(params, 1.0, comp.gather_dtype(params))
    payload = comp.encode(flat)
    total = comp.decode(payload.data, payload)
    for (j, part), p in zip(split(total, [p.numel() for p in params]), params):
        set_grad(p, part, scale)
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, want[j]), (j, p.dtype)


def test_set_grad_writes_into_a_gradient_that_requires_grad():
    """As after backward(create_graph=True)."""
    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = torch.ones(2, 3).requires_grad_()
    set_grad(p, torch.arange(6.0), 0.5)
    assert torch.equal(p.grad.detach(), torch.arange(6.0).view(2, 3) * 0.5)
