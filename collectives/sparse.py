"""Sparse gradient collectives: gTopKAllReduce (log P tree) and the Top-k AllGather baseline."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
from mpi4py import MPI

from .errors import check_agree
from .handle import Pending

VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
DEFAULT_TAG = 7301
_HEADER = np.dtype(np.int64).itemsize


@dataclass(frozen=True)
class SparseResult:
    """The global sparse sum, identical on every rank, and this rank's own bookkeeping.

    ``indices`` are sorted ascending; ``values`` are sums over ranks (not divided by P).
    ``reached[i]`` tells whether this rank's i-th input pair (input order) is part of the
    result; pairs with ``reached == False`` belong back in the caller's residual.
    ``sent_bytes``: what this rank put on the wire (counted for gTop-k's own messages; the
    ring model for the allgather, whose algorithm belongs to the MPI library).
    """

    indices: np.ndarray
    values: np.ndarray
    reached: np.ndarray
    sent_bytes: int = 0


def index_dtype(d: int) -> np.dtype:
    """int32 where every index of a length-d vector fits, else int64."""
    return np.dtype(np.int32) if d <= 2**31 else np.dtype(np.int64)


def ceil_log2(p: int) -> int:
    return max(p - 1, 0).bit_length()


def select_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest |x|; ties go to the lower index."""
    if not 0 < k <= x.size:
        raise ValueError(f"k must be in [1, {x.size}], got {k}")
    mag = np.abs(x)
    if k == x.size:
        return np.arange(x.size, dtype=index_dtype(x.size))
    cut = np.partition(mag, x.size - k)[x.size - k]
    above = np.flatnonzero(mag > cut)
    ties = np.flatnonzero(mag == cut)[: k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(index_dtype(x.size))


def merge_select(idx_a: np.ndarray, val_a: np.ndarray, idx_b: np.ndarray, val_b: np.ndarray,
                 k: int) -> Tuple[np.ndarray, np.ndarray]:
    """One tree step: sum values at common indices, keep the k largest |sum|.

    Each input holds unique indices. Ties in |sum| go to the lower index, so the result
    depends only on the inputs. Output is sorted by index.
    """
    idx = np.concatenate([idx_a, idx_b])
    val = np.concatenate([val_a, val_b])
    order = np.argsort(idx, kind="stable")  # two sorted runs: a linear merge; a before b
    idx, val = idx[order], val[order]
    first = np.ones(idx.size, bool)
    first[1:] = idx[1:] != idx[:-1]
    starts = np.flatnonzero(first)
    uniq = idx[starts]
    sums = np.add.reduceat(val, starts) if idx.size else val
    if uniq.size <= k:
        return uniq, sums
    keep = select_topk(sums, k)  # positions ascending = indices ascending (uniq is sorted)
    return uniq[keep], sums[keep]


def _pack(idx: np.ndarray, val: np.ndarray, mask: Optional[np.ndarray] = None) -> np.ndarray:
    parts = [np.array([idx.size], np.int64).view(np.uint8), idx.view(np.uint8), val.view(np.uint8)]
    if mask is not None:
        parts.append(mask.view(np.uint8))
    return np.concatenate(parts)


def _unpack(buf: np.ndarray, idt: np.dtype, vdt: np.dtype, mask_len: int = 0):
    n = int(buf[:_HEADER].view(np.int64)[0])
    i0, v0 = _HEADER, _HEADER + n * idt.itemsize
    m0 = v0 + n * vdt.itemsize
    return (buf[i0:v0].view(idt), buf[v0:m0].view(vdt),
            buf[m0:m0 + mask_len].view(np.bool_))


def _isin_sorted(a: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    if sorted_set.size == 0:
        return np.zeros(a.size, bool)
    pos = np.minimum(np.searchsorted(sorted_set, a), sorted_set.size - 1)
    return sorted_set[pos] == a


def _local_error(indices, values, d, k) -> Optional[str]:
    if not isinstance(indices, np.ndarray) or not isinstance(values, np.ndarray):
        return "indices and values must be numpy arrays"
    if indices.ndim != 1 or values.ndim != 1 or indices.size != values.size:
        return (f"indices and values must be 1-D of equal length, got shapes "
                f"{indices.shape} and {values.shape}")
    if not (indices.flags.c_contiguous and values.flags.c_contiguous):
        return "indices and values must be contiguous (use np.ascontiguousarray)"
    if indices.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        return f"indices must be int32 or int64, got {indices.dtype}"
    if indices.dtype == np.int32 and d > 2**31:
        return f"d = {d} needs int64 indices (see collectives.index_dtype)"
    if values.dtype not in VALUE_DTYPES:
        return f"values must be float32 or float64, got {values.dtype}"
    if not (isinstance(d, (int, np.integer)) and d > 0):
        return f"d must be a positive integer, got {d!r}"
    if k is not None and not (isinstance(k, (int, np.integer)) and 0 < k <= d):
        return f"k must be an integer in [1, d={d}], got {k!r}"
    if k is not None and indices.size > k:
        return f"got {indices.size} pairs, more than k = {k}"
    if indices.size and (indices.min() < 0 or indices.max() >= d):
        return f"indices must lie in [0, {d}), got range [{indices.min()}, {indices.max()}]"
    if np.unique(indices).size != indices.size:
        return "indices must be unique within a rank"
    if not np.isfinite(values).all():
        return "values contain NaN or Inf; check the gradients (loss scale, learning rate)"
    return None


def _check(comm, indices, values, d, k, what):
    err = _local_error(indices, values, d, k)
    key = (int(d) if isinstance(d, (int, np.integer)) else d, k,
           str(getattr(values, "dtype", None)) if err is None else None)
    check_agree(comm, key if err is None else None, what, err)


def _gtopk_schedule(comm, indices, values, d, k, tag):
    rank, size = comm.Get_rank(), comm.Get_size()
    idt, vdt = index_dtype(d), values.dtype
    order = np.argsort(indices, kind="stable")
    own_idx = indices[order].astype(idt)
    cur_idx, cur_val = own_idx, values[order]
    max_msg = _HEADER + k * (idt.itemsize + vdt.itemsize)
    history = []  # (child, indices before merge, child's indices) per merge, in round order
    parent, sent = None, 0
    for r in range(ceil_log2(size)):
        step = 1 << r
        if rank % (2 * step) == step:
            parent, msg = rank - step, _pack(cur_idx, cur_val)
            sent += msg.nbytes
            yield [comm.Isend(msg, dest=parent, tag=tag)]
            break
        child = rank + step
        if child < size:
            buf = np.empty(max_msg, np.uint8)
            yield [comm.Irecv(buf, source=child, tag=tag)]
            c_idx, c_val, _ = _unpack(buf, idt, vdt)
            history.append((child, cur_idx, c_idx.copy()))
            cur_idx, cur_val = merge_select(cur_idx, cur_val, c_idx, c_val, k)
    if parent is None:
        final_idx, final_val, survived = cur_idx, cur_val, cur_idx
    else:
        buf = np.empty(max_msg + cur_idx.size, np.uint8)
        yield [comm.Irecv(buf, source=parent, tag=tag)]
        final_idx, final_val, mask = _unpack(buf, idt, vdt, cur_idx.size)
        final_idx, final_val, survived = final_idx.copy(), final_val.copy(), cur_idx[mask]
    sends, msgs = [], []
    for child, before, child_idx in reversed(history):
        msgs.append(_pack(final_idx, final_val, _isin_sorted(child_idx, survived)))
        sent += msgs[-1].nbytes
        sends.append(comm.Isend(msgs[-1], dest=child, tag=tag))
        survived = before[_isin_sorted(before, survived)]
    if sends:
        yield sends
    reached = np.empty(indices.size, bool)
    reached[order] = _isin_sorted(own_idx, survived)
    return SparseResult(final_idx, final_val, reached, sent)


def igtopk_allreduce(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int, k: int,
                     *, tag: int = DEFAULT_TAG, check: bool = True) -> Pending:
    """Start gTopKAllReduce; ``.wait()`` returns a :class:`SparseResult`.

    Each rank passes at most k (index, value) pairs of a length-d vector (unique indices).
    Every rank receives the same k pairs: the k largest |partial sums| kept along a binomial
    tree. Calls in flight together on one communicator need distinct tags.

    Schedule for P = 6 (ceil(log2 6) = 3 rounds up, the same tree back down)::

        round 0:  1->0   3->2   5->4        receiver merges: sum common indices,
        round 1:  2->0          (4 idle)                     keep top-k of <= 2k
        round 2:  4->0
        down:     0->4, 0->2, 0->1;  2->3;  4->5   (final pairs + a survival mask)

    Cost: 2 * ceil(log2 P) * (alpha + k*(w_idx + w_val)*beta), plus k mask bytes per
    downward step. The mask tells each child which of the pairs it sent up reached the
    result, so a pair dropped at any tree level is reported back to its owner exactly.
    With ``check`` (default) one small allgather first verifies d, k and dtype agree on all
    ranks and that no rank's input is malformed; every rank raises together if not.
    """
    if check:
        _check(comm, indices, values, d, k, "gtopk_allreduce")
    return Pending(_gtopk_schedule(comm, indices, values, int(d), int(k), tag))


def gtopk_allreduce(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int, k: int,
                    *, tag: int = DEFAULT_TAG, check: bool = True) -> SparseResult:
    """Blocking gTopKAllReduce; see :func:`igtopk_allreduce`."""
    return igtopk_allreduce(comm, indices, values, d, k, tag=tag, check=check).wait()


def sum_sparse(idx: np.ndarray, val: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Sum values that share an index, in input order; returns sorted unique indices."""
    uniq, inv = np.unique(idx, return_inverse=True)
    sums = np.zeros(uniq.size, val.dtype)
    np.add.at(sums, inv, val)
    return uniq, sums


def _allgather_schedule(comm, indices, values, d):
    size = comm.Get_size()
    idt = index_dtype(d)
    counts = np.empty(size, np.int64)
    yield [comm.Iallgather(np.array([indices.size], np.int64), counts)]
    all_idx = np.empty(int(counts.sum()), idt)
    all_val = np.empty(int(counts.sum()), values.dtype)
    send_idx = np.ascontiguousarray(indices, dtype=idt)
    yield [comm.Iallgatherv(send_idx, (all_idx, counts)),
           comm.Iallgatherv(values, (all_val, counts))]
    uniq, sums = sum_sparse(all_idx, all_val)
    pair_bytes = idt.itemsize + values.dtype.itemsize
    ring = 0 if size == 1 else int(counts.sum() - counts[(comm.Get_rank() + 1) % size]) * pair_bytes
    return SparseResult(uniq, sums, np.ones(indices.size, bool), ring + 8 * (size - 1))


def itopk_allgather(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int,
                    k: Optional[int] = None, *, check: bool = True) -> Pending:
    """Start Top-k AllGather: every rank gathers all ranks' pairs and sums them.

    Ranks may pass different numbers of pairs. Volume O(kP):
    cost ~ 2*ceil(log2 P)*alpha + (P-1)*k*(w_idx + w_val)*beta (counts, then pairs).
    """
    if check:
        _check(comm, indices, values, d, k, "topk_allgather")
    return Pending(_allgather_schedule(comm, indices, values, int(d)))


def topk_allgather(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int,
                   k: Optional[int] = None, *, check: bool = True) -> SparseResult:
    """Blocking Top-k AllGather; see :func:`itopk_allgather`."""
    return itopk_allgather(comm, indices, values, d, k, check=check).wait()
