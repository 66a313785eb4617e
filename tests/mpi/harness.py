"""Shared by the MPI tests: the size check, expect_everywhere, assert_none_anywhere,
with_grads, and ``Checks`` (the one-verdict runner of the scripts that are programs, not pytest
suites: check_netem.py, check_reproducible.py, train_resumable.py; the pytest suites agree through
conftest.py)."""
from __future__ import annotations

import contextlib
import os
import sys
import traceback

from mpi4py import MPI

from collectives.errors import HvcommError


def wrong_size(comm=MPI.COMM_WORLD):
    """The complaint if HVCOMM_TEST_EXPECT_SIZE is set and differs from ``comm``'s size, else
    None. A wrong mpirun starts N unconnected one-rank jobs, which would all pass alone."""
    expect = int(os.environ.get("HVCOMM_TEST_EXPECT_SIZE", comm.Get_size()))
    if comm.Get_size() != expect:
        return f"launched {comm.Get_size()} connected ranks, expected {expect}: wrong mpirun?"
    return None


def expect_everywhere(call, text):
    """``call()`` raises HvcommError mentioning ``text`` (on this rank; every rank runs it)."""
    try:
        call()
    except HvcommError as e:
        assert text in str(e), f"{text!r} not in {e}"
        return
    raise AssertionError(f"no error mentioning {text!r}")


def assert_none_anywhere(problems, comm=MPI.COMM_WORLD, shown=6):
    """Every rank raises the same AssertionError if any rank has ``problems`` (a list of
    lines), so that every rank fails, or xfails, alike."""
    everyone = comm.allgather(list(problems))
    lines = [f"rank {q}: {line}" for q, theirs in enumerate(everyone) for line in theirs]
    assert not lines, "\n".join(lines[:shown]) + (
        f"\n... {len(lines) - shown} more" if len(lines) > shown else "")


@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype set to ``dtype`` inside (as each script's process had it)."""
    import torch
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class Checks:
    """Collect failures per rank; ``finish`` combines them so every rank ends alike."""

    def __init__(self, comm=MPI.COMM_WORLD):
        self.comm = comm
        problem = wrong_size(comm)
        if problem:
            print(problem, file=sys.stderr)
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


def with_grads(*grads):
    """Parameters whose ``.grad`` are ``grads`` (what a Reducer gathers for a bucket)."""
    import torch  # (only here: the torch-free checks import this module too)
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        params.append(p)
    return params
