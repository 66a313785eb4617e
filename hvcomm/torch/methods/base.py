"""What every method module declares, and the pieces its compressor or strategy is built from.

A method is one way of synchronising gradients. Its module (one file in this folder) defines
``METHOD``, an instance of one of:

- :class:`CompressionMethod`: what travels (``compression=Compression.<name>``); its compressor
  carries the collective that moves the :class:`Payload` (:class:`Collective`);
- :class:`ScheduleMethod`: which gradients travel together, and when (``schedule=<name>``);
  it builds the strategy (:mod:`hvcomm.torch.methods.strategy`);
- :class:`hvcomm.torch.methods.delayed.DelayMethod`: delayed synchronisation (``delay=<name>``):
  its step rules, around the machinery of that module; or
  :class:`hvcomm.torch.methods.periodic.PeriodicMethod`, periodic averaging of the models
  (``delay=<its settings>``).

Each also predicts its iteration time for the simulator from a :class:`Case` (``predict``).
Nothing here imports an MPI library: the simulator and the advisor read these modules without
one (the collectives import MPI when they run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from collectives.errors import HvcommError

from ..sums import adasum_, sum_in_place


# -- what a prediction reads -------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One prediction's input (built by :func:`hvcomm.sim.simulate.iteration`): one worker's
    ``trace`` (a :class:`hvcomm.sim.simulate.LayerTrace`), the ``cluster`` of more than one
    worker (a :class:`hvcomm.sim.simulate.Cluster`: nodes of GPUs, the links inside and between
    them), the local ``compute`` costs per element (:class:`hvcomm.sim.simulate.ComputeCost`),
    the methods' settings, and ``local_s``: a measured per-iteration local cost that replaces
    the modelled one (None: modelled). A prediction prices its dense allreduces with
    :meth:`allreduce_s` (hierarchical where a node has several GPUs); a method whose
    collective takes another form on nodes of several GPUs reads ``cluster``'s links."""

    trace: Any
    cluster: Any
    compute: Any
    density: float = 0.001
    threshold_bytes: int = 25 << 20
    slice_elems: int = 50_000
    delay_k: int = 5
    rank: int = 4
    period: int = 16
    local_s: Optional[float] = None

    @property
    def workers(self) -> int:
        return self.cluster.workers

    def allreduce_s(self, nbytes: float) -> float:
        """A dense allreduce of ``nbytes`` over every worker of the cluster."""
        return self.cluster.allreduce_s(nbytes)

    def local(self, modelled_s: float = 0.0) -> float:
        """The local cost on the critical path: measured if given, else ``modelled_s``."""
        return self.local_s if self.local_s is not None else modelled_s

    @property
    def k(self) -> int:
        """Top-k's k for the whole model at ``density``."""
        return max(int(self.density * self.trace.params), 1)


# -- what travels ------------------------------------------------------------------------------
@dataclass
class Payload:
    """What a compressor made of one flat gradient: ``data`` travels (a tensor, or sparse
    ``(indices, values)`` NumPy arrays); the rest is what rebuilding the dense sum needs:
    ``numel`` and ``dtype`` of the flat gradient, ``k`` pairs (sparse), the positions every
    rank chose alike (``indices``, random-k), and the context of a compressor that has
    Horovod's interface alone (``ctx``, as its ``compress`` returned it)."""

    data: Any
    numel: int
    dtype: torch.dtype
    k: int = 0
    indices: Optional[torch.Tensor] = None
    ctx: Any = None

    @property
    def nbytes(self) -> int:
        parts = self.data if isinstance(self.data, tuple) else (self.data,)
        return sum(p.nbytes if hasattr(p, "nbytes") else p.numel() * p.element_size()
                   for p in parts)


class Collective:
    """How a payload travels: ``run(comm, payload)`` (on the engine thread) returns the
    result that ``decode`` reads and the bytes this rank sent. ``label``: its name on the
    timeline."""

    label = "collective"

    def run(self, comm, payload: Payload) -> Tuple[Any, float]:
        raise NotImplementedError


def ring_bytes(comm, nbytes: int) -> float:
    """What one rank sends in a ring allreduce of ``nbytes``."""
    return 2 * (comm.Get_size() - 1) / comm.Get_size() * nbytes


class Allreduce(Collective):
    """The payload's tensor summed over the ranks in place."""

    label = "allreduce"

    def run(self, comm, payload):
        sum_in_place(comm, payload.data)
        return payload.data, ring_bytes(comm, payload.nbytes)


class Adasum(Collective):
    """The payload's tensor combined by Horovod's adaptive summation (``op=Adasum``)."""

    label = "adasum"

    def run(self, comm, payload):
        adasum_(comm, payload.data)
        return payload.data, ring_bytes(comm, payload.data.nbytes)


ALLREDUCE, ADASUM = Allreduce(), Adasum()


@dataclass(frozen=True)
class Request:
    """What every method's ``problem(request) -> Optional[str]`` judges (its first reason it
    cannot serve, on this rank, or None): the DistributedOptimizer's options
    (:class:`hvcomm.torch.options.Options`; None where a compressor alone is asked), the
    parameters it trains and the number of ranks that average them."""
    options: Any = None
    params: Sequence[torch.nn.Parameter] = ()
    size: int = 1

    @property
    def dtypes(self) -> set:
        return {p.dtype for p in self.params}


