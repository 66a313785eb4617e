"""ElasticSampler: Horovod's sampler that repartitions what is left of an epoch after a reset."""
from __future__ import annotations

import math
import random
from typing import Dict, Iterator, List

import torch.utils.data

from ..runtime import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, but it counts the samples the job has processed this
    epoch, so that after a reset (ranks lost) the survivors share only what is left.

    Horovod 0.28.1's semantics: the epoch's order is a shuffle of the whole dataset seeded by
    ``seed + epoch`` (the same on every rank); rank r takes every size-th sample of what is
    left from position r; ``record_batch(batch_idx, batch_size)`` counts ``batch_size``
    samples on each of the ``size`` ranks (call it once per batch on every rank); ``set_epoch``
    (call it at the end of an epoch) starts the next epoch from its first sample. Padding
    repeats the first samples (cyclically) so that every rank gets ``len(self)`` of them.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One batch of ``batch_size`` samples is done on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Take the current size and rank (after init() or a reset) and what is left."""
        self.num_replicas, self.rank = size(), rank()
        order: List[int] = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        left = self.remaining_indices
        padded = (left * -(-self.total_size // max(len(left), 1)))[:self.total_size]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
