"""Broadcasting model parameters and optimizer state from one rank to all."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Tuple, Union

import torch

from .exchange_ops import broadcast_async_, broadcast_object
from .ops import synchronize
from .runtime import rank


def broadcast_parameters(params: Union[Mapping[str, torch.Tensor],
                                        Iterable[Tuple[str, torch.Tensor]]],
                         root_rank: int = 0) -> None:
    """Overwrite, in place, every tensor of ``params`` with root_rank's.

    ``params`` is a ``model.state_dict()`` (broadcast in sorted name order) or
    ``model.named_parameters()`` (in the given order), as in Horovod.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = list(params)
        if any(not (isinstance(it, tuple) and len(it) == 2) for it in items):
            raise ValueError("params should be a state_dict or a sequence of (name, tensor) tuples")
    handles = [broadcast_async_(t, root_rank, name=name) for name, t in items
               if isinstance(t, torch.Tensor)]
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root_rank's optimizer state and hyper-parameters.

    The state dict travels as one pickled object and is loaded with ``load_state_dict``; no
    optimizer step is taken (Horovod's version steps with zero gradients to create missing
    state, which would change momentum, Adam's step count and any error-feedback residual).
    hvcomm's per-rank state (residuals, step counter) stays as it is on every rank. As in
    Horovod (whose initialising step creates them), a parameter that requires a gradient and
    has none gets a zero gradient.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    state: Any = None
    if rank() == root_rank:
        state = dict(optimizer.state_dict())
        state.pop("hvcomm", None)
    state = broadcast_object(state, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(state)
