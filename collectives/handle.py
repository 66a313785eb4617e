"""A request-like handle that drives a multi-round schedule written as a generator."""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Generator, List

from .errors import env_number

if TYPE_CHECKING:  # mpi4py's MPI is imported on first use, so that importing needs no MPI library
    from mpi4py import MPI

Schedule = Generator[list, None, Any]  # lists of MPI requests or collectives.tcp.Transfer

# wait() polls its requests for SPIN_S, then sleeps between polls, FIRST_SLEEP_S first and
# twice as long each time, never longer than HVCOMM_WAIT_SLEEP_US (default DEFAULT_SLEEP_US).
# MPI_Waitall would poll without sleeping for the whole wait, taking a core from the backward
# pass and the kernel's network work beside it (results/ddp.md gives each step's CPU time;
# docs/benchmarks.md compares the two ways of waiting). Linux's timer slack makes each sleep
# some 50 us longer than asked.
SPIN_S = 50e-6
FIRST_SLEEP_S = 20e-6
DEFAULT_SLEEP_US = 500


def longest_sleep_s() -> float:
    """The longest sleep between two polls of :meth:`Pending.wait`, in seconds
    (HVCOMM_WAIT_SLEEP_US, read as each collective starts); 0: wait in MPI_Waitall."""
    return env_number("HVCOMM_WAIT_SLEEP_US", DEFAULT_SLEEP_US, "a number of microseconds", 0,
                      1_000_000) * 1e-6


class Pending:
    """Progress a schedule that yields lists of requests (MPI's, or :mod:`collectives.tcp`'s)
    and returns its result.

    The same generator serves the blocking call (``wait`` at once) and the non-blocking one
    (``test`` from time to time, ``wait`` when the result is needed).
    """

    def __init__(self, schedule: Schedule):
        self._longest_sleep = longest_sleep_s()  # (a bad setting raises before any message)
        self._schedule = schedule
        self._requests: list = []
        self._done = False
        self._result: Any = None
        self.rounds = 0  # rounds of requests completed so far: a poller's sign of progress
        self._advance()

    def _advance(self) -> None:
        self.rounds += 1
        try:
            self._requests = self._schedule.send(None)
        except StopIteration as stop:
            self._done, self._result, self._requests = True, stop.value, []

    def test(self) -> bool:
        """Make what progress is possible without blocking; True once finished."""
        with self._closed_on_error():
            while not self._done and _all_complete(self._requests):
                self._advance()
        return self._done

    def then(self, fn: Callable[[Any], Any]) -> "Pending":
        """A handle on the same work whose result is ``fn(result)``, called as it finishes."""
        def schedule():
            while not self.test():
                yield self._requests
            return fn(self._result)
        return Pending(schedule())

    def wait(self) -> Any:
        """Block until finished and return the result; between polls of the requests in
        flight sleep up to :func:`longest_sleep_s`."""
        from mpi4py import MPI
        with self._closed_on_error():
            while not self._done:
                if not _is_mpi(self._requests):
                    for request in self._requests:  # collectives.tcp's: each waits on a thread
                        request.Wait()
                elif self._longest_sleep > 0:
                    _sleep_until_complete(self._requests, self._longest_sleep)
                else:
                    MPI.Request.Waitall(self._requests)
                self._advance()
        return self._result

    @contextlib.contextmanager
    def _closed_on_error(self):
        """A collectives.tcp transfer that raises ends the schedule there: its cleanup (the
        links failed, its buffers no longer written) runs now, not when it is collected."""
        try:
            yield
        except BaseException:
            if not _is_mpi(self._requests):
                self._done, self._requests = True, []
                self._schedule.close()
            raise


def _is_mpi(requests: list) -> bool:
    """Whether ``requests`` are MPI requests, not :class:`collectives.tcp.Transfer` (a
    schedule yields one kind at a time)."""
    from mpi4py import MPI
    return not requests or isinstance(requests[0], MPI.Request)


def _all_complete(requests: list) -> bool:
    from mpi4py import MPI
    if _is_mpi(requests):
        return MPI.Request.Testall(requests)
    return all(request.Test() for request in requests)


def _sleep_until_complete(requests: "List[MPI.Request]", longest: float) -> None:
    from mpi4py import MPI
    if MPI.Request.Testall(requests):
        return
    backoff = Backoff(longest)
    while not MPI.Request.Testall(requests):
        backoff.pause()


class Backoff:
    """The pauses between polls: none for SPIN_S, then sleeps of FIRST_SLEEP_S, twice as long
    each time, never longer than ``longest`` (s); :meth:`restart` after progress."""

    def __init__(self, longest: float):
        self.longest = longest
        self.restart()

    def restart(self) -> None:
        self._spin_until = time.perf_counter() + SPIN_S
        self._sleep = min(FIRST_SLEEP_S, self.longest)

    def pause(self) -> None:
        if time.perf_counter() >= self._spin_until:
            time.sleep(self._sleep)
            self._sleep = min(2 * self._sleep, self.longest)


def completed(value: Any) -> Pending:
    """A handle that is already finished (for size-1 communicators and empty inputs)."""
    def schedule():
        return value
        yield  # pragma: no cover - makes this a generator
    return Pending(schedule())
