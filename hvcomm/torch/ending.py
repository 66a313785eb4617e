"""How an hvcomm process ends: with the status its program meant, and with the job's outcome
recorded for the launcher (:mod:`hvcomm.cluster.outcome`).

- An uncaught exception on one rank aborts the whole job (``MPI_Abort``), after recording the
  failure: one failing rank must not leave the others waiting for it. Inside
  ``hvcomm.torch.elastic.run`` the same holds, unless the job opted in to letting that rank
  leave as a failed process (``run(on_exception="leave")``). ``HVCOMM_ABORT_ON_ERROR=0`` turns
  the abort off where there is no fault tolerance.
- At exit every rank waits for the others (under ``HVCOMM_EXIT_DEADLINE_S``, default 600 s) and
  learns the largest exit status among them; rank 0 of the final world records ``completed``
  when every status is 0, else ``failed``. Only when a launcher asked for the record
  (``HVCOMM_OUTCOME_FILE``), or after a survived failure.
  Rank 0 removes a record left by an earlier job when hvcomm starts.
- A process that met a failure (also during that last wait) must not call ``MPI_Finalize``:
  Open MPI 5's finalize waits in a PMIx fence that a failure can leave unfinished for ever
  (measured: always when a host has lost all its ranks, whose daemon has gone; now and then on
  one node too, 1 of 18 runs). It ends with ``os._exit`` after the others, once every open
  Python file is flushed; atexit handlers registered before ``hvcomm.torch.init()`` do not run
  then.

The exit status a program means: ``sys.exit(n)``, the built-in ``exit(n)``/``quit(n)``, an
uncaught exception (1, whatever ``sys.excepthook`` is), and after a survived failure also a
bare ``raise SystemExit(n)`` (a trace on the main thread's outermost frame sees it leave).
Without a failure the record counts only uncaught exceptions: after ``sys.exit(n)`` or a bare
``raise SystemExit(n)`` it can say ``completed``, but the process exits ``n`` and the
launcher's non-zero status wins.
"""
from __future__ import annotations

import atexit
import builtins
import dis
import faulthandler
import gc
import io
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional, Tuple

import numpy as np
from mpi4py import MPI

from collectives.errors import env_number

from ..cluster import outcome
from . import fault

EXIT_DEADLINE_S = env_number("HVCOMM_EXIT_DEADLINE_S", 600.0, "a number of seconds", 0)
"""How long a rank that has ended its program waits for the others before it ends anyway."""
# seconds between the ranks' MPI_Abort calls under fault tolerance
ABORT_STAGGER_S = 0.5

_UNSET = object()
_requested_status: object = _UNSET   # sys.exit / exit / quit's argument, last call
_leaving_status: object = _UNSET     # the SystemExit leaving the main frame (after a failure)
_world_of: Optional[Callable[[], MPI.Comm]] = None
_previous_excepthook = None  # the sys.excepthook hvcomm's replaced
_ended = False


def install(world_of: Callable[[], MPI.Comm]) -> None:
    """Once per process, from ``hvcomm.torch.init()``: remember how the program asks to exit,
    end the process as described in the module, and abort the job on an uncaught exception
    (:func:`abort_on_uncaught`). ``world_of()`` gives the communicator hvcomm ran on last (the
    final world at exit). Rank 0 removes an outcome record left by an earlier job."""
    global _world_of
    if _world_of is not None:
        return
    _world_of = world_of
    path = outcome.requested()
    if path is not None and world_of().Get_rank() == 0:
        path.unlink(missing_ok=True)  # an earlier job's record must not stand for this one
    sys.exit = _recording(sys.exit)
    for name in ("exit", "quit"):  # site's helpers raise SystemExit themselves
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, _recording(getattr(builtins, name)))
    atexit.register(_at_exit)


def _recording(exit_function):
    def exit(status=None):  # noqa: A001 - keep the status a script asks for
        global _requested_status
        if threading.current_thread() is threading.main_thread():  # (elsewhere: a thread ends)
            _requested_status = status
        exit_function(status)
    exit.__doc__ = exit_function.__doc__
    return exit


