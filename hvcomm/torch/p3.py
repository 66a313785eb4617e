"""P3 priority-based parameter propagation on allreduce (ALGORITHMS.md section 4).

Gradients are cut into slices of about ``slice_elems`` elements. One engine job per
iteration sends them one Allreduce at a time, always the highest-priority slice (the
parameter closest to the input first) among those whose gradient is ready *on every rank*;
so a slice that becomes ready overtakes queued lower-priority ones, and a slice on the wire is
never interrupted.

Ranks must issue the same collectives in the same order, and "ready" differs between ranks
from moment to moment. So every Allreduce carries, after the slice, each rank's readiness
vector (1 per parameter whose gradient is ready here); the sum tells every rank the same set of
globally-ready parameters, and the next choice is a function of that shared state alone. When
nothing globally ready is left to send, the ranks exchange readiness alone (a "negotiation"),
each once it has something new to report. Every rank makes the same sequence of choices, so
no collective is mismatched, whatever the timing.
"""
from __future__ import annotations

import threading
from typing import List, Optional, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .ops import as_numpy
from .timeline import measure


class P3Round:
    """The gradients of one iteration: filled by :meth:`ready` on the main thread, sent by
    :meth:`job` on the engine thread, read with :meth:`wait` (sums over ranks, flat)."""

    def __init__(self, numels: Sequence[int], names: Sequence[str], slice_elems: int):
        self.n = len(numels)
        self.names = list(names)
        self.bounds: List[List[tuple]] = [
            [(lo, min(lo + slice_elems, n)) for lo in range(0, max(n, 1), slice_elems)]
            for n in numels]
        self._cond = threading.Condition()
        self._local = np.zeros(self.n, bool)
        self._send: List[Optional[np.ndarray]] = [None] * self.n
        self.results: List[Optional[torch.Tensor]] = [None] * self.n
        self._done = [threading.Event() for _ in range(self.n)]
        self._error: Optional[BaseException] = None
        self.messages = 0
        self.negotiations = 0
        self.payload_bytes = 0
        self.sent_bytes = 0.0
        self.sent: List[tuple] = []  # (parameter, slice) in the order they went on the wire

    # -- main thread -----------------------------------------------------------------------
    def ready(self, i: int, flat: torch.Tensor) -> None:
        """Hand over parameter i's final local gradient (a private flat CPU copy)."""
        with self._cond:
            if self._local[i]:
                return
            self._send[i] = as_numpy(flat)
            self.results[i] = torch.empty_like(flat)
            self._local[i] = True
            self._cond.notify()

    def is_ready(self, i: int) -> bool:
        return bool(self._local[i])

    def wait(self, i: int) -> torch.Tensor:
        self._done[i].wait()
        if self._error is not None:
            raise self._error
        return self.results[i]

    # -- engine thread ---------------------------------------------------------------------
    def job(self, comm: MPI.Comm) -> None:
        try:
            self._run(comm)
        except BaseException as e:  # noqa: BLE001 - re-raised to every waiter
            self._error = e
            for d in self._done:
                d.set()
            raise

    def _run(self, comm: MPI.Comm) -> None:
        size = comm.Get_size()
        everywhere = np.zeros(self.n, bool)
        next_slice = [0] * self.n
        left = sum(len(b) for b in self.bounds)
        while left:
            cand = next((i for i in range(self.n)
                         if everywhere[i] and next_slice[i] < len(self.bounds[i])), None)
            if cand is None:  # nothing to send that every rank has: report what is new here
                with self._cond:
                    self._cond.wait_for(lambda: bool((self._local & ~everywhere).any()))
                    mine = self._local.astype(np.float64)
                comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.SUM)
                everywhere |= mine > size - 0.5
                self.negotiations += 1
                continue
            i = cand
            lo, hi = self.bounds[i][next_slice[i]]
            src = self._send[i]
            buf = np.empty(hi - lo + self.n, dtype=src.dtype)
            buf[:hi - lo] = src[lo:hi]
            with self._cond:
                buf[hi - lo:] = self._local
            with measure(f"p3 {self.names[i]}[{lo}:{hi}]", "comm"):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            as_numpy(self.results[i])[lo:hi] = buf[:hi - lo]
            everywhere |= buf[hi - lo:] > size - 0.5
            self.messages += 1
            self.payload_bytes += (hi - lo) * buf.itemsize
            self.sent_bytes += 2 * (size - 1) / size * buf.nbytes
            self.sent.append((i, next_slice[i]))
            next_slice[i] += 1
            left -= 1
            if next_slice[i] == len(self.bounds[i]):
                self._done[i].set()
