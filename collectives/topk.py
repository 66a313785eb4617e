"""Top-k selection, hvcomm's one tie rule (ties in |x| go to the lower index), and the
gTop-k tree's step: merge two sorted runs of (index, value) pairs and keep the k largest
|sums|."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import kernels
from .plans import index_dtype
from .workspace import Workspace


def _largest(val: np.ndarray, k: int, ws: Optional[Workspace] = None) -> np.ndarray:
    """Positions (ascending) of the k largest |val| (k < val.size); ties at the threshold
    go to the lower position. Linear time: introselect for the threshold, then a mask
    (vectorised, and faster than a compiled loop here) turned into positions. ``ws``
    lends scratch buffers."""
    n, ws = val.size, ws or Workspace()
    mag = np.abs(val, out=ws.get("mag", n, val.dtype))
    part = ws.get("part", n, val.dtype)
    np.copyto(part, mag)
    part.partition(n - k)  # in place: part[n - k] is the k-th largest
    cut = part[n - k]
    keep = np.greater(mag, cut, out=ws.get("keep", n, np.bool_))
    short = k - np.count_nonzero(keep)
    if short:
        keep[np.flatnonzero(mag == cut)[:short]] = True
    return np.flatnonzero(keep)


def select_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest |x|; ties go to the lower index."""
    if not 0 < k <= x.size:
        raise ValueError(f"k must be in [1, {x.size}], got {k}")
    if k == x.size:
        return np.arange(x.size, dtype=index_dtype(x.size))
    return _largest(x, k).astype(index_dtype(x.size))


def merge_select(idx_a: np.ndarray, val_a: np.ndarray, idx_b: np.ndarray, val_b: np.ndarray,
                 k: int) -> Tuple[np.ndarray, np.ndarray]:
    """One tree step: sum values at common indices, keep the k largest |sum|.

    Each input is sorted by index with unique indices. Ties in |sum| go to the lower index,
    so the result depends only on the inputs. Output is sorted by index. Linear time.
    """
    step = merge_step(idx_a, val_a, idx_b, val_b, k)
    return step.indices, step.values


@dataclass
class MergeStep:
    """A tree step's result and what maps it back to its inputs: the origin (1 a, 2 b,
    3 both) of every merged pair, the sizes of a and b, and ``keep``, the positions of the
    merged pairs selected (None: all)."""
    indices: np.ndarray
    values: np.ndarray
    origin: np.ndarray
    sizes: Tuple[int, int]
    keep: Optional[np.ndarray]

    def inputs_reached(self, reached: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Given which of this step's output pairs reached the result, which of input a's
        and of input b's pairs did."""
        if self.keep is None:
            merged = reached
        else:
            merged = np.zeros(self.origin.size, bool)
            merged[self.keep] = reached
        out_a, out_b = np.empty(self.sizes[0] + 1, bool), np.empty(self.sizes[1] + 1, bool)
        kernels.split_by_origin(self.origin, merged, out_a, out_b)
        return out_a[:-1], out_b[:-1]


def merge_step(idx_a, val_a, idx_b, val_b, k, ws: Optional[Workspace] = None,
                level: int = 0) -> MergeStep:
    """Merge two runs, sum common indices and keep the k largest |sums|; the merged pairs
    live in ``ws`` (per tree level), the k kept pairs in new arrays."""
    ws = ws or Workspace()
    if idx_a.dtype != idx_b.dtype:
        idx_a, idx_b = idx_a.astype(np.int64), idx_b.astype(np.int64)
    vdt = np.result_type(val_a, val_b)
    n_in = idx_a.size + idx_b.size
    idx, val = ws.get(("idx", level), n_in, idx_a.dtype), ws.get(("val", level), n_in, vdt)
    origin = ws.get(("origin", level), n_in, np.uint8)
    n = kernels.merge_sum(idx_a, val_a.astype(vdt, copy=False), idx_b,
                          val_b.astype(vdt, copy=False), idx, val, origin)
    idx, val, origin = idx[:n], val[:n], origin[:n]
    sizes = (idx_a.size, idx_b.size)
    if n <= k:
        return MergeStep(idx.copy(), val.copy(), origin, sizes, None)
    keep = _largest(val, k, ws)
    return MergeStep(idx[keep], val[keep], origin, sizes, keep)
