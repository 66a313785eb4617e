"""The same command with the same seeds gives bitwise-identical final weights, for every way
of synchronising hvcomm offers (a few steps of each, run twice); and, with the portable
kernels, on machines whose CPUs differ."""
import json

import pytest

from hvcomm.cluster.launch import PORTABLE_KERNELS
from mpi_launch import mpirun


def digests(n, *methods, env=None):
    proc = mpirun(n, "check_reproducible.py", *methods, timeout=300, env=env)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("n", [2, 3])
def test_two_runs_give_identical_weights(n):
    first, second = digests(n), digests(n)
    assert first == second, {m: (first[m][:12], second[m][:12]) for m in first
                             if first[m] != second[m]}
    assert set(first) == {"none", "fp16", "topk", "gtopk", "randomk", "twobit", "powersgd",
                          "wfbp", "od-sgd", "ssd-sgd", "cd-sgd", "p3"}  # train_resumable's
    assert first["none"] != first["gtopk"] != first["od-sgd"]  # the digests see the weights


# A machine whose CPU offers only the oldest x86 kernels, emulated on this one: torch's
# dispatch held to its DEFAULT kernels and MKL to SSE4.2 (as an AVX2-only or an AMD CPU would
# move MKL to other kernels than an Intel AVX-512 one does).
OLDER_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def test_portable_kernels_give_the_same_weights_on_different_cpus():
    methods = ("none", "gtopk", "od-sgd")
    native = digests(2, *methods), digests(2, *methods, env=OLDER_CPU)
    if native[0] == native[1]:
        pytest.skip("this CPU's own kernels already give the older CPU's weights: nothing "
                    "for the portable kernels to show here")
    portable = (digests(2, *methods, env=PORTABLE_KERNELS),
                digests(2, *methods, env={**OLDER_CPU, **PORTABLE_KERNELS}))
    assert portable[0] == portable[1], {m: (portable[0][m][:12], portable[1][m][:12])
                                        for m in methods if portable[0][m] != portable[1][m]}
