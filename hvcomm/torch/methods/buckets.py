"""Bucket assembly shared by every synchronisation strategy: grouping parameters into buckets,
flattening their gradients into one buffer, and splitting a buffer back per parameter."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from collectives.merged import BucketPlan

ONE_BUCKET_BYTES = 2 ** 62  # a fusion threshold no model reaches: one bucket per dtype


@dataclass
class CommStats:
    """What this rank moved in one synchronisation: ``payload_bytes`` handed to the
    collectives, ``sent_bytes`` put on the wire by this rank under the ring model."""

    messages: int = 0
    payload_bytes: int = 0
    sent_bytes: float = 0.0

    def add(self, sent_bytes: float, payload_bytes: int) -> None:
        self.messages += 1
        self.sent_bytes += sent_bytes
        self.payload_bytes += payload_bytes

    def include(self, other: "CommStats") -> None:
        """Add another synchronisation's counts to these."""
        self.messages += other.messages
        self.sent_bytes += other.sent_bytes
        self.payload_bytes += other.payload_bytes


@dataclass
class Bucket:
    """Parameters reduced together (``indices`` into the optimizer's parameter list), and
    the in-flight state of this iteration."""

    indices: List[int]
    names: List[str]
    numels: List[int]
    shapes: Sequence[Tuple[int, ...]] = ()  # the parameters' shapes (empty: not known)
    ready: int = 0                       # parameters whose gradient is final this iteration
    pending: Optional[object] = field(default=None, repr=False)  # the reducer's InFlight

    @property
    def key(self) -> str:
        """Names the bucket (timeline spans, random-k seeds)."""
        return "|".join(self.names)

    @property
    def complete(self) -> bool:
        return self.ready == len(self.indices)


def make_buckets(groups: Sequence[Sequence[int]], params: Sequence[torch.nn.Parameter],
                 names: Sequence[str]) -> List[Bucket]:
    return [Bucket(list(g), [names[i] for i in g], [params[i].numel() for i in g],
                   [tuple(params[i].shape) for i in g]) for g in groups]


def plan_groups(params: Sequence[torch.nn.Parameter], groups, threshold_bytes: int
                ) -> List[List[int]]:
    """Buckets in launch order, as indices into ``params``: explicit ``groups`` (an int
    count, or lists of parameters), else filled up to ``threshold_bytes`` in reverse
    registration order (the usual backward order), never mixing dtypes."""
    position = {id(p): i for i, p in enumerate(params)}
    if isinstance(groups, list):
        grouped = [[position[id(p)] for p in g] for g in groups]
        seen = {i for g in grouped for i in g}
        grouped += [[i] for i in range(len(params)) if i not in seen]
        grouped.sort(key=lambda g: -max(g))
        return grouped
    order = list(reversed(range(len(params))))
    if isinstance(groups, int) and groups > 0:
        per = -(-len(params) // groups)
        return [order[s:s + per] for s in range(0, len(order), per)]
    plan = BucketPlan.by_threshold([p.numel() * p.element_size() for p in params],
                                   threshold_bytes, order, keys=[p.dtype for p in params])
    return [list(b) for b in plan.buckets]


def common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a flat copy of ``tensors`` takes: the widest of theirs (torch.cat's)."""
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def flat_grad(params: Sequence[torch.nn.Parameter], predivide: float = 1.0,
              dtype: Optional[torch.dtype] = None,
              residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A private flat CPU copy of the parameters' gradients (zeros for a parameter with no
    gradient on this rank, e.g. an unused branch; sparse gradients made dense), divided by
    ``predivide``, plus ``residual`` (the error-feedback residual: a flat tensor of as many
    elements), in ``dtype`` (default: their common dtype), with one rounding to ``dtype``.
    Where ``predivide`` is 1 each gradient is copied into its place, added to the residual or
    cast on the way: one pass, where ``torch.cat`` and an addition or a cast took two."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad.detach()
        grads.append((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
    common = common_dtype(params)
    dtype = dtype or common
    if predivide != 1.0 and (dtype != common or residual is not None):
        flat = torch.cat(grads).div_(predivide)  # divide, add, then round to dtype
        return (flat.add_(residual) if residual is not None else flat).to(dtype)
    flat, offset = torch.empty(sum(g.numel() for g in grads), dtype=dtype), 0
    for grad in grads:
        at = slice(offset, offset + grad.numel())
        if residual is None:
            flat[at].copy_(grad)
        else:
            torch.add(grad, residual[at], out=flat[at])
        offset = at.stop
    if predivide != 1.0:
        flat.div_(predivide)
    return flat


def set_grad(p: torch.nn.Parameter, total: torch.Tensor, scale: float = 1.0,
             alias: bool = False) -> None:
    """``p.grad = total * scale``: :func:`scaled_in` ``p.grad``'s dtype, written into it in
    place; or, with ``alias`` where the gradient is dense and of ``total``'s dtype, ``total``
    itself becomes ``p.grad`` (a view, as with DDP's ``gradient_as_bucket_view``: one pass
    over the gradients fewer); or sparse again where the gradient was sparse (an
    Embedding(sparse=True): SparseAdam and friends expect that). ``total``: a flat sum of
    ``p.numel()`` elements in any floating dtype, which this may overwrite; with ``alias``,
    this step's own and already scaled (``scale`` must be 1)."""
    assert not alias or scale == 1.0, "an aliased sum is scaled already"
    total = total.view(p.shape)
    with torch.no_grad():  # (a gradient made with create_graph=True requires grad)
        if p.grad.is_sparse:
            p.grad = scaled_in(total, p.dtype, scale).to_sparse()
        elif alias and total.dtype == p.grad.dtype:
            p.grad = total
        else:
            scaled_in(total, p.grad.dtype, scale, out=p.grad)


def scaled_in(total: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``total * scale`` in ``dtype``, the product formed in the wider of ``total``'s dtype
    and ``dtype`` (a 16-bit sum is widened first, a wider one scaled first): written into
    ``out`` where given (one pass where the dtypes match; ``out``: ``dtype``, ``total``'s
    shape), else ``total`` itself, scaled in place, where it has ``dtype``, else a new tensor.
    ``total`` may be overwritten."""
    if out is not None and scale != 1.0 and total.dtype == dtype:
        return torch.mul(total, scale, out=out)
    if scale != 1.0 and torch.promote_types(total.dtype, dtype) == total.dtype:
        total, scale = total.mul_(scale), 1.0
    if out is not None:
        out.copy_(total)
    else:
        out = total if total.dtype == dtype else total.to(dtype)
    return out.mul_(scale) if scale != 1.0 else out


def split(flat: torch.Tensor, numels: Sequence[int]) -> Iterator[Tuple[int, torch.Tensor]]:
    """(position, its flat part) for each array packed into ``flat``."""
    offset = 0
    for i, n in enumerate(numels):
        yield i, flat[offset:offset + n]
        offset += n
