"""hvcomm's DistributedOptimizer and Horovod's, side by side in one job: same weights."""
import sys

from mpi4py import MPI  # noqa: F401 - mpi4py first, then Horovod on its communicator

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import Checks  # noqa: E402
from check_optimizer import BATCH, Net, assert_close, data, loss_fn, make_opt, shard  # noqa: E402

import horovod.torch as horovod  # noqa: E402
import hvcomm.torch as hvd  # noqa: E402


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


def check_same(passes, compression_name, tol):
    ours = train(hvd, 5, passes, compression_name)
    theirs = train(horovod, 5, passes, compression_name)
    assert_close(ours, theirs, tol=tol)


def main():
    horovod.init(comm=MPI.COMM_WORLD)
    hvd.init()
    checks = Checks()
    assert horovod.size() == hvd.size()
    checks.run("dense", check_same, 1, "none", 1e-12)
    checks.run("backward_passes_per_step=2", check_same, 2, "none", 1e-12)
    checks.run("fp16 compression", check_same, 1, "fp16", 1e-3)
    checks.finish()


if __name__ == "__main__":
    main()
