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

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from collectives.errors import HvcommError

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

    def zero_grad(self) -> None:
        """The user zeroed the gradients (between steps)."""

    def finish_pending(self) -> None:
        """Apply every update still pending, so the model holds the synchronised weights."""

    def global_weights(self) -> Dict[str, torch.Tensor]:
        """The global weights by parameter name, where the strategy keeps them apart."""
        raise HvcommError("global_weights() is for delay=... optimizers")

    def close(self) -> None:
        """Detach what the strategy attached to the model; it is not used again (an elastic
        reset builds a new one on the survivors)."""

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
                params: Sequence[torch.nn.Parameter]) -> None:
    """The wrapped optimizer's step on ``params`` alone: its param_groups narrowed to them for
    the call."""
    keep = {id(p) for p in params}
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    for g in groups:
        g["params"] = [p for p in g["params"] if id(p) in keep]
    try:
        base_step(None)
    finally:
        for g, ps in zip(groups, saved):
            g["params"] = ps


def in_flight_error() -> HvcommError:
    return HvcommError("load_state_dict() while gradients are in flight; call synchronize() or "
                       "step() first")
