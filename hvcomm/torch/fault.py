"""Process failures under MPI's own fault tolerance (ULFM: ``mpirun --with-ft ulfm``).

What hvcomm does when a process of the job dies, and the one place that knows the facts:

- :func:`enabled`: the job runs with fault tolerance (Open MPI sets ``OMPI_MCA_mpi_ft_enable``
  under ``--with-ft ulfm``, and the library has MPI_Comm_revoke/shrink/agree). Without it, a
  lost rank ends the whole job, as it always has.
- Every communicator hvcomm makes is :func:`track`-ed. The first MPI error that says a process
  failed (:func:`is_process_failure`) :func:`revoke`-s all of them, so that every surviving
  rank's pending or next hvcomm call fails at once (ERR_REVOKED) instead of waiting for a rank
  that waits for the dead one; the caller gets :class:`ProcessFailure` (a
  ``HorovodInternalError``, which is :class:`HvcommError`).
- :mod:`hvcomm.torch.elastic` then shrinks the world (:func:`shrink`) and starts hvcomm again
  on the survivors.
- A process that survived a failure must not call ``MPI_Finalize``: Open MPI 5's finalize
  waits in a PMIx fence that a failure can leave unfinished for ever (measured: always when a
  host has lost all its ranks, whose daemon has gone; now and then on one node too, 1 of 18
  runs). :func:`end_process` ends such a process after the other survivors are done, with its
  exit status, without it (atexit handlers registered before ``hvcomm.torch.init()`` do not
  run then; logging is shut down and stdout/stderr flushed). A rank whose exception escapes
  kills itself with SIGKILL: a process that merely exits is not reported to the others by Open
  MPI 5 (they would wait for it for ever), a killed one is.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from typing import List, Optional

from mpi4py import MPI

from collectives.errors import ProcessFailure

# ERR_IN_STATUS: how a wait on several requests (the sparse collectives' rounds) reports one
# of them failing; under fault tolerance that is a failed peer
FAILURE_CLASSES = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED,
                   MPI.ERR_IN_STATUS)

_tracked: List[MPI.Comm] = []
_generation = 0        # which start of hvcomm the tracked communicators belong to
_failures = 0          # revocations in this process (one per failure, per world)
_revoked = False       # the tracked communicators are revoked (until the next world)
_exit_status: object = 0
_ending_installed = False
_enabled: Optional[bool] = None  # enabled(), once known


def enabled() -> bool:
    """True when this job runs with MPI fault tolerance (``mpirun --with-ft ulfm``)."""
    global _enabled
    if _enabled is None:
        flag = os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "t")
        _enabled = (flag and hasattr(MPI.Comm, "Shrink")
                    and "Open MPI" in MPI.Get_library_version())
    return _enabled


def is_process_failure(error: BaseException) -> bool:
    """Under fault tolerance, the MPI error says a process of the communicator failed, or
    another rank revoked it (without fault tolerance no error is one: the job ends)."""
    return (isinstance(error, MPI.Exception) and error.Get_error_class() in FAILURE_CLASSES
            and enabled())


def track(*comms: MPI.Comm) -> None:
    """Revoke these communicators when a process fails."""
    _tracked.extend(c for c in comms if c != MPI.COMM_NULL)


def generation() -> int:
    """Which start of hvcomm this is: a thread of an earlier one (an engine that outlived its
    shutdown) must not revoke the communicators of the next."""
    return _generation


def untrack_all() -> None:
    """hvcomm has shut down: its communicators are no longer its own to revoke."""
    global _revoked, _generation
    _tracked.clear()
    _revoked = False
    _generation += 1


def broken() -> bool:
    """A process failure has revoked hvcomm's communicators (until hvcomm starts again)."""
    return _revoked


def revoke(of_generation: Optional[int] = None) -> None:
    """Interrupt every hvcomm communication on every surviving rank (idempotent); nothing when
    ``of_generation`` is given and is not the current one."""
    global _revoked, _failures
    if _revoked or (of_generation is not None and of_generation != _generation):
        return
    _revoked = True
    _failures += 1
    for comm in _tracked:
        try:
            comm.Revoke()
        except MPI.Exception:  # already revoked, or freed by the other side: nothing to stop
            pass


def failure_error(error: MPI.Exception, during: str, of_generation: int) -> ProcessFailure:
    """Revoke (the communicators of ``of_generation``), and the error every hvcomm caller on
    this rank gets for ``error``."""
    revoke(of_generation)
    return ProcessFailure(
        f"a process of the job failed while this rank ran {during} ({error.Get_error_string()}); "
        "inside hvcomm.torch.elastic.run the survivors restore the last commit and go on, "
        "elsewhere the job cannot continue")


