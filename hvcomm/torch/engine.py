"""One background thread per process that runs tensor collectives in submission order."""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional

from collectives.errors import HvcommError

from . import timeline


class Handle:
    """The future of one submitted job: ``done()`` polls, ``wait()`` returns or re-raises."""

    def __init__(self):
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
        self._event.wait()
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
        self._open_streams = 0  # running jobs that wait for the main thread (a P3 round)
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hvcomm-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, handle, name, comm = item
            timeline.cycle()
            try:
                if name is None:
                    handle._finish(job(comm))
                else:
                    with timeline.measure(name, "comm"):
                        handle._finish(job(comm))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                handle._finish(error=e)

    def open_stream(self) -> None:
        """A job that waits for the main thread (a P3 round) is submitted."""
        self._open_streams += 1

    def close_stream(self) -> None:
        """The main thread has handed that job everything it waits for."""
        self._open_streams -= 1

    def check_can_wait(self, what: str) -> None:
        """Refuse to block the main thread on a job queued behind one that waits for it."""
        if self._open_streams:
            raise HvcommError(f"{what}: a DistributedOptimizer(schedule='p3') round is open "
                              "(after backward, before step()); this collective would wait for "
                              "it forever. Call it after optimizer.step()")

    def submit(self, job: Callable[[Any], Any], name: Optional[str] = None,
               comm: Any = None) -> Handle:
        """Queue ``job(comm)``; ``comm`` defaults to the engine's communicator (a process
        set's is derived from it); ``name`` labels its span on the timeline."""
        if not self._thread.is_alive():
            raise RuntimeError("hvcomm engine is shut down; call hvcomm.torch.init() first")
        handle = Handle()
        self._jobs.put((job, handle, name, self.comm if comm is None else comm))
        return handle

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
