"""gTop-k (Shi et al., ICDCS 2019): top-k selection reduced by gTopKAllReduce, a log P tree that
keeps the k largest of the merged pairs at each level, so every rank ends with the same global
top-k. Pairs that do not reach the global top-k (at any tree level) stay in the residual."""
from __future__ import annotations

import numpy as np
import torch

from collectives.cost import gtopk_allreduce_s
from collectives.plans import ceil_log2

from .base import CompressionMethod
from .topk import SparsePairs, TopKCompressor, pair_bytes, sparse_after_backward_s


class GTopKCompressor(TopKCompressor):
    """Top-k selection (as :class:`TopKCompressor`) reduced by gTopKAllReduce."""

    collective = SparsePairs("gtopk", "gtopk_allreduce")
    name = "gtopk"

    def settle(self, residual, payload, result):
        lost = ~result.reached
        pairs = payload.data
        residual.view(-1)[torch.from_numpy(pairs.indices[lost].astype(np.int64))] += \
            torch.from_numpy(pairs.values[lost])


class GTopK(CompressionMethod):
    takes_density = True

    def predict(self, case):
        """gTopKAllReduce, then ceil(log2 P) merges of 2k pairs. On N nodes of G > 1 GPUs the
        tree is already hierarchical, and this is the form hvcomm's collective takes there:
        with ranks numbered node by node (mpirun's default placement, by slot), round r pairs
        ranks 2^r apart, so the first ceil(log2 G) rounds stay inside a node (over the intra
        link) and the last ceil(log2 N) cross the nodes, one GPU of a node sending at a time.
        Exact where G is a power of two; otherwise ceil(log2 G) + ceil(log2 N) rounds, at
        most one more than the tree has. A dense reduce inside the node first (Top-k's form)
        would put d values on the intra link where the tree puts k pairs. G = 1: the flat
        form."""
        c, k, pair = case.cluster, case.k, pair_bytes(case)
        wire_s = gtopk_allreduce_s(c.gpus_per_node, k, pair, c.intra_ab) \
            + gtopk_allreduce_s(c.nodes, k, pair, c.inter_ab)
        rounds = ceil_log2(c.gpus_per_node) + ceil_log2(c.nodes)
        return sparse_after_backward_s(case, wire_s, rounds * 2 * k * case.compute.merge_s_per_pair)


METHOD = GTopK("gtopk", "global top-k by gTopKAllReduce (log P tree), error feedback",
               factory=GTopKCompressor)
