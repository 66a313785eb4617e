"""The same command with the same seeds gives bitwise-identical final weights, for every way
of synchronising hvcomm offers (a few steps of each, run twice); and, with the portable
kernels, on machines whose CPUs differ."""
import json

import pytest

from hvcomm.cluster import launch
from hvcomm.cluster.launch import PORTABLE_KERNELS
from mpi_launch import HERE, mpirun


def digests(n):
    proc = mpirun(n, "check_reproducible.py", timeout=300)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def test_two_runs_give_identical_weights():
    n = 3  # an odd size: the sums in the most orders
    first, second = digests(n), digests(n)
    assert first == second, {m: (first[m][:12], second[m][:12]) for m in first
                             if first[m] != second[m]}
    assert set(first) == {"none", "fp16", "topk", "gtopk", "randomk", "twobit", "powersgd",
                          "wfbp", "od-sgd", "ssd-sgd", "cd-sgd", "p3"}  # train_resumable's
    assert first["none"] != first["gtopk"] != first["od-sgd"]  # the digests see the weights


# The main job's digits model (float32 MLP of scripts/workloads.py, MKL's matrix products),
# one epoch on 2 ranks
TRAIN = HERE.parent / "scripts" / "train.py"
OLDER_MKL = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}  # an older CPU's MKL, emulated on this one
DEFAULT_ATEN = {"ATEN_CPU_CAPABILITY": "default"}


def main_job_digest(tmp_path, env):
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    proc = launch.run(2, [str(TRAIN), "--method", "hvcomm-dense", "--epochs", "1", "--out",
                          str(out)], timeout=300, env=env)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["ranks"] == 2, result  # not two unconnected one-rank jobs
    return result["final_weights_sha256"]


def test_portable_kernels_give_the_same_weights_on_different_cpus(tmp_path):
    """With torch's DEFAULT kernels, MKL's instruction set alone changes the digest; with
    PORTABLE_KERNELS (torch DEFAULT, MKL_CBWR=COMPATIBLE) this CPU and the emulated older
    one give the same. torch's own kernels are the same in both by construction: the
    portable mode forces them."""
    this_cpu = main_job_digest(tmp_path, DEFAULT_ATEN)
    older_cpu = main_job_digest(tmp_path, {**DEFAULT_ATEN, **OLDER_MKL})
    if this_cpu == older_cpu:
        pytest.skip("MKL's SSE4.2 kernels give this CPU's own digest here: nothing for the "
                    "portable kernels to show")
    assert (main_job_digest(tmp_path, PORTABLE_KERNELS)
            == main_job_digest(tmp_path, {**OLDER_MKL, **PORTABLE_KERNELS}))
