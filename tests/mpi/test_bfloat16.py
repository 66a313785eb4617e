"""bfloat16 through DistributedOptimizer: dense and Compression.fp16 gradients (bfloat16 stays
bfloat16 on the wire), float32 gradients through Compression.bf16, on a small tensor (Open
MPI's path) and a large one (the ring), each in a bucket (or P3 slice) of its own, against a
serial loop over the simulated ranks; and the compressors that cannot take it say which can.
With them, the engine's rings in flight together (float32, bfloat16, float16 on the wire)
between buckets on Open MPI's path.

Each rank's gradient is its own input (loss = sum(w * x)): integers, times 2**20 where the wire
is bfloat16, so every sum is exact in bfloat16 whatever the order, and would overflow float16
(a bfloat16 wire cast to float16 fails the test). With op=Sum and SGD at lr=1 the weights
after a step are exactly w0 - sum over ranks of x."""
import numpy as np
import pytest
import torch

import hvcomm.torch as hvd

from harness import expect_everywhere

SHAPES = {"small": (3, 5), "large": (400, 400)}  # 320 KB of bfloat16: the ring


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()


def rank_input(rank, name, dtype, scale, shape=None):
    gen = torch.Generator().manual_seed(1000 * rank + len(name))
    return (torch.randint(-8, 9, shape or SHAPES[name], generator=gen) * scale).to(dtype)


class Weights(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        for name, shape in SHAPES.items():
            start = torch.arange(np.prod(shape), dtype=torch.float64).reshape(shape) % 7
            self.register_parameter(name, torch.nn.Parameter(start.to(dtype)))


@pytest.mark.parametrize("param_dtype, compression, wire, schedule", [
    (torch.bfloat16, "none", torch.bfloat16, None),
    (torch.bfloat16, "fp16", torch.bfloat16, None),
    (torch.float32, "fp16", torch.float16, None),
    (torch.float32, "bf16", torch.bfloat16, None),
    (torch.bfloat16, "none", torch.bfloat16, "p3"),  # one slice a tensor
])
def test_one_step_equals_the_serial_loop(param_dtype, compression, wire, schedule):
    scale = 2.0 ** 20 if wire == torch.bfloat16 else 1.0
    model = Weights(param_dtype)
    how = (dict(schedule="p3", slice_elems=int(np.prod(SHAPES["large"])))
           if schedule else dict(fusion_threshold_bytes=0))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression),
                                   op=hvd.Sum, **how)
    if schedule is None:  # a bucket each: the small one on Open MPI's path
        assert len(opt.plan) == len(SHAPES)
    loss = sum((p * rank_input(hvd.rank(), n, param_dtype, scale)).sum()
               for n, p in model.named_parameters())
    loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        total = sum(rank_input(q, name, torch.float64, scale) for q in range(hvd.size()))
        sent = total.to(wire).to(torch.float64)  # the sum as the wire carries it (exact here)
        want = Weights(torch.float64).get_parameter(name).detach() - sent
        assert p.dtype == param_dtype
        assert torch.equal(p.detach(), want.to(param_dtype)), name


@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_compressors_that_cannot_take_bfloat16_say_which_can(compression):
    model = Weights(torch.bfloat16)
    factory = getattr(hvd.Compression, compression)
    expect_everywhere(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters(),
        compression=factory(0.1) if compression == "topk" else factory()),
        "Compression.none or Compression.fp16")



# launched last first: the large ones take the ring (HVCOMM_RING_MIN_BYTES below), "b" and "e"
# Open MPI's allreduce; no two the same size
INTERLEAVED = {"a": (400, 400), "b": (3, 5), "c": (300, 410), "d": (390, 300), "e": (7,),
               "f": (200, 400)}


@pytest.mark.parametrize("param_dtype, compression, wire, op", [
    (torch.float32, "none", torch.float32, "Sum"),
    (torch.bfloat16, "none", torch.bfloat16, "Sum"),
    (torch.float32, "fp16", torch.float16, "Sum"),
    (torch.bfloat16, "none", torch.bfloat16, "Average"),  # a 16-bit sum scaled after the ring
])
def test_buckets_on_the_wire_together_equal_the_serial_loop(param_dtype, compression, wire, op,
                                                              monkeypatch):
    """The engine starts a bucket's ring while the one before it is still under way, and
    waits for them before a bucket that goes over Open MPI's allreduce: a bucket a tensor,
    rings and Open MPI's path interleaved, three steps, every average exact against the serial
    loop (with op=Average each input a multiple of 3 * 2**20: its sum over 2 or 3 ranks
    divides exactly)."""
    from hvcomm.torch.runtime import runtime
    monkeypatch.setenv("HVCOMM_RING_MIN_BYTES", "100000")
    n = hvd.size()
    scale = (2.0 ** 20 if wire == torch.bfloat16 else 1.0) * (3 if op == "Average" else 1)
    engine = runtime().engine
    started_before = engine._started
    model = torch.nn.Module()
    for name, shape in INTERLEAVED.items():
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=param_dtype)))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression),
                                   op=getattr(hvd, op), fusion_threshold_bytes=0)
    for step in range(3):
        inputs = {q: {name: rank_input(100 * q + 10 * step + j, name, torch.float64, scale,
                                       shape)
                      for j, (name, shape) in enumerate(INTERLEAVED.items())}
                  for q in range(n)}
        opt.zero_grad()
        sum((p * inputs[hvd.rank()][name].to(param_dtype)).sum()
            for name, p in model.named_parameters()).backward()
        opt.step()
        for name, p in model.named_parameters():
            total = sum(inputs[q][name] for q in range(n)).to(wire).double()
            want = total / n if op == "Average" else total
            assert torch.equal(p.grad.double(), want), (step, name)
    wire_bytes = torch.finfo(wire).bits // 8
    rings = sum(np.prod(s) * wire_bytes >= 100000 for s in INTERLEAVED.values())
    assert engine._started - started_before == (3 * rings if n > 1 else 0)
