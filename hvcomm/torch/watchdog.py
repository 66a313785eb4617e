"""The stall inspector and failure notices: a thread per rank beside the engine, talking to the
other ranks' watchdogs on a communicator of its own, so the collectives pay nothing for it.

- A job that has waited ``stall_check_s`` (HVCOMM_STALL_CHECK_S, default 60) makes each waiting
  rank tell the others what it waits in; each waiting rank then prints the op and the ranks
  that have not submitted it, and repeats every ``stall_check_s``. After ``stall_shutdown_s``
  (HVCOMM_STALL_SHUTDOWN_S, default off) it aborts the whole job with that message.
- A job that fails on this rank alone (not an error that every rank raises together), and a
  rank that shuts down, are announced; a rank whose engine is then stuck waiting for the other
  one raises that as an exception in its waiting caller within seconds, instead of hanging.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Dict, List, Optional

from mpi4py import MPI

from collectives.errors import HvcommError

from . import ending, fault

TAG = 7471


class Watchdog:
    def __init__(self, comm: MPI.Comm, engine, stall_check_s: float,
                 stall_shutdown_s: Optional[float]):
        self.comm, self.engine = comm, engine  # comm: a duplicate of the engine's, ours alone
        self.stall_check_s, self.stall_shutdown_s = stall_check_s, stall_shutdown_s
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.peer_problem: Optional[str] = None  # a failed or departed rank, once announced
        self.peer_problem_at = 0.0  # time.monotonic() when it was heard of
        self._waiting: Dict[int, str] = {}       # rank -> the op it says it waits in
        self.departed: set = set()               # ranks that have said bye
        self._sends: List[MPI.Request] = []
        self._told_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvcomm-watchdog", daemon=True)
        self._thread.start()

    # -- called by the engine and by shutdown ----------------------------------------------
    def announce(self, kind: str, text: str) -> None:
        """Tell every other rank: ("failed", what) or ("bye", "")."""
        for dest in range(self.size):
            if dest != self.rank:
                self._sends.append(self.comm.isend((kind, self.rank, text), dest, TAG))

    def wait_for_departures(self, timeout_s: float) -> None:
        """Before aborting a stuck job: let every other rank report its own error and say
        bye first (at most ``timeout_s``)."""
        end = time.monotonic() + timeout_s
        while len(self.departed) < self.size - 1 and time.monotonic() < end:
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if not fault.broken():  # after a failure, sends to a dead rank never complete
            MPI.Request.Waitall(self._sends)  # small messages: complete once buffered

    # -- the thread -------------------------------------------------------------------------
    def _period(self) -> float:
        return min(1.0, self.stall_check_s / 4, (self.stall_shutdown_s or 60.0) / 4)

    def _loop(self) -> None:
        while not self._stop.wait(self._period()):
            try:
                self._receive()
                self._inspect()
            except Exception as e:  # noqa: BLE001 - the watchdog must never take a rank down
                if fault.is_process_failure(e):
                    fault.revoke(self.engine.generation)
                    return  # its communicator is revoked: the elastic layer takes over
                print(f"hvcomm watchdog on rank {self.rank}: {e!r}", file=sys.stderr)

    def _receive(self) -> None:
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG):
            kind, rank, text = self.comm.recv(source=MPI.ANY_SOURCE, tag=TAG)
            if kind == "waiting":
                self._waiting[rank] = text
            elif kind == "failed":
                self.peer_problem = f"rank {rank} failed in {text}"
                self.peer_problem_at = time.monotonic()
            elif kind == "bye":
                self.departed.add(rank)
                if self.peer_problem is None:
                    self.peer_problem = f"rank {rank} has shut down"
                    self.peer_problem_at = time.monotonic()

    def _inspect(self) -> None:
        current = self.engine.current
        if current is None:
            self._waiting.clear()
            return
        label, since = current
        interval = min(self.stall_check_s, self.stall_shutdown_s or self.stall_check_s)
        waited = time.monotonic() - since
        if waited < interval:
            return
        now = time.monotonic()
        if now - self._told_at >= interval:
            self._told_at = now
            self.announce("waiting", label)
            return  # report on the next tick, once the others' notes have arrived
        if now - self._told_at < self._period() * 1.5:
            missing = [r for r in range(self.size) if r != self.rank
                       and self._waiting.get(r) != label]
            message = (f"hvcomm stall: rank {self.rank} has waited {waited:.0f} s in {label}; "
                       f"ranks {missing} have not submitted it")
            print(message, file=sys.stderr, flush=True)
            if self.stall_shutdown_s is not None and waited >= self.stall_shutdown_s:
                ending.abort_job(f"{message}; HVCOMM_STALL_SHUTDOWN_S={self.stall_shutdown_s:g} "
                          "reached")


def peer_error(problem: str, label: str) -> HvcommError:
    return HvcommError(f"{problem} while this rank waits in {label}; the ranks no longer run "
                       "the same collectives (see that rank's error)")
