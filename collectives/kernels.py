"""The local compute of the sparse collectives, in linear time, compiled by numba.

Every input run here is sorted by index with unique indices, which is what makes each step a
single pass: merging two runs, summing common indices and recording where each output came
from (which maps a survival mask back to the inputs), and summing P runs in rank order (a
heap over the runs' heads). Keeping the k largest |values| in index order needs no kernel:
NumPy's introselect finds the threshold in linear time (faster than numba's own
np.partition), and a mask keeps the order. NumPy has no linear merge of sorted runs, and its
sort-based equivalents cost 5-20x more; numba compiles these loops to machine code with no
build step (wheels for every platform), and ``cache=True`` keeps the compiled code beside
this file, so only the first process to use it pays the compilation.
"""
from __future__ import annotations

import numba
import numpy as np

jit = numba.njit(cache=True, nogil=True)


@jit
def merge_sum(idx_a, val_a, idx_b, val_b, out_idx, out_val, origin):
    """Merge two sorted runs into out_*, adding values at common indices (a's + b's), and
    record each output's origin: 1 from a, 2 from b, 3 from both. Returns the number of
    unique indices written. With the origins, a mask over the output maps back to a mask
    over either input (:func:`split_by_origin`)."""
    i = j = n = 0
    na, nb = idx_a.size, idx_b.size
    while i < na and j < nb:
        ia, ib = idx_a[i], idx_b[j]
        if ia < ib:
            out_idx[n] = ia
            out_val[n] = val_a[i]
            origin[n] = 1
            i += 1
        elif ib < ia:
            out_idx[n] = ib
            out_val[n] = val_b[j]
            origin[n] = 2
            j += 1
        else:
            out_idx[n] = ia
            out_val[n] = val_a[i] + val_b[j]
            origin[n] = 3
            i += 1
            j += 1
        n += 1
    while i < na:
        out_idx[n] = idx_a[i]
        out_val[n] = val_a[i]
        origin[n] = 1
        i += 1
        n += 1
    while j < nb:
        out_idx[n] = idx_b[j]
        out_val[n] = val_b[j]
        origin[n] = 2
        j += 1
        n += 1
    return n


@jit
def split_by_origin(origin, flags, out_a, out_b):
    """Split ``flags`` (one per merged output) into a's and b's, by the origins merge_sum
    recorded: out_a gets the flags of outputs a contributed to, out_b those of b, in order.
    Branch-free, so each output needs one spare slot at its end. Returns the counts."""
    i = j = 0
    for t in range(origin.size):
        o = origin[t]
        f = flags[t]
        out_a[i] = f
        out_b[j] = f
        i += o & 1
        j += o >> 1
    return i, j


@jit
def sum_runs(idx, val, starts, out_idx, out_val):
    """Sum P sorted runs (run r is idx[starts[r]:starts[r+1]]), adding values of a common
    index in run order, as a serial loop over the ranks would. A binary heap over the runs'
    heads: O(n log P). Returns the number of unique indices written to out_*."""
    p = starts.size - 1
    heap_key = np.empty(p, idx.dtype)
    heap_run = np.empty(p, np.int64)
    pos = starts[:-1].copy()
    size = 0
    for r in range(p):  # push every non-empty run's head
        if pos[r] < starts[r + 1]:
            c = size
            size += 1
            while c > 0:
                parent = (c - 1) // 2
                if (heap_key[parent] < idx[pos[r]]
                        or (heap_key[parent] == idx[pos[r]] and heap_run[parent] < r)):
                    break
                heap_key[c] = heap_key[parent]
                heap_run[c] = heap_run[parent]
                c = parent
            heap_key[c] = idx[pos[r]]
            heap_run[c] = r
    n = 0
    while size > 0:
        key, r = heap_key[0], heap_run[0]
        if n > 0 and out_idx[n - 1] == key:
            out_val[n - 1] += val[pos[r]]
        else:
            out_idx[n] = key
            out_val[n] = val[pos[r]]
            n += 1
        pos[r] += 1
        if pos[r] < starts[r + 1]:  # replace the top by this run's next head
            new_key, new_run = idx[pos[r]], r
        else:                       # or by the last element
            size -= 1
            if size == 0:
                break
            new_key, new_run = heap_key[size], heap_run[size]
        c = 0
        while True:  # sift down
            child = 2 * c + 1
            if child >= size:
                break
            if child + 1 < size and (heap_key[child + 1] < heap_key[child]
                                     or (heap_key[child + 1] == heap_key[child]
                                         and heap_run[child + 1] < heap_run[child])):
                child += 1
            if (new_key < heap_key[child]
                    or (new_key == heap_key[child] and new_run < heap_run[child])):
                break
            heap_key[c] = heap_key[child]
            heap_run[c] = heap_run[child]
            c = child
        heap_key[c] = new_key
        heap_run[c] = new_run
    return n


@jit
def sorted_unique_in_range(idx, d):
    """0 if idx is strictly increasing within [0, d); 1 if it is out of order (or has a
    repeat); 2 if an index lies outside [0, d)."""
    if idx.size and (idx[0] < 0 or idx[idx.size - 1] >= d):
        return 2
    for t in range(1, idx.size):
        if idx[t] <= idx[t - 1]:
            return 1
    return 0


@jit
def all_finite(val):
    for t in range(val.size):
        if not np.isfinite(val[t]):
            return False
    return True