class Compressor:
    """A compressor: ``encode`` a flat gradient into a :class:`Payload` whose ``collective``
    sums it over the ranks, then ``decode`` the result into the dense sum. ``scope``:
    "layer" (each tensor alone), "model" (one buffer for the whole model) or "bucket" (the
    optimizer's fusion buckets). ``error_feedback``: what was not sent is kept
    (:mod:`hvcomm.torch.methods.memory`) and added to the next step's gradient.

    Horovod's interface is kept on top: ``compress(tensor) -> (data, ctx)`` and
    ``decompress(data, ctx)``, ctx being the payload."""

    collective: Collective = ALLREDUCE
    scope = "bucket"
    error_feedback = False
    sends_as_is = False   # True for the identity (dense gradients as they are)

    def encode(self, tensor: torch.Tensor, step: int = 0, key: str = "",
               shapes: Sequence[Tuple[int, ...]] = (), names: Sequence[str] = ()) -> Payload:
        """``tensor``: a flat gradient (a bucket's), at synchronisation ``step``; ``key``
        names the bucket; ``shapes`` and ``names``: its parameters', in order (empty if
        unknown)."""
        raise NotImplementedError

    def decode(self, result: Any, payload: Payload) -> torch.Tensor:
        """The dense sum, in a tensor the caller owns (the optimizer scales it in place)."""
        raise NotImplementedError

    def residual(self, acc: torch.Tensor, payload: Payload) -> torch.Tensor:
        """What of ``acc`` the payload does not carry (before communication, as in GRACE's
        compensate -> compress -> update memory -> communicate); may reuse ``acc``."""
        raise NotImplementedError

    def settle(self, residual: torch.Tensor, payload: Payload, result: Any) -> None:
        """After communication: put back into ``residual`` what was sent but not applied."""

    def problem(self, request: Request) -> Optional[str]:
        """Why this compressor cannot serve the request's gradient dtypes or ranks."""
        return None

    def for_optimizer(self) -> "Compressor":
        """The instance one optimizer uses: itself, or a copy with state of its own where the
        compressor keeps state between steps (so that optimizers never share it)."""
        return self

    def state_dict(self) -> Optional[dict]:
        """State the compressor keeps between steps, for the checkpoint (None: none)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        raise HvcommError(f"the checkpoint holds compressor state, but {self!r} keeps none: "
                          "load it into an optimizer with the compression it was saved with")

    # Horovod's interface: for compressors whose payload a dense allreduce can sum
    def compress(self, tensor: torch.Tensor, step: int = 0, key: str = ""):
        self._check_horovod_interface()
        payload = self.encode(tensor, step, key)
        return payload.data, payload

    def decompress(self, data: Any, ctx: Payload) -> torch.Tensor:
        self._check_horovod_interface()
        return self.decode(data, ctx)

    def _check_horovod_interface(self) -> None:
        if not isinstance(self.collective, Allreduce):
            raise HvcommError(f"{self!r} needs its own collective ({self.collective.label}): "
                              "use it as DistributedOptimizer(compression=...), not in "
                              "compress()/decompress() or hvd.allreduce(compression=...)")


def is_native(compressor: Any) -> bool:
    """An hvcomm compressor (its own ``encode``), not one with Horovod's interface alone (an
    object with ``compress``/``decompress``, a subclass of ``Compressor`` included)."""
    return isinstance(compressor, Compressor) and type(compressor).encode is not Compressor.encode


def sends_as_is(compression: Any) -> bool:
    """The gradients travel as they are (``Compression.none``)."""
    return getattr(compression, "sends_as_is", False)


def check_density(density: float) -> float:
    if not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise HvcommError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def check_scope(scope: str) -> str:
    if scope not in ("layer", "model", "bucket"):
        raise HvcommError(f"scope must be 'layer', 'model' or 'bucket', got {scope!r}")
    return scope


def float_problem(dtypes, name: str) -> Optional[str]:
    bad = sorted({str(d) for d in dtypes} - {"torch.float32", "torch.float64"})
    if bad:
        return (f"{name} needs float32 or float64 gradients, got {bad}; for 16-bit "
                "gradients use Compression.none or Compression.fp16 (bfloat16 travels as it is)")
    return None


def zero_at(acc: torch.Tensor, indices) -> torch.Tensor:
    """``acc`` with the sent positions zeroed (the residual of a selection)."""
    if isinstance(indices, np.ndarray):
        indices = torch.from_numpy(indices.astype(np.int64))
    acc.view(-1)[indices] = 0
    return acc


# -- methods -----------------------------------------------------------------------------------
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

    def optimizer_options(self, density: float = 0.001, model=None, warmup_steps: int = 100,
                          trial_steps: int = 5) -> dict:
        """``DistributedOptimizer``'s keyword arguments that run this method as the simulator
        models it (the replay's): ``density`` for the sparse methods, ``model`` for those that
        take it, the delayed methods' ``warmup_steps``, the raced schedules' ``trial_steps``."""
        raise NotImplementedError


@dataclass(frozen=True)
class CompressionMethod(Method):
    """``factory``: ``Compression.<name>``, the compressor itself (no parameters) or its
    class (parameters)."""

    factory: Any = None
    role = "compression"
    takes_density = False   # the factory's first argument is the density (a sparse method)
    scope = "model"         # a sparse method's scope, as its prediction models it

    def optimizer_options(self, density=0.001, model=None, warmup_steps=100, trial_steps=5):
        """The compressor with its defaults; a sparse method's with ``density`` and the
        ``scope`` its prediction models."""
        f = self.factory
        if isinstance(f, Compressor):
            return {"compression": f}
        return {"compression": f(density, scope=self.scope) if self.takes_density else f()}


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
