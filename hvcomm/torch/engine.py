"""One background thread per process that runs tensor collectives in submission order."""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Optional

from collectives.errors import HvcommError
from collectives.handle import DEFAULT_SLEEP_US, Backoff, longest_sleep_s

from . import fault, timeline
from .watchdog import peer_error

# Collectives a job's ``start`` may have under way at once, and their tags: a bucket's ring
# starts while the last chunks of the one before it are still on the wire, so that a rank's
# link need not idle while the others carry the ring's last chunks (docs/benchmarks.md, "Two
# buckets on the wire at once").
IN_FLIGHT = 2
START_TAGS = tuple(7421 + slot for slot in range(IN_FLIGHT))

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


@dataclass
class _Started:
    """A job whose collective was started (``start``) and is not yet finished; ``error``: its
    failure, reported (and converted) when found, handed to the caller in submission order."""

    pending: Any         # a collectives.handle.Pending, None if start() raised
    handle: Handle
    name: Optional[str]
    label: str
    lane: str            # its timeline lane (timeline.ENGINE_LANES)
    since: float         # time.monotonic() at its start
    start_us: float      # timeline.Timeline.now_us() at its start
    done: bool = False
    error: Optional[BaseException] = None


class Engine:
    """Runs ``job(comm)`` callables on a private communicator, in order.

    Every rank submits the same jobs in the same order (the optimizer launches buckets in a
    fixed order; user calls are checked by signature), so the blocking MPI calls inside the
    jobs match across ranks. mpi4py releases the GIL inside MPI calls, so communication
    overlaps the backward pass running on the main thread. A job that can also be started
    without waiting (``start``: a bucket's ring) runs beside the one before it, up to
    :data:`IN_FLIGHT` at once on the engine's communicator; a job that cannot waits until
    those have finished. Jobs finish in submission order either way.
    """

    def __init__(self, comm):
        self.comm = comm
        self.current: "Optional[tuple[str, float]]" = None  # (job, since) while one runs
        self.watchdog = None    # a hvcomm.torch.watchdog.Watchdog, attached by init()
        self.generation = fault.generation()  # whose communicators a failure here revokes
        self._problem_at = 0.0
        self._open_streams: list = []  # what each running job that waits for the main thread is
        self._started = 0  # jobs started ahead so far: the next one's tag
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hvcomm-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        in_flight: Deque[_Started] = collections.deque()
        while True:
            item = self._progress(in_flight, 0, take=True)
            if item is None:
                self._progress(in_flight, 0)
                return
            job, handle, name, comm, detail, start = item
            timeline.cycle()
            label = name or getattr(job, "__qualname__", "job")
            if detail:
                label = f"{label} ({detail})"
            if start is not None and comm is self.comm:
                self._progress(in_flight, IN_FLIGHT - 1)
                if self._start(start, handle, name, label, in_flight):
                    continue
            self._progress(in_flight, 0)
            since = time.monotonic()
            self.current = (label, since)
            try:
                if name is None:
                    result = job(comm)
                else:
                    with timeline.measure(name, "comm"):
                        result = job(comm)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                self.current = None
                handle._finish(error=self._reported(e, label))
                continue
            self.current = None
            self._finish(handle, result, since)

    def _start(self, start, handle: Handle, name, label: str, in_flight) -> bool:
        """Start a job's collective beside those in flight; False if it cannot be (``start``
        returned None). A start that raises counts as started, its failure handed over in
        order."""
        slot = self._started % IN_FLIGHT
        job = _Started(None, handle, name, label, timeline.ENGINE_LANES[slot],
                       time.monotonic(), timeline.Timeline.now_us())
        if not in_flight:
            self.current = (label, job.since)
        try:
            job.pending = start(self.comm, START_TAGS[slot])
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            job.done, job.error = True, self._reported(e, label)
        started = job.pending is not None or job.done
        if started:
            self._started += 1
            in_flight.append(job)
        self._show(in_flight)
        return started

    def _show(self, in_flight) -> None:
        """``current``: the oldest job in flight."""
        self.current = (in_flight[0].label, in_flight[0].since) if in_flight else None

    def _progress(self, in_flight: Deque[_Started], most: int, take: bool = False) -> Any:
        """Drive the collectives in flight (each job finished in order as they end) until at
        most ``most`` are left; with ``take``, return the next submitted item as soon as there
        is one (waiting for it once nothing is in flight). Between polls it pauses as
        :meth:`collectives.handle.Pending.wait` does, from the shortest pause again after
        progress."""
        try:
            backoff = Backoff(longest_sleep_s())
        except HvcommError:  # a bad setting: the collectives' own starts raise it, here
            backoff = Backoff(DEFAULT_SLEEP_US * 1e-6)
        rounds = -1
        while True:
            for job in in_flight:
                if not job.done:
                    try:
                        job.done = job.pending.test()
                    except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                        job.done, job.error = True, self._reported(e, job.label)
            while in_flight and in_flight[0].done:
                self._retire(in_flight.popleft())
            self._show(in_flight)
            if len(in_flight) <= most:
                return self._jobs.get() if take else None
            now = sum(job.pending.rounds for job in in_flight if job.pending is not None)
            if now != rounds:
                backoff.restart()
                rounds = now
            if take:  # (not a timed get: one waited for ever here, its timeout long past)
                try:
                    return self._jobs.get_nowait()
                except queue.Empty:
                    pass
            backoff.pause()

    def _retire(self, job: _Started) -> None:
        tl = timeline.active()
        if tl is not None and job.name is not None:
            tl.span(job.name, job.start_us, tl.now_us(), job.lane)
        if job.error is not None:
            job.handle._finish(error=job.error)
        else:
            self._finish(job.handle, job.pending.wait(), job.since)

    def _finish(self, handle: Handle, result: Any, since: float) -> None:
        """A job begun at ``since`` (time.monotonic()) ended well: a problem heard of before
        it began is over (the ranks are in step), not one heard of since (it may concern a
        job still in flight)."""
        wd = self.watchdog
        if wd is not None and wd.peer_problem is not None and wd.peer_problem_at < since:
            wd.peer_problem = None
        handle._finish(result)

    def _reported(self, error: BaseException, label: str) -> BaseException:
        """A job's failure as its caller gets it, reported at once: a process failure revokes
        hvcomm's communicators everywhere; any other is announced to the other ranks."""
        if fault.is_process_failure(error):
            return fault.failure_error(error, label, self.generation)
        if self.watchdog is not None and not getattr(error, "everywhere", False):
            self.watchdog.announce("failed", f"{label}: {type(error).__name__}: {error}")
        return error

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
               comm: Any = None, detail: Optional[str] = None,
               start: Optional[Callable[[Any, int], Any]] = None) -> Handle:
        """Queue ``job(comm)``; ``comm`` defaults to the engine's communicator (a process
        set's is derived from it); ``name`` labels its span on the timeline; ``detail`` (the
        tensor's shape and dtype) is added to the name in stall reports and errors.
        ``start(comm, tag)``: the same work started without waiting, on the engine's
        communicator, returning a :class:`collectives.handle.Pending` (whose result is the
        handle's), or None, having done nothing, where it cannot be (then ``job`` runs); a
        started job runs beside the one started before it, each with its own ``tag``."""
        if not self._thread.is_alive():
            raise RuntimeError("hvcomm engine is shut down; call hvcomm.torch.init() first")
        handle = Handle(self)
        self._jobs.put((job, handle, name, self.comm if comm is None else comm, detail, start))
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
