"""gTop-k (Shi et al., ICDCS 2019): top-k selection reduced by gTopKAllReduce, a log P tree that
keeps the k largest of the merged pairs at each level, so every rank ends with the same global
top-k. Pairs that do not reach the global top-k (at any tree level) stay in the residual."""
from __future__ import annotations

import numpy as np
import torch

from collectives.cost import gtopk_allreduce_s
from collectives.plans import ceil_log2

from .base import CompressionMethod
from .topk import SparsePairs, TopKCompressor, sparse_after_backward_s


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
        """gTopKAllReduce, then ceil(log2 P) merges of 2k pairs."""
        return sparse_after_backward_s(
            case, gtopk_allreduce_s, lambda p, k: ceil_log2(p) * 2 * k * case.compute.merge_s_per_pair)


METHOD = GTopK("gtopk", "global top-k by gTopKAllReduce (log P tree), error feedback",
               factory=GTopKCompressor)
