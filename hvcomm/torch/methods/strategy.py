"""The interface between DistributedOptimizer and a way of synchronising gradients.

The optimizer is a thin layer: it counts backward passes, checks Horovod's guards, and hands
each event to one strategy object chosen at construction:

- :class:`hvcomm.torch.methods.sync.Synchronous`: buckets averaged (dense or compressed) as soon as
  their gradients are final; its groupings come from the fusion threshold, explicit groups,
  or a :class:`hvcomm.torch.methods.schedule.GroupingPlanner` (MG-WFBP and the baselines);
- :class:`hvcomm.torch.methods.p3.P3`: priority slices, per-module deferred updates;
- :class:`hvcomm.torch.methods.delayed.DelayedAveraging`: OD / SSD / CD-SGD around a Synchronous;
- :class:`hvcomm.torch.methods.periodic.PeriodicAveraging`: local SGD and DiLoCo.

Each strategy owns its state and its checkpoint entry (``state_dict()["hvcomm"]``).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from collectives.errors import HvcommError

from .. import timeline
from .buckets import CommStats

BaseStep = Callable[[Optional[Callable[[], Any]]], Any]  # the wrapped optimizer's step()


class Strategy:
    """``params`` / ``names``: the optimizer's parameters (those with requires_grad) and
    their names, in registration order; events refer to parameters by position. Each
    strategy also has ``comm_stats`` (a :class:`CommStats` of the last completed
    synchronisation) and ``steps`` (synchronisations so far: density warm-up, seeds)."""

    comm_stats: CommStats
    steps: int
    plans = None  # a GroupingPlanner where the grouping is planned (schedule=)
    _next_forward: Optional["NextForward"] = None  # model=: the update at the next forward

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 base_step: BaseStep):
        self.params: List[torch.nn.Parameter] = list(params)
        self.names: List[str] = list(names)
        self.base_step = base_step

    @property
    def plan(self) -> List[List[str]]:
        """The buckets in use, as parameter names, in launch order."""
        raise HvcommError(f"{type(self).__name__} sends no buckets")

    def on_grad(self, i: int) -> None:
        """Parameter i's gradient is final for this step (its last backward pass)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Finish this step's averaging: the averaged gradients are in ``.grad``."""
        raise NotImplementedError

    def update(self, closure=None):
        """The optimizer update alone (after ``synchronize()``)."""
        raise NotImplementedError

    def step(self, closure=None):
        """Synchronise and update (``optimizer.step()``)."""
        self.synchronize()
        return self.update(closure)

    def finish_pending(self) -> None:
        """Apply every update still pending, so the model holds the synchronised weights."""
        if self._next_forward is not None:
            self._next_forward.finish()

    def global_weights(self) -> Dict[str, torch.Tensor]:
        """The global weights by parameter name, where the strategy keeps them apart."""
        raise HvcommError("global_weights() is for delay=... optimizers")

    def close(self) -> None:
        """Detach what the strategy attached to the model; it is not used again (an elastic
        reset builds a new one on the survivors)."""
        if self._next_forward is not None:
            self._next_forward.close()

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore ``state`` (None: keep hvcomm's state, only forget this step's progress)."""
        raise NotImplementedError


# torch.optim's optimizers whose update of a parameter reads nothing but that parameter, its
# gradient and its own state: stepped on a few parameters at a time they give, bit for bit,
# the weights of one step on all of them
PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                 torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
                 torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)


def may_update_in_parts(optimizer: torch.optim.Optimizer,
                        averaged: Sequence[torch.nn.Parameter]) -> bool:
    """Whether the DistributedOptimizer ``optimizer`` may be stepped a few of the ``averaged``
    parameters at a time (:func:`update_only`) with the weights of one step: it wraps one of
    :data:`PER_PARAMETER` itself (a subclass may do anything in ``step``), the parameters it
    holds are the averaged ones (none frozen when it was wrapped, or added since, which a
    step in parts would never update), and no step hook would run once per part."""
    from torch.optim import optimizer as torch_optimizer
    wrapped = getattr(type(optimizer), "_hvcomm_wrapped", None)
    hooks = (getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
             getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None))
    held = [id(p) for g in optimizer.param_groups for p in g["params"]]
    return (wrapped in PER_PARAMETER and all(h is not None and not h for h in hooks)
            and len(held) == len(averaged) and set(held) == {id(p) for p in averaged})


def update_only(optimizer: torch.optim.Optimizer, base_step: BaseStep,
                params: Sequence[torch.nn.Parameter],
                settings: Optional[Sequence[Dict[str, Any]]] = None) -> None:
    """The wrapped optimizer's step on ``params`` alone: its param_groups narrowed to them for
    the call (and given ``settings``, one dict per group, for it: the learning rate...)."""
    keep = {id(p) for p in params}
    groups = optimizer.param_groups
    given = [{}] * len(groups) if settings is None else list(settings)
    if len(given) != len(groups):
        raise HvcommError(f"the optimizer has {len(groups)} param groups, {len(given)} when its "
                          "update was deferred: add param groups only after finish_pending()")
    saved = [dict(g) for g in groups]
    try:
        for g, s in zip(groups, given):
            g.update(s, params=[p for p in g["params"] if id(p) in keep])
        base_step(None)
    finally:
        for g, before in zip(groups, saved):
            g.clear()
            g.update(before)


