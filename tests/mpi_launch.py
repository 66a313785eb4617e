"""Launch an MPI test script under the venv's own mpirun, with a timeout and a size check."""
from __future__ import annotations

from pathlib import Path

from hvcomm.cluster import launch

HERE = Path(__file__).resolve().parent


def mpi_env(n: int) -> dict:
    return launch.mpi_env({"HVCOMM_TEST_EXPECT_SIZE": str(n)})


def mpirun(n: int, script: str, *args: str, timeout: float = 180, check_ok: bool = True):
    """Run ``tests/mpi/<script>`` on n ranks. Returns the CompletedProcess.

    With ``check_ok`` the run must exit 0 and rank 0 must print ``OK size=<n>``: N
    unconnected one-rank jobs (a wrong mpirun) fail the size check inside the script.
    """
    proc = launch.run(n, [str(HERE / "mpi" / script), *args], timeout=timeout,
                      env={"HVCOMM_TEST_EXPECT_SIZE": str(n)})
    if check_ok:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{script} on {n} ranks exited {proc.returncode}:\n{out[-6000:]}"
        assert f"OK size={n}" in proc.stdout, f"{script} on {n} ranks did not report OK:\n{out[-6000:]}"
    return proc
