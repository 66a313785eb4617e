"""DistributedOptimizer's arguments as one frozen object: validation (every rank raises
together, see :func:`collectives.errors.raise_together`), the choices derived from them, and
the synchronisation strategy they select."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from mpi4py import MPI

from collectives.errors import HvcommError

from . import methods
from .methods.base import Compressor, is_native, sends_as_is
from .methods.buckets import ONE_BUCKET_BYTES
from .methods.delayed import as_delay
from .methods.strategy import BaseStep, Strategy
from .methods.sync import Setup
from .ops import Adasum, Average, Sum
from .process_sets import ProcessSet, global_process_set
from .runtime import runtime


@dataclass(frozen=True)
class Options:
    named_parameters: Optional[List[tuple]]
    compression: Any
    backward_passes_per_step: int = 1
    op: str = Average
    gradient_predivide_factor: float = 1.0
    groups: Any = None
    sparse_as_dense: bool = False
    process_set: Any = None
    fusion_threshold_bytes: Optional[int] = None
    schedule: Optional[str] = None
    profile_steps: int = 3
    slice_elems: int = 50_000
    model: Optional[torch.nn.Module] = None
    trial_steps: int = 5
    delay: Any = None              # as given; :meth:`resolved` turns a name into its settings

    # -- derived -------------------------------------------------------------------------------
    def resolved(self, default_threshold_bytes: int) -> "Options":
        """After :meth:`problem` found nothing: the delay's settings object (a Delay, LocalSGD
        or DiLoCo) and the fusion threshold."""
        threshold = self.fusion_threshold_bytes
        return dataclasses.replace(self, delay=as_delay(self.delay),
                                   fusion_threshold_bytes=(default_threshold_bytes
                                                           if threshold is None else threshold))

    @property
    def predivide(self) -> float:
        return self.gradient_predivide_factor if self.op == Average else 1.0

    def scale(self, size: int) -> float:
        """The factor applied to each sum: an average (times the predivide factor), or 1."""
        return self.gradient_predivide_factor / size if self.op == Average else 1.0

    def bucket_threshold_bytes(self) -> int:
        """The compressor's scope decides the buckets unless groups= does: "layer" is one
        tensor per bucket, "model" one bucket; "bucket" follows the fusion threshold."""
        scope = getattr(self.compression, "scope", "bucket")
        if scope == "bucket" or self.groups is not None:
            return self.fusion_threshold_bytes
        return 0 if scope == "layer" else ONE_BUCKET_BYTES

    def agreement_key(self, name_of: Dict[Any, str]) -> tuple:
        """What every rank must pass alike (besides the parameters), of a resolved Options:
        everything but the parameters themselves, the model and the process set (whose
        members agree when it is made). ``name_of``: each parameter's name, to say ``groups``
        by name."""
        groups = self.groups
        if isinstance(groups, list):
            groups = [[name_of.get(p, "not a parameter") for p in g] for g in groups]
        return ("options", self.backward_passes_per_step, self.op,
                self.gradient_predivide_factor, _described(self.compression), self.schedule,
                self.profile_steps, self.slice_elems, self.model is not None, self.trial_steps,
                repr(as_delay(self.delay)), self.fusion_threshold_bytes, self.sparse_as_dense,
                groups)

    # -- validation ----------------------------------------------------------------------------
    def problem(self, optimizer, size: int) -> Optional[str]:
        """This rank's first problem with the arguments, or None."""
        problem = _local_problem(self, optimizer, size)
        if problem is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            problem = _schedule_problem(self, params)
        if problem is None:
            problem = _delay_problem(self)
        if problem is None and self.sparse_as_dense not in (True, False):
            problem = f"sparse_as_dense must be True or False, got {self.sparse_as_dense!r}"
        if problem is None and self.process_set not in (None, global_process_set):
            if not isinstance(self.process_set, ProcessSet):
                problem = (f"process_set must be an hvcomm ProcessSet (add_process_set), got "
                           f"{type(self.process_set).__name__}")
            elif self.schedule is not None or self.delay is not None:
                problem = "process_set= combines with neither schedule= nor delay="
        return problem


def _described(compression) -> str:
    """What every rank must pass alike: the compressor's repr, or its class where the repr is
    Python's default (an address, different on every rank)."""
    text = repr(compression)
    if text == object.__repr__(compression):
        return f"{type(compression).__module__}.{type(compression).__qualname__}"
    return text


