"""Synchronous bucketed averaging: each bucket goes to the engine as soon as its gradients are
final (in one fixed order on every rank), dense or compressed, and is waited for in
``synchronize()``. Its grouping comes from the fusion threshold, explicit groups, or a
planner-driven source of plans (:class:`hvcomm.torch.methods.schedule.GroupingPlanner`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import timeline
from .buckets import Bucket, CommStats, make_buckets, plan_groups, scaled_in, set_grad, split
from .compressor import Compressor
from .memory import ErrorFeedback
from .none import NoneCompressor
from .reducer import InFlight, Reducer
from .strategy import (BaseStep, NextForward, Strategy, in_flight_error,
                       may_update_in_parts, update_only)

Launched = List[Tuple[Bucket, InFlight]]


class Synchronous(Strategy):
    """``predivide``: divide each gradient before the sum (Horovod's gradient_predivide_factor);
    ``scale``: multiply each sum by it (1/size for an average, times predivide; the dense
    allreduce applies it as it sums). ``dense_at(step)``: steps whose buckets go uncompressed
    (the delayed modes' warm-up and CD-SGD's full-precision steps). ``comm``: a process set's
    communicator (default: every rank). ``adasum``: buckets are combined by Adasum instead of
    summed. ``memory``: the error-feedback residuals (default: its own). ``optimizer``: the
    DistributedOptimizer, given where ``step()`` may update each bucket's parameters as soon as
    that bucket is averaged (:meth:`step`). ``model``: ``step()`` returns once the buckets are
    handed over, and each module's next forward applies the update of the parameters it owns as
    their buckets arrive (:class:`NextForward`; launch the buckets in :func:`forward_first`
    order for it to overlap)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 base_step: BaseStep, engine, compression: Compressor,
                 groups: Sequence[Sequence[int]], *, predivide: float = 1.0,
                 scale: float = 1.0, plans=None,
                 dense_at: Callable[[int], bool] = lambda step: False, comm=None,
                 adasum: bool = False, memory: Optional[ErrorFeedback] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 model: Optional[torch.nn.Module] = None):
        super().__init__(params, names, base_step)
        self._optimizer = optimizer
        self._next_forward = (None if model is None else
                              NextForward(model, self.params, optimizer, base_step))
        self.memory = ErrorFeedback() if memory is None else memory
        self.comm_stats, self.steps = CommStats(), 0
        self._reducer = Reducer(engine, compression, self.memory, comm, adasum)
        self._dense_reducer = Reducer(engine, NoneCompressor(), self.memory, comm, adasum)
        self.predivide, self.scale = predivide, scale
        self.plans, self.dense_at = plans, dense_at
        self.comm_end = 0.0  # when the last collective of the last synchronize() ended
        self.buckets: List[Bucket] = []
        self.set_groups(groups)

    def set_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Install a grouping (positions into ``params``, in launch order); error-feedback
        residuals are kept per parameter, so nothing is lost."""
        assert all(b.pending is None for b in self.buckets), "regrouping while in flight"
        self.buckets = make_buckets(groups, self.params, self.names)
        self._bucket_of = {i: b for b in self.buckets for i in b.indices}
        self._next_launch = 0

    @property
    def plan(self) -> List[List[str]]:
        """The grouping in use, as parameter names per bucket, in launch order."""
        return [list(b.names) for b in self.buckets]

    # -- during backward ---------------------------------------------------------------------
    def on_grad(self, i: int) -> None:
        self.finish_pending()  # a parameter used before its owner's forward
        if self.plans is not None:
            self.plans.grad_ready(i)
        self._bucket_of[i].ready += 1
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        with timeline.measure("compress+launch", bucket=bucket.key[:80]):
            reducer = self._dense_reducer if self.dense_at(self.steps) else self._reducer
            bucket.pending = reducer.start(bucket, [self.params[i] for i in bucket.indices],
                                           self.steps, self.predivide, self.scale)

    def take_launched(self) -> Launched:
        """Launch, in order, what the hooks did not (unused parameters: zeros) and hand over
        this step's collectives in flight; the buckets are free for the next step."""
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
        launched = [(b, b.pending) for b in self.buckets]
        for b in self.buckets:
            b.pending, b.ready = None, 0
        self._next_launch = 0
        return launched

    def collect(self, launched: Launched, into_grads: bool = False
                ) -> Iterator[Tuple[int, torch.Tensor]]:
        """Wait for ``launched`` bucket by bucket, yielding (parameter position, its averaged
        gradient in the parameter's dtype and shape) for each bucket's parameters as soon as
        that bucket is finished (:meth:`collect_buckets`, one pair at a time)."""
        for _, averaged in self.collect_buckets(launched, into_grads):
            yield from averaged

    def collect_buckets(self, launched: Launched, into_grads: bool = False
                        ) -> Iterator[Tuple[Bucket, List[Tuple[int, torch.Tensor]]]]:
        """Wait for ``launched`` bucket by bucket, yielding each bucket with its parameters'
        (position, averaged gradient in the parameter's dtype and shape) as soon as it is
        finished, so the caller's use of them overlaps the later buckets' communication.
        ``into_grads``: each average goes into its parameter's ``.grad`` (:func:`set_grad`:
        a dense sum sent as it is becomes ``.grad`` itself, as views), which is what is
        yielded. Sets ``comm_stats`` and ``comm_end`` once exhausted. If a bucket's
        collective raises, the buckets before it have been handed over and the rest not (a
        failure: elastic restores the state)."""
        stats, comm_end = CommStats(), 0.0
        for bucket, job in launched:
            flat, sent, payload_bytes = job.finish()  # the decoded sum: this step's own
            comm_end = max(comm_end, job.handle.finished_at)
            stats.add(sent, payload_bytes)
            scale = 1.0 if job.scale_applied else self.scale
            # the sum as it travelled, this step's own flat copy: the gradients may view it
            alias = job.scale_applied and flat is job.payload.data
            averaged = []
            for j, total in split(flat, bucket.numels):
                i = bucket.indices[j]
                p = self.params[i]
                if into_grads:
                    set_grad(p, total, scale, alias)
                    averaged.append((i, p.grad))
                else:
                    averaged.append((i, scaled_in(total, p.dtype, scale).view(p.shape)))
            yield bucket, averaged
        self.comm_stats, self.comm_end = stats, comm_end

    # -- Horovod's synchronize / step --------------------------------------------------------
    def synchronize(self) -> None:
        self.finish_pending()
        launched = self.take_launched()
        with timeline.measure("wait"):
            for _ in self.collect(launched, into_grads=True):
                pass
        self.steps += 1

    def update(self, closure=None):
        with timeline.measure("update"):
            loss = self.base_step(closure)
        self._after_update()
        return loss

    def step(self, closure=None):
        """Synchronise and update. Where the optimizer allows it (a torch.optim optimizer
        that updates each parameter on its own, holding just the averaged parameters, with
        no step hook: :func:`may_update_in_parts`; no closure; no planned grouping, whose
        planner times the update whole), each bucket's parameters are updated as soon as that
        bucket is averaged, while the later buckets are still on the wire: the same weights,
        and only the last bucket's update after the last collective. If an update raises,
        the later buckets are still waited for (their residuals settled, their averages in
        ``.grad``) before it propagates."""
        if (closure is not None or self._optimizer is None or self.plans is not None
                or len(self.buckets) < 2
                or not may_update_in_parts(self._optimizer, self.params)):
            return super().step(closure)
        if self._next_forward is not None:
            self._defer()
            return None
        buckets = self.collect_buckets(self.take_launched(), into_grads=True)
        try:
            while True:
                with timeline.measure("wait"):
                    done = next(buckets, None)
                if done is None:
                    break
                bucket, averaged = done
                with timeline.measure("update", bucket=bucket.key[:80]):
                    update_only(self._optimizer, self.base_step,
                                [self.params[i] for i, _ in averaged])
        except BaseException:
            for _ in buckets:  # (empty if a collective raised: the generator has ended)
                pass
            raise
        self.steps += 1
        self._after_update()
        return None

    def _defer(self) -> None:
        """Launch what the hooks did not and leave the buckets to the next forward
        (``model=``). The last step's update first: its buckets settle the residuals this
        step's launches read."""
        self.finish_pending()
        buckets = self.collect_buckets(self.take_launched())

        def averages(wanted):
            wanted = set(wanted)
            while wanted:
                _, averaged = next(buckets)
                wanted.difference_update(i for i, _ in averaged)
                yield from averaged
        self._next_forward.defer(averages, done=lambda: next(buckets, None))
        self.steps += 1

    def _after_update(self) -> None:
        if self.plans is not None:
            groups = self.plans.after_step(self.comm_end)
            if groups is not None:
                self.set_groups(groups)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self):
        self.finish_pending()
        state = {"step": self.steps, "residuals_by_param": self.memory.state_dict()}
        compressor = self._reducer.compressor.state_dict()
        if compressor is not None:
            state["compressor"] = compressor
        return state

    def load_state_dict(self, state) -> None:
        self.finish_pending()
        if any(b.pending is not None for b in self.buckets):
            raise in_flight_error()
        if state is not None:
            if "compressor" in state:  # first: it refuses state of another compression
                self._reducer.compressor.load_state_dict(state["compressor"])
            self.steps = state["step"]
            self.memory.load_state_dict(state["residuals_by_param"])
        for b in self.buckets:
            b.ready = 0
        self._next_launch = 0


