"""One bucket's trip: gather and compensate -> compress -> keep the residual -> communicate ->
decompress."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .compressor import Compressor, is_native
from .payload import ADASUM, ALLREDUCE, Payload
from .buckets import Bucket, common_dtype, flat_grad
from .memory import ErrorFeedback


@dataclass
class InFlight:
    """One bucket's collective on the engine; ``finish()`` waits for it."""

    reducer: "Reducer"
    handle: Any                   # the engine's Handle
    payload: Payload
    names: Sequence[str] = ()     # the bucket's parameters (their residuals)
    numels: Sequence[int] = ()
    scale_applied: bool = False   # the collective multiplied the sum by start()'s scale

    def finish(self):
        """Wait; returns (dense sum over ranks, bytes this rank sent, payload bytes)."""
        return self.reducer.finish(self)


class _HorovodCompressor(Compressor):
    """A compressor with Horovod's interface alone (``compress(tensor) -> (tensor, ctx)``,
    ``decompress(tensor, ctx)``), carried by a dense allreduce without error feedback."""

    def __init__(self, compressor: Any):
        self.compressor = compressor

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        data, ctx = self.compressor.compress(tensor)
        return Payload(data.contiguous(), tensor.numel(), tensor.dtype, ctx=ctx)

    def decode(self, result, payload):
        return self.compressor.decompress(result, payload.ctx)


class Reducer:
    """Runs a compressor (with error feedback where it keeps one) and the collective it
    carries; ``adasum``: the dense payload is combined by Adasum instead (the options allow
    op=Adasum with dense gradients only)."""

    def __init__(self, engine, compressor: Any, memory: ErrorFeedback, comm=None,
                 adasum: bool = False):
        compressor = compressor.for_optimizer() if is_native(compressor) \
            else _HorovodCompressor(compressor)
        self.engine, self.compressor, self.memory = engine, compressor, memory
        self.comm = comm  # None: the engine's (every rank); else a process set's
        self.collective = ADASUM if adasum else compressor.collective

    def start(self, bucket: Bucket, params: Sequence[torch.nn.Parameter], step: int,
              predivide: float = 1.0, scale: float = 1.0) -> InFlight:
        """Gather the bucket's gradients (``params``, divided by ``predivide``) into one flat
        tensor, with this rank's residual added where the compressor keeps one, encode it and
        hand its collective to the engine. ``scale``: the factor the caller multiplies the
        sum by, applied by the collective where the gradients travel as they are
        (``scale_applied``), else left to the caller."""
        comp, names, numels = self.compressor, bucket.names, bucket.numels
        if comp.error_feedback:  # (its residuals are kept in the gradients' own dtype)
            acc = flat_grad(params, predivide,
                            residual=self.memory.kept(names, numels, common_dtype(params)))
        else:
            acc = flat_grad(params, predivide, comp.gather_dtype(params))
        payload = comp.encode(acc, step, bucket.key, bucket.shapes, bucket.names)
        scale_applied = comp.sends_as_is and self.collective is ALLREDUCE
        if scale_applied:
            payload.scale = float(scale)
        if comp.error_feedback:
            self.memory.store(names, numels, comp.residual(acc, payload))
        collective = self.collective
        handle = self.engine.submit(lambda comm: collective.run(comm, payload),
                                    f"{collective.label} {bucket.key[:80]}", self.comm,
                                    start=lambda comm, tag: collective.start(comm, payload, tag))
        return InFlight(self, handle, payload, names, numels, scale_applied)

    def finish(self, job: InFlight):
        """See :meth:`InFlight.finish`."""
        result, sent = job.handle.wait()
        comp = self.compressor
        if comp.error_feedback:
            # into the residual as it is now: with delay=, the next step's compensation may
            # already have taken the one this job stored
            comp.settle(self.memory.flat(job.names, job.numels, job.payload.dtype),
                        job.payload, result)
        return comp.decode(result, job.payload), sent, job.payload.nbytes
