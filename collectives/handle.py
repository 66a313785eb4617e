"""A request-like handle that drives a multi-round schedule written as a generator."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generator, List

from .errors import env_number

if TYPE_CHECKING:  # mpi4py's MPI is imported on first use, so that importing needs no MPI library
    from mpi4py import MPI

Schedule = Generator[List["MPI.Request"], None, Any]

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
    """Progress a schedule that yields lists of MPI requests and returns its result.

    The same generator serves the blocking call (``wait`` at once) and the non-blocking one
    (``test`` from time to time, ``wait`` when the result is needed).
    """

    def __init__(self, schedule: Schedule):
        self._longest_sleep = longest_sleep_s()  # (a bad setting raises before any message)
        self._schedule = schedule
        self._requests: List[MPI.Request] = []
        self._done = False
        self._result: Any = None
        self._advance()

    def _advance(self) -> None:
        try:
            self._requests = self._schedule.send(None)
        except StopIteration as stop:
            self._done, self._result, self._requests = True, stop.value, []

    def test(self) -> bool:
        """Make what progress is possible without blocking; True once finished."""
        from mpi4py import MPI
        while not self._done and MPI.Request.Testall(self._requests):
            self._advance()
        return self._done

    def wait(self) -> Any:
        """Block until finished and return the result; between polls of the requests in
        flight sleep up to :func:`longest_sleep_s`."""
        from mpi4py import MPI
        while not self._done:
            if self._longest_sleep > 0:
                _sleep_until_complete(self._requests, self._longest_sleep)
            else:
                MPI.Request.Waitall(self._requests)
            self._advance()
        return self._result


def _sleep_until_complete(requests: "List[MPI.Request]", longest: float) -> None:
    from mpi4py import MPI
    if MPI.Request.Testall(requests):
        return
    spin_until, sleep = time.perf_counter() + SPIN_S, min(FIRST_SLEEP_S, longest)
    while not MPI.Request.Testall(requests):
        if time.perf_counter() >= spin_until:
            time.sleep(sleep)
            sleep = min(2 * sleep, longest)


def completed(value: Any) -> Pending:
    """A handle that is already finished (for size-1 communicators and empty inputs)."""
    def schedule():
        return value
        yield  # pragma: no cover - makes this a generator
    return Pending(schedule())