@dataclass
class Setup:
    """What a method builds its strategy from: the optimizer's resolved ``options``
    (:class:`hvcomm.torch.options.Options`), its parameters and their names, the
    DistributedOptimizer, the wrapped optimizer's step, the engine, the communicator the
    gradients are averaged on, and the pre-/post-scaling of each sum."""

    options: Any
    params: Sequence[torch.nn.Parameter]
    names: Sequence[str]
    optimizer: torch.optim.Optimizer
    base_step: BaseStep
    engine: Any
    comm: Any
    adasum: bool
    predivide: float
    scale: float

    def fusion_groups(self) -> List[List[int]]:
        """The buckets the options ask for: ``groups=``, else filled up to the fusion
        threshold (a scope of "layer" or "model" overrides it)."""
        o = self.options
        return plan_groups(self.params, o.groups, o.bucket_threshold_bytes())

    def synchronous(self, groups: Sequence[Sequence[int]], **kw) -> Synchronous:
        """Bucketed averaging of ``groups`` with the options' compressor (``kw``: ``plans``,
        ``dense_at``, ``model``)."""
        return Synchronous(self.params, self.names, self.base_step, self.engine,
                           self.options.compression, groups, predivide=self.predivide,
                           scale=self.scale, comm=self.comm, adasum=self.adasum,
                           optimizer=self.optimizer, **kw)


def forward_first(groups: List[List[int]]) -> List[List[int]]:
    """The launch order for updates deferred to the next forward: the bucket nearest the
    output first (its gradients are final first), then the others from the input on, so the
    next forward meets its modules' buckets in the order they arrive and waits, after the
    last collective, only for the modules of the last two buckets (those nearest the
    output). ``groups``: in backward order (:func:`plan_groups`'s)."""
    return groups[:1] + groups[:0:-1]
