"""The same command with the same seeds gives bitwise-identical final weights, for every way
of synchronising hvcomm offers (a few steps of each, run twice)."""
import json

import pytest

from mpi_launch import mpirun


def digests(n):
    proc = mpirun(n, "check_reproducible.py", timeout=300)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("n", [2, 3])
def test_two_runs_give_identical_weights(n):
    first, second = digests(n), digests(n)
    assert first == second, {m: (first[m][:12], second[m][:12]) for m in first
                             if first[m] != second[m]}
    assert set(first) == {"none", "fp16", "topk", "gtopk", "randomk", "twobit", "powersgd",
                          "wfbp", "od-sgd", "ssd-sgd", "cd-sgd", "p3"}  # train_resumable's
    assert first["none"] != first["gtopk"] != first["od-sgd"]  # the digests see the weights
