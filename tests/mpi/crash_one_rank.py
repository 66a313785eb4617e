"""The last rank raises while the others wait in a collective: the job must end, not hang."""
import os

import torch

import hvcomm.torch as hvd

hvd.init()
expect = int(os.environ["HVCOMM_TEST_EXPECT_SIZE"])
if hvd.size() != expect:  # a wrong mpirun: one-rank jobs, each of which would "fail" alone
    raise SystemExit(f"expected {expect} ranks, mpirun started {hvd.size()}")
if hvd.rank() == 0:
    print(f"started size={hvd.size()}", flush=True)
if hvd.rank() == hvd.size() - 1:
    raise RuntimeError("deliberate failure on the last rank")
hvd.allreduce(torch.ones(4))
print("unreachable: allreduce returned without the failed rank")
