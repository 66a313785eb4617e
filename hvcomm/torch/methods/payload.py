"""What travels: the :class:`Payload` a compressor makes of a gradient, and the
:class:`Collective` that moves it (the dense sum and Adasum here; the sparse methods bring
their own)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ..sums import adasum_, start_ring_sum, sum_in_place


@dataclass
class Payload:
    """What a compressor made of one flat gradient: ``data`` travels (a tensor, or sparse
    ``(indices, values)`` NumPy arrays); the rest is what rebuilding the dense sum needs:
    ``numel`` and ``dtype`` of the flat gradient, ``k`` pairs (sparse), the positions every
    rank chose alike (``indices``, random-k), and the context of a compressor that has
    Horovod's interface alone (``ctx``, as its ``compress`` returned it), and the factor the
    dense sum comes back multiplied by (``scale``: :class:`Allreduce` applies it)."""

    data: Any
    numel: int
    dtype: torch.dtype
    k: int = 0
    indices: Optional[torch.Tensor] = None
    ctx: Any = None
    scale: float = 1.0

    @property
    def nbytes(self) -> int:
        parts = self.data if isinstance(self.data, tuple) else (self.data,)
        return sum(p.nbytes if hasattr(p, "nbytes") else p.numel() * p.element_size()
                   for p in parts)


class Collective:
    """How a payload travels: ``run(comm, payload)`` (on the engine thread) returns the
    result that ``decode`` reads and the bytes this rank sent. ``label``: its name on the
    timeline."""

    label = "collective"

    def run(self, comm, payload: Payload) -> Tuple[Any, float]:
        raise NotImplementedError

    def start(self, comm, payload: Payload, tag: int):
        """``run`` started without waiting, where it can share the wire with the collective
        before it (the engine gives the two distinct ``tag``s): a
        :class:`collectives.handle.Pending` whose ``wait()`` returns run's result; None, having
        sent nothing, where it cannot (the engine then waits for the others and calls
        ``run``)."""
        return None


def ring_bytes(comm, nbytes: int) -> float:
    """What one rank sends in a ring allreduce of ``nbytes``."""
    return 2 * (comm.Get_size() - 1) / comm.Get_size() * nbytes


class Allreduce(Collective):
    """The payload's tensor summed over the ranks in place, times its ``scale``."""

    label = "allreduce"

    def run(self, comm, payload):
        sum_in_place(comm, payload.data, payload.scale)
        return payload.data, ring_bytes(comm, payload.nbytes)

    def start(self, comm, payload, tag):
        pending = start_ring_sum(comm, payload.data, payload.scale, tag)
        return None if pending is None else \
            pending.then(lambda data: (data, ring_bytes(comm, payload.nbytes)))


class Adasum(Collective):
    """The payload's tensor combined by Horovod's adaptive summation (``op=Adasum``)."""

    label = "adasum"

    def run(self, comm, payload):
        adasum_(comm, payload.data)
        return payload.data, ring_bytes(comm, payload.data.nbytes)


ALLREDUCE, ADASUM = Allreduce(), Adasum()
