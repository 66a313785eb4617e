"""Delayed synchronisation on allreduce: the machinery that OD-SGD, SSD-SGD and CD-SGD share
(their rules are in :mod:`od_sgd`, :mod:`ssd_sgd` and :mod:`cd_sgd`).

Every rank keeps the global weights W, advanced identically on every rank by the wrapped
optimizer from the averaged gradient, and trains on its local weights w (the model's
parameters). At step t (after ``warmup_steps`` ordinary synchronous steps):

1. the allreduce of g_t (computed on w_t) was started by the hooks during backward and runs
   on while step t+1 computes;
2. the averaged gradient of step t-1 (its allreduce overlapped this step's forward and
   backward) advances W: ``W <- GlobalOpt(W, avg g_{t-1})``;
3. the local weights move with this rank's own fresh gradient, by the method's
   ``local_step``: on a *reset* step (the method's ``is_reset``; every step but SSD-SGD's
   in between) ``w <- W - lr_local * (g + wd*W + dc)``, with DC-ASGD's delay compensation
   ``dc = dc_lambda * g*g*(W - w_t)`` when ``local_optimizer="dcasgd"`` (else 0); SSD-SGD's
   steps in between add GLU (:mod:`ssd_sgd`).

Steps the method sends in full precision (``is_full_precision``) go uncompressed; the others
with the optimizer's compressor (with its error feedback). Warm-up steps are dense synchronous
SGD in every mode, so a warm-up covering the whole run is exactly S-SGD.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from collectives.errors import HvcommError

from .. import timeline
from .base import Method, delay_problem
from .compressor import sends_as_is
from .request import Request
from .registry import REGISTRY, get, names
from .strategy import Strategy, in_flight_error
from .sync import Launched, Synchronous


@dataclass(frozen=True)
class Delay:
    """How to delay synchronisation; pass as ``DistributedOptimizer(..., delay=Delay(...))``
    or just ``delay="od-sgd"`` for the defaults. ``mode``: a delay method's name."""

    mode: str
    warmup_steps: int = 100
    k: int = 5
    local_lr: Optional[float] = None     # None: each param group's current lr
    local_optimizer: str = "sgd"         # or "dcasgd"
    dc_lambda: float = 0.04
    glu: float = 1.0                     # without a reset (SSD-SGD)

    @property
    def method(self) -> DelayMethod:
        return get(self.mode, "delay")

    def problem(self, request: Request) -> Optional[str]:
        if self.mode not in names("delay"):
            return f"delay mode must be one of {names('delay')}, got {self.mode!r}"
        method = self.method
        if not isinstance(method, DelayMethod):
            settings = type(method.default_settings()).__name__
            return f"delay mode {self.mode!r} takes hvcomm.torch.{settings}(...), not a Delay"
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            return f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}"
        if not isinstance(self.k, int) or self.k < 1:
            return f"k must be a positive integer, got {self.k!r}"
        if self.local_lr is not None and not self.local_lr > 0:
            return f"local_lr must be > 0 (or None for the group's lr), got {self.local_lr!r}"
        if self.local_optimizer not in ("sgd", "dcasgd"):
            return f"local_optimizer must be 'sgd' or 'dcasgd', got {self.local_optimizer!r}"
        if method.needs_compressor and sends_as_is(request.options.compression):
            return (f"delay={self.mode!r} needs a compressor (e.g. "
                    "compression=Compression.twobit(0.5))")
        return delay_problem(request)

    def is_reset(self, delayed_index: int) -> bool:
        return self.method.is_reset(delayed_index, self.k)

    def is_full_precision(self, delayed_index: int) -> bool:
        return self.method.is_full_precision(delayed_index, self.k)

    def sends_dense(self, step: int) -> bool:
        """Warm-up steps, and the method's full-precision steps, go uncompressed."""
        j = step - self.warmup_steps
        return j < 0 or self.is_full_precision(j)


def as_delay(delay):
    """``delay=`` as given: None, a settings object (a Delay, LocalSGD or DiLoCo), or a delay
    method's name (its default settings)."""
    from .periodic import Periodic
    if delay is None or isinstance(delay, (Delay, Periodic)):
        return delay
    if isinstance(delay, str):
        method = REGISTRY.get(delay)
        return method.default_settings() if method is not None and method.role == "delay" \
            else Delay(delay)  # whose problem() lists the valid names
    raise HvcommError(f"delay must be None, a Delay, LocalSGD or DiLoCo, or one of "
                      f"{names('delay')}, got {delay!r}")


