"""Planned groupings for the synchronous strategy: :class:`PlannedSchedule` (what the schedule
methods wfbp, single, threshold, merge_rule and mgwfbp share: each names its plan), profiling
the backward pass from the gradient hooks, the communicator's cost fit, and
:class:`GroupingPlanner`, which turns them into plans through the schedules' plan functions
(and races the plans a schedule names in ``race_against``)."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from collectives.errors import HvcommError
from hvcomm import planner

from .base import ScheduleMethod
from .buckets import ONE_BUCKET_BYTES, plan_groups
from .registry import REGISTRY

_COSTS: Dict[int, "tuple[int, planner.Cost]"] = {}  # size -> (largest bytes measured, fit)


def cost_for(engine, largest_bytes: int = 8 << 20) -> planner.Cost:
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
        from collectives.cost import calibrate
        cal = engine.submit(lambda comm: calibrate(comm, sizes, repeats=3), "calibrate").wait()
        _COSTS[size] = (largest, planner.Cost(max(cal.a_s, _engine_startup_s(engine)),
                                              cal.b_s_per_byte))
    return _COSTS[size][1]


def _engine_startup_s(engine, messages: int = 50) -> float:
    """The startup of one message the way the optimizer sends it: tiny allreduces submitted
    back to back to the engine (thread hand-over and Python included), slowest rank's mean.
    On shared memory this is several times MPI's own latency."""
    from mpi4py import MPI

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

    def agreed(self, comm) -> "tuple[np.ndarray, float]":
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


class _Race:
    """A race of plans (a schedule's ``race_against``): each candidate plan runs one warm-up
    and ``steps`` timed iterations in turn; the fastest (slowest rank's best time) wins."""

    def __init__(self, candidates: List[planner.Prediction], steps: int):
        self.candidates, self.steps = candidates, steps
        self.times: List[List[float]] = [[] for _ in candidates]
        self.at, self.warm = 0, True

    def record(self, seconds: float) -> "tuple[Optional[planner.Prediction], bool]":
        """Count one iteration of the current candidate: (plan to install now or None,
        whether the race is over)."""
        if self.warm:
            self.warm = False
            return None, False
        self.times[self.at].append(seconds)
        if len(self.times[self.at]) < self.steps:
            return None, False
        self.at, self.warm = self.at + 1, True
        if self.at < len(self.candidates):
            return self.candidates[self.at], False
        return None, True


class GroupingPlanner:
    """A planner-driven source of groupings for :class:`hvcomm.torch.methods.sync.Synchronous`.

    Profiles the first iterations (1 skipped, then ``profile_steps``) with everything sent in
    one message after backward, fits the communicator's cost, asks every planned schedule for
    its plan and prediction (``schedule_report``) and hands back ``schedule``'s grouping. A
    schedule with ``race_against`` then races its plan against those schedules' plans
    (``trial_steps`` timed iterations each, after one warm-up) and keeps the fastest
    (``trial_report``, ``plan_origin``). Every decision is identical on every rank."""

    def __init__(self, schedule: "PlannedSchedule", nbytes: Sequence[int], dtypes: Sequence[str],
                 names: Sequence[str], engine, fusion_threshold_bytes: int,
                 profile_steps: int = 3, trial_steps: int = 5):
        self.schedule = schedule
        self._nbytes, self._dtypes, self._names = list(nbytes), list(dtypes), list(names)
        self._engine, self._threshold = engine, fusion_threshold_bytes
        self._profiler: Optional[Profiler] = Profiler(len(nbytes), steps=profile_steps)
        self._trial_steps = trial_steps
        self._race: Optional[_Race] = None
        self._order = list(range(len(nbytes)))
        self._last_step_end = time.perf_counter()
        self.schedule_report: List[planner.Prediction] = []   # every schedule, once planned
        self.plan_prediction: Optional[planner.Prediction] = None  # the one in use
        self.trial_report: Dict[str, float] = {}   # candidate -> best measured iteration (s)
        self.plan_origin: Optional[str] = None     # which candidate's plan the race kept

    @property
    def racing(self) -> bool:
        return self._race is not None

    def grad_ready(self, i: int) -> None:
        if self._profiler is not None:
            self._profiler.grad_ready(i)

    def after_step(self, comm_end: float) -> Optional[List[List[int]]]:
        """The step has ended (collective on every rank while planning): the new grouping,
        or None to keep the current one."""
        new = None
        prof = self._profiler
        if prof is not None:
            prof.tail(comm_end)
        if self._race is not None:
            new = self._race_iteration(time.perf_counter() - self._last_step_end)
        if prof is not None:
            was_recording = prof.recording
            prof.next_iteration()
            if was_recording and prof.complete:
                new = self._replan()
                self._profiler = None
        self._last_step_end = time.perf_counter()  # planning is not the next iteration's time
        return new

    def _replan(self) -> List[List[int]]:
        ready, update_s = self._engine.submit(lambda comm: self._profiler.agreed(comm)).wait()
        self._order, trace = observed_trace(ready, update_s, self._nbytes, self._dtypes,
                                            self._names)
        cost = cost_for(self._engine, sum(self._nbytes))
        self.schedule_report = [m.plan(trace, cost, self._threshold) for m in REGISTRY.values()
                                if isinstance(m, PlannedSchedule)]
        by_name = {p.schedule: p for p in self.schedule_report}
        mine = self.schedule.name
        if self.schedule.race_against and self._trial_steps > 0:
            seen, candidates = set(), []
            for name in (mine, *self.schedule.race_against):
                if by_name[name].plan.buckets not in seen:
                    seen.add(by_name[name].plan.buckets)
                    candidates.append(by_name[name])
            self._race = _Race(candidates, self._trial_steps)
            return self._install(candidates[0])
        return self._install(by_name[mine])

    def _race_iteration(self, seconds: float) -> Optional[List[List[int]]]:
        race = self._race
        plan, over = race.record(seconds)
        if not over:
            return None if plan is None else self._install(plan)
        from mpi4py import MPI
        best = np.array([min(ts) for ts in race.times])
        self._engine.submit(lambda comm: comm.Allreduce(MPI.IN_PLACE, best, op=MPI.MAX)).wait()
        self.trial_report = {c.schedule: float(b) for c, b in zip(race.candidates, best)}
        winner = race.candidates[int(np.argmin(best))]
        self.plan_origin = winner.schedule
        self._race = None
        return self._install(dataclasses.replace(winner, schedule=self.schedule.name))

    def _install(self, prediction: planner.Prediction) -> List[List[int]]:
        self.plan_prediction = prediction
        return [[self._order[i] for i in bucket] for bucket in prediction.plan.buckets]


