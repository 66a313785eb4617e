"""hvcomm's DistributedOptimizer and Horovod's, side by side in one job: same weights."""
import pytest
import torch
from mpi4py import MPI  # mpi4py first, then Horovod on its communicator

import hvcomm.torch as hvd

from harness import default_dtype
from training import BATCH, Net, assert_close, data, loss_fn, make_opt, shard

horovod = pytest.importorskip("horovod.torch",
                              reason="Horovod is not installed (scripts/setup_env.sh builds it)")


@pytest.fixture(scope="module", autouse=True)
def started(request):
    others = {item.path for item in request.session.items} - {request.path}
    if others:  # the same on every rank: every rank skips
        pytest.skip("Horovod is initialised first in its own process, as check_vs_horovod.py "
                    "was (horovod.init hangs after hvcomm.torch.shutdown in the same process): "
                    "run this file alone, as tests/test_torch_mpi.py does")
    with default_dtype(torch.float64):
        horovod.init(comm=MPI.COMM_WORLD)
        hvd.init()
        assert horovod.size() == hvd.size()
        yield


def train(module, steps, passes, compression_name):
    r = hvd.rank()
    model = Net()
    opt = module.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                      backward_passes_per_step=passes,
                                      compression=getattr(module.Compression, compression_name))
    for s in range(steps):
        x, y = data(s, hvd.size())
        x, y = shard(x, r), shard(y, r)
        opt.zero_grad()
        for c in range(passes):
            part = slice(c * BATCH // passes, (c + 1) * BATCH // passes)
            loss_fn(model, x[part], y[part]).backward()  # Horovod sums the passes
        opt.step()
    return model


@pytest.mark.parametrize("passes, compression_name, tol", [
    pytest.param(1, "none", 1e-12, id="dense"),
    pytest.param(2, "none", 1e-12, id="backward_passes_per_step=2"),
    pytest.param(1, "fp16", 1e-3, id="fp16-compression"),
])
def test_same_weights(passes, compression_name, tol):
    ours = train(hvd, 5, passes, compression_name)
    theirs = train(horovod, 5, passes, compression_name)
    assert_close(ours, theirs, tol=tol)
