"""The last rank raises while the others wait in a collective: the job must end, not hang."""
import torch

import hvcomm.torch as hvd

hvd.init()
if hvd.rank() == hvd.size() - 1:
    raise RuntimeError("deliberate failure on the last rank")
hvd.allreduce(torch.ones(4))
print("unreachable: allreduce returned without the failed rank")