# -- the planned schedules' common part ---------------------------------------------------------
def allreduce_cost(case, probe_bytes: float = float(1 << 30)) -> planner.Cost:
    """The cluster's allreduce (``case.allreduce_s``: the ring, or the hierarchical form on
    nodes of several GPUs) as the planner's T(M) = a + b*M: it is linear in M, so two points
    give a and b."""
    a_s = case.allreduce_s(0)
    return planner.Cost(a_s, (case.allreduce_s(probe_bytes) - a_s) / probe_bytes)


def dense_schedule_s(case, plan: Callable[..., planner.Prediction],
                     wire_bytes_per_param: Optional[float] = None) -> float:
    """Iteration time of dense buckets grouped by ``plan`` (a schedule's plan function), plus
    the local cost on the critical path. The buckets are grouped by the gradients' bytes, as
    the optimizer's fusion threshold groups them; each is priced at ``wire_bytes_per_param``
    per parameter where its encoding travels in fewer bytes (None: the gradients' own)."""
    cost = allreduce_cost(case)
    if wire_bytes_per_param is not None:
        cost = planner.Cost(cost.a_s, cost.b_s_per_byte * wire_bytes_per_param
                            / case.trace.bytes_per_param)
    predicted = plan(case.trace.planner_trace(), cost, case.settings.threshold_bytes)
    return predicted.iteration_s + case.local()


class PlannedSchedule(ScheduleMethod):
    """A schedule whose grouping is planned from a profile of the first iterations: ``plan``
    returns its grouping and prediction for a trace and a cost (see :mod:`hvcomm.planner`).
    ``race_against``: schedules whose plans race this one's before one is kept."""

    race_against: Tuple[str, ...] = ()

    def plan(self, trace: planner.Trace, cost: planner.Cost,
             threshold_bytes: int) -> planner.Prediction:
        raise NotImplementedError

    def predict(self, case) -> float:
        return dense_schedule_s(case, self.plan)

    def optimizer_options(self, settings, model=None):
        """The planner's threshold and the race's trial steps from ``settings``."""
        return {"schedule": self.name, "trial_steps": settings.trial_steps,
                "fusion_threshold_bytes": settings.threshold_bytes}

    def problem(self, request):
        o = request.options
        if (problem := super().problem(request)) is not None:
            return problem
        if getattr(o.compression, "scope", "bucket") != "bucket":
            return (f"schedule={self.name!r} plans the buckets, but the compressor's scope is "
                    f"{o.compression.scope!r}; create it with scope='bucket'")
        if not isinstance(o.profile_steps, int) or o.profile_steps < 1:
            return f"profile_steps must be a positive integer, got {o.profile_steps!r}"
        if not isinstance(o.trial_steps, int) or o.trial_steps < 0:
            return f"trial_steps must be an integer >= 0, got {o.trial_steps!r}"
        return None

    def strategy(self, setup):
        o, params = setup.options, setup.params
        plans = GroupingPlanner(self, [p.numel() * p.element_size() for p in params],
                               [str(p.dtype) for p in params], setup.names, setup.engine,
                               o.fusion_threshold_bytes, o.profile_steps, o.trial_steps)
        # profiling: everything in one message after backward
        return setup.synchronous(plan_groups(params, o.groups, ONE_BUCKET_BYTES), plans=plans)
