"""P3 priority-based parameter propagation on allreduce (ALGORITHMS.md section 4).

Gradients are cut into slices of about ``slice_elems`` elements. One engine job per
iteration sums them in place one at a time (:func:`hvcomm.torch.sums.sum_in_place`: hvcomm's
ring, which sleeps between polls, for large slices), always the highest-priority slice (the
parameter closest to the input first) among those whose gradient is ready *on every rank*;
so a slice that becomes ready overtakes queued lower-priority ones, and a slice on the wire is
never interrupted.

Ranks must issue the same collectives in the same order, and "ready" differs between ranks
from moment to moment. So beside every slice's sum goes a small non-blocking allreduce of each
rank's readiness vector (1 per parameter whose gradient is ready here, taken as the slice
starts); the sum tells every rank the same set of globally-ready parameters, and the next
choice is a function of that shared state alone. When nothing globally ready is left to send,
the ranks exchange readiness alone (a "negotiation"), each once it has something new to
report. Every rank makes the same sequence of choices, so no collective is mismatched,
whatever the timing.
"""
from __future__ import annotations

import functools
import heapq
import math
import threading
from typing import List, Optional, Sequence

import numpy as np
import torch

from .. import timeline
from ..sums import sum_in_place
from .base import ScheduleMethod
from .compressor import sends_as_is
from .payload import ring_bytes
from .buckets import CommStats, flat_grad
from .strategy import (BaseStep, NextForward, Strategy, in_flight_error, may_update_in_parts,
                       model_problem)


def priority_key(tensor_index: int) -> int:
    """P3's rule, for the runtime and the prediction alike: among the slices ready on every
    rank, the tensor closest to the input (the lowest index in forward order) goes first."""
    return tensor_index


class P3Round:
    """The gradients of one iteration: filled by :meth:`ready` on the main thread, sent by
    :meth:`job` on the engine thread, read with :meth:`wait` (sums over ranks times
    ``scale``, flat)."""

    def __init__(self, numels: Sequence[int], names: Sequence[str], slice_elems: int,
                 scale: float = 1.0):
        self.n = len(numels)
        self.scale = scale  # each sum comes back multiplied by it
        self.names = list(names)
        self.bounds: List[List[tuple]] = [
            [(lo, min(lo + slice_elems, n)) for lo in range(0, max(n, 1), slice_elems)]
            for n in numels]
        self._cond = threading.Condition()
        self._local = np.zeros(self.n, bool)
        self.results: List[Optional[torch.Tensor]] = [None] * self.n  # summed in place
        self._done = [threading.Event() for _ in range(self.n)]
        self._error: Optional[BaseException] = None
        self.messages = 0
        self.negotiations = 0
        self.payload_bytes = 0
        self.sent_bytes = 0.0
        self.sent: List[tuple] = []  # (parameter, slice) in the order they went on the wire

    # -- main thread -----------------------------------------------------------------------
    def ready(self, i: int, flat: torch.Tensor) -> None:
        """Hand over parameter i's final local gradient (a private flat CPU copy, which
        becomes its sum times ``scale``)."""
        with self._cond:
            if self._local[i]:
                return
            self.results[i] = flat
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
    def _slice_sent(self, i: int, s: int) -> None:
        """Slice s of parameter i is summed (engine thread, before the next choice)."""
        self.sent.append((i, s))

    def job(self, comm) -> None:
        try:
            self._run(comm)
        except BaseException as e:  # noqa: BLE001 - re-raised to every waiter
            self._error = e
            for d in self._done:
                d.set()
            raise

    def _run(self, comm) -> None:
        from mpi4py import MPI
        size = comm.Get_size()
        everywhere = np.zeros(self.n, bool)
        next_slice = [0] * self.n
        left = sum(len(b) for b in self.bounds)
        while left:
            cand = min((i for i in range(self.n)
                        if everywhere[i] and next_slice[i] < len(self.bounds[i])),
                       key=priority_key, default=None)
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
            with self._cond:  # what is ready here travels beside the slice
                news = self._local.astype(np.float64)
            request = comm.Iallreduce(MPI.IN_PLACE, news, op=MPI.SUM)
            part = self.results[i][lo:hi]
            with timeline.measure(f"p3 {self.names[i]}[{lo}:{hi}]", "comm"):
                try:
                    sum_in_place(comm, part, self.scale)
                except BaseException as error:
                    _settle(request, error)
                    raise
                request.Wait()
            everywhere |= news > size - 0.5
            self.messages += 1
            nbytes = part.numel() * part.element_size()
            self.payload_bytes += nbytes
            self.sent_bytes += ring_bytes(comm, nbytes + news.nbytes)
            self._slice_sent(i, next_slice[i])
            next_slice[i] += 1
            left -= 1
            if next_slice[i] == len(self.bounds[i]):
                self._done[i].set()


