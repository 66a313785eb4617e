"""The batch scripts under a real Slurm: the local Slurm (scripts/slurm_local.sh) with 2 emulated
nodes at 1 Gbit/s, slurm/ethernet.sbatch launched by mpirun and by srun, and a job whose
environment is missing failing at once."""
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from hvcomm.cluster import netem, slurm_local

ROOT = Path(__file__).resolve().parent.parent
UP = ["bash", str(ROOT / "scripts" / "slurm_local.sh")]
if os.geteuid() != 0:
    pytest.skip("the local Slurm needs root (daemons, namespaces, apt-get)",
                allow_module_level=True)
if netem.unsupported_reason():
    pytest.skip(f"no emulated nodes here: {netem.unsupported_reason()}", allow_module_level=True)


@pytest.fixture(scope="module")
def slurm():
    """The local Slurm with 2 nodes at 1gbit; installed first if need be (skipped only when
    that is impossible here); always taken down."""
    proc = subprocess.run([*UP, "up", "--nodes", "2", "--rate", "1gbit"], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"Slurm cannot be installed here: {proc.stderr.strip()[-500:]}")
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield slurm_local.slurm_env()
    finally:
        subprocess.run([*UP, "down"], capture_output=True, text=True, timeout=120)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert slurm_local.PREFIX not in listed, f"namespaces left behind:\n{listed}"
        assert subprocess.run(["pgrep", "-x", "slurmctld"]).returncode != 0, "slurmctld left"


def submit(env, *args, extra_env=None):
    """sbatch --wait a job of slurm/ethernet.sbatch; (exit code, its log)."""
    log = Path(tempfile.mkdtemp(prefix="hvcomm-slurm-test-")) / "job.out"
    proc = subprocess.run(["sbatch", "--wait", f"--output={log}", *args],
                          cwd=ROOT, env={**env, **(extra_env or {})}, capture_output=True,
                          text=True, timeout=600)
    text = log.read_text() if log.exists() else ""
    return proc.returncode, proc.stdout + proc.stderr + text


GTOPK = ["slurm/ethernet.sbatch", "scripts/train_digits.py", "--method", "gtopk-0.001",
         "--epochs", "2"]


@pytest.mark.parametrize("launcher, per_node", [("mpirun", 1), ("srun", 2)])
def test_ethernet_job_spans_the_nodes(slurm, launcher, per_node):
    rc, log = submit(slurm, "--nodes=2", f"--ntasks-per-node={per_node}", *GTOPK,
                     extra_env={"LAUNCHER": launcher})
    assert rc == 0, log
    size = 2 * per_node
    assert f"P: {size} ranks = 2 nodes x {per_node} tasks per node" in log, log
    assert f"launched by {launcher}" in log and "shaped to rate 1Gbit" in log, log
    assert "method: gtopk-0.001" in log, log
    # what MPI itself saw: the world size, and ranks on both emulated nodes
    assert f"world size {size} on 2 hosts: node1, node2" in log, log
    acc = re.search(r"final test acc (\d\.\d+)", log)
    assert acc and float(acc.group(1)) > 0.5, log
    assert "exit 0" in log, log


def test_missing_environment_fails_at_once(slurm):
    rc, log = submit(slurm, "--nodes=1", *GTOPK, extra_env={"HVCOMM_VENV": "/nonexistent"})
    assert rc != 0, log
    assert "cannot start this job: no environment at /nonexistent" in log, log
    assert "world size" not in log, log


def test_infiniband_job_refuses_the_pypi_open_mpi(slurm):
    """This environment holds the PyPI Open MPI: the InfiniBand job must stop before any rank
    starts, saying how to build against the site's MPI."""
    rc, log = submit(slurm, "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1",
                     "slurm/infiniband.sbatch", "--epochs", "1")
    assert rc != 0, log
    assert "not the site's MPI" in log and "HVCOMM_SYSTEM_MPI=1" in log, log
    assert "world size" not in log, log
