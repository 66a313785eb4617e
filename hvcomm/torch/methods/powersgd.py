"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): a rank-r approximation of each
matrix-shaped gradient by one step of power iteration, the low-rank method PyTorch users know
from DDP's ``powerSGD_hook``.

For each parameter of two or more dimensions, viewed as an n x m matrix M (its first dimension
by the rest), with this rank's error added (M = gradient + residual):

1. P = M Q, summed over the ranks (one allreduce for the bucket's P factors, which also carries
   its vectors and small tensors, sent dense);
2. P is orthogonalised (reduced QR: orthonormal columns), the same on every rank;
3. Q = M^T P, summed over the ranks (a second allreduce);
4. the sum over ranks is approximated by P Q^T; this rank keeps ``M - P Q^T / size`` (the
   paper's error feedback: its matrix less the average approximation), and Q is kept to
   start the next step (warm start).

Q starts as standard normal numbers drawn from ``torch.Generator().manual_seed(
seed * 1_000_003 + crc32(f"{key}#{j}"))`` in float64 (key: the bucket's name, j: the matrix's
position in it), the same on every rank. A matrix whose rank-r factors are no smaller than
itself (r * (n + m) >= n * m) is sent dense. The Q factors are in the optimizer's checkpoint.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from collectives.cost import ring_allreduce_s
from collectives.errors import HvcommError

from .base import (Collective, CompressionMethod, Compressor, Payload, float_problem,
                   ring_bytes)


@dataclass
class LowRankPayload(Payload):
    """``matrices``: (offset, n, m) of each low-rank part of the flat gradient, with its M
    (``data[0]``) and Q (``data[1]``); ``dense``: (offset, numel) of the parts sent as they
    are, concatenated in ``data[2]``; ``key``: the bucket's name (its Q factors' key)."""

    matrices: List[Tuple[int, int, int]] = field(default_factory=list)
    dense: List[Tuple[int, int]] = field(default_factory=list)
    key: str = ""

    @property
    def nbytes(self) -> int:
        """What travels: the P and Q factors and the dense parts."""
        ms, qs, vec = self.data
        return sum((m.shape[0] + q.shape[0]) * q.shape[1] * q.element_size()
                   for m, q in zip(ms, qs)) + vec.numel() * vec.element_size()


@dataclass
class LowRankSum:
    """The collective's result: each matrix's orthonormal P and summed Q, the dense parts'
    sum, and the number of ranks."""

    ps: List[torch.Tensor]
    qs: List[torch.Tensor]
    dense: torch.Tensor
    size: int


class PowerIteration(Collective):
    """Steps 1-3 of the module's docstring, on the engine thread."""

    label = "powersgd"

    def run(self, comm, payload):
        from ..ops import sum_in_place
        from .buckets import as_numpy
        ms, qs, vec = payload.data
        ps = [m @ q for m, q in zip(ms, qs)]
        first = torch.cat([p.reshape(-1) for p in ps] + [vec])
        sum_in_place(comm, as_numpy(first))
        sent = ring_bytes(comm, first.nbytes)
        ps, at = [], 0
        for m, q in zip(ms, qs):
            n, r = m.shape[0], q.shape[1]
            ps.append(torch.linalg.qr(first[at:at + n * r].view(n, r), mode="reduced")[0])
            at += n * r
        dense = first[at:]
        second = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(ms, ps)]
                           or [first.new_zeros(0)])
        if second.numel():
            sum_in_place(comm, as_numpy(second))
            sent += ring_bytes(comm, second.nbytes)
        summed, at = [], 0
        for m, q in zip(ms, qs):
            size = m.shape[1] * q.shape[1]
            summed.append(second[at:at + size].view(m.shape[1], q.shape[1]))
            at += size
        return LowRankSum(ps, summed, dense, comm.Get_size()), sent


