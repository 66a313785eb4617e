"""DistributedOptimizer: Horovod's drop-in, a thin layer of gradient hooks over one
synchronisation strategy (see :mod:`hvcomm.torch.methods.strategy`)."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import torch

from collectives.errors import HvcommError, raise_together

from . import timeline
from .methods import Compression
from .methods.compressor import Compressor
from .ops import Average
from .options import Options, agree_on_parameters, averaging_comm, make_strategy, trainable
from .process_sets import ProcessSet, global_process_set
from .runtime import optimizers, remember_optimizer, runtime


def _base_step(opt: torch.optim.Optimizer, closure=None):
    """The wrapped optimizer's own step() (also when the user subclasses further)."""
    return super(_DistributedMixin, opt).step(closure)


class _DistributedMixin:
    """Placed in front of the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _hvcomm_setup(self, o: Options) -> None:
        self._hvcomm_options = o
        self.backward_passes_per_step = o.backward_passes_per_step
        self.op, self.gradient_predivide_factor = o.op, o.gradient_predivide_factor
        self.schedule, self.delay = o.schedule, o.delay
        named = o.named_parameters
        if named is None:
            named = [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(self.param_groups)
                     for j, p in enumerate(g["params"])]
        name_of = {p: n for n, p in named}
        params = trainable(self)
        names = [name_of[p] for p in params]
        agree_on_parameters(averaging_comm(o), [(n, tuple(p.shape), str(p.dtype))
                                             for n, p in zip(names, params)]
                            + o.agreement_key(name_of))
        self._index = {p: i for i, p in enumerate(params)}
        self._parameter_names = dict(zip(params, names))  # Horovod's name; scripts read it
        self._passes_left = [o.backward_passes_per_step] * len(params)
        self._hooks_fired = False
        self._synchronized = False
        self._should_synchronize = True
        self._iter_start_us = timeline.Timeline.now_us()
        self._strategy = make_strategy(o, params, names, self,
                                       functools.partial(_base_step, self))
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._patch_step_function()

    def _hvcomm_rebuild(self, keep_state: bool) -> None:
        """Start again on the current runtime (after an elastic reset): a new strategy, as if
        made now with the same options. ``keep_state``: it takes over the old one's state
        (a reset without a failure); else its state comes from the next ``load_state_dict``
        (``TorchState.restore`` after a failure). Collective."""
        o = self._hvcomm_options
        if o.process_set is not None and o.process_set is not global_process_set:
            raise HvcommError("DistributedOptimizer(process_set=...) cannot go on after a process "
                              "failure: the world has shrunk and process sets are dissolved; "
                              "average over every rank in elastic training", everywhere=True)
        state = self._strategy.state_dict() if keep_state else None
        for hook in self._hook_handles:
            hook.remove()
        self._strategy.close()
        self._hvcomm_setup(o)
        if state is not None:
            self._strategy.load_state_dict(state)

    # -- what the strategies report ------------------------------------------------------------
    @property
    def comm_stats(self):
        """Messages, payload bytes and bytes sent (ring model) of the last step."""
        return self._strategy.comm_stats

    @property
    def plan(self) -> List[List[str]]:
        """The buckets in use, as parameter names, in launch order (read-only view)."""
        return self._strategy.plan

    def _plans(self):
        """The strategy's GroupingPlanner where a schedule plans the grouping, else None."""
        return self._strategy.plans

    # schedule=: every schedule's prediction; the one in use; a schedule that races plans:
    # each raced plan's best measured iteration (s), and which one was kept
    schedule_report = property(lambda self: self._plans().schedule_report
                               if self._plans() else [])
    plan_prediction = property(lambda self: self._plans().plan_prediction
                               if self._plans() else None)
    trial_report = property(lambda self: self._plans().trial_report if self._plans() else {})
    plan_origin = property(lambda self: self._plans().plan_origin if self._plans() else None)

    # -- hooks ---------------------------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        i = self._index[p]
        if self._passes_left[i] <= 0:
            raise HvcommError("Gradients were computed more than backward_passes_per_step times "
                              "before step(); increase backward_passes_per_step to accumulate "
                              "gradients locally")
        if not self._hooks_fired and timeline.active():
            timeline.active().span("forward+backward (to first gradient)", self._iter_start_us,
                                   timeline.Timeline.now_us())
        self._hooks_fired = True
        self._passes_left[i] -= 1
        if self._passes_left[i] == 0:
            self._strategy.on_grad(i)

    def _new_iteration(self) -> None:
        self._passes_left = [self.backward_passes_per_step] * len(self._passes_left)
        self._hooks_fired = False
        self._iter_start_us = timeline.Timeline.now_us()

    # -- Horovod's optimizer interface ---------------------------------------------------------
    def synchronize(self) -> None:
        """Finish this iteration's gradient averaging (launching what the hooks did not)."""
        self._strategy.synchronize()
        self._new_iteration()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if not self._should_synchronize:
            loss = self._strategy.update(closure)
        else:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(); gradients are averaged twice")
            loss = self._strategy.step(closure)
        self._new_iteration()
        self._synchronized = False
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._hooks_fired:
            raise HvcommError("optimizer.zero_grad() was called after loss.backward() but before "
                              "optimizer.step() or optimizer.synchronize(); call step() first")
        return super().zero_grad(set_to_none)

    def finish_pending(self) -> None:
        """Apply every update still pending, so the model holds the synchronised weights.

        ``model=``: the updates deferred to the next forward (applied by themselves before the
        next backward, ``state_dict()`` and the model's ``state_dict()``).
        ``delay=``: waits for the last step's allreduce, advances the global weights with it
        and sets the local weights to them (the next step then starts from W; the same on
        every rank). ``delay=LocalSGD/DiLoCo``: applies the exchanges under way and sets the
        local weights to W (no exchange is started). Call it before evaluating or saving the
        model for inference."""
        self._strategy.finish_pending()

    def global_weights(self) -> Dict[str, torch.Tensor]:
        """Delayed modes: the global weights W by parameter name (identical on every rank)."""
        return self._strategy.global_weights()

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus hvcomm's own, under "hvcomm": the step counter,
        this rank's error-feedback residuals by parameter name, the compressor's state
        (PowerSGD's Q factors) and the delayed modes' state. Only the residuals
        (:data:`PER_RANK_STATE`) differ between ranks: save one checkpoint per rank to resume
        exactly."""
        ours = self._strategy.state_dict()  # first: it may apply a pending (model=) update
        state = super().state_dict()
        state["hvcomm"] = ours
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore; hvcomm's state is restored when the dict has it, kept otherwise."""
        state_dict = dict(state_dict)
        self._strategy.load_state_dict(state_dict.pop("hvcomm", None))
        self._new_iteration()
        self._synchronized = False
        super().load_state_dict(state_dict)


PER_RANK_STATE = ("residuals_by_param",)
"""The entries of ``state_dict()["hvcomm"]`` that differ between ranks; the others are the
same on every rank (elastic ``sync()`` sends them from rank 0)."""


@functools.lru_cache(maxsize=None)
def _distributed_class(base: type) -> type:
    class Distributed(_DistributedMixin, base):  # type: ignore[misc, valid-type]
        __doc__ = f"{base.__name__} whose gradients are averaged across ranks by hvcomm."
        _hvcomm_wrapped = base  # whose step() the update runs (methods.strategy reads it)

    Distributed.__name__ = Distributed.__qualname__ = f"Distributed{base.__name__}"
    return Distributed


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

    ``schedule`` names a schedule method (``hvcomm.torch.methods.names("schedule")``): the
    planned ones ("mgwfbp", "merge_rule", "wfbp", "single", "threshold") plan the buckets
    from a profile of the first iterations (see
    :class:`hvcomm.torch.methods.schedule.GroupingPlanner`); "p3" sends priority slices of
    ``slice_elems`` elements (see :mod:`hvcomm.torch.methods.p3`).

    ``model`` (with ``schedule=None`` or "p3"): ``step()`` returns at once and each module's
    next forward applies the update of the parameters it owns, waiting only for their
    buckets (launched nearest-the-output first, then from the input on:
    :func:`hvcomm.torch.methods.sync.forward_first`) or P3's slices, so the communication
    overlaps the next forward; for torch.optim's per-parameter optimizers (see
    :class:`hvcomm.torch.methods.strategy.NextForward`).

    ``delay`` (a delay method's name, "od-sgd", "ssd-sgd", "cd-sgd", or a
    :class:`hvcomm.torch.Delay`) turns on delayed synchronisation (see
    :mod:`hvcomm.torch.methods.delayed`):
    step() returns before the gradients are averaged, which happens during the next step.
    ``delay="local-sgd"`` / ``"diloco"`` (or :class:`hvcomm.torch.LocalSGD`,
    :class:`hvcomm.torch.DiLoCo`) averages the models every ``period`` steps instead (see
    :mod:`hvcomm.torch.methods.periodic`).
    ``finish_pending()`` brings the model to the global weights (before evaluating);
    ``global_weights()`` returns them; everything is in ``state_dict()``.
    """
    given = locals()  # first: exactly the parameters, the Options' fields among them
    options = Options(**{f.name: given[f.name] for f in dataclasses.fields(Options)})
    if named_parameters is not None:
        options = dataclasses.replace(options, named_parameters=list(named_parameters))
    rt = runtime()
    if isinstance(optimizer, _DistributedMixin):
        problem = "the optimizer is already a DistributedOptimizer; wrap the plain optimizer once"
    else:
        problem = options.problem(optimizer, rt.comm.Get_size())
    in_a_set = isinstance(process_set, ProcessSet) and process_set.process_set_id is not None
    raise_together(averaging_comm(options) if in_a_set else rt.comm, problem,
                   "DistributedOptimizer")
    cls = _distributed_class(type(optimizer))
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)
    opt._hvcomm_setup(options.resolved(rt.fusion_threshold_bytes))
    remember_optimizer(opt)
    return opt


def rebuild_all(keep_state: bool = False) -> None:
    """Every DistributedOptimizer still in use starts again on the current runtime, in the
    order they were made (the same on every rank); see ``_hvcomm_rebuild`` for ``keep_state``.
    Called by :mod:`hvcomm.torch.elastic`."""
    for opt in optimizers():
        opt._hvcomm_rebuild(keep_state)
