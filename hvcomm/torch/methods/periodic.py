"""Periodic averaging of the models: the machinery local SGD and DiLoCo share (their settings
are in :mod:`local_sgd` and :mod:`diloco`).

Every rank keeps the global weights W (identical on every rank) and trains its own local
weights w (the model's parameters) with the wrapped optimizer, whose state (momentum, Adam's
moments) stays each rank's own:

1. the first ``warmup_steps`` steps are synchronous (dense averaged gradients); W follows w;
2. after that, gradients stay local: ``step()`` is the wrapped optimizer's step alone;
3. the parameters are cut into ``fragments`` (consecutive parameters in registration order; a
   new fragment starts once the earlier ones hold f/F of the elements, or when every fragment
   still to come needs one of the parameters left). After local step t (counted from 1 after
   the warm-up) fragment f is exchanged when ``t mod period == (f * period) // fragments``:
   each rank sends its outer difference ``delta = W_f - w_f`` (through ``compression=``, with
   its error feedback), and the average (the sum divided by P) is the outer gradient;
4. ``overlap_steps`` steps later (0: at once), the outer optimizer, SGD with momentum mu
   (torch's rule: ``buf = delta`` at first, then ``mu*buf + delta``; Nesterov:
   ``delta + mu*buf``), moves ``W_f -= outer_lr * update``, and the local fragment is mixed
   in: ``w_f = (1 - mix) * w_f + mix * W_f`` (mix = 1: every rank restarts from W_f).

Local SGD is the case ``outer_lr = 1``, no momentum, one fragment, no overlap, mix 1: the
models are averaged every ``period`` steps.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from collectives.errors import HvcommError

from .. import timeline
from .base import Method, delay_problem
from .request import Request
from .buckets import CommStats, plan_groups
from .memory import ErrorFeedback
from .registry import get
from .strategy import Strategy
from .sync import Launched, Synchronous


@dataclasses.dataclass(frozen=True)
class Periodic:
    """The settings of a periodic method: ``period`` H (local steps between a fragment's
    exchanges), ``warmup_steps`` synchronous steps first, and the outer step's settings
    (see the module docstring). A method's own settings class fixes or adds to them."""

    period: int = 16
    warmup_steps: int = 0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = False
    fragments: int = 1
    overlap_steps: int = 0
    mix: float = 1.0

    mode = ""  # the method's name (a class attribute of each settings class)

    @property
    def method(self) -> "PeriodicMethod":
        return get(self.mode, "delay")

    def problem(self, request: Request) -> Optional[str]:
        def whole(value, least):
            return isinstance(value, int) and not isinstance(value, bool) and value >= least

        def number(value):
            return isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value)
        if not whole(self.period, 1):
            return f"period must be an integer >= 1, got {self.period!r}"
        if not whole(self.warmup_steps, 0):
            return f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}"
        if not (number(self.outer_lr) and self.outer_lr > 0):
            return f"outer_lr must be a number > 0, got {self.outer_lr!r}"
        if not (number(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            return f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}"
        if self.nesterov not in (True, False):
            return f"nesterov must be True or False, got {self.nesterov!r}"
        if self.nesterov and self.outer_momentum == 0:
            return "nesterov=True needs outer_momentum > 0"
        if not whole(self.fragments, 1) or self.fragments > self.period:
            return (f"fragments must be an integer from 1 to period ({self.period}), got "
                    f"{self.fragments!r}")
        if not whole(self.overlap_steps, 0) or self.overlap_steps >= self.period:
            return (f"overlap_steps must be an integer from 0 to period - 1 "
                    f"({self.period - 1}), got {self.overlap_steps!r}")
        if not (number(self.mix) and 0 < self.mix <= 1):
            return f"mix must be in (0, 1], got {self.mix!r}"
        o = request.options
        if not o.plain_average:
            return (f"delay={self.mode!r} averages the models: leave op=Average and "
                    "gradient_predivide_factor=1.0")
        return delay_problem(request)

    def offset(self, f: int) -> int:
        """Fragment f is exchanged after local steps t with t mod period == offset(f)."""
        return (f * self.period) // self.fragments


def fragments_of(numels: Sequence[int], count: int) -> List[List[int]]:
    """Positions of consecutive parameters, cut into ``count`` fragments (module docstring)."""
    if count > len(numels):
        raise HvcommError(f"fragments={count} but the optimizer has {len(numels)} parameters; "
                          "use at most one fragment per parameter")
    total, held, out = sum(numels), 0, [[]]
    for i, n in enumerate(numels):
        if out[-1] and len(out) < count and (
                held * count >= total * len(out) or len(numels) - i == count - len(out)):
            out.append([])
        out[-1].append(i)
        held += n
    return out


class _Fragment:
    """One fragment: its parameters (positions into the strategy's), their global weights,
    the outer momentum, and the Synchronous that sums the outer differences."""

    def __init__(self, indices: List[int], sync: Synchronous):
        self.indices, self.sync = indices, sync
        self.momentum: Optional[List[torch.Tensor]] = None


class PeriodicAveraging(Strategy):
    """See the module docstring; ``setup`` is a :class:`hvcomm.torch.methods.sync.Setup`."""

    def __init__(self, setup, settings: Periodic):
        super().__init__(setup.params, setup.names, setup.base_step)
        o, self.settings = setup.options, settings
        self.size = setup.comm.Get_size()
        self.steps = 0
        self.comm_stats = CommStats()
        self._warm = setup.synchronous(setup.fusion_groups(), dense_at=lambda step: True)
        self.memory = ErrorFeedback()  # every fragment's residuals, by parameter name
        self._fragments = []
        for indices in fragments_of([p.numel() for p in self.params], settings.fragments):
            params = [self.params[i] for i in indices]
            sync = Synchronous(params, [self.names[i] for i in indices], self.base_step,
                               setup.engine, o.compression,
                               plan_groups(params, None, o.bucket_threshold_bytes()),
                               comm=setup.comm, memory=self.memory)
            self._fragments.append(_Fragment(indices, sync))
        self._W: Optional[List[torch.Tensor]] = None
        # exchanges under way: (local step they are applied at, fragment, collectives)
        self._in_flight: List[Tuple[int, int, Launched]] = []
        # ... or done and not applied yet (after state_dict): (step, fragment, averages)
        self._averaged: List[Tuple[int, int, Dict[str, torch.Tensor]]] = []

    @property
    def _local_step(self) -> int:
        return self.steps - self.settings.warmup_steps

    def _warming_up(self) -> bool:
        return self._local_step < 0

    @property
    def plan(self):
        if self._warming_up():
            return self._warm.plan
        return [bucket for f in self._fragments for bucket in f.sync.plan]

    # -- events ------------------------------------------------------------------------------
    def on_grad(self, i: int) -> None:
        if self._warming_up():
            self._warm.on_grad(i)

    def synchronize(self) -> None:
        """Warm-up: average the gradients. After it they stay local: nothing to do."""
        if self._warming_up():
            self._warm.synchronize()
            self.comm_stats = self._warm.comm_stats

    def update(self, closure=None):
        if self._W is None:  # W starts as the weights of the first step (after any broadcast)
            self._W = [p.detach().clone() for p in self.params]
        if self._warming_up():
            loss = self._warm.update(closure)
            with torch.no_grad():
                for p, w in zip(self.params, self._W):
                    w.copy_(p)
            self.steps += 1
            return loss
        with timeline.measure("local update"):
            loss = self.base_step(closure)
        self.steps += 1
        t, s = self._local_step, self.settings
        self.comm_stats = CommStats()
        self._apply_due(t)
        for f in range(len(self._fragments)):
            if t % s.period == s.offset(f):
                self._launch(f, t + s.overlap_steps)
        self._apply_due(t)
        return loss

    # -- the outer exchange ------------------------------------------------------------------
    def _launch(self, f: int, due: int) -> None:
        """Send fragment f's outer difference W_f - w_f; applied after local step ``due``."""
        frag = self._fragments[f]
        params = [self.params[i] for i in frag.indices]
        saved = [p.grad for p in params]
        with torch.no_grad():
            for p, i in zip(params, frag.indices):
                p.grad = self._W[i] - p
        try:
            with timeline.measure("outer launch"):
                launched = frag.sync.take_launched()  # copies the differences
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        self._in_flight.append((due, f, launched))

    def _collect(self, up_to: Optional[int]) -> None:
        """Wait for the exchanges due by local step ``up_to`` (None: all) and keep their
        averages, in launch order."""
        keep = []
        for due, f, launched in self._in_flight:
            if up_to is not None and due > up_to:
                keep.append((due, f, launched))
                continue
            sync = self._fragments[f].sync
            with timeline.measure("outer wait"):
                sums = list(sync.collect(launched))
            sync.steps += 1
            self.comm_stats.include(sync.comm_stats)
            names = sync.names
            self._averaged.append((due, f, {names[j]: g.div(self.size) for j, g in sums}))
        self._in_flight = keep

    def _apply_due(self, t: int) -> None:
        self._collect(t)
        rest = []
        for due, f, averaged in self._averaged:
            if due <= t:
                self._outer_step(f, averaged)
            else:
                rest.append((due, f, averaged))
        self._averaged = rest

    @torch.no_grad()
    def _outer_step(self, f: int, averaged: Dict[str, torch.Tensor]) -> None:
        s, frag = self.settings, self._fragments[f]
        deltas = [averaged[self.names[i]].to(self._W[i].dtype) for i in frag.indices]
        update = deltas
        if s.outer_momentum:
            if frag.momentum is None:
                frag.momentum = [d.clone() for d in deltas]
            else:
                for b, d in zip(frag.momentum, deltas):
                    b.mul_(s.outer_momentum).add_(d)
            update = ([d + s.outer_momentum * b for d, b in zip(deltas, frag.momentum)]
                      if s.nesterov else frag.momentum)
        for i, u in zip(frag.indices, update):
            self._W[i].sub_(s.outer_lr * u)
            p = self.params[i]
            if s.mix == 1:
                p.copy_(self._W[i])
            else:
                p.mul_(1 - s.mix).add_(s.mix * self._W[i])

    # -- the rest of the interface -----------------------------------------------------------
    def finish_pending(self) -> None:
        """Apply the exchanges under way (waiting for them) and set the local weights to W:
        the same model on every rank. It starts no exchange, so the local steps since each
        fragment's last one are dropped: end a run after a multiple of ``period`` local steps
        (plus ``overlap_steps``) to drop none. Calling it again changes nothing."""
        if self._W is None:
            return
        self._collect(None)
        for _, f, averaged in self._averaged:
            self._outer_step(f, averaged)
        self._averaged = []
        with torch.no_grad():
            for p, w in zip(self.params, self._W):
                p.copy_(w)

    def global_weights(self) -> Dict[str, torch.Tensor]:
        if self._W is None:
            return {n: p.detach().clone() for p, n in zip(self.params, self.names)}
        return dict(zip(self.names, self._W))

    def close(self) -> None:
        self._warm.close()
        for frag in self._fragments:
            frag.sync.close()

    def state_dict(self):
        self._collect(None)  # waits for, but does not apply, the exchanges under way
        by_name = lambda tensors: dict(zip(self.names, (t.clone() for t in tensors)))  # noqa
        momentum = {}
        for frag in self._fragments:
            if frag.momentum is not None:
                momentum.update({self.names[i]: b.clone()
                                 for i, b in zip(frag.indices, frag.momentum)})
        return {
            "step": self.steps, "residuals_by_param": self.memory.state_dict(),
            "periodic": {
                "settings": repr(self.settings),
                "W": None if self._W is None else by_name(self._W),
                "outer_momentum": momentum,
                "averaged": [(due, f, {k: v.clone() for k, v in avg.items()})
                             for due, f, avg in self._averaged],
                "fragments": [{k: v for k, v in f.sync.state_dict().items()
                               if k != "residuals_by_param"} for f in self._fragments]}}

    def load_state_dict(self, state) -> None:
        """Restore ``state`` (None: keep this one). Exchanges under way are waited for first
        (every rank started them); with a state given, their averages give way to its."""
        self._collect(None)
        self._warm.load_state_dict(None)
        for frag in self._fragments:
            frag.sync.load_state_dict(None)
        if state is None:
            return
        if "periodic" not in state:
            raise HvcommError("the checkpoint was saved by an optimizer without local SGD or "
                              "DiLoCo (delay=LocalSGD/DiLoCo): load it into one made as it was")
        ours = state["periodic"]
        if ours["settings"] != repr(self.settings):
            raise HvcommError(f"the checkpoint was saved with delay={ours['settings']}, this "
                              f"optimizer has delay={self.settings!r}: make it as it was saved")
        if ours["W"] is not None and set(ours["W"]) != set(self.names):
            raise HvcommError("the checkpoint's global weights are of other parameters: "
                              f"{sorted(set(ours['W']) ^ set(self.names))[:5]} differ")
        self.steps = state["step"]
        for frag, saved in zip(self._fragments, ours["fragments"]):
            frag.sync.load_state_dict({**saved, "residuals_by_param": state["residuals_by_param"]})
        self._W = None if ours["W"] is None else [ours["W"][n].clone() for n in self.names]
        for frag in self._fragments:
            names = [self.names[i] for i in frag.indices]
            frag.momentum = ([ours["outer_momentum"][n].clone() for n in names]
                             if names[0] in ours["outer_momentum"] else None)
        self._averaged = [(due, f, {k: v.clone() for k, v in avg.items()})
                          for due, f, avg in ours["averaged"]]


def periodic_s(case, settings: Periodic) -> float:
    """An iteration after the warm-up: the computation, and each fragment's exchange (the
    model's bytes / fragments, every period steps) less the ``overlap_steps`` iterations of
    computation that hide it."""
    trace = case.trace
    compute = trace.compute_s + case.local()
    exchange = case.allreduce_s(trace.params * trace.bytes_per_param / settings.fragments)
    exposed = max(0.0, exchange - settings.overlap_steps * compute)
    return compute + settings.fragments * exposed / settings.period


class PeriodicMethod(Method):
    """A periodic method (``delay=<its settings>``): ``settings`` is its settings class, whose
    defaults the name alone selects. Its prediction is :func:`periodic_s` at those defaults
    and ``case.settings.period``."""

    role = "delay"
    settings = Periodic

    def default_settings(self, **kw) -> Periodic:
        return self.settings(**kw)

    def cycle(self, settings) -> int:
        """One step in every period averages the models."""
        return settings.period

    def strategy(self, setup) -> PeriodicAveraging:
        return PeriodicAveraging(setup, setup.options.delay)

    def predict(self, case):
        return periodic_s(case, self.default_settings(period=case.settings.period))

    def optimizer_options(self, settings, model=None):
        return {"delay": self.default_settings(period=settings.period,
                                               warmup_steps=settings.warmup_steps)}
