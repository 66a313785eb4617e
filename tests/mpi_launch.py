"""Launch an MPI test script under the venv's own mpirun, with a timeout and a size check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MPIRUN = Path(sys.executable).parent / "mpirun"


def mpi_env(n: int) -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", HVCOMM_TEST_EXPECT_SIZE=str(n),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def mpirun(n: int, script: str, *args: str, timeout: float = 180, check_ok: bool = True):
    """Run ``tests/mpi/<script>`` on n ranks. Returns the CompletedProcess.

    With ``check_ok`` the run must exit 0 and rank 0 must print ``OK size=<n>``: N
    unconnected one-rank jobs (a wrong mpirun) fail the size check inside the script.
    """
    cmd = [str(MPIRUN), "-n", str(n), "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", "mpi4py", str(HERE / "mpi" / script), *args]
    proc = subprocess.run(cmd, env=mpi_env(n), capture_output=True, text=True, timeout=timeout)
    if check_ok:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{script} on {n} ranks exited {proc.returncode}:\n{out[-6000:]}"
        assert f"OK size={n}" in proc.stdout, f"{script} on {n} ranks did not report OK:\n{out[-6000:]}"
    return proc
