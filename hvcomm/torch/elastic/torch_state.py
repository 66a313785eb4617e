"""A PyTorch job's elastic state (Horovod 0.28.1's :class:`TorchState`): the model, the
optimizer, LR schedulers and samplers kept by handlers that snapshot their ``state_dict()``
into reused buffers, on :class:`hvcomm.torch.elastic.state.ObjectState`'s commits."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch

from collectives.errors import HvcommError

from ..functions import broadcast_optimizer_state, broadcast_parameters
from ..exchange_ops import broadcast_object
from ..optimizer import PER_RANK_STATE
from ..runtime import rank
from .sampler import ElasticSampler
from .state import Kept, ObjectState


def snapshot(value, previous=None):
    """A copy of ``value`` (a state dict: nested dicts, lists and tuples of tensors and plain
    objects) that reuses ``previous``'s tensors where shape, dtype and device match: a commit
    then costs a memory copy, not new allocations (whose page faults cost as much again)."""
    if isinstance(value, torch.Tensor):
        if (isinstance(previous, torch.Tensor) and previous.shape == value.shape
                and previous.dtype == value.dtype and previous.device == value.device):
            return previous.copy_(value)
        return value.detach().clone()
    if isinstance(value, dict):
        before = previous if isinstance(previous, dict) else {}
        copied = type(value)((k, snapshot(v, before.get(k))) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a module's state dict: the modules' versions
            copied._metadata = copy.deepcopy(value._metadata)
        return copied
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        before = previous if type(previous) is type(value) and len(previous) == len(value) \
            else [None] * len(value)
        return type(value)(snapshot(v, p) for v, p in zip(value, before))
    return copy.deepcopy(value)


class _Handler:
    """How one kind of object is saved, restored and synchronised."""

    def __init__(self, value, commit_id: int):
        self.set_value(value, commit_id)

    def set_value(self, value, commit_id: int) -> None:
        self.value = value
        self._kept = Kept()
        self.save(commit_id)

    def save(self, commit_id: int) -> None:
        self._kept.put(commit_id, lambda reuse: snapshot(self.value.state_dict(), reuse))

    def kept_commits(self) -> set:
        return self._kept.ids()

    def kept(self, commit_id: int):
        return self._kept.get(commit_id)

    def keep(self, commit_id: int, saved) -> None:
        self._kept.put(commit_id, lambda _: saved)

    def restore(self, commit_id: int) -> None:
        # a copy: load_state_dict may keep the tensors it is given (the optimizer's state),
        # which the next commit would then overwrite
        self.value.load_state_dict(snapshot(self._kept.get(commit_id)))
        self._kept.forget_newer(commit_id)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)
        state = self.value.state_dict()
        ours = state.get("hvcomm")
        if ours is not None:  # a DistributedOptimizer: rank 0's step counter, global weights...
            shared = broadcast_object({k: v for k, v in ours.items() if k not in PER_RANK_STATE})
            state["hvcomm"] = {**ours, **shared}
            self.value.load_state_dict(state)


# the first entry whose type an attribute has handles it; others are plain objects
HANDLERS: List[Tuple[type, type]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _Handler),
]


def _handler_for(value, commit_id: int):
    return next((handler(value, commit_id) for kind, handler in HANDLERS
                 if isinstance(value, kind)), None)


class TorchState(ObjectState):
    """A PyTorch job's state: ``model`` and ``optimizer`` (a DistributedOptimizer or any
    optimizer), any LR scheduler or :class:`ElasticSampler`, and any picklable attributes,
    all as keyword arguments and attributes. Assigning a new model, optimizer, scheduler or
    sampler to an attribute saves it at once."""

    def __init__(self, model: torch.nn.Module = None, optimizer: torch.optim.Optimizer = None,
                 **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        plain = {}
        for name, value in kwargs.items():
            handler = _handler_for(value, 0)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(broadcast_object, rank, **plain)

    def __setattr__(self, name: str, value) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value, self.commit_id)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save(self.commit_id)
        super().save()

    def kept_commits(self) -> set:
        return super().kept_commits().intersection(*(h.kept_commits()
                                                     for h in self._handlers.values()))

    def _copy_of(self, commit_id: int) -> Dict[str, Any]:
        return {**super()._copy_of(commit_id),
                "handlers": {name: h.kept(commit_id) for name, h in self._handlers.items()}}

    def _keep(self, commit_id: int, copy_of: Dict[str, Any]) -> None:
        if set(copy_of.get("handlers", {})) != set(self._handlers):
            raise HvcommError(f"the elastic state on disk holds "
                              f"{sorted(copy_of.get('handlers', {}))}, "
                              f"this state {sorted(self._handlers)}: another job's state? "
                              "Point HVCOMM_CHECKPOINT_DIR elsewhere")
        super()._keep(commit_id, copy_of)
        for name, handler in self._handlers.items():
            handler.keep(commit_id, copy_of["handlers"][name])

    def _restore(self, commit_id: int) -> None:
        for handler in self._handlers.values():
            handler.restore(commit_id)
        super()._restore(commit_id)

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
            handler.save(self.commit_id)  # what restore() goes back to is the synced state
        super().sync()