@torch.no_grad()
def local_update(cfg: Delay, groups: Sequence[dict], W: Dict[torch.nn.Parameter, torch.Tensor],
                 W_before: Optional[Dict[torch.nn.Parameter, torch.Tensor]],
                 reset: bool) -> None:
    """Move the local weights (the parameters) by the method's ``local_step``."""
    method = cfg.method
    for group in groups:
        lr = cfg.local_lr if cfg.local_lr is not None else group["lr"]
        wd = group.get("weight_decay", 0.0)
        for p in group["params"]:
            if p in W and p.grad is not None:
                method.local_step(cfg, p, W[p], None if W_before is None else W_before[p],
                                  lr, wd, reset)


class DelayedAveraging(Strategy):
    """The delayed modes around a :class:`Synchronous` that launches the buckets (built with
    ``dense_at=delay.sends_dense``). ``optimizer`` is the DistributedOptimizer (its
    param_groups give the local learning rates)."""

    def __init__(self, sync: Synchronous, delay: Delay, optimizer: torch.optim.Optimizer):
        super().__init__(sync.params, sync.names, sync.base_step)
        self.sync, self.delay, self._optimizer = sync, delay, optimizer
        self._W: Optional[Dict[torch.nn.Parameter, torch.Tensor]] = None  # global weights
        self._in_flight: Optional[Launched] = None   # last step's collectives, under way
        self._averaged: Optional[Dict[str, torch.Tensor]] = None  # ... or done, not applied

    @property
    def comm_stats(self):
        return self.sync.comm_stats

    @property
    def steps(self) -> int:
        return self.sync.steps

    @property
    def plan(self):
        return self.sync.plan

    def _warming_up(self) -> bool:
        return self.sync.steps < self.delay.warmup_steps

    def on_grad(self, i: int) -> None:
        self.sync.on_grad(i)

    def synchronize(self) -> None:
        if not self._warming_up():
            raise HvcommError("with delay=..., step() averages the gradients (one step late); "
                              "synchronize() is not available after the warm-up")
        self.sync.synchronize()

    def update(self, closure=None):
        """Warm-up: the synchronous update; W follows the weights."""
        self.synchronize()  # raises after the warm-up
        return self._synchronous_update(closure)

    def _synchronous_update(self, closure):
        loss = self.sync.update(closure)
        with torch.no_grad():
            for p, w in self._W.items():
                w.copy_(p)
        return loss

    def step(self, closure=None):
        if self._W is None:  # W starts as the weights of the first step (after any broadcast)
            self._W = {p: p.detach().clone() for p in self.params}
        if self._warming_up():
            self.sync.synchronize()
            return self._synchronous_update(closure)
        d = self.delay
        loss = closure() if closure is not None else None
        launched = self.sync.take_launched()
        reset = d.is_reset(self.sync.steps - d.warmup_steps)
        averaged = self._collect_previous()
        W_before = None
        if averaged is not None:
            if not reset and d.glu:
                W_before = {p: w.clone() for p, w in self._W.items()}
            with timeline.measure("wait+global update"):
                self._global_update(averaged)
        with timeline.measure("local update"):
            local_update(d, self._optimizer.param_groups, self._W, W_before, reset)
        self._in_flight = launched
        self.sync.steps += 1
        return loss

    def _collect_previous(self) -> Optional[Dict[str, torch.Tensor]]:
        """The last step's averaged gradients by parameter name (waiting if in flight)."""
        if self._in_flight is not None:
            self._averaged = {self.names[i]: g for i, g in self.sync.collect(self._in_flight)}
            self._in_flight = None
        return self._averaged

    def _global_update(self, averaged: Dict[str, torch.Tensor]) -> None:
        """W <- the wrapped optimizer's step on W with the averaged gradients, which are
        then consumed."""
        saved = []
        for p, name in zip(self.params, self.names):
            saved.append((p.data, p.grad))
            p.data = self._W[p]
            p.grad = averaged[name].to(p.dtype)
        try:
            with timeline.measure("global update"):
                self.base_step(None)
        finally:
            for p, (data, grad) in zip(self.params, saved):
                p.data, p.grad = data, grad
        self._averaged = None

    def finish_pending(self) -> None:
        """Advance W with the last step's average and set the local weights to W."""
        if self._W is None:
            return
        averaged = self._collect_previous()
        if averaged is not None:
            self._global_update(averaged)
        with torch.no_grad():
            for p, w in self._W.items():
                p.copy_(w)

    def global_weights(self) -> Dict[str, torch.Tensor]:
        if self._W is None:
            return {n: p.detach().clone() for p, n in zip(self.params, self.names)}
        return {n: self._W[p] for p, n in zip(self.params, self.names)}

    def close(self) -> None:
        self.sync.close()

    def state_dict(self):
        averaged = self._collect_previous()  # waits for, but does not apply, the last step's
        state = self.sync.state_dict()
        state["delay"] = {
            "W": None if self._W is None else {n: self._W[p].clone()
                                               for p, n in zip(self.params, self.names)},
            "previous": None if averaged is None else {k: v.clone() for k, v in averaged.items()}}
        return state

    def load_state_dict(self, state) -> None:
        if state is None and self._in_flight is not None:
            raise in_flight_error()
        self.sync.load_state_dict(state)
        delay_state = None if state is None else state.get("delay")
        if delay_state is not None:
            by_name = dict(zip(self.names, self.params))
            self._W = (None if delay_state["W"] is None else
                       {by_name[k]: v.clone() for k, v in delay_state["W"].items()})
            self._averaged = (None if delay_state["previous"] is None else
                              {k: v.clone() for k, v in delay_state["previous"].items()})
            self._in_flight = None