def _settle(request, error: BaseException) -> None:
    """After a slice's sum raised ``error``: wait for the readiness allreduce every rank
    started beside it, so that it writes into no freed buffer (its own error, if any, is
    dropped for ``error``), unless a process failed: the engine then revokes the
    communicator, which ends it."""
    from .. import fault
    if fault.lost_a_process(error):
        return
    try:
        request.Wait()
    except Exception:  # noqa: BLE001 - the sum's error is the one raised
        pass


class P3(Strategy):
    """P3 as a synchronisation strategy: each final gradient goes into this iteration's
    :class:`P3Round`, whose job sends slices in priority order. Without ``model``,
    ``synchronize()`` waits for every slice. With ``model``, ``step()`` hands the round over
    and returns; each module's next forward (a pre-hook) applies the update of the
    parameters it owns, waiting only for their slices. ``optimizer`` is the
    DistributedOptimizer, whose param_groups a partial update narrows for a moment
    (:class:`hvcomm.torch.methods.strategy.NextForward`)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 base_step: BaseStep, engine, optimizer: torch.optim.Optimizer,
                 slice_elems: int, *, predivide: float = 1.0, scale: float = 1.0,
                 model: Optional[torch.nn.Module] = None):
        super().__init__(params, names, base_step)
        self._engine, self._optimizer, self.slice_elems = engine, optimizer, slice_elems
        self.comm_stats, self.steps = CommStats(), 0
        self.predivide, self.scale = predivide, scale
        self._round: Optional[P3Round] = None      # this iteration's gradients
        self._round_handle = None
        self._next_forward = (None if model is None else
                              NextForward(model, self.params, optimizer, base_step))

    def on_grad(self, i: int) -> None:
        self.finish_pending()  # a parameter used before its owner's forward
        if self._round is None:
            self._round = P3Round([p.numel() for p in self.params], self.names,
                                  self.slice_elems, self.scale)
            self._engine.open_stream("a DistributedOptimizer(schedule='p3') round")
            self._round_handle = self._engine.submit(self._round.job)
        self._round.ready(i, flat_grad([self.params[i]], self.predivide))

    def _close(self) -> P3Round:
        """Hand over every gradient not handed over yet (zeros where none); the round's job
        then finishes on every rank."""
        if self._round is None:
            self.on_grad(0)
        r, self._round = self._round, None
        for i, p in enumerate(self.params):
            if not r.is_ready(i):
                r.ready(i, flat_grad([p], self.predivide))
        self._engine.close_stream()
        return r

    def _averages(self, r: P3Round, indices):
        """Wait for these parameters' sums: (position, the average in its shape)."""
        for i in sorted(indices):
            yield i, r.wait(i).view_as(self.params[i])

    def _round_stats(self, r: P3Round) -> CommStats:
        self._round_handle.wait()
        return CommStats(r.messages + r.negotiations, r.payload_bytes, r.sent_bytes)

    def synchronize(self) -> None:
        self.finish_pending()
        r = self._close()
        with timeline.measure("wait"):
            for i, average in self._averages(r, range(len(self.params))):
                self.params[i].grad = average
        self.comm_stats = self._round_stats(r)
        self.steps += 1

    def update(self, closure=None):
        with timeline.measure("update"):
            return self.base_step(closure)

    def step(self, closure=None):
        if (self._next_forward is None or closure is not None
                or not may_update_in_parts(self._optimizer, self.params)):
            return super().step(closure)
        self.finish_pending()
        r = self._close()
        self._next_forward.defer(functools.partial(self._averages, r),
                                 done=lambda: setattr(self, "comm_stats", self._round_stats(r)))
        self.steps += 1
        return None

    def state_dict(self):
        self.finish_pending()
        return {"step": self.steps, "residuals_by_param": {}}

    def load_state_dict(self, state) -> None:
        self.finish_pending()
        if self._round is not None:
            raise in_flight_error()
        if state is not None:
            self.steps = state["step"]


