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
- How a process ends, once failures are possible (no ``MPI_Finalize`` after a survived
  failure; an uncaught exception aborts the job): :mod:`hvcomm.torch.ending`.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
from typing import List, Optional

from mpi4py import MPI

from collectives.errors import ProcessFailure, env_number

# ERR_IN_STATUS: how a wait on several requests (the sparse collectives' rounds) reports one
# of them failing; under fault tolerance that is a failed peer
FAILURE_CLASSES = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED,
                   MPI.ERR_IN_STATUS)

_tracked: List[MPI.Comm] = []
_generation = 0        # which start of hvcomm the tracked communicators belong to
_failures = 0          # revocations in this process (one per failure, per world)
_revoked = False       # the tracked communicators are revoked (until the next world)
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


def lost_a_process(error: BaseException) -> bool:
    """``error`` is a lost process: hvcomm's :class:`ProcessFailure`, or the MPI error of
    :func:`is_process_failure`."""
    return isinstance(error, ProcessFailure) or is_process_failure(error)


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


def failures_met() -> int:
    """How many process failures this process has met and gone on from (0: none)."""
    return _failures


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
        "inside hvcomm.torch.elastic.run the survivors restore the newest commit they all have "
        "and go on, "
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


DEADLINE_S = env_number("HVCOMM_ELASTIC_DEADLINE_S", 600.0, "a number of seconds", 0.001, 1e7)
"""How long a recovery may take before the rank gives up: it prints every thread's stack and
exits 1 (a safety net against a hang in MPI itself). A recovery waits for every survivor to
reach an hvcomm call: make it longer than the longest stretch without one (an evaluation)."""


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