def status_code(status) -> int:
    """The process exit status Python gives for ``sys.exit(status)``."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1  # sys.exit("message"): Python prints it and exits 1


def intended_status() -> int:
    """The status this process is exiting with (see the module). Without a failure only an
    uncaught exception counts (1): a ``sys.exit(n)`` whose SystemExit was caught must not fail
    the job, and the process's own exit status reaches the launcher anyway."""
    if getattr(sys, "last_type", None) is not None and not issubclass(sys.last_type, SystemExit):
        return 1  # an uncaught exception, printed by whatever sys.excepthook is
    if fault.failures_met() == 0:
        return 0
    if _leaving_status is not _UNSET:
        return status_code(_leaving_status)
    if _requested_status is not _UNSET:
        return status_code(_requested_status)
    return 0


def watch_system_exit() -> None:
    """See a bare ``raise SystemExit(n)`` leave the main thread's outermost frame (call on the
    main thread; after a failure, when this process will end with ``os._exit``): the frame's
    ``exception`` events say which exception went through it last, and its ``return`` event
    whether it left by returning (a caught one) or by that exception (also through a
    ``finally``). Frames other than that one are not traced, but tracing is on for the main
    thread: each Python call pays one empty trace call, and CPython runs its instrumented
    (slower) bytecode loop; see results/elastic.md for what that costs a training step."""
    if sys.gettrace() is not None:  # a debugger or coverage: leave its trace alone
        return
    outermost = sys._getframe()
    while outermost.f_back is not None:
        outermost = outermost.f_back

    def on_outermost(frame, event, arg):
        global _leaving_status, _requested_status
        if event == "exception":
            _leaving_status = arg[1].code if isinstance(arg[1], SystemExit) else _UNSET
        elif event == "return":  # the program has ended
            if dis.opname[frame.f_code.co_code[frame.f_lasti]] in _RETURNS:
                # a normal end: whatever went through was caught
                _leaving_status = _requested_status = _UNSET
            _keep_files()
        return on_outermost

    outermost.f_trace_lines = False
    outermost.f_trace = on_outermost
    sys.settrace(_no_trace)


_RETURNS = ("RETURN_VALUE", "RETURN_CONST")  # the instructions a frame returns normally by


def _no_trace(frame, event, arg):  # tracing on for this thread, no frame traced but one
    return None


def _keep_files() -> None:
    """The program is ending: from now until ``os._exit``, no garbage collection (which can
    finalize an unreachable file after the buffer beneath it, losing the file's buffered
    tail), and every open file flushed while still reachable."""
    gc.disable()
    flush_open_files()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def record_failure(error: str) -> None:
    """Record that the job failed (any rank may; the last writer wins)."""
    path = outcome.requested()
    if path is not None:
        try:
            outcome.write(path, outcome.FAILED, error=error, rank=MPI.COMM_WORLD.Get_rank())
        except OSError as e:
            sys.stderr.write(f"hvcomm: cannot write the job's outcome to {path}: {e}\n")


def abort_job(error: str, why: str = "") -> None:
    """Record that the job failed with ``error``, say it on stderr (with ``why``), and end
    every rank of the job."""
    rank = MPI.COMM_WORLD.Get_rank()
    if fault.enabled():
        # Under fault tolerance, MPI_Abort called by several ranks at once can leave mpirun
        # (prterun) hanging after every rank has gone: the lower ranks abort first, and rank
        # 0's abort usually ends the others before they call it (results/abort_under_ft.md).
        # A rank whose record or MPI_Abort hangs ends by itself (exit 1) 15 s after its turn.
        stagger = ABORT_STAGGER_S * min(rank, 8)
        faulthandler.dump_traceback_later(stagger + 15, exit=True)
    record_failure(f"rank {rank}: {error}")
    sys.stdout.flush()
    sys.stderr.write(f"hvcomm: rank {rank}: {error}; aborting the whole job{why}\n")
    sys.stderr.flush()
    if fault.enabled():
        time.sleep(stagger)
    MPI.COMM_WORLD.Abort(1)


def abort_on_uncaught(enable: bool) -> None:
    """Install (or, with False, take back) hvcomm's ``sys.excepthook``: under fault tolerance
    always (the caller passes True), else when ``init(abort_on_error)`` asks and more than one
    rank runs."""
    global _previous_excepthook
    if enable and _previous_excepthook is None:
        hook = _uncaught_under_fault_tolerance if fault.enabled() else _uncaught
        _previous_excepthook, sys.excepthook = sys.excepthook, hook
    elif not enable and _previous_excepthook is not None:
        sys.excepthook, _previous_excepthook = _previous_excepthook, None


