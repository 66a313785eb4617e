"""The local compute of the sparse collectives, in linear time, and the ring's 16-bit
conversions and additions (at the end), compiled by numba.

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


# -- 16-bit floating point, as raw bits ----------------------------------------------------------
# NumPy has no bfloat16 and adds float16 one element at a time (about 7 ns each here, slower than
# a 10 Gbit/s link delivers them); numba has no float16. These kernels work on the raw 16 bits
# (uint16 arrays) and widen to / round from float32 bit patterns (uint32 arrays), rounding to
# nearest even as IEEE 754 does; ``brain`` picks bfloat16 (True) or IEEE float16 (False).
@jit
def _widen(h, brain):
    """float32 bits of the 16-bit value ``h`` (exact)."""
    h = np.uint32(h)
    if brain:
        return h << np.uint32(16)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0x1F:                       # inf, nan
        return sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    if exp == 0:
        if man == 0:
            return sign
        e = np.uint32(113)                # subnormal: normalise
        while (man & np.uint32(0x400)) == 0:
            man <<= np.uint32(1)
            e -= np.uint32(1)
        return sign | (e << np.uint32(23)) | ((man & np.uint32(0x3FF)) << np.uint32(13))
    return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))


@jit
def _narrow(x, brain):
    """The 16 bits of float32 bits ``x`` rounded to nearest even (NaN stays NaN)."""
    x = np.uint32(x)
    absx = x & np.uint32(0x7FFFFFFF)
    if brain:
        if absx > np.uint32(0x7F800000):
            return np.uint16((x >> np.uint32(16)) | np.uint32(0x40))
        return np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1)))
                         >> np.uint32(16))
    sign = (x >> np.uint32(16)) & np.uint32(0x8000)
    if absx >= np.uint32(0x7F800000):     # inf, nan
        nan = np.uint32(0x200) if absx > np.uint32(0x7F800000) else np.uint32(0)
        return np.uint16(sign | np.uint32(0x7C00) | nan)
    if absx >= np.uint32(0x477FF000):     # 65520 and up round to inf
        return np.uint16(sign | np.uint32(0x7C00))
    if absx < np.uint32(0x38800000):      # below 2**-14: subnormal or zero
        if absx < np.uint32(0x33000000):  # below 2**-25: zero
            return np.uint16(sign)
        e = absx >> np.uint32(23)
        m = (absx & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - e
        r = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (r & np.uint32(1))):
            r += np.uint32(1)
        return np.uint16(sign | r)
    return np.uint16(sign | ((absx - np.uint32(0x38000000) + np.uint32(0xFFF)
                              + ((absx >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)))


@jit
def widen16(src, out, brain):
    """``out`` (uint32, float32 bits) = the 16-bit values ``src`` (uint16)."""
    for i in range(src.size):
        out[i] = _widen(src[i], brain)


@jit
def narrow16(src, out, brain):
    """``out`` (uint16) = float32 bits ``src`` (uint32) rounded to 16 bits."""
    for i in range(src.size):
        out[i] = _narrow(src[i], brain)


@jit
def add16(dst, src, wide_a, wide_b, brain):
    """``dst += src`` on 16-bit values (uint16 bits): each sum formed in float32 and rounded
    to 16 bits once. ``wide_a`` and ``wide_b``: uint32 scratch of at least ``dst.size``."""
    n = dst.size
    a, b = wide_a[:n], wide_b[:n]
    for i in range(n):
        a[i] = _widen(dst[i], brain)
        b[i] = _widen(src[i], brain)
    fa, fb = a.view(np.float32), b.view(np.float32)
    for i in range(n):
        fa[i] += fb[i]
    for i in range(n):
        dst[i] = _narrow(a[i], brain)
