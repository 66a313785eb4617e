"""What every method module declares.

A method is one way of synchronising gradients. Its module (one file in this folder) defines
``METHOD``, an instance of one of:

- :class:`CompressionMethod`: what travels (``compression=Compression.<name>``); its
  compressor (:mod:`hvcomm.torch.methods.compressor`) carries the collective that moves the
  payload (:mod:`hvcomm.torch.methods.payload`);
- :class:`ScheduleMethod`: which gradients travel together, and when (``schedule=<name>``);
  it builds the strategy (:mod:`hvcomm.torch.methods.strategy`);
- :class:`hvcomm.torch.methods.delayed.DelayMethod`: delayed synchronisation (``delay=<name>``):
  its step rules, around the machinery of that module; or
  :class:`hvcomm.torch.methods.periodic.PeriodicMethod`, periodic averaging of the models
  (``delay=<its settings>``).

Each judges the optimizer's options with ``problem(request)``
(:class:`hvcomm.torch.methods.request.Request`) and predicts its iteration time for the
simulator from a :class:`hvcomm.torch.methods.case.Case` (``predict``). Nothing here imports an
MPI library: the simulator and the advisor read these modules without one (the collectives
import MPI when they run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .case import Case, Settings
from .compressor import Compressor, is_native
from .request import Request


@dataclass(frozen=True)
class Method:
    """``name``: the method's one name (API, simulator, advisor, replay, tests; the main job's
    rows add their setting to it). ``simulated``: whether the simulator has a row for it."""

    name: str
    summary: str

    role = ""
    simulated = True

    def predict(self, case: Case) -> float:
        """The iteration time (s) at ``case.workers`` > 1 workers."""
        raise NotImplementedError

    def unmodelled(self, case: Case) -> Optional[str]:
        """Why this method has no prediction for ``case`` (None: it has one)."""
        return None

    def cycle(self, settings: Settings) -> int:
        """The steps after which this method's pattern of step times repeats with
        ``settings`` (1: every step alike): a timing over a multiple of it sees each kind of
        step in its proportion."""
        return 1

    def optimizer_options(self, settings: Settings, model=None) -> dict:
        """``DistributedOptimizer``'s keyword arguments that run this method as the simulator
        models it with ``settings`` (the replay's); ``model`` for the methods that take it."""
        raise NotImplementedError


@dataclass(frozen=True)
class CompressionMethod(Method):
    """``factory``: ``Compression.<name>``, the compressor itself (no parameters) or its
    class (parameters)."""

    factory: Any = None
    role = "compression"
    takes_density = False   # the factory's first argument is the density (a sparse method)
    scope = "model"         # a sparse method's scope, as its prediction models it

    def optimizer_options(self, settings, model=None):
        """The compressor with its defaults, at the settings' fusion threshold; a sparse
        method's with the settings' density and the ``scope`` its prediction models."""
        f = self.factory
        if isinstance(f, Compressor):
            compressor = f
        else:
            compressor = f(settings.density, scope=self.scope) if self.takes_density else f()
        return {"compression": compressor, "fusion_threshold_bytes": settings.threshold_bytes}


class ScheduleMethod(Method):
    """A way of grouping and ordering the messages; builds the strategy for
    ``DistributedOptimizer(schedule=<name>)``; ``takes_model``: it reads ``model=``."""

    role = "schedule"
    takes_model = False

    def problem(self, request: Request) -> Optional[str]:
        """This rank's first problem with the optimizer's options for this schedule (each
        schedule adds its own rules to these)."""
        if request.options.groups is not None:
            return "pass either groups= or schedule=, not both"
        return None

    def strategy(self, setup):
        """The strategy (a :class:`hvcomm.torch.methods.strategy.Strategy`) for ``setup``
        (:class:`hvcomm.torch.methods.sync.Setup`)."""
        raise NotImplementedError


def delay_problem(request: Request) -> Optional[str]:
    """The rules every delay= method (delayed and periodic) shares, on the other options."""
    o = request.options
    if o.schedule is not None:
        return "delay= and schedule= cannot be combined; leave schedule=None"
    if not is_native(o.compression):
        return "delay= needs an hvcomm compressor (Compression.*)"
    return None
