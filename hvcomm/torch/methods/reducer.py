"""One bucket's trip: compensate -> compress -> keep the residual -> communicate -> decompress."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

import collectives as C

from .buckets import Bucket
from .compression import Compressor
from ..engine import Engine, Handle
from .memory import ErrorFeedback
from ..ops import adasum_, as_numpy, sum_in_place


@dataclass
class InFlight:
    """One bucket's collective on the engine; ``finish()`` waits for it."""

    reducer: "Reducer"
    handle: Handle
    payload: Any
    ctx: Any
    names: Sequence[str] = ()     # the bucket's parameters (their residuals)
    numels: Sequence[int] = ()
    dtype: Any = None

    def finish(self):
        """Wait; returns (dense sum over ranks, bytes this rank sent, payload bytes)."""
        return self.reducer.finish(self)


def _collective_job(collective: str, payload: Any, ctx: Any):
    """The engine job that carries ``payload`` with ``collective``; returns its result."""
    if collective in ("allreduce", "allreduce_values"):
        buf = as_numpy(payload)

        def job(comm):
            sum_in_place(comm, buf)
            return payload, 2 * (comm.Get_size() - 1) / comm.Get_size() * buf.nbytes
    elif collective == "adasum":
        def job(comm):
            adasum_(comm, payload)
            return payload, 2 * (comm.Get_size() - 1) / comm.Get_size() * payload.nbytes
    elif collective == "allgather":
        def job(comm):
            res = C.topk_allgather(comm, *payload, ctx[0], ctx[1], check=False)
            return res, res.sent_bytes
    elif collective == "gtopk":
        def job(comm):
            res = C.gtopk_allreduce(comm, *payload, ctx[0], ctx[1], check=False)
            return res, res.sent_bytes
    else:
        raise ValueError(f"unknown collective {collective!r}")
    return job


class Reducer:
    """Runs compressors the hvcomm way (with error feedback) or Horovod's way (any object
    with compress/decompress, carried by a dense allreduce)."""

    def __init__(self, engine: Engine, compressor: Any, memory: ErrorFeedback, comm=None,
                 adasum: bool = False):
        self.engine, self.compressor, self.memory = engine, compressor, memory
        self.comm = comm  # None: the engine's (every rank); else a process set's
        self.dense_collective = "adasum" if adasum else "allreduce"  # what "allreduce" means
        self.native = isinstance(compressor, Compressor)

    def start(self, bucket: Bucket, flat: torch.Tensor, step: int) -> InFlight:
        comp, key = self.compressor, bucket.key
        if not self.native:
            payload, ctx = comp.compress(flat)
            payload = payload.contiguous()
            return InFlight(self, self.engine.submit(
                _collective_job(self.dense_collective, payload, ctx),
                f"{self.dense_collective} {key[:80]}", self.comm),
                            payload, ctx)
        names, numels = bucket.names, bucket.numels
        acc = self.memory.compensate(names, numels, flat) if comp.error_feedback else flat
        payload, ctx = comp.compress(acc, step, key)
        if comp.error_feedback:
            self.memory.store(names, numels, comp.residual(acc, payload, ctx))
        collective = self.dense_collective if comp.collective == "allreduce" else comp.collective
        return InFlight(self, self.engine.submit(_collective_job(collective, payload, ctx),
                                                 f"{collective} {key[:80]}", self.comm),
                        payload, ctx, names, numels, flat.dtype)

    def finish(self, job: InFlight):
        """See :meth:`InFlight.finish`."""
        result, sent = job.handle.wait()
        comp = self.compressor
        if self.native and comp.error_feedback:
            # into the residual as it is now: with delay=, the next step's compensation may
            # already have taken the one this job stored
            comp.settle(self.memory.flat(job.names, job.numels, job.dtype), job.payload, result)
        parts = job.payload if isinstance(job.payload, tuple) else (job.payload,)
        payload_bytes = sum(p.nbytes if hasattr(p, "nbytes") else p.numel() * p.element_size()
                            for p in parts)
        return comp.decompress(result, job.ctx), sent, payload_bytes
