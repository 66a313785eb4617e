"""Stop cleanly when the job is about to be ended: Slurm's warning signal, a preemption, a requeue.

A signal handler may run between any two bytecodes, in the middle of a collective; so the
handlers installed here only set a flag. The decision is taken at a step boundary, by every
rank together::

    import hvcomm.torch as hvd
    from hvcomm.torch import preemption

    preemption.install()                  # early: before the job's first step
    for step in range(start, steps):
        if preemption.requested():        # collective: every rank, at the same step
            save_checkpoint(step)         # every rank, then exit 0
            break
        train_step(step)

``requested()`` is one small allreduce (MAX) over ``hvcomm.torch.mpi_comm()``: True on every
rank as soon as any rank has been signalled, so the ranks all stop after the same step even
though a launcher delivers the signal to each at a different moment (or to only some).

Once the program has ended (Python's atexit), the warning signals (SIGUSR1, and any other
installed but SIGTERM and SIGINT) are ignored: there is no step left to checkpoint at, and
Python's finalization would give them back their default action, so Slurm's time-limit warning,
forwarded by the batch script as the job finishes, would end a rank after the job had recorded
that it completed, and the launcher would report it as failed (measured: ``mpirun`` exited 138
for a SIGUSR1 0.05-0.8 s after the ranks' last collective). SIGTERM and SIGINT get their default
action back as before: a process that hangs on its way out stays easy to end.

The module holds no other state and knows nothing of elastic training; with one process it works
as well (the allreduce of one value).
"""
from __future__ import annotations

import atexit
import signal as _signal
import threading
from typing import Dict, Iterable, Optional

__all__ = ["install", "installed", "signalled", "received", "requested", "uninstall"]

# Python runs a handler in the main thread between two bytecodes: assigning a global is all the
# handler does (no lock, no I/O, no MPI)
_received: Optional[int] = None    # the first signal number received; None: none yet
_previous: Dict[int, object] = {}  # signal number -> the handler installed before ours
# signals that keep their default action (ending the process) once the program has ended
_ENDING = (int(_signal.SIGTERM), int(_signal.SIGINT))


def _handler(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    global _received
    if _received is None:
        _received = signum


def install(signals: Iterable[int] = (_signal.SIGUSR1, _signal.SIGTERM)) -> None:
    """Make ``signals`` set this process's preemption flag instead of their default action
    (for SIGUSR1 and SIGTERM: ending the process). Call it from the main thread, as early as
    possible (a signal that arrives before it still ends the process). Calling it again adds
    signals and keeps the handlers that were there before the first call (see ``uninstall``)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("preemption.install() must be called from the main thread "
                           "(Python delivers signals to it only)")
    signals = [_signal.Signals(s) for s in signals]
    if not signals:
        raise ValueError("preemption.install(): no signal given")
    for sig in signals:
        if sig in (_signal.SIGKILL, _signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be caught")
    for sig in signals:
        previous = _signal.signal(sig, _handler)
        if previous is not _handler:
            _previous[int(sig)] = previous


def _ignore_at_exit() -> None:
    """atexit: the program has ended, so the warning signals still handled here are ignored
    from now on (not given back their default action by Python's finalization); SIGTERM and
    SIGINT are left to it (see the module's text)."""
    for signum in _previous:
        if signum not in _ENDING and _signal.getsignal(signum) is _handler:
            _signal.signal(signum, _signal.SIG_IGN)


atexit.register(_ignore_at_exit)  # (does nothing unless install() was called, not undone)


def uninstall() -> None:
    """Restore the handlers ``install`` replaced, and clear the flag (tests, or a second phase)."""
    global _received
    for signum, previous in _previous.items():
        _signal.signal(signum, previous)
    _previous.clear()
    _received = None


def installed() -> bool:
    """Are this module's handlers installed (``install`` called, ``uninstall`` not since)?"""
    return bool(_previous)


def signalled() -> bool:
    """Local, not collective: has this process received one of the signals?"""
    return _received is not None


def received() -> Optional[int]:
    """The first signal this process received (a number), or None."""
    return _received


def requested() -> bool:
    """COLLECTIVE (every rank of hvcomm's communicator, at the same step boundary): True on
    every rank when any rank has received one of the installed signals."""
    if not installed():
        raise RuntimeError("preemption.requested() before preemption.install(): no signal "
                           "would ever be noticed")
    from mpi4py import MPI

    from .runtime import mpi_comm  # raises the usual error when hvcomm is not initialised
    return bool(mpi_comm().allreduce(int(_received is not None), op=MPI.MAX))
