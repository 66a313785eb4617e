"""DistributedOptimizer: Horovod's drop-in, averaging gradients bucket by bucket from hooks."""
from __future__ import annotations

import functools
import dataclasses
import hashlib
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from mpi4py import MPI

from collectives.errors import HvcommError, raise_together
from collectives.merged import BucketPlan

from hvcomm import planner

from . import timeline
from .compression import Compression, Compressor, NoneCompressor
from .delayed import Delay, as_delay, local_update
from .memory import ErrorFeedback
from .ops import Average, Sum
from .p3 import P3Round
from .reducer import Reducer
from .runtime import runtime
from .schedule import SCHEDULES, Profiler, cost_for, observed_trace



@dataclass
class _Bucket:
    """Parameters reduced together, and the in-flight state of this iteration."""

    params: List[torch.nn.Parameter]
    key: str = ""                        # names its residual in the error-feedback memory
    ready: int = 0                       # parameters whose gradient is final this iteration
    pending: Optional[object] = None     # the reducer's InFlight once launched
    reducer: Optional[Reducer] = None    # the reducer that launched it


@dataclass
class CommStats:
    """What this rank moved in one synchronize(): ``payload_bytes`` handed to the
    collectives, ``sent_bytes`` put on the wire by this rank under the ring model."""

    messages: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0


def _local_problems(optimizer, named_parameters, compression, bpps, op, predivide) -> Optional[str]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
    if isinstance(optimizer, _DistributedMixin):
        return "the optimizer is already a DistributedOptimizer; wrap the plain optimizer once"
    if not isinstance(bpps, int) or bpps <= 0:
        return f"backward_passes_per_step must be a positive integer, got {bpps!r}"
    if op not in (Average, Sum):
        return f"op must be hvcomm.torch.Average or Sum for gradients, got {op!r}"
    if predivide != 1.0 and op != Average:
        return "gradient_predivide_factor is only supported with op=Average"
    if not isinstance(compression, Compressor) and not (
            hasattr(compression, "compress") and hasattr(compression, "decompress")):
        return "compression must provide compress() and decompress() (e.g. Compression.fp16)"
    if isinstance(compression, Compressor):
        dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        bad = compression.problem(dtypes, runtime().comm.Get_size())
        if bad:
            return bad
    if named_parameters is None:
        return None
    if any(not (isinstance(np_, tuple) and len(np_) == 2 and isinstance(np_[0], str)
                and isinstance(np_[1], torch.Tensor)) for np_ in named_parameters):
        return ("named_parameters should be a sequence of tuples (name, parameter), usually "
                "produced by model.named_parameters()")
    names = [n for n, _ in named_parameters]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        return f"parameter names in named_parameters must be unique; duplicates: {dups}"
    named = {id(p) for _, p in named_parameters}
    unnamed = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in named]
    if unnamed:
        return (f"named_parameters was given but {len(unnamed)} parameter(s) of param_groups "
                f"{sorted(set(unnamed))} are not named; pass model.named_parameters()")
    return None


def _agree_on_parameters(comm: MPI.Comm, spec: List[tuple]) -> None:
    """Raise on every rank if ranks hold different parameter names, shapes or dtypes."""
    digest = hashlib.sha1(repr(spec).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) == 1:
        return
    specs = comm.allgather(spec)
    lines = []
    for r, other in enumerate(specs):
        if other != specs[0]:
            diff = next((f"{a} vs {b}" for a, b in zip(specs[0], other) if a != b),
                        f"{len(specs[0])} vs {len(other)} parameters")
            lines.append(f"rank 0 vs rank {r}: {diff}")
    raise HvcommError("DistributedOptimizer: ranks hold different models (name, shape, dtype): "
                      + "; ".join(lines) + ". Build the same model on every rank.")