def _local_problem(o: Options, optimizer, size: int) -> Optional[str]:
    bpps, compression = o.backward_passes_per_step, o.compression
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
    if not isinstance(bpps, int) or bpps <= 0:
        return f"backward_passes_per_step must be a positive integer, got {bpps!r}"
    if o.op not in (Average, Sum, Adasum):
        return f"op must be hvcomm.torch.Average, Sum or Adasum for gradients, got {o.op!r}"
    if o.op == Adasum and (not sends_as_is(compression) or o.schedule or o.delay):
        return ("op=Adasum combines the uncompressed gradients: use it without compression=, "
                "schedule= and delay=")
    if o.gradient_predivide_factor != 1.0 and o.op != Average:
        return "gradient_predivide_factor is only supported with op=Average"
    if not isinstance(compression, Compressor) and not (
            hasattr(compression, "compress") and hasattr(compression, "decompress")):
        return "compression must provide compress() and decompress() (e.g. Compression.fp16)"
    if is_native(compression):
        dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        bad = compression.problem(dtypes, size)
        if bad:
            return bad
    return _names_problem(o.named_parameters, optimizer)


def _names_problem(named, optimizer) -> Optional[str]:
    if named is None:
        return None
    if any(not (isinstance(np_, tuple) and len(np_) == 2 and isinstance(np_[0], str)
                and isinstance(np_[1], torch.Tensor)) for np_ in named):
        return ("named_parameters should be a sequence of tuples (name, parameter), usually "
                "produced by model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        return f"parameter names in named_parameters must be unique; duplicates: {dups}"
    ids = {id(p) for _, p in named}
    unnamed = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in ids]
    if unnamed:
        return (f"named_parameters was given but {len(unnamed)} parameter(s) of param_groups "
                f"{sorted(set(unnamed))} are not named; pass model.named_parameters()")
    return None


def _schedule_problem(o: Options, params) -> Optional[str]:
    schedules = methods.names("schedule")
    if o.schedule is not None and o.schedule not in schedules:
        return f"schedule must be one of {schedules} (or None), got {o.schedule!r}"
    method = None if o.schedule is None else methods.get(o.schedule)
    if o.model is not None and not (method and method.takes_model):
        takers = [n for n in methods.names("schedule") if methods.get(n).takes_model]
        return f"model= is used by schedule={' or '.join(map(repr, takers))} only"
    if method is None:
        return None
    if o.groups is not None:
        return "pass either groups= or schedule=, not both"
    return method.problem(o, params)


def _delay_problem(o: Options) -> Optional[str]:
    try:
        delay = as_delay(o.delay)
    except HvcommError as e:
        return str(e)
    if delay is None:
        return None
    problem = delay.problem(sends_as_is(o.compression))
    if problem is None and delay.method.averages_models and (
            o.op != Average or o.gradient_predivide_factor != 1.0):
        problem = (f"delay={delay.mode!r} averages the models: leave op=Average and "
                   "gradient_predivide_factor=1.0")
    if problem is None and o.schedule is not None:
        problem = "delay= and schedule= cannot be combined; leave schedule=None"
    if problem is None and not is_native(o.compression):
        problem = "delay= needs an hvcomm compressor (Compression.*)"
    return problem


def averaging_comm(o: Options) -> MPI.Comm:
    """Where the gradients are averaged: every rank, a process set's ranks, or (on a rank
    outside the process set, as in Horovod) this rank alone."""
    ps = o.process_set
    if ps is None or ps is global_process_set:
        return runtime().engine.comm
    return ps.comm if ps.included() else MPI.COMM_SELF


def make_strategy(o: Options, params, names, opt: torch.optim.Optimizer,
                  base_step: BaseStep) -> Strategy:
    """The synchronisation strategy these options choose (``o`` resolved): the schedule
    method's, the delay method's, or bucketed averaging by the fusion threshold (or
    ``groups=``)."""
    comm = averaging_comm(o)
    setup = Setup(o, params, names, opt, base_step, runtime().engine, comm, o.op == Adasum,
                  o.predivide, o.scale(comm.Get_size()))
    if o.schedule is not None:
        return methods.get(o.schedule, "schedule").strategy(setup)
    if o.delay is not None:
        return o.delay.method.strategy(setup)
    return setup.synchronous(setup.fusion_groups())


def agree_on_parameters(comm: MPI.Comm, spec: Sequence[tuple]) -> None:
    """Raise on every rank if ranks hold different parameter names, shapes or dtypes, or
    different options (the last entries of ``spec``)."""
    spec = list(spec)
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
    raise HvcommError("DistributedOptimizer: ranks hold different models (name, shape, dtype) "
                      "or options: " + "; ".join(lines) + ". Build the same model and optimizer "
                      "on every rank (also the environment: HVCOMM_FUSION_THRESHOLD_BYTES).")