def p3_period_s(case, iterations: int = 5) -> float:
    """P3's steady-state iteration time: an event simulation of ``iterations`` iterations,
    the period between the last two starts. One wire, one slice at a time, chosen by
    :func:`priority_key` among the ready ones; when nothing known to be ready is left, the ranks
    exchange their readiness (one small allreduce) once a gradient is ready, as the runtime
    does. The next iteration's forward of a layer waits only for that layer's slices and its
    share of the update. Each slice is one allreduce at the cluster's cost (hierarchical on
    nodes of several GPUs, where each slice pays the reduce and broadcast inside the node),
    the readiness vector's allreduce beside it (the longer of the two)."""
    trace, slice_elems = case.trace, case.settings.slice_elems
    tensors = [(li, math.prod(shape)) for li, layer in enumerate(trace.layers)
               for shape in layer.tensors()]
    beside = negotiation = case.allreduce_s(8 * len(tensors))  # the readiness vector's sum
    done = [0.0] * len(trace.layers)  # when each layer's slices of the last iteration were summed
    t = wire = 0.0
    starts = []
    for _ in range(iterations):
        starts.append(t)
        for li, layer in enumerate(trace.layers):  # forward: each layer waits for its update
            if layer.params:
                t = max(t, done[li]) + trace.update_s * layer.params / trace.params
            t += layer.forward_s
        ready = [0.0] * len(trace.layers)
        for li in reversed(range(len(trace.layers))):
            t += trace.layers[li].backward_s
            ready[li] = t
        # slices in priority order, each with its ready time
        slices = [(priority_key(ti), ready[li], li, min(slice_elems, n - lo))
                  for ti, (li, n) in enumerate(tensors) for lo in range(0, n, slice_elems)]
        left = [0] * len(trace.layers)
        for _, _, li, _ in slices:
            left[li] += 1
        pending = sorted(slices, key=lambda s: s[1])
        heap: list = []
        at = 0
        while at < len(pending) or heap:
            if not heap:  # the wire idles until the next gradient, then a negotiation
                wire = max(wire, pending[at][1]) + negotiation
            while at < len(pending) and pending[at][1] <= wire:
                heapq.heappush(heap, pending[at])
                at += 1
            _, _, li, elems = heapq.heappop(heap)
            wire += max(case.allreduce_s(elems * trace.bytes_per_param), beside)
            left[li] -= 1
            if not left[li]:
                done[li] = wire
    return starts[-1] - starts[-2]


class P3Schedule(ScheduleMethod):
    """``schedule="p3"``: priority slices of ``slice_elems`` elements; with ``model=`` the
    update is deferred to each module's next forward."""

    takes_model = True

    def problem(self, request):
        o, params = request.options, request.params
        if (problem := super().problem(request)) is not None:
            return problem
        if not sends_as_is(o.compression):
            return ("schedule='p3' sends dense slices and takes no compression; use "
                    "compression=Compression.none or a merging schedule such as 'mgwfbp'")
        if not isinstance(o.slice_elems, int) or o.slice_elems < 1:
            return f"slice_elems must be a positive integer, got {o.slice_elems!r}"
        if o.model is not None:
            return model_problem(o.model, params, request.optimizer)
        return None

    def strategy(self, setup):
        o = setup.options
        return P3(setup.params, setup.names, setup.base_step, setup.engine, setup.optimizer,
                  o.slice_elems, model=o.model, predivide=setup.predivide, scale=setup.scale)

    def predict(self, case):
        return p3_period_s(case) + case.local()

    def optimizer_options(self, settings, model=None):
        """The settings' slice; with ``model``, each layer's next forward waits for its own
        slices only."""
        return {"schedule": self.name, "model": model, "slice_elems": settings.slice_elems}


METHOD = P3Schedule("p3", "P3: priority slices, the layer nearest the input first")
