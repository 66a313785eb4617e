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
seed * 1_000_003 + crc32(name))`` in float64 (name: the parameter's), the same on every rank,
and is drawn so again wherever a column of the summed Q is zero (a zero gradient would
otherwise leave Q at zero for good). Q is kept per parameter (regrouping keeps it) and is in
the optimizer's checkpoint. A matrix whose rank-r factors are no smaller than itself
(r * (n + m) >= n * m) is sent dense.

The residual is settled after the collective (what the approximation did not carry), as
gTop-k's: until then the whole gradient counts as sent, so with ``delay=``, where the next
step is encoded before this one is collected, nothing is sent twice.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from collectives.errors import HvcommError

from ..sums import sum_in_place
from .base import CompressionMethod
from .compressor import Compressor, float_problem
from .payload import Collective, Payload, ring_bytes
from .buckets import ONE_BUCKET_BYTES


def low_rank(shape: Sequence[int], rank: int) -> Optional[Tuple[int, int, int]]:
    """(n, m, r) where a tensor of ``shape`` travels as rank-r factors of its n x m matrix,
    or None where it travels dense (a vector, or factors no smaller than the matrix)."""
    if len(shape) < 2 or not math.prod(shape):
        return None
    n = shape[0]
    m = math.prod(shape) // n
    r = min(rank, n, m)
    return (n, m, r) if r * (n + m) < n * m else None


@dataclass
class Matrix:
    """One low-rank part of a bucket: its parameter's ``name``, where it lies in the flat
    gradient (``offset``, ``n`` x ``m``), this rank's M (a view of the bucket's gradient,
    which nothing writes after encoding) and the Q it starts from."""

    name: str
    offset: int
    n: int
    m: int
    M: torch.Tensor
    Q: torch.Tensor


@dataclass
class LowRankPayload(Payload):
    """A bucket for PowerSGD: its ``matrices``, and the parts sent as they are (``dense``:
    (offset, numel) each; their values concatenated in ``data``)."""

    matrices: List[Matrix] = field(default_factory=list)
    dense: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """What travels: the P and Q factors and the dense parts."""
        return sum((x.n + x.m) * x.Q.shape[1] * x.Q.element_size() for x in self.matrices) \
            + self.data.numel() * self.data.element_size()


@dataclass
class LowRankSum:
    """The collective's result: each matrix's orthonormal P and summed Q, the dense parts'
    sum, and the number of ranks."""

    ps: List[torch.Tensor]
    qs: List[torch.Tensor]
    dense: torch.Tensor
    size: int
    _flat: Optional[torch.Tensor] = None

    def flat(self, payload: LowRankPayload) -> torch.Tensor:
        """The sum's approximation as a flat gradient: each matrix's P Q^T in its place, the
        dense parts' sum in theirs. Formed once, for the residual (:meth:`settle
        <PowerSGDCompressor.settle>` reads it first) and as the decoded sum."""
        if self._flat is None:
            out = torch.empty(payload.numel, dtype=payload.dtype)  # every element written
            for x, p, q in zip(payload.matrices, self.ps, self.qs):
                torch.matmul(p, q.T, out=out[x.offset:x.offset + x.n * x.m].view(x.n, x.m))
            at = 0
            for offset, numel in payload.dense:
                out[offset:offset + numel] = self.dense[at:at + numel]
                at += numel
            self._flat = out
        return self._flat


class PowerIteration(Collective):
    """Steps 1-3 of the module's docstring, on the engine thread."""

    label = "powersgd"

    def run(self, comm, payload):
        mats = payload.matrices
        first = torch.cat([(x.M @ x.Q).reshape(-1) for x in mats] + [payload.data])
        sum_in_place(comm, first)
        sent = ring_bytes(comm, first.nbytes)
        ps, at = [], 0
        for x in mats:
            r = x.Q.shape[1]
            ps.append(torch.linalg.qr(first[at:at + x.n * r].view(x.n, r), mode="reduced")[0])
            at += x.n * r
        dense = first[at:]
        second = torch.cat([(x.M.T @ p).reshape(-1) for x, p in zip(mats, ps)]
                           or [first.new_zeros(0)])
        if second.numel():
            sum_in_place(comm, second)
            sent += ring_bytes(comm, second.nbytes)
        qs, at = [], 0
        for x in mats:
            size = x.m * x.Q.shape[1]
            qs.append(second[at:at + size].view(x.m, x.Q.shape[1]))
            at += size
        return LowRankSum(ps, qs, dense, comm.Get_size()), sent


class PowerSGDCompressor(Compressor):
    """``rank``: r, the approximation's rank; ``seed``: Q's first draw (0 <= seed < 2**31).
    Keeps Q between steps: each optimizer works on its own copy (:meth:`for_optimizer`)."""

    collective = PowerIteration()
    error_feedback = True

    def __init__(self, rank: int = 4, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise HvcommError(f"rank must be a positive integer, got {rank!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 31:
            raise HvcommError(f"seed must be an integer in [0, 2**31), got {seed!r}")
        self.rank, self.seed = rank, seed
        self._q: Dict[str, torch.Tensor] = {}  # parameter name -> its last summed Q

    def for_optimizer(self) -> "PowerSGDCompressor":
        return PowerSGDCompressor(self.rank, self.seed)

    def _first_q(self, name: str, m: int, r: int, dtype) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn((m, r), generator=gen, dtype=torch.float64).to(dtype)

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        flat = tensor.detach().reshape(-1)
        shapes = shapes or [(flat.numel(),)]
        names = names or [f"{key}#{j}" for j in range(len(shapes))]
        matrices, dense, values, offset = [], [], [], 0
        for name, shape in zip(names, shapes):
            numel, factors = math.prod(shape), low_rank(shape, self.rank)
            part = flat[offset:offset + numel]
            if factors is None:
                dense.append((offset, numel))
                values.append(part)
            else:
                n, m, r = factors
                q = self._q.get(name)
                if q is None or q.shape != (m, r) or q.dtype != flat.dtype:
                    q = self._q[name] = self._first_q(name, m, r, flat.dtype)
                matrices.append(Matrix(name, offset, n, m, part.view(n, m), q))
            offset += numel
        values = torch.cat(values) if values else flat.new_zeros(0)
        return LowRankPayload(values, flat.numel(), flat.dtype, matrices=matrices, dense=dense)

    def decode(self, result, payload):
        return result.flat(payload)

    def residual(self, acc, payload):
        """Nothing until :meth:`settle`: the dense parts travel exactly, and what the
        matrices' approximation leaves is known only after the collective. A new buffer:
        ``acc`` holds the matrices the collective reads."""
        return torch.zeros_like(acc)

    def settle(self, residual, payload, result):
        flat, approx = residual.view(-1), result.flat(payload)
        for x, q in zip(payload.matrices, result.qs):
            part = slice(x.offset, x.offset + x.n * x.m)
            flat[part].add_(x.M.reshape(-1)).sub_(approx[part], alpha=1 / result.size)
            zero = bool((q.norm(dim=0) == 0).any())  # the same on every rank: q is a sum
            self._q[x.name] = self._first_q(x.name, x.m, q.shape[1], q.dtype) if zero \
                else q.clone()

    def problem(self, request):
        return float_problem(request.dtypes, repr(self))

    def state_dict(self):
        return {"rank": self.rank, "q": {k: q.clone() for k, q in self._q.items()}}

    def load_state_dict(self, state):
        if state.get("rank") != self.rank:
            raise HvcommError(f"the checkpoint's PowerSGD Q factors are of rank "
                              f"{state.get('rank')}, this optimizer's of rank {self.rank}: "
                              "load it with the same Compression.powersgd(rank=...)")
        self._q = {k: q.clone() for k, q in state["q"].items()}

    def __repr__(self):
        return f"Compression.powersgd(rank={self.rank}, seed={self.seed})"


class PowerSGD(CompressionMethod):
    def predict(self, case):
        """One bucket after backward (as :meth:`optimizer_options` runs it): an allreduce of
        the P factors and the dense parts, then one of the Q factors, of the settings' rank r;
        the two products read each gradient r times (charged as r selection passes, an
        assumption)."""
        trace, r = case.trace, case.settings.rank
        p_elems = q_elems = 0
        for layer in trace.layers:
            for shape in layer.tensors():
                factors = low_rank(shape, r)
                p_elems += factors[0] * factors[2] if factors else math.prod(shape)
                q_elems += factors[1] * factors[2] if factors else 0
        bpp = trace.bytes_per_param
        local = case.local(trace.params * r * case.compute.select_s_per_element)
        return trace.compute_s + local + case.allreduce_s(p_elems * bpp) \
            + case.allreduce_s(q_elems * bpp)

    def optimizer_options(self, settings, model=None):
        """The settings' rank, every gradient in one bucket after backward, as
        :meth:`predict` models."""
        return {"compression": self.factory(rank=settings.rank),
                "fusion_threshold_bytes": ONE_BUCKET_BYTES}


METHOD = PowerSGD("powersgd", "rank-r factors by power iteration, two allreduces, error feedback",
                  factory=PowerSGDCompressor)
