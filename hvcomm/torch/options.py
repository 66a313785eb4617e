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
from .methods.compressor import Compressor, is_native, sends_as_is
from .methods.request import Request
from .methods.buckets import ONE_BUCKET_BYTES
from .methods.delayed import as_delay
from .methods.strategy import BaseStep, Strategy, model_problem
from .methods.sync import Setup, forward_first
from .ops import Adasum, Average, Sum
from .process_sets import ProcessSet, global_process_set
from .runtime import runtime


@dataclass(frozen=True, kw_only=True)
class Options:
    """DistributedOptimizer's keyword arguments, one field each (their defaults are its
    signature's: it builds this from its parameters of the same names)."""
    named_parameters: Optional[List[tuple]]
    compression: Any
    backward_passes_per_step: int
    op: str
    gradient_predivide_factor: float
    groups: Any
    sparse_as_dense: bool
    process_set: Any
    fusion_threshold_bytes: Optional[int]
    schedule: Optional[str]
    profile_steps: int
    slice_elems: int
    model: Optional[torch.nn.Module]
    trial_steps: int
    delay: Any                     # as given; :meth:`resolved` turns a name into its settings

    # -- derived -------------------------------------------------------------------------------
    def resolved(self, default_threshold_bytes: int) -> "Options":
        """After :meth:`problem` found nothing: the delay's settings object (a Delay, LocalSGD
        or DiLoCo) and the fusion threshold."""
        threshold = self.fusion_threshold_bytes
        return dataclasses.replace(self, delay=as_delay(self.delay),
                                   fusion_threshold_bytes=(default_threshold_bytes
                                                           if threshold is None else threshold))

    @property
    def plain_average(self) -> bool:
        """op=Average without a predivide factor: the sum over P divided by P."""
        return self.op == Average and self.gradient_predivide_factor == 1.0

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

    # the fields ranks may pass differently: each rank's own parameter objects (compared by
    # name, shape and dtype apart: agree_on_parameters) and its process set object (whose
    # members agree when it is made)
    NOT_AGREED = ("named_parameters", "process_set")

    def agreement_key(self, name_of: Dict[Any, str]) -> List[tuple]:
        """What every rank must pass alike, of a resolved Options: ("option", field, value)
        for every field but :data:`NOT_AGREED`, objects said by what matters of them.
        ``name_of``: each parameter's name, to say ``groups`` by name."""
        said = {"compression": _described(self.compression),
                "model": self.model is not None,  # each rank's own module: only whether given
                "delay": repr(as_delay(self.delay))}
        if isinstance(self.groups, list):
            said["groups"] = [[name_of.get(p, "not a parameter") for p in g]
                              for g in self.groups]
        return [("option", f.name, said.get(f.name, getattr(self, f.name)))
                for f in dataclasses.fields(self) if f.name not in self.NOT_AGREED]

    # -- validation ----------------------------------------------------------------------------
    def problem(self, optimizer, size: int) -> Optional[str]:
        """This rank's first problem with the arguments, or None: the options' own rules,
        then each method's ``problem`` (the compressor's, the schedule's, the delay's) on one
        :class:`hvcomm.torch.methods.request.Request`."""
        problem = _local_problem(self, optimizer)
        if problem is not None:
            return problem
        request = Request(self, trainable(optimizer), size, optimizer)
        if is_native(self.compression):
            problem = self.compression.problem(request)
        if problem is None:
            problem = _names_problem(self.named_parameters, optimizer)
        if problem is None:
            problem = _schedule_problem(request)
        if problem is None:
            problem = _delay_problem(request)
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


def _local_problem(o: Options, optimizer) -> Optional[str]:
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
    return None


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


def _schedule_problem(request: Request) -> Optional[str]:
    o = request.options
    schedules = methods.names("schedule")
    if o.schedule is not None and o.schedule not in schedules:
        return f"schedule must be one of {schedules} (or None), got {o.schedule!r}"
    method = None if o.schedule is None else methods.get(o.schedule)
    if o.model is not None and method is not None and not method.takes_model:
        takers = [n for n in methods.names("schedule") if methods.get(n).takes_model]
        return (f"model= is used by schedule={' or '.join(map(repr, takers))} or None "
                f"(the fusion threshold's buckets) only, not {o.schedule!r}")
    if o.model is not None and method is None:
        if o.delay is not None:
            return "model= and delay= cannot be combined: delay= already defers the averaging"
        return model_problem(o.model, request.params, request.optimizer)
    return None if method is None else method.problem(request)


def _delay_problem(request: Request) -> Optional[str]:
    try:
        delay = as_delay(request.options.delay)
    except HvcommError as e:
        return str(e)
    return None if delay is None else delay.problem(request)


def trainable(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The parameters the distributed optimizer averages: its groups' ones with
    requires_grad, in order."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


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
    if o.model is not None:
        return setup.synchronous(forward_first(setup.fusion_groups()), model=o.model)
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
