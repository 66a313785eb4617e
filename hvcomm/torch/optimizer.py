"""DistributedOptimizer: Horovod's drop-in, averaging gradients bucket by bucket from hooks."""
from __future__ import annotations

import functools
import hashlib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from mpi4py import MPI

from collectives.errors import HvcommError, raise_together
from collectives.merged import BucketPlan

from .compression import Compression, Compressor
from .memory import ErrorFeedback
from .ops import Average, Sum
from .reducer import Reducer
from .runtime import runtime



@dataclass
class _Bucket:
    """Parameters reduced together, and the in-flight state of this iteration."""

    params: List[torch.nn.Parameter]
    key: str = ""                        # names its residual in the error-feedback memory
    ready: int = 0                       # parameters whose gradient is final this iteration
    pending: Optional[object] = None     # the reducer's InFlight once launched


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
                      gradient_predivide_factor, groups, fusion_threshold_bytes):
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
                                               gradient_predivide_factor, repr(compression))])
        scope = getattr(compression, "scope", "bucket")
        if scope != "bucket" and groups is None:
            fusion_threshold_bytes = 0 if scope == "layer" else 2**62
        self._buckets = self._plan(params, groups, fusion_threshold_bytes)
        for b in self._buckets:
            b.key = "|".join(self._names[p] for p in b.params)
        self._memory = ErrorFeedback()
        self._reducer = Reducer(rt.engine, compression, self._memory)
        self._step = 0                     # synchronizations so far (density warm-up, seeds)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._delay = {p: backward_passes_per_step for p in params}
        self._next_launch = 0
        self._hooks_fired = False
        self._synchronized = False
        self._should_synchronize = True
        self.comm_stats = CommStats()      # the last completed synchronize()
        self._inflight = CommStats()       # the one under way
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._patch_step_function()

    @staticmethod
    def _plan(params, groups, threshold_bytes) -> List[_Bucket]:
        """Buckets in launch order: reverse registration order, the usual backward order."""
        if isinstance(groups, list):
            grouped = [list(g) for g in groups]
            seen = {id(p) for g in grouped for p in g}
            grouped += [[p] for p in params if id(p) not in seen]
            position = {id(p): i for i, p in enumerate(params)}
            grouped.sort(key=lambda g: -max(position[id(p)] for p in g))
            return [_Bucket(g) for g in grouped]
        order = list(reversed(range(len(params))))
        if isinstance(groups, int) and groups > 0:
            per = -(-len(params) // groups)
            return [_Bucket([params[i] for i in order[s:s + per]])
                    for s in range(0, len(order), per)]
        plan = BucketPlan.by_threshold([p.numel() * p.element_size() for p in params],
                                       threshold_bytes, order, keys=[p.dtype for p in params])
        return [_Bucket([params[i] for i in b]) for b in plan.buckets]

    # -- hooks: count passes, launch complete buckets in the fixed order ----------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise HvcommError(f"parameter {self._names[p]!r} has sparse gradients, which hvcomm "
                              "does not reduce; use a dense layer (e.g. Embedding(sparse=False))")
        if self._delay[p] <= 0:
            raise HvcommError("Gradients were computed more than backward_passes_per_step times "
                              "before step(); increase backward_passes_per_step to accumulate "
                              "gradients locally")
        self._hooks_fired = True
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._bucket_of[p].ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while (self._next_launch < len(self._buckets)
               and self._buckets[self._next_launch].ready == len(self._buckets[self._next_launch].params)):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:  # no gradient on this rank (unused branch): contribute zeros
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.detach().reshape(-1))
        flat = torch.cat(grads).cpu()
        if self.op == Average and self.gradient_predivide_factor != 1.0:
            flat.div_(self.gradient_predivide_factor)
        bucket.pending = self._reducer.start(bucket.key, flat, self._step)
        self._inflight.messages += 1

    # -- Horovod's optimizer interface --------------------------------------------------------
    def synchronize(self) -> None:
        """Finish this iteration's gradient averaging (launching what the hooks did not)."""
        for bucket in self._buckets[self._next_launch:]:
            self._launch(bucket)
        size = runtime().comm.Get_size()
        scale = self.gradient_predivide_factor / size if self.op == Average else 1.0
        for bucket in self._buckets:
            flat, sent, payload_bytes = self._reducer.finish(bucket.pending)
            self._inflight.sent_bytes += sent
            self._inflight.payload_bytes += payload_bytes
            if scale != 1.0:
                flat = flat * scale
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
            bucket.pending, bucket.ready = None, 0
        self.comm_stats, self._inflight = self._inflight, CommStats()
        self._reset_counters()
        self._step += 1
        self._synchronized = True

    def _reset_counters(self) -> None:
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._next_launch = 0
        self._hooks_fired = False

    @contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(); gradients are averaged twice")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._hooks_fired:
            raise HvcommError("optimizer.zero_grad() was called after loss.backward() but before "
                              "optimizer.step() or optimizer.synchronize(); call step() first")
        return super().zero_grad(set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus hvcomm's own, under "hvcomm": this rank's
        error-feedback residuals and the step counter. Residuals differ between ranks:
        save one checkpoint per rank to resume exactly."""
        state = super().state_dict()
        state["hvcomm"] = {"step": self._step, "residuals": self._memory.state_dict()}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore; hvcomm's state is restored when the dict has it, kept otherwise."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvcomm", None)
        if ours is not None:
            self._step = ours["step"]
            self._memory.load_state_dict(ours["residuals"])
        if any(b.pending is not None for b in self._buckets):
            raise HvcommError("load_state_dict() while gradients are in flight; call "
                              "synchronize() or step() first")
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


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1, op: str = Average,
                         gradient_predivide_factor: float = 1.0, groups=None,
                         sparse_as_dense: bool = False, process_set=None, *,
                         fusion_threshold_bytes: Optional[int] = None):
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
    """
    rt = runtime()
    named = list(named_parameters) if named_parameters is not None else None
    problem = _local_problems(optimizer, named, compression, backward_passes_per_step, op,
                              gradient_predivide_factor)
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
                      gradient_predivide_factor, groups, fusion_threshold_bytes)
    return opt
