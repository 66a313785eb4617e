"""Profiling the backward pass from the gradient hooks, and the communicator's cost fit,
for the planner in :mod:`hvcomm.planner`."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from collectives.cost import calibrate
from collectives.errors import HvcommError
from hvcomm import planner

from .engine import Engine

SCHEDULES = planner.SCHEDULES + ("p3",)
_COSTS: Dict[int, "tuple[int, planner.Cost]"] = {}  # size -> (largest bytes measured, fit)


def cost_for(engine: Engine, largest_bytes: int = 8 << 20) -> planner.Cost:
    """The allreduce cost fit T(M) = a + b*M of the engine's communicator, measured once per
    communicator size in this process (again if a model brings a larger message than
    measured), on sizes from 4 KiB up to ``largest_bytes`` (at most 64 MiB): the slope of
    large messages differs from that of small ones. HVCOMM_COST="a_s,b_s_per_byte" sets it
    instead. Collective: every rank must call it with the same ``largest_bytes``."""
    env = os.environ.get("HVCOMM_COST")
    if env:
        try:
            a, b = (float(x) for x in env.split(","))
        except ValueError:
            raise HvcommError(f"HVCOMM_COST must be 'a_s,b_s_per_byte', got {env!r}") from None
        return planner.Cost(a, b)
    size = engine.comm.Get_size()
    largest = int(min(max(largest_bytes, 1 << 20), 64 << 20))
    if size not in _COSTS or _COSTS[size][0] < largest:
        sizes = sorted({4 << 10, 64 << 10, 1 << 20, min(8 << 20, largest), largest})
        cal = engine.submit(lambda comm: calibrate(comm, sizes, repeats=3), "calibrate").wait()
        _COSTS[size] = (largest, planner.Cost(max(cal.a_s, _engine_startup_s(engine)),
                                              cal.b_s_per_byte))
    return _COSTS[size][1]


def _engine_startup_s(engine: Engine, messages: int = 50) -> float:
    """The startup of one message the way the optimizer sends it: tiny allreduces submitted
    back to back to the engine (thread hand-over and Python included), slowest rank's mean.
    On shared memory this is several times MPI's own latency."""
    def tiny(comm):
        comm.Allreduce(MPI.IN_PLACE, np.zeros(16, np.float32), op=MPI.SUM)

    engine.submit(lambda comm: comm.Barrier()).wait()
    t0 = time.perf_counter()
    for h in [engine.submit(tiny) for _ in range(messages)]:
        h.wait()
    mine = (time.perf_counter() - t0) / messages
    return engine.submit(lambda comm: comm.allreduce(mine, op=MPI.MAX)).wait()


class Profiler:
    """Records when each parameter's gradient is final, from the start of the iteration
    (the end of the previous step), over ``steps`` iterations after ``skip`` warm-up ones."""

    def __init__(self, n: int, skip: int = 1, steps: int = 3):
        if steps < 1 or skip < 0:
            raise HvcommError(f"profile steps must be >= 1 and skip >= 0, got {steps}, {skip}")
        self.n, self.skip, self.steps = n, skip, steps
        self.iteration = 0
        self.start = time.perf_counter()
        self.ready: List[List[float]] = [[] for _ in range(n)]
        self.update: List[float] = []
        self.last_ready = 0.0

    @property
    def recording(self) -> bool:
        return self.skip <= self.iteration < self.skip + self.steps

    @property
    def complete(self) -> bool:
        return self.iteration >= self.skip + self.steps

    def grad_ready(self, i: int) -> None:
        self.last_ready = time.perf_counter()
        if self.recording:
            self.ready[i].append(self.last_ready - self.start)

    def tail(self, comm_end: float) -> None:
        """Now the step has ended: record the time after both backward and communication had
        finished (unpacking, averaging, the optimizer update)."""
        if self.recording:
            self.update.append(time.perf_counter() - max(comm_end, self.last_ready))

    def next_iteration(self) -> None:
        self.iteration += 1
        self.start = time.perf_counter()

    def agreed(self, comm: MPI.Comm) -> "tuple[np.ndarray, float]":
        """Per-parameter ready time (NaN: never had a gradient) and update time, the slowest
        rank's, identical on every rank. Collective."""
        local = np.array([np.median(t) if t else np.nan for t in self.ready])
        update = float(np.median(self.update)) if self.update else 0.0
        everyone = comm.allgather((local, update))
        stacked = np.vstack([r for r, _ in everyone])
        ready = np.max(np.where(np.isnan(stacked), -np.inf, stacked), axis=0)
        ready[np.isneginf(ready)] = np.nan
        return ready, max(u for _, u in everyone)


def observed_trace(ready: np.ndarray, update_s: float, nbytes: Sequence[int],
                   keys: Sequence[object], names: Sequence[str]) -> "tuple[list, planner.Trace]":
    """The trace in observed order (ties and unused parameters in reverse registration order,
    unused last) and that order as positions into the registration order."""
    n = len(nbytes)
    order = sorted(range(n), key=lambda i: (np.isnan(ready[i]),
                                            0.0 if np.isnan(ready[i]) else ready[i], -i))
    times: List[Optional[float]] = [None if np.isnan(ready[i]) else float(ready[i]) for i in order]
    trace = planner.Trace(tuple(times), tuple(nbytes[i] for i in order), update_s,
                          tuple(keys[i] for i in order), tuple(names[i] for i in order))
    return order, trace
