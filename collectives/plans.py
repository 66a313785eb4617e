"""The collectives' pure helpers, with no MPI import (the simulator, the planner and the
compressors use them without an MPI library): which arrays travel together
(:class:`BucketPlan`), the index dtype of a length-d vector, and the depth of the log2 P tree.
:mod:`collectives.merged` re-exports :class:`BucketPlan`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import HvcommError


def index_dtype(d: int) -> np.dtype:
    """int32 where every index of a length-d vector fits, else int64."""
    return np.dtype(np.int32) if d <= 2**31 else np.dtype(np.int64)


def ceil_log2(p: int) -> int:
    return max(p - 1, 0).bit_length()


@dataclass(frozen=True)
class BucketPlan:
    """Which arrays travel together, in launch order. Pure data: computed once, reused.

    ``buckets[b]`` lists the positions (into the caller's list of arrays) packed, in that
    order, into bucket b. Every position appears exactly once.
    """

    buckets: Tuple[Tuple[int, ...], ...]

    def __post_init__(self):
        flat = [i for b in self.buckets for i in b]
        if any(len(b) == 0 for b in self.buckets):
            raise HvcommError("BucketPlan: empty bucket")
        if sorted(flat) != list(range(len(flat))):
            raise HvcommError(f"BucketPlan: every array must appear exactly once, got {flat}")

    @property
    def num_arrays(self) -> int:
        return sum(len(b) for b in self.buckets)

    @classmethod
    def by_threshold(cls, sizes_bytes: Sequence[int], threshold_bytes: int,
                     order: Optional[Iterable[int]] = None,
                     keys: Optional[Sequence[object]] = None) -> "BucketPlan":
        """Fill buckets in ``order`` (default: as given) until one reaches threshold_bytes.

        Arrays whose ``keys`` differ (e.g. dtypes) never share a bucket.
        threshold_bytes = 0 gives one array per bucket (WFBP); a huge threshold gives one
        bucket (Horovod fusion and PyTorch DDP's 25 MB buckets lie in between).
        """
        if threshold_bytes < 0:
            raise HvcommError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
        order = list(range(len(sizes_bytes))) if order is None else list(order)
        buckets: List[Tuple[int, ...]] = []
        cur: List[int] = []
        cur_bytes = 0
        for i in order:
            if cur and (cur_bytes + sizes_bytes[i] > threshold_bytes
                        or (keys is not None and keys[i] != keys[cur[-1]])):
                buckets.append(tuple(cur))
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += sizes_bytes[i]
        if cur:
            buckets.append(tuple(cur))
        return cls(tuple(buckets))
