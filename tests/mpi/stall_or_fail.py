"""Scenarios for the watchdog, run by tests/test_reliability.py:
  stall SECONDS  - the last rank sleeps SECONDS before an allreduce the others wait in;
  fail           - a job raises on the last rank only while the others wait in its collective.
Rank 0 prints what it saw; nothing here may hang."""
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import hvcomm.torch as hvd
from hvcomm.torch.runtime import runtime

hvd.init()
r, n = hvd.rank(), hvd.size()
late = r == n - 1
if sys.argv[1] == "stall":
    if late:
        time.sleep(float(sys.argv[2]))
    print(f"rank {r} sum {hvd.allreduce(torch.ones(4), op=hvd.Sum, name='late_one')[0].item()}",
          flush=True)
else:
    def job(comm):
        if late:
            raise RuntimeError("deliberate failure in a job")
        comm.Allreduce(MPI.IN_PLACE, np.zeros(3), op=MPI.SUM)

    t0 = time.monotonic()
    try:
        runtime().engine.submit(job, "ALLREDUCE deliberate").wait()
    except Exception as e:  # noqa: BLE001 - what each rank saw is the point
        print(f"rank {r} raised after {time.monotonic() - t0:.1f} s: {e}", flush=True)
