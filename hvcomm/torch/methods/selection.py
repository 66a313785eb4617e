"""Top-k selection of |x| for sparsification: exact, and a fast sampled-threshold selector.
Both keep hvcomm's one tie rule (that of :func:`collectives.select_topk` and of the gTop-k
tree): of equal magnitudes, the lower index."""
from __future__ import annotations

from typing import Optional

import numpy as np

import collectives as C


def exact_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest |x| by a full partition; ties: the lower index."""
    if k >= x.size:
        return np.arange(x.size)
    return C.select_topk(x, k)


class SampledTopk:
    """Top-k by a threshold estimated from a random sample, then exact among the candidates.

    A sample of |x| gives a threshold expected to pass ``margin * k`` elements; the
    candidates (one vectorised pass over x) are cut to the exact top-k. Whenever at least k
    elements pass, this is exactly the top-k of x (everything left out is below the
    threshold), so recall is 1.0; when fewer pass, the threshold is lowered and, after
    ``retries``, it falls back to the exact selector. ``last_candidates`` and
    ``fallbacks`` record what happened, for reports.
    """

    def __init__(self, sample: int = 20_000, margin: float = 1.25, retries: int = 2, seed: int = 0):
        self.sample, self.margin, self.retries = sample, margin, retries
        self.rng = np.random.default_rng(seed)
        self._scratch: Optional[np.ndarray] = None
        self.last_candidates = 0
        self.fallbacks = 0

    def __call__(self, x: np.ndarray, k: int) -> np.ndarray:
        n = x.size
        if k >= n or n <= 4 * self.sample:
            return exact_topk(x, k)
        if self._scratch is None or self._scratch.size < n or self._scratch.dtype != x.dtype:
            self._scratch = np.empty(n, x.dtype)
        mag = np.abs(x, out=self._scratch[:n])
        s = np.abs(x[self.rng.integers(0, n, self.sample)])
        want = self.margin * k
        for _ in range(self.retries + 1):
            pos = int(np.clip(self.sample - want / n * self.sample, 0, self.sample - 1))
            thr = np.partition(s, pos)[pos]
            cand = np.flatnonzero(mag >= thr)
            self.last_candidates = cand.size
            if cand.size >= k:  # every tie at the k-th magnitude is a candidate, cand ascends
                return cand[C.select_topk(x[cand], k)]
            want *= 4
        self.fallbacks += 1
        return exact_topk(x, k)


def recall(selected: np.ndarray, x: np.ndarray, k: int) -> float:
    """Fraction of the true top-k magnitude ranks that ``selected`` holds (ties count as hits)."""
    kth = np.partition(np.abs(x), x.size - k)[x.size - k]
    return float(np.count_nonzero(np.abs(x[selected]) >= kth)) / k
