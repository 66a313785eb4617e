"""The state an elastic job commits, restores and synchronises (Horovod 0.28.1's names and
semantics): :class:`State`, :class:`ObjectState`, :class:`TorchState`.

- ``commit()``: ``save()`` a copy in host memory, then ``check_host_updates()``.
- ``restore()``: back to the last commit (after a failure: on the survivors).
- ``sync()``: every rank takes the lowest rank's state (rank 0 of the current world).

What a DistributedOptimizer keeps per rank travels with its ``state_dict()`` (the "hvcomm"
entry: step counter, this rank's error-feedback residuals, the delayed methods' global weights
and pending average): a commit saves this rank's, ``restore()`` brings it back, ``sync()``
leaves it alone (``broadcast_optimizer_state`` sends only the wrapped optimizer's state). A
failed rank's residuals are lost with it.
"""
from __future__ import annotations

import copy
import queue
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..functions import broadcast_optimizer_state, broadcast_parameters
from ..gather_ops import broadcast_object
from ..runtime import rank
from .sampler import ElasticSampler


REMOVED, ADDED = 1, 2  # Horovod's HostUpdateResult flags (removed | added = mixed)


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: every rank stops at the same commit and resets.
    ``skip_sync``: only hosts were removed, so the survivors' state is already the same."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts have changed")
        self.skip_sync = skip_sync


class State:
    """What an elastic job keeps in step across a reset. ``bcast_object(obj)`` gives every
    rank rank 0's ``obj``; ``get_rank()`` is this rank."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]):
        self._bcast_object, self._rank = bcast_object, get_rank
        self._host_messages: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Call these after every reset (ranks lost or added), e.g. to rescale the learning
        rate by the new size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int = REMOVED | ADDED) -> None:
        """A change of hosts was announced (``timestamp`` grows with each announcement;
        ``update_res``: :data:`REMOVED`, :data:`ADDED` or both, as Horovod's driver says)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (a copy in host memory), then check for host changes: raises
        :class:`HostsUpdatedInterrupt` on every rank when there are any. Collective."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Collective: every rank learns rank 0's newest host change, and raises
        :class:`HostsUpdatedInterrupt` together when there is a new one."""
        newest, update = self._last_updated_timestamp, 0
        while not self._host_messages.empty():
            timestamp, update_res = self._host_messages.get()
            if timestamp > newest:
                newest = timestamp
                update |= update_res
        previous = self._last_updated_timestamp
        previous, newest, update = self._bcast_object((previous, newest, update))
        self._last_updated_timestamp = newest
        if newest > previous:
            raise HostsUpdatedInterrupt(skip_sync=update == REMOVED)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called on a reset, before the reset callbacks."""


class ObjectState(State):
    """Picklable attributes, given as keyword arguments (``state.epoch``, ``state.batch``)."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


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

    def __init__(self, value):
        self.value = value
        self._saved = None
        self.save()

    def set_value(self, value) -> None:
        self.value = value
        self._saved = None
        self.save()

    def save(self) -> None:
        self._saved = snapshot(self.value.state_dict(), self._saved)

    def restore(self) -> None:
        # a copy: load_state_dict may keep the tensors it is given (the optimizer's state),
        # which the next commit would then overwrite
        self.value.load_state_dict(snapshot(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


# the first entry whose type an attribute has handles it; others are plain objects
HANDLERS: List[Tuple[type, type]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _Handler),
]


def _handler_for(value):
    return next((handler(value) for kind, handler in HANDLERS if isinstance(value, kind)), None)


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
            handler = _handler_for(value)
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
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