def model_problem(model, params: Sequence[torch.Tensor], optimizer) -> Optional[str]:
    """What is wrong with ``model=`` for deferring the update to the next forward
    (:class:`NextForward`), or None."""
    if not isinstance(model, torch.nn.Module):
        return f"model must be a torch.nn.Module, got {type(model).__name__}"
    owned = {id(p) for p in model.parameters()}
    if not all(id(p) in owned for p in params):
        return "model= must own every parameter of the optimizer"
    if type(optimizer) not in PER_PARAMETER:
        return (f"model= updates the parameters module by module, which gives the weights of "
                f"one step only for torch.optim's per-parameter optimizers "
                f"({', '.join(c.__name__ for c in PER_PARAMETER)}), not "
                f"{type(optimizer).__name__}; leave model= out")
    return None


Averages = Callable[[Set[int]], Iterable[Tuple[int, torch.Tensor]]]


class NextForward:
    """A step's update deferred to the next forward (``model=``): before a module's forward
    the parameters it owns are updated, so the communication still under way overlaps the
    forward of the modules whose averages have arrived. Before the model's ``state_dict()``
    and ``load_state_dict()`` (and :meth:`finish`) every parameter is.

    Which forward applies a parameter's update is learnt from the forwards before the first
    deferred step: its own module's if that ran (before the module's other forward pre-hooks,
    which may read its weights, as ``spectral_norm``'s does), else its nearest ancestor's that
    ran (a parameter its module's parent uses directly, as ``nn.MultiheadAttention`` uses
    ``out_proj``'s), else the first forward of any module.

    :meth:`defer` hands over a step: ``averages(wanted)`` yields (position, averaged gradient
    in the parameter's shape) for at least the positions ``wanted``, waiting for them;
    ``done()`` runs once every parameter is updated. Each update is the wrapped optimizer's
    step narrowed to the parameters that arrived (:func:`update_only`), with the param
    groups' settings of :meth:`defer` (a learning-rate scheduler stepped since does not reach
    it) and the averages in ``.grad`` for that call only: ``.grad`` then holds again whatever
    the user left there (the local gradient, or nothing after ``zero_grad()``), so a
    ``model.zero_grad()`` between ``step()`` and the forward is kept."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, base_step: BaseStep):
        self.params, self._optimizer, self._base_step = list(params), optimizer, base_step
        self._model = model
        self._ran: Optional[set] = set()  # modules whose forward ran, until the first defer
        self._owned: Dict[torch.nn.Module, Set[int]] = {}
        self._orphans: Set[int] = set()
        self._averages: Optional[Averages] = None
        self._done: Callable[[], None] = lambda: None
        self._settings: List[Dict[str, Any]] = []
        self._sparse: Set[int] = set()
        self._left: Set[int] = set()
        finish = lambda *_a, **_k: self.finish()  # noqa: E731
        self._hooks = [m.register_forward_pre_hook(self._before_forward, prepend=True)
                       for m in model.modules()]  # first: other pre-hooks may read weights
        self._hooks += [model.register_state_dict_pre_hook(finish),
                        model.register_load_state_dict_pre_hook(finish)]

    def _before_forward(self, module, _inputs) -> None:
        if self._ran is not None:
            self._ran.add(module)
        elif self._left:
            self.apply(self._owned.get(module, set()) | self._orphans)

    def _learn_owners(self) -> None:
        index = {p: i for i, p in enumerate(self.params)}
        ran, self._ran = self._ran, None

        def walk(module, nearest):
            here = module if module in ran else nearest
            for p in module.parameters(recurse=False):
                if p in index:
                    owner = self._orphans if here is None else self._owned.setdefault(here, set())
                    owner.add(index[p])
            for child in module.children():
                walk(child, here)
        walk(self._model, None)

    def defer(self, averages: Averages, done: Callable[[], None] = lambda: None) -> None:
        """Hand over a step whose update waits for the next forward."""
        self.finish()
        if self._ran is not None:
            self._learn_owners()
        self._averages, self._done = averages, done
        self._settings = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                          for g in self._optimizer.param_groups]
        self._sparse = {i for i, p in enumerate(self.params)
                        if p.grad is not None and p.grad.is_sparse}
        self._left = set(range(len(self.params)))

    def apply(self, wanted) -> None:
        """Update the parameters at positions ``wanted`` that still wait (and the others of
        their buckets, which have arrived with them). If a collective raises, the rest of
        the step is dropped (it will not arrive; elastic training restores the state); if
        the update raises, the rest is still waited for first."""
        todo = self._left & set(wanted)
        if not todo:
            return
        with torch.inference_mode(False):  # the optimizer's state must not be made there
            try:
                with timeline.measure("wait"):
                    got = dict(self._averages(todo))
            except BaseException:
                self._averages, self._left = None, set()
                raise
            try:
                self._update(got)
            except BaseException:
                self._drain(set(got))
                raise
        self._left -= got.keys()
        if not self._left:
            self._averages = None
            self._done()

    def _update(self, got: Dict[int, torch.Tensor]) -> None:
        positions = sorted(got)
        params = [self.params[i] for i in positions]
        saved = [p.grad for p in params]
        try:
            for p, i in zip(params, positions):
                p.grad = got[i].to_sparse() if i in self._sparse else got[i]
            with timeline.measure("update", params=len(params)):
                update_only(self._optimizer, self._base_step, params, self._settings)
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    def _drain(self, got: Set[int]) -> None:
        """Wait for the rest of the step without updating (an update raised)."""
        rest, self._left = self._left - got, set()
        try:
            for _ in self._averages(rest):
                pass
            self._done()
        finally:
            self._averages = None

    def finish(self) -> None:
        """Update every parameter still waiting."""
        if self._left:
            self.apply(set(self._left))

    def close(self) -> None:
        """Detach from the model; an update still waiting is dropped."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._averages, self._left = None, set()


def in_flight_error() -> HvcommError:
    return HvcommError("load_state_dict() while gradients are in flight; call synchronize() or "
                       "step() first")
