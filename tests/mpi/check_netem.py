"""Runs across an emulated cluster: each rank reports its network namespace; ranks 0 and 1
time a transfer over their link in each direction; a float16 cast allreduce sums exactly."""
import json
import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as C

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import Checks  # noqa: E402


def main():
    checks = Checks()
    comm = MPI.COMM_WORLD
    ns = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                        text=True).stdout.strip()
    names = comm.gather(ns)
    nbytes = int(sys.argv[1])
    buf = np.ones(nbytes, np.uint8)

    def transfer(src, dest):
        comm.Barrier()
        t0 = time.perf_counter()
        if comm.rank == src:
            comm.Send(buf, dest=dest)
        elif comm.rank == dest:
            comm.Recv(buf, source=src)
        comm.Barrier()
        return time.perf_counter() - t0
    seconds = [transfer(0, 1), transfer(1, 0)]

    def float16_sum():
        x = np.arange(1000, dtype=np.float16) + comm.rank
        C.icast_allreduce(comm, x).wait()
        want = np.arange(1000) * comm.size + sum(range(comm.size))
        np.testing.assert_array_equal(x, want.astype(np.float16))
    checks.run("float16 sum", float16_sum)
    if comm.rank == 0:
        print(json.dumps({"namespaces": names, "seconds": seconds}))
    checks.finish()


if __name__ == "__main__":
    main()
