"""Build and run ``mpirun`` command lines for the venv's own Open MPI (no torch import)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def find_mpirun() -> str:
    """The mpirun next to this Python (the venv's Open MPI), else the one on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpirun found: run scripts/setup_env.sh, or put Open MPI's "
                                "mpirun on PATH")
    return found


def mpi_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for Open MPI 5 on a small machine: root allowed, yield when idle."""
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def mpirun_cmd(n: int, argv: Sequence[str], mpi_args: Sequence[str] = ()) -> List[str]:
    """``mpirun -n N --oversubscribe ... python -m mpi4py ARGV`` (mpi4py aborts all ranks on
    an uncaught exception instead of leaving the others hanging)."""
    return [find_mpirun(), "-n", str(n), "--oversubscribe", "--bind-to", "none", *mpi_args,
            sys.executable, "-m", "mpi4py", *argv]


def run(n: int, argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
        mpi_args: Sequence[str] = (), capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m mpi4py ARGV`` on n ranks of this machine."""
    return subprocess.run(mpirun_cmd(n, argv, mpi_args), env=mpi_env(env), timeout=timeout,
                          capture_output=capture, text=True)
