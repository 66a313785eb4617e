"""Shared by the MPI test scripts: size check, named checks, one verdict for all ranks."""
from __future__ import annotations

import os
import sys
import traceback

from mpi4py import MPI

from collectives.errors import HvcommError


def expect_everywhere(call, text):
    """``call()`` raises HvcommError mentioning ``text`` (on this rank; every rank runs it)."""
    try:
        call()
    except HvcommError as e:
        assert text in str(e), f"{text!r} not in {e}"
        return
    raise AssertionError(f"no error mentioning {text!r}")


class Checks:
    """Collect failures per rank; ``finish`` combines them so every rank ends alike."""

    def __init__(self, comm=MPI.COMM_WORLD):
        self.comm = comm
        expect = int(os.environ.get("HVCOMM_TEST_EXPECT_SIZE", comm.Get_size()))
        if comm.Get_size() != expect:
            print(f"launched {comm.Get_size()} connected ranks, expected {expect}: wrong mpirun?",
                  file=sys.stderr)
            sys.exit(3)
        self.failures = []
        self.count = 0

    def run(self, name, fn, *args, **kwargs):
        self.count += 1
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - reported below, on every rank
            self.failures.append(f"[rank {self.comm.Get_rank()}] {name}:\n{traceback.format_exc()}")

    def finish(self):
        everyone = self.comm.allgather(self.failures)
        bad = [f for fs in everyone for f in fs]
        if self.comm.Get_rank() == 0:
            for f in bad:
                print(f)
            if not bad:
                print(f"OK size={self.comm.Get_size()} checks={self.count}")
        sys.stdout.flush()
        if bad:
            sys.exit(1)