class _DistributedMixin:
    """Placed in front of the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _hvcomm_setup(self, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, fusion_threshold_bytes, schedule,
                      profile_steps, slice_elems, model, trial_steps, delay):
        rt = runtime()
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        if named_parameters is None:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p)
                                for i, g in enumerate(self.param_groups)
                                for j, p in enumerate(g["params"])]
        self._names = {p: n for n, p in named_parameters}
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        spec = [(self._names[p], tuple(p.shape), str(p.dtype)) for p in params]
        _agree_on_parameters(rt.comm, spec + [("options", backward_passes_per_step, op,
                                               gradient_predivide_factor, repr(compression),
                                               schedule, profile_steps, slice_elems,
                                               model is not None, trial_steps, repr(delay))])
        self._params = params
        self._index = {p: i for i, p in enumerate(params)}
        self.schedule = schedule
        self._fusion_threshold = fusion_threshold_bytes
        scope = getattr(compression, "scope", "bucket")
        if scope != "bucket" and groups is None:
            fusion_threshold_bytes = 0 if scope == "layer" else 2**62
        self._memory = ErrorFeedback()
        self._buckets: List[_Bucket] = []
        if schedule in planner.SCHEDULES:  # profile with everything sent after backward
            fusion_threshold_bytes = 2**62
        self._set_buckets(self._plan(params, groups, fusion_threshold_bytes))
        self._reducer = Reducer(rt.engine, compression, self._memory)
        self._dense_reducer = Reducer(rt.engine, Compression.none, self._memory)
        self.delay: Optional[Delay] = delay  # delayed synchronisation, or None
        self._W: Optional[Dict[torch.nn.Parameter, torch.Tensor]] = None  # global weights
        self._previous = None   # delayed: last step's gradients (in flight, or averaged by name)
        self._step = 0                     # synchronizations so far (density warm-up, seeds)
        self._passes_left = {p: backward_passes_per_step for p in params}
        self._next_launch = 0
        self._hooks_fired = False
        self._synchronized = False
        self._should_synchronize = True
        self.comm_stats = CommStats()      # the last completed synchronize()
        self._inflight = CommStats()       # the one under way
        # scheduling: profile, then plan (planner schedules); or P3 rounds
        self.schedule_report: List[planner.Prediction] = []  # every schedule, once planned
        self.plan_prediction: Optional[planner.Prediction] = None  # the one in use
        self._profiler = (Profiler(len(params), steps=profile_steps)
                          if schedule in planner.SCHEDULES else None)
        self._trial_steps = trial_steps
        self._trials = None                # "mgwfbp": the race between candidate plans
        self.trial_report: Dict[str, float] = {}   # candidate -> best measured iteration (s)
        self.plan_origin: Optional[str] = None     # which candidate's plan "mgwfbp" kept
        self._order = list(range(len(params)))
        self._last_step_end = time.perf_counter()
        self._slice_elems = slice_elems
        self._round: Optional[P3Round] = None      # P3: this iteration's gradients
        self._deferred: Optional[P3Round] = None   # P3: last iteration's, applied layer by layer
        self._deferred_left: set = set()
        self._zeroed_since_step = False
        self._module_hooks: list = []              # P3 with model=: the forward pre-hooks
        self._comm_end = 0.0                       # when the last collective ended (profiling)
        self._iter_start_us = timeline.Timeline.now_us()
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if model is not None:
            self._attach_model(model)
        self._patch_step_function()

    @staticmethod
    def _plan(params, groups, threshold_bytes) -> List[List[torch.nn.Parameter]]:
        """Buckets in launch order: reverse registration order, the usual backward order."""
        if isinstance(groups, list):
            grouped = [list(g) for g in groups]
            seen = {id(p) for g in grouped for p in g}
            grouped += [[p] for p in params if id(p) not in seen]
            position = {id(p): i for i, p in enumerate(params)}
            grouped.sort(key=lambda g: -max(position[id(p)] for p in g))
            return grouped
        order = list(reversed(range(len(params))))
        if isinstance(groups, int) and groups > 0:
            per = -(-len(params) // groups)
            return [[params[i] for i in order[s:s + per]] for s in range(0, len(order), per)]
        plan = BucketPlan.by_threshold([p.numel() * p.element_size() for p in params],
                                       threshold_bytes, order, keys=[p.dtype for p in params])
        return [[params[i] for i in b] for b in plan.buckets]

    def _set_buckets(self, groups: List[List[torch.nn.Parameter]]) -> None:
        """Install a new grouping; error-feedback residuals are carried over parameter by
        parameter, so replanning loses no state."""
        per_param = self._residuals_by_param()
        self._buckets = [_Bucket(list(g)) for g in groups]
        self._memory.residuals = {}
        for b in self._buckets:
            b.key = "|".join(self._names[p] for p in b.params)
            self._pack_residual(b, per_param)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}

    @staticmethod
    def _split(flat: torch.Tensor, params):
        """(parameter, its part of ``flat`` shaped like it) for a bucket's flat buffer."""
        offset = 0
        for p in params:
            yield p, flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def _residuals_by_param(self) -> Dict[str, torch.Tensor]:
        out = {}
        for b in self._buckets:
            res = self._memory.residuals.get(b.key)
            if res is not None:
                out.update((self._names[p], r) for p, r in self._split(res, b.params))
        return out

    def _pack_residual(self, bucket: _Bucket, per_param: Dict[str, torch.Tensor]) -> None:
        parts = [per_param.get(self._names[p]) for p in bucket.params]
        if all(r is None for r in parts):
            return
        self._memory.residuals[bucket.key] = torch.cat([
            r.reshape(-1) if r is not None else torch.zeros(p.numel(), dtype=p.dtype)
            for r, p in zip(parts, bucket.params)])

    # -- hooks: count passes, launch complete buckets in the fixed order ----------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise HvcommError(f"parameter {self._names[p]!r} has sparse gradients, which hvcomm "
                              "does not reduce; use a dense layer (e.g. Embedding(sparse=False))")
        if self._passes_left[p] <= 0:
            raise HvcommError("Gradients were computed more than backward_passes_per_step times "
                              "before step(); increase backward_passes_per_step to accumulate "
                              "gradients locally")
        if self._deferred is not None:  # a P3 parameter used before its owner's forward
            self._apply_deferred(set(self._deferred_left))
        if not self._hooks_fired and timeline.active():
            timeline.active().span("forward+backward (to first gradient)", self._iter_start_us,
                                   timeline.Timeline.now_us())
        self._hooks_fired = True
        self._passes_left[p] -= 1
        if self._passes_left[p] == 0:
            if self._profiler is not None:
                self._profiler.grad_ready(self._index[p])
            if self.schedule == "p3":
                self._p3_ready(p)
            else:
                self._bucket_of[p].ready += 1
                self._launch_ready()

    def _launch_ready(self) -> None:
        while (self._next_launch < len(self._buckets)
               and self._buckets[self._next_launch].ready == len(self._buckets[self._next_launch].params)):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _flat_grad(self, params) -> torch.Tensor:
        grads = []
        for p in params:
            if p.grad is None:  # no gradient on this rank (unused branch): contribute zeros
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.detach().reshape(-1))
        flat = torch.cat(grads).cpu()
        if self.op == Average and self.gradient_predivide_factor != 1.0:
            flat.div_(self.gradient_predivide_factor)
        return flat

    def _dense_now(self) -> bool:
        """Delayed modes: warm-up steps, and CD's k-step corrections, go uncompressed."""
        d = self.delay
        if d is None:
            return False
        j = self._step - d.warmup_steps
        return j < 0 or d.is_full_precision(j)

    def _launch_rest(self) -> None:
        """Launch, in order, the buckets the hooks did not (unused parameters: zeros)."""
        for bucket in self._buckets[self._next_launch:]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)

    def _launch(self, bucket: _Bucket) -> None:
        with timeline.measure("compress+launch", bucket=bucket.key[:80]):
            flat = self._flat_grad(bucket.params)
            reducer = self._reducer
            if self._dense_now():
                reducer = self._dense_reducer
            bucket.reducer = reducer
            bucket.pending = reducer.start(bucket.key, flat, self._step)
        self._inflight.messages += 1

    # -- P3 ------------------------------------------------------------------------------------
    def _p3_ready(self, p: torch.nn.Parameter) -> None:
        if self._round is None:
            self._round = P3Round([q.numel() for q in self._params],
                                  [self._names[q] for q in self._params], self._slice_elems)
            engine = runtime().engine
            engine.open_streams += 1
            self._round_handle = engine.submit(self._round.job)
        self._round.ready(self._index[p], self._flat_grad([p]))

    def _p3_close(self) -> P3Round:
        """Hand over every gradient not handed over yet (zeros where none); the round's job
        then finishes on every rank."""
        if self._round is None:
            self._p3_ready(self._params[0])
        r, self._round = self._round, None
        for i, p in enumerate(self._params):
            if not r.is_ready(i):
                r.ready(i, self._flat_grad([p]))
        runtime().engine.open_streams -= 1
        return r

    def _p3_collect(self, r: P3Round, indices) -> None:
        """Wait for these parameters' sums and put the average into .grad."""
        scale = self._scale()
        with timeline.measure("wait"):
            for i in sorted(indices):
                p = self._params[i]
                p.grad = (r.wait(i) * scale if scale != 1.0 else r.wait(i)).view_as(p)

    def _p3_stats(self, r: P3Round) -> CommStats:
        self._round_handle.wait()
        return CommStats(r.messages + r.negotiations, r.payload_bytes, r.sent_bytes)

    def _attach_model(self, model: torch.nn.Module) -> None:
        """P3's overlap with the next forward: each module's forward first applies the
        deferred update of the parameters it owns, waiting only for their slices."""
        for module in model.modules():
            owned = {self._index[p] for p in module.parameters(recurse=False) if p in self._index}
            if owned:
                self._module_hooks.append(module.register_forward_pre_hook(
                    lambda _m, _inp, owned=owned: self._apply_deferred(owned)))
        self._module_hooks.append(model.register_state_dict_pre_hook(
            lambda *_a, **_k: self._finish_p3()))

    def _apply_deferred(self, indices) -> None:
        todo = self._deferred_left & set(indices)
        if not todo or self._deferred is None:
            return
        r = self._deferred
        params = [self._params[i] for i in sorted(todo)]
        saved = [p.grad for p in params]
        self._p3_collect(r, todo)
        self._deferred_left -= todo
        if not self._deferred_left:
            self._deferred = None
            self.comm_stats = self._p3_stats(r)
        with timeline.measure("update", params=len(params)):
            self._update_only(params)
        if self._zeroed_since_step:
            for p, g in zip(params, saved):
                p.grad = g

    def _update_only(self, params) -> None:
        """The wrapped optimizer's step on a subset of the parameters."""
        keep = {id(p) for p in params}
        saved = [g["params"] for g in self.param_groups]
        for g in self.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        try:
            super().step()
        finally:
            for g, ps in zip(self.param_groups, saved):
                g["params"] = ps

    def _finish_p3(self) -> None:
        if self._deferred is not None:
            self._apply_deferred(set(self._deferred_left))

    def finish_pending(self) -> None:
        """Apply every update still pending, so the model holds the synchronised weights.

        P3 with ``model=``: the updates deferred to the next forward (applied by themselves
        before the next backward, ``state_dict()`` and the model's ``state_dict()``).
        ``delay=``: waits for the last step's allreduce, advances the global weights with it
        and sets the local weights to them (the next step then starts from W; the same on
        every rank). Call it before evaluating or saving the model for inference."""
        self._finish_p3()
        if self.delay is not None and self._W is not None:
            prev = self._collect_previous()
            if prev is not None:
                self._global_update(prev)
            with torch.no_grad():
                for p, w in self._W.items():
                    p.copy_(w)

    # -- delayed synchronisation (OD-SGD, SSD-SGD, CD-SGD) -------------------------------------
    def global_weights(self) -> Dict[str, torch.Tensor]:
        """Delayed modes: the global weights W by parameter name (identical on every rank)."""
        if self.delay is None:
            raise HvcommError("global_weights() is for delay=... optimizers")
        if self._W is None:
            return {self._names[p]: p.detach().clone() for p in self._params}
        return {self._names[p]: w for p, w in self._W.items()}

    def _collect_previous(self) -> Optional[Dict[str, torch.Tensor]]:
        """The last step's averaged gradients by parameter name (waiting if in flight)."""
        prev = self._previous
        if isinstance(prev, list):
            scale = self._scale()
            averaged, stats = {}, CommStats()
            for params, reducer, job in prev:
                flat, sent, payload_bytes = reducer.finish(job)
                stats.messages += 1
                stats.sent_bytes += sent
                stats.payload_bytes += payload_bytes
                averaged.update((self._names[p], g * scale) for p, g in self._split(flat, params))
            self.comm_stats = stats
            self._previous = prev = averaged
        return prev

    def _global_update(self, averaged: Dict[str, torch.Tensor]) -> None:
        """W <- the wrapped optimizer's step on W with the averaged gradients; then the
        gradients are consumed (_previous cleared)."""
        saved = []
        for p in self._params:
            saved.append((p.data, p.grad))
            p.data = self._W[p]
            p.grad = averaged[self._names[p]].to(p.dtype)
        try:
            with timeline.measure("global update"):
                super().step()
        finally:
            for p, (data, grad) in zip(self._params, saved):
                p.data, p.grad = data, grad
        self._previous = None

    def _delayed_step(self, closure):
        d = self.delay
        if self._W is None:  # W starts as the weights of the first step (after any broadcast)
            self._W = {p: p.detach().clone() for p in self._params}
        if self._step < d.warmup_steps:  # synchronous, dense
            self.synchronize()
            self._synchronized = False
            with timeline.measure("update"):
                loss = super().step(closure)
            with torch.no_grad():
                for p, w in self._W.items():
                    w.copy_(p)
            return loss
        loss = closure() if closure is not None else None
        current = []
        self._launch_rest()
        for b in self._buckets:
            current.append((b.params, b.reducer, b.pending))
            b.pending, b.ready, b.reducer = None, 0, None
        self._inflight = CommStats()
        j = self._step - d.warmup_steps
        reset = d.is_reset(j)
        previous = self._collect_previous()
        W_before = None
        if previous is not None:
            if not reset and d.glu:
                W_before = {p: w.clone() for p, w in self._W.items()}
            with timeline.measure("wait+global update"):
                self._global_update(previous)
        with timeline.measure("local update"):
            local_update(d, self.param_groups, self._W, W_before, reset)
        self._previous = current
        self._reset_counters()
        self._step += 1
        return loss

    # -- Horovod's optimizer interface --------------------------------------------------------
    def _scale(self) -> float:
        size = runtime().comm.Get_size()
        return self.gradient_predivide_factor / size if self.op == Average else 1.0

    def synchronize(self) -> None:
        """Finish this iteration's gradient averaging (launching what the hooks did not)."""
        if self.delay is not None and self._step >= self.delay.warmup_steps:
            raise HvcommError("with delay=..., step() averages the gradients (one step late); "
                              "synchronize() is not available after the warm-up")
        if self.schedule == "p3":
            self._finish_p3()
            r = self._p3_close()
            self._p3_collect(r, range(len(self._params)))
            self.comm_stats = self._p3_stats(r)
            self._end_iteration()
            return
        self._launch_rest()
        scale = self._scale()
        comm_end = 0.0
        with timeline.measure("wait"):
            for bucket in self._buckets:
                flat, sent, payload_bytes = bucket.reducer.finish(bucket.pending)
                comm_end = max(comm_end, bucket.pending.handle.finished_at)
                self._inflight.sent_bytes += sent
                self._inflight.payload_bytes += payload_bytes
                for p, g in self._split(flat, bucket.params):
                    p.grad.copy_(g)
                    if scale != 1.0:
                        p.grad.mul_(scale)
                bucket.pending, bucket.ready = None, 0
        self._comm_end = comm_end
        self.comm_stats, self._inflight = self._inflight, CommStats()
        self._end_iteration()

    def _end_iteration(self) -> None:
        self._reset_counters()
        self._step += 1
        self._synchronized = True

    def _reset_counters(self) -> None:
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step
        self._next_launch = 0
        self._hooks_fired = False

    def _next_profile_iteration(self) -> None:
        if self._trials:
            self._trial_iteration(time.perf_counter() - self._last_step_end)
        prof = self._profiler
        if prof is not None:
            was_recording = prof.recording
            prof.next_iteration()
            if was_recording and prof.complete:
                self._replan()
                self._profiler = None
        # the next iteration starts now (after any planning, which is not its time)
        self._iter_start_us = timeline.Timeline.now_us()
        self._last_step_end = time.perf_counter()

    def _replan(self) -> None:
        """Plan the buckets from the profile, identically on every rank (collective). For
        "mgwfbp", the model's choice then races the baselines' plans for a few iterations
        (see :meth:`_trial_iteration`): the model ignores that computing and communicating
        at once can slow both down, and the race catches it."""
        rt = runtime()
        ready, update_s = rt.engine.submit(lambda comm: self._profiler.agreed(comm)).wait()
        order, trace = observed_trace(ready, update_s,
                                      [p.numel() * p.element_size() for p in self._params],
                                      [str(p.dtype) for p in self._params],
                                      [self._names[p] for p in self._params])
        cost = cost_for(rt.engine, sum(p.numel() * p.element_size() for p in self._params))
        self.schedule_report = planner.compare(trace, cost, self._fusion_threshold)
        by_name = {p.schedule: p for p in self.schedule_report}
        self._order = order
        if self.schedule == "mgwfbp" and self._trial_steps > 0:
            seen, trials = set(), []
            for name in ("mgwfbp", "single", "threshold", "wfbp"):
                if by_name[name].plan.buckets not in seen:
                    seen.add(by_name[name].plan.buckets)
                    trials.append(by_name[name])
            self._trials = {"candidates": trials, "at": 0, "times": [[] for _ in trials],
                            "warm": True}
        self._install(by_name[self.schedule] if not self._trials
                      else self._trials["candidates"][0])

    def _install(self, prediction: planner.Prediction) -> None:
        self.plan_prediction = prediction
        self._set_buckets([[self._params[self._order[i]] for i in bucket]
                           for bucket in prediction.plan.buckets])

    def _trial_iteration(self, seconds: float) -> None:
        """One iteration of the race between candidate plans: each runs one warm-up and
        ``trial_steps`` timed iterations; then the fastest (slowest rank's best time) wins."""
        t = self._trials
        if t["warm"]:
            t["warm"] = False
        else:
            t["times"][t["at"]].append(seconds)
            if len(t["times"][t["at"]]) >= self._trial_steps:
                t["at"] += 1
                t["warm"] = True
                if t["at"] == len(t["candidates"]):
                    best = np.array([min(ts) for ts in t["times"]])
                    runtime().engine.submit(
                        lambda comm: comm.Allreduce(MPI.IN_PLACE, best, op=MPI.MAX)).wait()
                    self.trial_report = {c.schedule: float(b)
                                         for c, b in zip(t["candidates"], best)}
                    winner = t["candidates"][int(np.argmin(best))]
                    self._install(dataclasses.replace(winner, schedule="mgwfbp")
                                  if winner.schedule != "mgwfbp" else winner)
                    self.plan_origin = winner.schedule
                    self._trials = None
                else:
                    self._install(t["candidates"][t["at"]])

    @contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self.delay is not None:
            return self._delayed_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(); gradients are averaged twice")
            if self.schedule == "p3" and self._module_hooks and closure is None:
                return self._p3_defer()
            self.synchronize()
        self._synchronized = False
        with timeline.measure("update"):
            loss = super().step(closure)
        if self._profiler is not None:
            self._profiler.tail(self._comm_end)
        self._next_profile_iteration()
        return loss

    def _p3_defer(self):
        """P3 with a model: hand everything over and return; each module's next forward
        applies its own parameters' update when their slices have arrived."""
        self._finish_p3()
        r = self._p3_close()
        self._deferred, self._deferred_left = r, set(range(len(self._params)))
        self._zeroed_since_step = False
        self._end_iteration()
        self._synchronized = False
        self._next_profile_iteration()
        return None

    def zero_grad(self, set_to_none: bool = True):
        if self._hooks_fired:
            raise HvcommError("optimizer.zero_grad() was called after loss.backward() but before "
                              "optimizer.step() or optimizer.synchronize(); call step() first")
        self._zeroed_since_step = True
        return super().zero_grad(set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus hvcomm's own, under "hvcomm": this rank's
        error-feedback residuals (by parameter name) and the step counter. Residuals differ
        between ranks: save one checkpoint per rank to resume exactly."""
        self._finish_p3()
        state = super().state_dict()
        state["hvcomm"] = {"step": self._step,
                           "residuals_by_param": {k: v.clone() for k, v in
                                                  self._residuals_by_param().items()}}
        if self.delay is not None:
            prev = self._collect_previous()  # waits for, but does not apply, the last step's
            state["hvcomm"]["delay"] = {
                "W": None if self._W is None else {self._names[p]: w.clone()
                                                   for p, w in self._W.items()},
                "previous": None if prev is None else {k: v.clone() for k, v in prev.items()}}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore; hvcomm's state is restored when the dict has it, kept otherwise."""
        self._finish_p3()
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvcomm", None)
        if (any(b.pending is not None for b in self._buckets) or self._round is not None
                or isinstance(self._previous, list) and ours is None):
            raise HvcommError("load_state_dict() while gradients are in flight; call "
                              "synchronize() or step() first")
        if ours is not None:
            self._step = ours["step"]
            delay_state = ours.get("delay")
            if self.delay is not None and delay_state is not None:
                by_name = {self._names[p]: p for p in self._params}
                self._W = (None if delay_state["W"] is None else
                           {by_name[k]: v.clone() for k, v in delay_state["W"].items()})
                self._previous = (None if delay_state["previous"] is None else
                                  {k: v.clone() for k, v in delay_state["previous"].items()})
            if "residuals_by_param" in ours:
                self._memory.residuals = {}
                for b in self._buckets:
                    self._pack_residual(b, ours["residuals_by_param"])
            else:
                self._memory.load_state_dict(ours["residuals"])
        for b in self._buckets:
            b.ready = 0
        self._inflight = CommStats()
        self._reset_counters()
        self._synchronized = False
        super().load_state_dict(state_dict)


@functools.lru_cache(maxsize=None)
def _distributed_class(base: type) -> type:
    class Distributed(_DistributedMixin, base):  # type: ignore[misc, valid-type]
        __doc__ = f"{base.__name__} whose gradients are averaged across ranks by hvcomm."

    Distributed.__name__ = Distributed.__qualname__ = f"Distributed{base.__name__}"
    return Distributed


def _schedule_problem(schedule, compression, groups, profile_steps, slice_elems, model,
                      params, trial_steps) -> Optional[str]:
    if schedule is None:
        return "model= is used by schedule='p3' only" if model is not None else None
    if schedule not in SCHEDULES:
        return f"schedule must be one of {SCHEDULES} (or None), got {schedule!r}"
    if groups is not None:
        return "pass either groups= or schedule=, not both"
    if schedule == "p3":
        if type(compression) is not NoneCompressor:
            return ("schedule='p3' sends dense slices and takes no compression; use "
                    "compression=Compression.none or a merging schedule such as 'mgwfbp'")
        if not isinstance(slice_elems, int) or slice_elems < 1:
            return f"slice_elems must be a positive integer, got {slice_elems!r}"
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                return f"model must be a torch.nn.Module, got {type(model).__name__}"
            owned = {id(p) for p in model.parameters()}
            if not all(id(p) in owned for p in params):
                return "model= must own every parameter of the optimizer"
        return None
    if model is not None:
        return "model= is used by schedule='p3' only"
    if getattr(compression, "scope", "bucket") != "bucket":
        return (f"schedule={schedule!r} plans the buckets, but the compressor's scope is "
                f"{compression.scope!r}; create it with scope='bucket'")
    if not isinstance(profile_steps, int) or profile_steps < 1:
        return f"profile_steps must be a positive integer, got {profile_steps!r}"
    if not isinstance(trial_steps, int) or trial_steps < 0:
        return f"trial_steps must be an integer >= 0, got {trial_steps!r}"
    return None


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1, op: str = Average,
                         gradient_predivide_factor: float = 1.0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, *,
                         fusion_threshold_bytes: Optional[int] = None,
                         schedule: Optional[str] = None, profile_steps: int = 3,
                         slice_elems: int = 50_000, model: Optional[torch.nn.Module] = None,
                         trial_steps: int = 5, delay=None):
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    Horovod's signature and semantics: gradients are summed locally over
    ``backward_passes_per_step`` passes, then averaged across ranks (``op=Sum`` sums);
    communication starts from per-parameter hooks during backward, in buckets of up to
    ``fusion_threshold_bytes`` (default 25 MiB, or env HVCOMM_FUSION_THRESHOLD_BYTES)
    launched in the same order on every rank. ``groups`` (int or list of lists of
    parameters) sets the buckets explicitly. Parameters without a gradient on a rank
    contribute zeros. The result is an instance of ``type(optimizer)`` (a subclass of it),
    sharing its state and param_groups. Collective: every rank must call it; bad arguments
    or models that differ between ranks raise on every rank.

    ``schedule`` (default None: the fusion threshold above, in reverse registration order)
    plans the buckets from a profile of the first iterations (1 skipped, then
    ``profile_steps``) and a cost fit of the communicator: "mgwfbp" (the grouping with the
    earliest predicted end of communication), "merge_rule" (MG-WFBP's greedy rule), "wfbp"
    (one tensor per message), "single" (one message after backward), "threshold" (the
    fusion threshold, in observed order). The predictions of all of them are then in
    ``optimizer.schedule_report``. During profiling everything is sent in one message after
    backward, so the layer times are measured without communication beside them. "mgwfbp"
    then races its plan against the single, threshold and WFBP plans for ``trial_steps``
    timed iterations each (plus one warm-up) and keeps the fastest (``trial_report``,
    ``plan_origin``; ``trial_steps=0`` trusts the model). "p3" sends slices of ``slice_elems`` elements, the
    parameters closest to the input first; with ``model=`` the update is deferred to each
    module's next forward, which waits only for its own parameters.

    ``delay`` ("od", "ssd", "cd" or a :class:`hvcomm.torch.Delay`) turns on delayed
    synchronisation (OD-SGD, SSD-SGD with GLU, CD-SGD; see :mod:`hvcomm.torch.delayed`):
    step() returns before the gradients are averaged, which happens during the next step.
    ``finish_pending()`` brings the model to the global weights (before evaluating);
    ``global_weights()`` returns them; everything is in ``state_dict()``.
    """
    rt = runtime()
    named = list(named_parameters) if named_parameters is not None else None
    problem = _local_problems(optimizer, named, compression, backward_passes_per_step, op,
                              gradient_predivide_factor)
    if problem is None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        problem = _schedule_problem(schedule, compression, groups, profile_steps, slice_elems,
                                    model, params, trial_steps)
    delay_cfg = None
    if problem is None:
        try:
            delay_cfg = as_delay(delay)
        except HvcommError as e:
            problem = str(e)
    if problem is None and delay_cfg is not None:
        problem = delay_cfg.problem(type(compression) is NoneCompressor)
        if problem is None and schedule is not None:
            problem = "delay= and schedule= cannot be combined; leave schedule=None"
        if problem is None and not isinstance(compression, Compressor):
            problem = "delay= needs an hvcomm compressor (Compression.*)"
    if problem is None and sparse_as_dense is not False:
        problem = "sparse_as_dense is not supported: hvcomm reduces dense gradients only"
    if problem is None and process_set is not None:
        problem = "process_set is not supported: pass a communicator to hvcomm.torch.init()"
    raise_together(rt.comm, problem, "DistributedOptimizer")
    if fusion_threshold_bytes is None:
        fusion_threshold_bytes = rt.fusion_threshold_bytes
    cls = _distributed_class(type(optimizer))
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)
    opt._hvcomm_setup(named, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, fusion_threshold_bytes, schedule,
                      profile_steps, slice_elems, model, trial_steps, delay_cfg)
    return opt
