"""One background thread per process that runs tensor collectives in submission order."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional

from collectives.errors import HvcommError

from . import fault, timeline
from .watchdog import peer_error


class Handle:
    """The future of one submitted job: ``done()`` polls, ``wait()`` returns or re-raises
    (or raises once another rank has failed or left while this rank's engine is stuck)."""

    def __init__(self, engine: "Optional[Engine]" = None):
        self._engine = engine
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.finished_at = 0.0  # time.perf_counter() when the job ended

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self.finished_at = time.perf_counter()
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> Any:
        while not self._event.wait(0.5):
            stuck = self._engine.stuck_error() if self._engine is not None else None
            if stuck is not None:
                raise stuck
        if self._error is not None:
            raise self._error
        return self._result


class Engine:
    """Runs ``job(comm)`` callables on a private communicator, one at a time, in order.

    Every rank submits the same jobs in the same order (the optimizer launches buckets in a
    fixed order; user calls are checked by signature), so the blocking MPI calls inside the
    jobs match across ranks. mpi4py releases the GIL inside MPI calls, so communication
    overlaps the backward pass running on the main thread.
    """

    def __init__(self, comm):
        self.comm = comm
        self.current: "Optional[tuple[str, float]]" = None  # (job, since) while one runs
        self.watchdog = None    # a hvcomm.torch.watchdog.Watchdog, attached by init()
        self.generation = fault.generation()  # whose communicators a failure here revokes
        self._problem_at = 0.0
        self._open_streams: list = []  # what each running job that waits for the main thread is
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hvcomm-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, handle, name, comm, detail = item
            timeline.cycle()
            label = name or getattr(job, "__qualname__", "job")
            if detail:
                label = f"{label} ({detail})"
            self.current = (label, time.monotonic())
            try:
                if name is None:
                    result = job(comm)
                else:
                    with timeline.measure(name, "comm"):
                        result = job(comm)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                self.current = None
                if fault.is_process_failure(e):  # revokes hvcomm's communicators everywhere
                    e = fault.failure_error(e, label, self.generation)
                elif self.watchdog is not None and not getattr(e, "everywhere", False):
                    self.watchdog.announce("failed", f"{label}: {type(e).__name__}: {e}")
                handle._finish(error=e)
                continue
            self.current = None
            if self.watchdog is not None:
                self.watchdog.peer_problem = None  # progress: the ranks are in step
            handle._finish(result)

    def stuck_error(self) -> Optional[HvcommError]:
        """An error for a caller waiting on this engine, once another rank has failed or
        left and this engine has stayed stuck in a job for a second since."""
        problem = self.watchdog.peer_problem if self.watchdog is not None else None
        current = self.current
        if problem is None or current is None:
            self._problem_at = 0.0
            return None
        now = time.monotonic()
        self._problem_at = self._problem_at or now
        if now - self._problem_at < 1.0:
            return None
        return peer_error(problem, current[0])

    def open_stream(self, what: str) -> None:
        """A job that waits for the main thread is submitted; ``what`` says, in an error,
        what it is and when it closes."""
        self._open_streams.append(what)

    def close_stream(self) -> None:
        """The main thread has handed the oldest such job everything it waits for."""
        self._open_streams.pop(0)

    def check_can_wait(self, what: str) -> None:
        """Refuse to block the main thread on a job queued behind one that waits for it."""
        if self._open_streams:
            raise HvcommError(f"{what}: {self._open_streams[0]} is open; this collective would "
                              "wait for it forever. Call it after optimizer.step()")

    def submit(self, job: Callable[[Any], Any], name: Optional[str] = None,
               comm: Any = None, detail: Optional[str] = None) -> Handle:
        """Queue ``job(comm)``; ``comm`` defaults to the engine's communicator (a process
        set's is derived from it); ``name`` labels its span on the timeline; ``detail`` (the
        tensor's shape and dtype) is added to the name in stall reports and errors."""
        if not self._thread.is_alive():
            raise RuntimeError("hvcomm engine is shut down; call hvcomm.torch.init() first")
        handle = Handle(self)
        self._jobs.put((job, handle, name, self.comm if comm is None else comm, detail))
        return handle

    @property
    def stuck(self) -> bool:
        """A job will never finish: another rank failed or left while this one waits."""
        return self.current is not None and self.stuck_error() is not None

    def close(self) -> None:
        if self._thread.is_alive() and not self.stuck:
            self._jobs.put(None)
            # after a failure every job fails at once (its communicators are revoked), but a
            # job that waits for the main thread (a P3 round) may wait for ever: leave it
            self._thread.join(timeout=10.0 if fault.broken() else None)
