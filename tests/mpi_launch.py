"""Launch the MPI tests under the venv's own mpirun, with a timeout and a size check:
``mpi_pytest`` runs a pytest suite of tests/mpi on n ranks (tests/mpi/conftest.py makes the
ranks agree on every verdict), ``mpirun`` runs one of the scripts there that are programs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

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
        assert proc.returncode == 0, \
            f"{script} on {n} ranks exited {proc.returncode}:\n{out[-6000:]}"
        assert f"OK size={n}" in proc.stdout, \
            f"{script} on {n} ranks did not report OK:\n{out[-6000:]}"
    return proc


def pytest_argv(*test_files: str) -> list:
    """``-m pytest ...`` for ``tests/mpi/<test_file>`` ...: no cache (the ranks would all
    write it), no colour (Open MPI gives the ranks a terminal), and no Hypothesis plugin (it
    imports Hypothesis at the end of every session, about 0.5 s of CPU per rank; @given tests
    run the same examples without it)."""
    return ["-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", *(str(HERE / "mpi" / f) for f in test_files)]


COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)\b")


def summary_counts(stdout: str) -> dict:
    """The counts of pytest's summary line ("1 failed, 11 passed in 3.21s"), e.g.
    {"passed": 11, "failed": 1}; {} if there is none."""
    for line in reversed(re.sub(r"\x1b\[[0-9;]*m", "", stdout).splitlines()):
        if re.search(r" in \d+(\.\d+)?s\b", line) and \
                (COUNT.search(line) or "no tests ran" in line):
            return {what.rstrip("s") if what in ("errors", "warnings") else what: int(number)
                    for number, what in COUNT.findall(line)}
    return {}


def check_passed(proc, what: str) -> dict:
    """The run exited 0 and its summary counts some passed tests and no failed ones."""
    out = proc.stdout + proc.stderr
    counts = summary_counts(proc.stdout)
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-8000:]}"
    assert counts.get("passed", 0) > 0, f"{what}: no test passed ({counts}):\n{out[-8000:]}"
    assert not (counts.get("failed") or counts.get("error")), f"{what}: {counts}:\n{out[-8000:]}"
    return counts


def mpi_pytest(n: int, *test_files: str, timeout: float = 180):
    """Run the pytest suites ``tests/mpi/<test_file>`` ... together on n ranks: it must exit 0
    and report passed tests and no failures (rank 0 prints the report). Returns the
    CompletedProcess. N unconnected one-rank jobs (a wrong mpirun) fail the size check in
    tests/mpi/conftest.py."""
    proc = launch.run(n, pytest_argv(*test_files), timeout=timeout,
                      env={"HVCOMM_TEST_EXPECT_SIZE": str(n)})
    check_passed(proc, f"{', '.join(test_files)} on {n} ranks")
    return proc


def suites_by_size(suites: dict) -> dict:
    """{n: ([test_file, ...], their time bounds summed)} from {test_file: (sizes, bound in
    s)}: each size's suites run in one mpirun (:func:`run_suites`), since a launch costs
    seconds of MPI start-up and imports, more than most suites take."""
    by_size: dict = {}
    for test_file, (sizes, bound) in suites.items():
        for n in sizes:
            files, total = by_size.get(n, ([], 0))
            by_size[n] = (files + [test_file], total + bound)
    return dict(sorted(by_size.items()))


def sizes(suites: dict) -> list:
    """The sizes of ``suites``, as pytest parameters whose timeout is their run's bound (and
    a minute to start)."""
    return [pytest.param(n, id=str(n), marks=pytest.mark.timeout(bound + 60))
            for n, (_, bound) in suites_by_size(suites).items()]


def run_suites(n: int, suites: dict):
    """Every suite of ``suites`` ({test_file: (sizes, bound in s)}) that runs at size n, in
    one mpirun bounded by their bounds summed."""
    files, bound = suites_by_size(suites)[n]
    return mpi_pytest(n, *files, timeout=bound)