def failed_in(world: MPI.Comm) -> bool:
    """Collective over the survivors (``MPI_Comm_agree``, valid on a revoked communicator):
    True on every one of them when a process of ``world`` has failed. A failure can reach a
    rank as another error first (a tree collective whose dead rank's partner went on to the
    next bucket reports mismatched buckets); this tells the two apart, the same way on every
    rank."""
    try:
        world.Agree(1)
    except MPI.Exception as error:
        if is_process_failure(error):
            return True
        raise
    return False


DEADLINE_S = float(os.environ.get("HVCOMM_ELASTIC_DEADLINE_S", 600))
"""How long a recovery may take before the rank gives up: it prints every thread's stack and
exits 1 (a safety net against a hang in MPI itself). A recovery waits for every survivor to
reach an hvcomm call: make it longer than the longest stretch without one (an evaluation)."""
# seconds between the ranks' MPI_Abort calls when an exception escapes outside elastic.run
ABORT_STAGGER_S = 0.5


@contextlib.contextmanager
def deadline():
    """Run the block under :data:`DEADLINE_S` (faulthandler's timer: it fires even while this
    thread is inside MPI)."""
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def shrink(world: MPI.Comm) -> MPI.Comm:
    """The survivors of ``world`` (collective over them; tolerant of further failures; the
    caller has revoked it)."""
    survivors = world.Shrink()
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    return survivors


# -- how a process ends once failures are possible ------------------------------------------------
def install_ending(world_of) -> None:
    """From now on (fault tolerance on): an exception that escapes ends this rank as a failed
    process inside ``hvcomm.torch.elastic.run`` (the others go on) and aborts the whole job
    elsewhere; after a survived failure, the process ends without MPI_Finalize
    (:func:`end_process`). ``world_of()`` gives the communicator of the survivors."""
    global _ending_installed
    if _ending_installed:
        return
    _ending_installed = True
    sys.excepthook = _uncaught
    real_exit = sys.exit

    def exit(status=None):  # noqa: A001 - keep the status a script asks for
        _record_status(status)
        real_exit(status)
    sys.exit = exit
    atexit.register(lambda: end_process(world_of()))


def _record_status(status) -> None:
    global _exit_status
    _exit_status = status


def _uncaught(exc_type, exc, tb) -> None:
    traceback.print_exception(exc_type, exc, tb)
    rank = MPI.COMM_WORLD.Get_rank()
    if getattr(exc, "everywhere", False):  # every rank raises it together: a clean error exit
        _record_status(1)
        sys.stderr.write("hvcomm: every rank stops with this error\n")
        sys.stderr.flush()
        return
    sys.stderr.flush()
    sys.stdout.flush()
    if not getattr(exc, "hvcomm_elastic", False):
        sys.stderr.write(f"hvcomm: uncaught exception on rank {rank}; aborting the whole job\n")
        sys.stderr.flush()
        # Under fault tolerance, MPI_Abort called by several ranks at once can leave mpirun
        # (prterun) hanging after every rank has gone: the lower ranks abort first, and rank
        # 0's abort usually ends the others before they call it (results/abort_under_ft.md).
        # A rank whose MPI_Abort itself hangs ends by itself (exit 1) after 15 s.
        time.sleep(ABORT_STAGGER_S * min(rank, 8))
        faulthandler.dump_traceback_later(15, exit=True)
        MPI.COMM_WORLD.Abort(1)
    # inside elastic.run: a killed process is reported to the others (an exiting one is not)
    sys.stderr.write(f"hvcomm: uncaught exception on rank {rank} in elastic.run: this rank ends "
                     "as a failed process and the others go on without it\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _status_code(status) -> int:
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1  # sys.exit("message"): Python prints it and exits 1


def end_process(world: Optional[MPI.Comm]) -> None:
    """After a survived failure: wait for the other survivors, then end the process here, with
    its exit status, without MPI_Finalize (see the module's docstring). Without a failure,
    nothing: mpi4py finalizes as always."""
    if _failures == 0 or MPI.Is_finalized() or world is None:
        return
    try:  # every survivor is done: nothing it sent is still on its way
        world.Barrier()
    except MPI.Exception:  # a further failure at the very end: nobody is left to wait for
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(_status_code(_exit_status))
