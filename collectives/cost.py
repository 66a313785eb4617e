"""Alpha-beta cost model of each collective, and its calibration on a live communicator."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .plans import ceil_log2

if TYPE_CHECKING:  # the formulas need no MPI library; the measurements import it when called
    from mpi4py import MPI


@dataclass(frozen=True)
class AlphaBeta:
    """Per-message latency ``alpha_s`` (s) and transfer time ``beta_s_per_byte`` (s/byte)."""

    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def from_link(cls, latency_s: float, bandwidth_bit_s: float) -> "AlphaBeta":
        return cls(latency_s, 8.0 / bandwidth_bit_s)


def ring_allreduce_s(p: int, nbytes: float, ab: AlphaBeta) -> float:
    """Ring allreduce: 2(P-1) alpha + 2(P-1)/P * bytes * beta."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * ab.alpha_s + 2 * (p - 1) / p * nbytes * ab.beta_s_per_byte


def reduce_s(p: int, nbytes: float, ab: AlphaBeta) -> float:
    """Reduce to one rank: a ring reduce-scatter, then the root gathers the other P-1 blocks.
    Each half takes (P-1) alpha + (P-1)/P * bytes * beta, so a reduce costs what a ring
    allreduce costs (whose second half is an allgather instead of the gather)."""
    return ring_allreduce_s(p, nbytes, ab)


def broadcast_s(p: int, nbytes: float, ab: AlphaBeta) -> float:
    """Broadcast from one rank: the root scatters P blocks, then a ring allgather; the mirror
    of :func:`reduce_s`, at its cost."""
    return reduce_s(p, nbytes, ab)


def hierarchical_allreduce_s(nodes: int, gpus_per_node: int, nbytes: float, intra: AlphaBeta,
                             inter: AlphaBeta) -> float:
    """Allreduce of ``nbytes`` over N ``nodes`` of G ``gpus_per_node`` GPUs, the GPUs of a
    node joined by the ``intra`` link, the nodes by the ``inter`` network (one port each):
    reduce inside each node to one of its GPUs, ring allreduce among those N GPUs, broadcast
    inside each node (M = nbytes; a = alpha, b = beta):

        T = reduce_s(G) + ring_allreduce_s(N) + broadcast_s(G)
          = 4(G-1) a_intra + 4(G-1)/G M b_intra + 2(N-1) a_inter + 2(N-1)/N M b_inter

    G = 1 is the flat ring over N. N = 1 has nothing to cross: the G GPUs run one ring
    allreduce over the intra link, 2(G-1) a_intra + 2(G-1)/G M b_intra, as NCCL does inside a
    node. (Horovod's NCCL hierarchical allreduce does a reduce-scatter and an allgather inside
    the node instead of the reduce and the broadcast, each GPU allreducing its 1/G across the
    nodes: the same inter term through the node's one port, half the intra term.)"""
    if nodes == 1:
        return ring_allreduce_s(gpus_per_node, nbytes, intra)
    return reduce_s(gpus_per_node, nbytes, intra) + ring_allreduce_s(nodes, nbytes, inter) \
        + broadcast_s(gpus_per_node, nbytes, intra)


def topk_allgather_s(p: int, k: int, pair_bytes: int, ab: AlphaBeta) -> float:
    """Top-k AllGather: counts then pairs, ceil(log2 P) steps each, (P-1) k pairs received."""
    if p <= 1:
        return 0.0
    return 2 * ceil_log2(p) * ab.alpha_s + (p - 1) * k * pair_bytes * ab.beta_s_per_byte


def gtopk_allreduce_s(p: int, k: int, pair_bytes: int, ab: AlphaBeta) -> float:
    """gTopKAllReduce: ceil(log2 P) rounds up and down, k pairs (+ k mask bytes down) each."""
    if p <= 1:
        return 0.0
    rounds = ceil_log2(p)
    return 2 * rounds * ab.alpha_s + rounds * k * (2 * pair_bytes + 1) * ab.beta_s_per_byte


@dataclass(frozen=True)
class Calibration:
    """Fit of the measured allreduce time T(M) = a_s + b_s_per_byte * M, and the alpha-beta
    parameters of the ring model that it implies, for a communicator of ``size`` ranks."""

    size: int
    a_s: float
    b_s_per_byte: float
    alpha_beta: AlphaBeta

    def allreduce_s(self, nbytes: float) -> float:
        return self.a_s + self.b_s_per_byte * nbytes


def slowest_times(comm: MPI.Comm, fn, repeats: int) -> np.ndarray:
    """The slowest rank's time of ``fn()`` in each of ``repeats`` calls, each started after
    a barrier (one untimed call first)."""
    from mpi4py import MPI
    fn()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    slowest = np.empty(repeats)
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return slowest


def time_collective(comm: MPI.Comm, fn, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``fn()`` (after one warm-up)."""
    return float(np.median(slowest_times(comm, fn, repeats)))


def calibrate(comm: MPI.Comm, sizes_bytes: Sequence[int] = (4 << 10, 64 << 10, 1 << 20, 4 << 20),
              repeats: int = 5) -> Calibration:
    """Measure Allreduce at a few sizes on ``comm`` and fit a, b (and alpha, beta).

    Collective: every rank must call it. Takes well under a second on shared memory.
    """
    p = comm.Get_size()
    if p == 1:
        return Calibration(1, 0.0, 0.0, AlphaBeta(0.0, 0.0))
    ts = []
    for nbytes in sizes_bytes:
        buf = np.ones(max(nbytes // 4, 1), np.float32)
        out = np.empty_like(buf)
        ts.append(time_collective(comm, lambda: comm.Allreduce(buf, out), repeats))
    b, a = np.polyfit(np.asarray(sizes_bytes, float), np.asarray(ts), 1)
    a, b = max(float(a), 0.0), max(float(b), 0.0)
    ab = AlphaBeta(a / (2 * (p - 1)), b * p / (2 * (p - 1)))
    return Calibration(p, a, b, ab)