def _uncaught(exc_type, exc, tb) -> None:
    """Print the error, then end every rank: one failing rank must not leave the rest hanging."""
    traceback.print_exception(exc_type, exc, tb)
    abort_job(f"uncaught {describe(exc)}", " (HVCOMM_ABORT_ON_ERROR=0 disables this)")


def _uncaught_under_fault_tolerance(exc_type, exc, tb) -> None:
    traceback.print_exception(exc_type, exc, tb)
    if getattr(exc, "everywhere", False):  # every rank raises it together: a clean error exit
        sys.stderr.write("hvcomm: every rank stops with this error\n")
        sys.stderr.flush()
        return
    if not getattr(exc, "hvcomm_leave", False):
        abort_job(f"uncaught {describe(exc)}")
    # elastic.run(on_exception="leave"): a killed process is reported to the others (an
    # exiting one is not), who go on without it
    sys.stderr.write(f"hvcomm: uncaught exception on rank {MPI.COMM_WORLD.Get_rank()} in "
                     "elastic.run: this rank ends as a failed process and the others go on "
                     "without it (on_exception='leave')\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _at_exit() -> None:
    global _ended
    path = outcome.requested()
    after_failure = fault.failures_met() > 0
    if _ended or _world_of is None or MPI.Is_finalized() or not (after_failure or path):
        return
    _ended = True
    world = _world_of()
    if after_failure:
        _keep_files()  # (already, when the program's end was seen leaving its outermost frame)
    status = intended_status()
    worst, trouble = _worst_status(world, status)
    if path is not None and world.Get_rank() == 0:
        _record_outcome(path, world, status, worst, trouble)
    # under fault tolerance, a rank that did not meet the others at the end may be facing a
    # failure: MPI_Finalize could wait for ever
    if after_failure or (trouble is not None and fault.enabled()):
        logging.shutdown()
        flush_open_files()
        os._exit(status)


def _worst_status(world: MPI.Comm, status: int) -> Tuple[Optional[int], Optional[str]]:
    """COLLECTIVE over ``world``, under :data:`EXIT_DEADLINE_S`: the largest exit status among
    its ranks, or None; and what went wrong (a process failure, the deadline), or None.
    (Without fault tolerance, past the deadline ``MPI_Finalize`` still waits for the late
    ranks.)"""
    mine, worst = np.array([status], np.int64), np.zeros(1, np.int64)
    try:
        request = world.Iallreduce(mine, worst, op=MPI.MAX)
        end = time.monotonic() + EXIT_DEADLINE_S
        while not request.Test():
            if time.monotonic() > end:
                sys.stderr.write(f"hvcomm: rank {world.Get_rank()} has ended its program; the "
                                 f"others did not within {EXIT_DEADLINE_S:.0f} s "
                                 "(HVCOMM_EXIT_DEADLINE_S)\n")
                return None, f"not every rank ended within {EXIT_DEADLINE_S:.0f} s"
            time.sleep(0.01)
    except MPI.Exception as e:  # a process failed as the job ended
        if fault.enabled():
            try:
                world.Revoke()  # the others learn of it now, not at their deadline
            except MPI.Exception:  # already revoked
                pass
        return None, f"a process failed as the ranks ended their programs: {e}"
    return int(worst[0]), None


def _record_outcome(path, world: MPI.Comm, status: int, worst: Optional[int],
                    trouble: Optional[str]) -> None:
    try:
        if worst == 0:
            outcome.write(path, outcome.COMPLETED, size=world.Get_size(),
                          failures_survived=fault.failures_met())
            return
        earlier = outcome.read(path)
        if earlier is not None and earlier.get("outcome") == outcome.FAILED:
            return  # the rank that gave up has said why
        error = (describe(sys.last_value) if getattr(sys, "last_value", None) is not None
                 else f"rank 0 ended with status {status}" if status
                 else trouble if trouble is not None
                 else "a rank ended with a non-zero status")
        outcome.write(path, outcome.FAILED, error=error, size=world.Get_size())
    except OSError as e:
        sys.stderr.write(f"hvcomm: cannot write the job's outcome to {path}: {e}\n")


def flush_open_files() -> None:
    """Flush every open Python file object (``os._exit`` would lose their buffered tails)."""
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a detached or broken stream: nothing to save
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