def delayed_s(case, coded_bytes_per_param: Optional[float] = None, k: int = 1) -> float:
    """A delayed method's iteration: the whole model's allreduce overlapped with the next
    iteration's forward and backward (its cost hidden up to the computation's length), then
    the update. ``coded_bytes_per_param``: k-1 of every k steps send that many bytes per
    parameter, the k-th the full gradient."""
    trace = case.trace
    busy = trace.compute_s - trace.update_s + case.local()
    dense = max(busy, case.allreduce_s(trace.params * trace.bytes_per_param))
    if coded_bytes_per_param is None:
        return dense + trace.update_s
    coded = max(busy, case.allreduce_s(trace.params * coded_bytes_per_param))
    return ((k - 1) * coded + dense) / k + trace.update_s


class DelayMethod(Method):
    """Delayed synchronisation (``delay=<name>``) on this module's machinery: which delayed
    steps reset the local weights (``is_reset``), which go in full precision
    (``is_full_precision``), whether it needs a compressor, and the local step (by default a
    reset to the global weights, the module docstring's step 3). Its prediction is
    :func:`delayed_s` with dense gradients."""

    role = "delay"
    needs_compressor = False

    def is_reset(self, delayed_index: int, k: int) -> bool:
        return True

    def cycle(self, settings) -> int:
        """Every k-th delayed step is a reset or a full-precision one."""
        return settings.delay_k

    def is_full_precision(self, delayed_index: int, k: int) -> bool:
        return False

    def local_step(self, cfg: Delay, p: torch.nn.Parameter, W: torch.Tensor,
                   W_before: Optional[torch.Tensor], lr: float, wd: float,
                   reset: bool) -> None:
        """A reset: ``w <- W - lr * (g + wd*W + dc)``, dc being DC-ASGD's compensation with
        ``local_optimizer="dcasgd"``."""
        g = p.grad
        w_then = p.detach().clone() if cfg.local_optimizer == "dcasgd" else None
        p.copy_(W)
        step = g + wd * p if wd else g.clone()
        if w_then is not None:
            step.add_(cfg.dc_lambda * g * g * (p - w_then))
        p.sub_(lr * step)

    def default_settings(self) -> Delay:
        return Delay(self.name)

    def strategy(self, setup) -> DelayedAveraging:
        """A Synchronous of the fusion buckets (or ``groups=``), dense at the warm-up and
        full-precision steps, inside the delayed machinery."""
        sync = setup.synchronous(setup.fusion_groups(), dense_at=setup.options.delay.sends_dense)
        return DelayedAveraging(sync, setup.options.delay, setup.optimizer)

    def predict(self, case):
        return delayed_s(case)

    def optimizer_options(self, settings, model=None):
        return {"delay": Delay(self.name, warmup_steps=settings.warmup_steps,
                               k=settings.delay_k)}
