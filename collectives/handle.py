"""A request-like handle that drives a multi-round schedule written as a generator."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator, List

if TYPE_CHECKING:  # mpi4py's MPI is imported on first use, so that importing needs no MPI library
    from mpi4py import MPI

Schedule = Generator[List["MPI.Request"], None, Any]


class Pending:
    """Progress a schedule that yields lists of MPI requests and returns its result.

    The same generator serves the blocking call (``wait`` at once) and the non-blocking one
    (``test`` from time to time, ``wait`` when the result is needed).
    """

    def __init__(self, schedule: Schedule):
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
        """Block until finished and return the result."""
        from mpi4py import MPI
        while not self._done:
            MPI.Request.Waitall(self._requests)
            self._advance()
        return self._result


def completed(value: Any) -> Pending:
    """A handle that is already finished (for size-1 communicators and empty inputs)."""
    def schedule():
        return value
        yield  # pragma: no cover - makes this a generator
    return Pending(schedule())