class PowerSGDCompressor(Compressor):
    """``rank``: r, the approximation's rank; ``seed``: Q's first draw."""

    collective = PowerIteration()
    error_feedback = True

    def __init__(self, rank: int = 4, seed: int = 0):
        if not isinstance(rank, int) or rank < 1:
            raise HvcommError(f"rank must be a positive integer, got {rank!r}")
        if not isinstance(seed, int):
            raise HvcommError(f"seed must be an integer, got {seed!r}")
        self.rank, self.seed = rank, seed
        self._q: Dict[str, List[torch.Tensor]] = {}  # bucket key -> each matrix's last Q

    def _first_q(self, key: str, j: int, m: int, r: int, dtype) -> torch.Tensor:
        seed = self.seed * 1_000_003 + zlib.crc32(f"{key}#{j}".encode())
        gen = torch.Generator().manual_seed(seed)
        return torch.randn((m, r), generator=gen, dtype=torch.float64).to(dtype)

    def encode(self, tensor, step=0, key="", shapes=()):
        flat = tensor.detach().reshape(-1)
        shapes = shapes or [(flat.numel(),)]
        ms, matrices, dense, vec, offset = [], [], [], [], 0
        for shape in shapes:
            numel = math.prod(shape)
            n = shape[0] if len(shape) >= 2 else 0
            m = numel // n if n else 0
            r = min(self.rank, n, m)
            if n and r * (n + m) < n * m:
                matrices.append((offset, n, m))
                ms.append(flat[offset:offset + numel].view(n, m).clone())
            else:
                dense.append((offset, numel))
                vec.append(flat[offset:offset + numel])
            offset += numel
        if key not in self._q or len(self._q[key]) != len(ms):
            self._q[key] = [self._first_q(key, j, m_.shape[1], min(self.rank, *m_.shape),
                                          flat.dtype) for j, m_ in enumerate(ms)]
        vec = torch.cat(vec) if vec else flat.new_zeros(0)
        return LowRankPayload((ms, list(self._q[key]), vec), flat.numel(), flat.dtype,
                              matrices=matrices, dense=dense, key=key)

    def decode(self, result, payload):
        out = torch.zeros(payload.numel, dtype=payload.dtype)
        for (offset, n, m), p, q in zip(payload.matrices, result.ps, result.qs):
            out[offset:offset + n * m] = (p @ q.T).reshape(-1)
        at = 0
        for offset, numel in payload.dense:
            out[offset:offset + numel] = result.dense[at:at + numel]
            at += numel
        return out

    def residual(self, acc, payload):
        """The dense parts travel exactly (nothing kept); the matrices keep M until
        :meth:`settle` subtracts the average approximation."""
        flat = acc.view(-1)
        for offset, numel in payload.dense:
            flat[offset:offset + numel] = 0
        return acc

    def settle(self, residual, payload, result):
        flat = residual.view(-1)
        for (offset, n, m), p, q in zip(payload.matrices, result.ps, result.qs):
            flat[offset:offset + n * m] -= (p @ q.T).reshape(-1) / result.size
        self._q[payload.key] = [q.clone() for q in result.qs]  # warm start

    def problem(self, dtypes, size):
        return float_problem(dtypes, repr(self))

    def state_dict(self):
        return {"q": {k: [q.clone() for q in qs] for k, qs in self._q.items()}}

    def load_state_dict(self, state):
        self._q = {k: [q.clone() for q in qs] for k, qs in state["q"].items()}

    def __repr__(self):
        return f"Compression.powersgd(rank={self.rank}, seed={self.seed})"


class PowerSGD(CompressionMethod):
    def predict(self, case):
        """The default fusion's buckets after backward as one bucket: an allreduce of the P
        factors and the vectors, then one of the Q factors, of rank ``case.rank``; the two
        products read each gradient r times (charged as r selection passes, an assumption)."""
        trace, r = case.trace, case.rank
        p_bytes = q_bytes = 0
        for layer in trace.layers:
            for shape in layer.shapes or ((layer.params,) if layer.params else ()):
                numel = math.prod(shape)
                n = shape[0] if len(shape) >= 2 else 0
                m = numel // n if n else 0
                if n and min(r, n, m) * (n + m) < n * m:
                    p_bytes += n * min(r, n, m)
                    q_bytes += m * min(r, n, m)
                else:
                    p_bytes += numel
        bpp = trace.bytes_per_param
        local = case.local(trace.params * r * case.compute.select_s_per_element)
        return trace.compute_s + local + ring_allreduce_s(case.workers, p_bytes * bpp, case.ab) \
            + ring_allreduce_s(case.workers, q_bytes * bpp, case.ab)


METHOD = PowerSGD("powersgd", "rank-r factors by power iteration, two allreduces, error feedback",
                  factory=PowerSGDCompressor)
