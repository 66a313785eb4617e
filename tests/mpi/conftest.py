"""pytest on every rank of an MPI job, with one verdict per test for all ranks:

    mpirun -n 2 python -m pytest tests/mpi/test_optimizer.py -k checkpoint

- The size check: if HVCOMM_TEST_EXPECT_SIZE is set and differs from the size of
  COMM_WORLD, every process exits at once ("... wrong mpirun?"): a wrong mpirun starts N
  unconnected one-rank jobs, which would each pass alone.
- The same tests in the same order: after collection (and -k/-m deselection) the ranks
  compare their lists of test ids; if any rank differs, or collected with errors the others
  did not have, every rank stops before running anything (a test run by only some ranks
  would leave the others waiting in its collectives).
- One verdict: after each phase of each test (setup, call, teardown) the ranks allgather
  their outcomes, on a communicator of their own (a duplicate of COMM_WORLD), and every rank
  takes the same one:
    any rank failed                       -> failed on every rank; the report holds every
                                             failing rank's traceback, headed by its number;
    every rank skipped                    -> skipped;
    some ranks skipped, the others passed -> failed on every rank (a test runs on every rank
                                             or on none: skip on a condition all ranks share);
    every rank passed                     -> passed.
  A failed setup is thus failed everywhere and no rank runs that test's body, and -x stops
  every rank after the same test.
- Only rank 0 prints a report; the other ranks' reports go to /dev/null (their exit code
  is the same, as their outcomes are). Before exiting, the ranks wait for each other, so
  rank 0 has written its summary before any rank ends the job (``python -m mpi4py`` aborts
  the job when a rank exits non-zero).
"""
import os
import sys

import pytest
from mpi4py import MPI

from harness import wrong_size

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
_comm = None  # a duplicate of COMM_WORLD for the verdicts, set up in pytest_configure
_devnull = None  # where the report of a rank > 0 goes


@pytest.hookimpl(trylast=True)  # after the terminal plugin has made its reporter
def pytest_configure(config):
    global _comm
    problem = wrong_size(WORLD)
    if problem:
        pytest.exit(problem, returncode=3)  # before any collective: written to stderr
    _comm = WORLD.Dup()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if RANK != 0 and reporter is not None:
        # pytest offers no public way to point its reporter elsewhere once it exists; its
        # writer is reporter._tw (-p no:terminal would also silence it, but must be given
        # on the command line, and on rank 0 it is not wanted)
        from _pytest.config import create_terminal_writer
        global _devnull
        _devnull = open(os.devnull, "w")
        reporter._tw = create_terminal_writer(config, _devnull)


def pytest_unconfigure(config):
    if _comm is not None:
        sys.stdout.flush()
        _comm.Barrier()  # rank 0's report is out before any rank may end the job
        _comm.Free()
    if _devnull is not None:
        _devnull.close()


def pytest_collection_finish(session):
    mine = ([item.nodeid for item in session.items], session.testsfailed)
    everyone = _comm.allgather(mine)
    if all(theirs == everyone[0] for theirs in everyone):
        return  # also when every rank has the same collection errors: pytest stops them alike
    lines = ["the ranks collected different tests; no rank runs any:"]
    for q, (ids, errors) in enumerate(everyone):
        lines.append(f"  rank {q}: {len(ids)} tests, {errors} collection errors")
    first = set(everyone[0][0])
    for q, (ids, _) in enumerate(everyone[1:], 1):
        only = sorted(set(ids) ^ first)[:5]
        if only:
            lines.append(f"  rank {q} and rank 0 differ in: {', '.join(only)}")
    pytest.exit("\n".join(lines), returncode=pytest.ExitCode.INTERRUPTED)


def _own_account(rep):
    """What the other ranks need to know of this rank's report: (outcome, its one-line
    message, the full text, the captured output)."""
    if rep.passed:
        return "passed", "", "", []
    if rep.skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longreprtext
        return "skipped", reason.removeprefix("Skipped: "), "", []
    crash = getattr(getattr(rep.longrepr, "reprcrash", None), "message", "")
    return "failed", crash.split("\n")[0], rep.longreprtext, rep.sections


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: sees the report as pytest made it
def pytest_runtest_makereport(item, call):
    rep = yield
    everyone = _comm.allgather(_own_account(rep))
    by = {o: [q for q, account in enumerate(everyone) if account[0] == o]
          for o in ("failed", "skipped", "passed")}
    if not by["failed"] and not (by["skipped"] and by["passed"]):
        return rep  # every rank passed, or every rank skipped
    where = "; ".join(f"{o} on rank{'s' if len(qs) > 1 else ''} {', '.join(map(str, qs))}"
                      for o, qs in by.items() if qs)
    first = everyone[by["failed"][0]][1] if by["failed"] else "skipped on some ranks only"
    text = [f"[{rep.when}] {where} (of {SIZE}): {first}"]
    for q in by["failed"]:
        _, _, longrepr, sections = everyone[q]
        text.append(f"{'=' * 30} rank {q} {'=' * 30}\n{longrepr}")
        if q != RANK:  # this rank's own captured output is shown with its report
            text.extend(f"{'-' * 10} rank {q}: {title} {'-' * 10}\n{body}"
                        for title, body in sections)
    if not by["failed"]:
        text.append("a test must run on every rank or on none: skip only on a condition "
                    "every rank shares")
    for q in by["skipped"]:
        text.append(f"rank {q} skipped: {everyone[q][1]}")
    rep.outcome = "failed"
    rep.longrepr = "\n".join(text)
    if hasattr(rep, "wasxfail"):
        del rep.wasxfail
    return rep
