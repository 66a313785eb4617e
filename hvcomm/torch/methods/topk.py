"""Top-k sparsification summed by Top-k AllGather: each rank sends its k largest
|gradient + residual| as (index, value) pairs; every rank gathers all P*k pairs and sums them.
What was not sent stays in the residual (error feedback)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

import collectives as C
from collectives.cost import broadcast_s, reduce_s, topk_allgather_s
from collectives.errors import HvcommError
from collectives.plans import index_dtype

from .base import CompressionMethod
from .compressor import Compressor, check_density, check_scope, float_problem, zero_at
from .payload import Collective, Payload
from .selection import SampledTopk, exact_topk

DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)  # DGC's densities before the final one


class Pairs(NamedTuple):
    """What a sparse payload carries: sorted indices into the flat gradient, and their values."""

    indices: np.ndarray
    values: np.ndarray


class SparsePairs(Collective):
    """Each rank's k (index, value) pairs summed by the sparse collective of
    :mod:`collectives` named ``function`` (its result has the sum and what this rank sent)."""

    def __init__(self, label: str, function: str):
        self.label, self.function = label, function

    def run(self, comm, payload):
        pairs = payload.data
        res = getattr(C, self.function)(comm, pairs.indices, pairs.values, payload.numel,
                                        payload.k, check=False)
        return res, res.sent_bytes


class TopKCompressor(Compressor):
    """Each rank's k largest |gradient + residual|.

    ``warmup_steps`` > 0 follows DGC's density warm-up (25%, 6.25%, 1.5625%, 0.4%, then
    ``density``), each stage a quarter of the warm-up. ``selector``: "sampled" (fast,
    exact whenever its threshold passes k elements) or "exact".
    """

    collective = SparsePairs("allgather", "topk_allgather")
    error_feedback = True
    name = "topk"

    def __init__(self, density: float, selector: str = "sampled", warmup_steps: int = 0,
                 scope: str = "layer"):
        self.density = check_density(density)
        if selector not in ("sampled", "exact"):
            raise HvcommError(f"selector must be 'sampled' or 'exact', got {selector!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise HvcommError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.selector, self.warmup_steps, self.scope = selector, warmup_steps, check_scope(scope)
        self._select = SampledTopk() if selector == "sampled" else exact_topk

    def density_at(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.density
        stage = step * len(DGC_WARMUP) // self.warmup_steps
        return max(DGC_WARMUP[stage], self.density)

    def k_for(self, n: int, step: int) -> int:
        return min(n, max(1, int(self.density_at(step) * n)))

    def encode(self, tensor, step=0, key="", shapes=(), names=()):
        x = tensor.detach().reshape(-1).numpy()
        k = self.k_for(x.size, step)
        idx = np.sort(self._select(x, k)).astype(index_dtype(x.size))
        return Payload(Pairs(idx, np.ascontiguousarray(x[idx])), x.size, tensor.dtype, k=k)

    def decode(self, result, payload):
        dense = torch.zeros(payload.numel, dtype=payload.dtype)
        dense[torch.from_numpy(result.indices.astype(np.int64))] = torch.from_numpy(result.values)
        return dense

    def residual(self, acc, payload):
        return zero_at(acc, payload.data.indices)

    def problem(self, request):
        return float_problem(request.dtypes, repr(self))

    def __repr__(self):
        return (f"Compression.{self.name}(density={self.density}, selector={self.selector!r}, "
                f"warmup_steps={self.warmup_steps}, scope={self.scope!r})")


def pair_bytes(case) -> int:
    """One (index, value) pair: a 4-byte index and the gradient's value."""
    return 4 + case.trace.bytes_per_param


def sparse_after_backward_s(case, collective_s: float, merge_s: float) -> float:
    """One message of k pairs after backward: the computation, the selection over the d
    gradients (or the measured local cost), the collective's time ``collective_s`` and its
    local merging ``merge_s``."""
    d = case.trace.params
    return case.trace.compute_s + case.local(d * case.compute.select_s_per_element) \
        + collective_s + merge_s


class TopK(CompressionMethod):
    takes_density = True

    def predict(self, case):
        """Top-k AllGather, then summing the P*k gathered pairs. On N nodes of G > 1 GPUs, the
        form that sends least across the nodes:

        1. a dense reduce of the gradients inside each node to one of its GPUs (d values over
           the intra link, :func:`collectives.cost.reduce_s`);
        2. that GPU selects the top k of the node's sum, the N such GPUs run Top-k AllGather
           across the nodes ((N-1) k pairs received each) and sum the N k pairs;
        3. it broadcasts the sum inside the node: the N k pairs, or the dense gradient where
           that is smaller.

        Why: flat over the N G workers, each worker receives (NG-1) k pairs and the G workers
        of a node share its one port, G (NG-1) k pairs through it, against (N-1) k here; the
        dense reduce costs 2(G-1)/G of the gradient's bytes on a link 10-100x faster than the
        network (NVLink, PCIe), and a sparse exchange inside the node would need the same
        selection on every GPU and a merge on top. The selection becomes the node's (its
        error feedback kept by the GPU that selects). hvcomm's runtime does not run this form:
        its Top-k AllGather is one flat collective over every rank. G = 1: the flat form."""
        c, k, pair = case.cluster, case.k, pair_bytes(case)
        dense_bytes = case.trace.params * case.trace.bytes_per_param
        wire_s = reduce_s(c.gpus_per_node, dense_bytes, c.intra_ab) \
            + topk_allgather_s(c.nodes, k, pair, c.inter_ab) \
            + broadcast_s(c.gpus_per_node, min(c.nodes * k * pair, dense_bytes), c.intra_ab)
        return sparse_after_backward_s(case, wire_s, c.nodes * k * case.compute.sum_s_per_pair)


METHOD = TopK("topk", "top-k pairs summed by Top-k AllGather, error feedback",
              factory=TopKCompressor)
