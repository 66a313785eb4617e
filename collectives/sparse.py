"""Sparse gradient collectives: gTopKAllReduce (log P tree) and the Top-k AllGather baseline."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np

from . import kernels
from .errors import HvcommError
from .handle import Pending
from .plans import ceil_log2, index_dtype  # noqa: F401 (re-exported: they were defined here)
from .workspace import Workspace, pooled

if TYPE_CHECKING:
    from mpi4py import MPI

VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
DEFAULT_TAG = 7301


@dataclass(frozen=True)
class SparseResult:
    """The global sparse sum, identical on every rank, and this rank's own bookkeeping.

    ``indices`` are sorted ascending; ``values`` are sums over ranks (not divided by P).
    ``reached[i]`` tells whether this rank's i-th input pair (input order) is part of the
    result; pairs with ``reached == False`` belong back in the caller's residual.
    ``sent_bytes``: what this rank put on the wire (counted for gTop-k's own messages; the
    ring model for the allgather, whose algorithm belongs to the MPI library).
    ``compute_s``: this rank's local compute inside the collective (checking and sorting its
    input, merging, selecting, summing, the survival masks), wall-clock seconds.
    """

    indices: np.ndarray
    values: np.ndarray
    reached: np.ndarray
    sent_bytes: int = 0
    compute_s: float = 0.0


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
    step = _merge_step(idx_a, val_a, idx_b, val_b, k)
    return step.indices, step.values


@dataclass
class _Step:
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


def _merge_step(idx_a, val_a, idx_b, val_b, k, ws: Optional[Workspace] = None,
                level: int = 0) -> _Step:
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
        return _Step(idx.copy(), val.copy(), origin, sizes, None)
    keep = _largest(val, k, ws)
    return _Step(idx[keep], val[keep], origin, sizes, keep)


# -- input checks, carried in the messages themselves ---------------------------------------
# Every message of a sparse collective starts with a small header: the sender's status (0, or
# the code of a problem with some rank's input), who it is about, and the sender's signature
# (d, k, value dtype). A receiver compares the signature with its own, so a disagreement or a
# malformed input anywhere reaches every rank through the collective's own messages: every
# rank raises the same HvcommError, with no extra collective on the hot path.
PROBLEMS = {
    1: "indices and values must be numpy arrays",
    2: "indices and values must be 1-D arrays of equal length",
    3: "indices and values must be contiguous (use np.ascontiguousarray)",
    4: "indices must be int32 or int64",
    5: "d needs int64 indices (see collectives.index_dtype)",
    6: "values must be float32 or float64",
    7: "d must be a positive integer",
    8: "k must be an integer in [1, d]",
    9: "more pairs than k",
    10: "indices must lie in [0, d)",
    11: "indices must be unique within a rank",
    12: "values contain NaN or Inf; check the gradients (loss scale, learning rate)",
}
DISAGREE = 99
_DTYPE_CODE = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}
_DTYPE_NAME = {1: "float32", 2: "float64", -1: "?"}
# header fields: status, pairs, mask length, then (rank, d, k, dtype) of whom it is about,
# and of the other party of a disagreement
STATUS, N, M, RANK, D, K, DT, RANK2, D2, K2, DT2 = range(11)
HEADER_LEN = 11


@dataclass
class _Input:
    """One rank's input, sorted by index, with its header (status and signature)."""
    indices: np.ndarray
    values: np.ndarray
    order: Optional[np.ndarray]  # input position of each sorted pair; None: already sorted
    header: np.ndarray
    compute_s: float             # the time the checks and the sort took


def _structural_problem(indices, values, d, k) -> int:
    if not isinstance(indices, np.ndarray) or not isinstance(values, np.ndarray):
        return 1
    if indices.ndim != 1 or values.ndim != 1 or indices.size != values.size:
        return 2
    if not (indices.flags.c_contiguous and values.flags.c_contiguous):
        return 3
    if indices.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        return 4
    if values.dtype not in VALUE_DTYPES:
        return 6
    if not (isinstance(d, (int, np.integer)) and d > 0):
        return 7
    if indices.dtype == np.int32 and d > 2**31:
        return 5
    if k is not None and not (isinstance(k, (int, np.integer)) and 0 < k <= d):
        return 8
    if k is not None and indices.size > k:
        return 9
    return 0


def _prepare(comm, indices, values, d, k, check: bool) -> _Input:
    """This rank's pairs sorted by index (one linear pass when they already are), checked,
    with the header that carries the verdict. ``check=False`` skips the range and
    finiteness checks, not the structural ones or the signature comparison."""
    t0 = time.perf_counter()
    header = np.zeros(HEADER_LEN, np.int64)
    header[RANK], header[RANK2] = comm.Get_rank(), -1
    problem = _structural_problem(indices, values, d, k)
    if problem:
        header[STATUS], header[D:DT + 1] = problem, -1
        return _Input(np.empty(0, np.int64), np.empty(0), None, header, 0.0)
    header[D], header[K], header[DT] = d, -1 if k is None else k, _DTYPE_CODE[values.dtype]
    order = None
    state = kernels.sorted_unique_in_range(indices, d)
    if state == 1:  # out of order: sort (the only O(k log k) case), then look again
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
        state = kernels.sorted_unique_in_range(indices, d)
        if state == 1:
            header[STATUS] = 11
    if check and state == 2:
        header[STATUS] = 10
    if check and not header[STATUS] and not kernels.all_finite(values):
        header[STATUS] = 12
    indices = indices.astype(index_dtype(d), copy=False)
    return _Input(indices, values, order, header, time.perf_counter() - t0)


def _absorb(mine: np.ndarray, theirs: np.ndarray) -> None:
    """Fold a received header into this rank's: the first problem seen wins."""
    if mine[STATUS]:
        return
    if theirs[STATUS]:
        mine[STATUS], mine[RANK:] = theirs[STATUS], theirs[RANK:]
    elif not np.array_equal(mine[D:DT + 1], theirs[D:DT + 1]):
        mine[RANK2:] = mine[RANK:DT + 1]
        mine[RANK:DT + 1] = theirs[RANK:DT + 1]
        mine[STATUS] = DISAGREE


def _raise_if_problem(header: np.ndarray, what: str) -> None:
    status = int(header[STATUS])
    if not status:
        return
    if status == DISAGREE:
        def sig(at):
            k = header[at + 2]
            return (f"rank {header[at]}: d={header[at + 1]}, k={'None' if k < 0 else k}, "
                    f"dtype={_DTYPE_NAME[int(header[at + 3])]}")
        raise HvcommError(f"{what}: ranks disagree ({sig(RANK)}; {sig(RANK2)}); every rank "
                          "must pass the same d, k and value dtype", everywhere=True)
    raise HvcommError(f"{what}: rank {header[RANK]}: {PROBLEMS[status]}", everywhere=True)


def _pair_dtypes(header: np.ndarray, idt, vdt):
    """The index and value dtypes of the pairs that follow a header (own ones if unknown)."""
    if header[D] > 0 and int(header[DT]) in _DTYPE_NAME and header[DT] > 0:
        return index_dtype(int(header[D])), np.dtype(_DTYPE_NAME[int(header[DT])])
    return idt, vdt


def _children(rank: int, size: int):
    """The ranks this rank receives from in the binomial tree, in round order."""
    out = []
    for r in range(ceil_log2(size)):
        step = 1 << r
        if rank % (2 * step) == step:
            break
        if rank + step < size:
            out.append(rank + step)
    return out


def _gtopk_steps(comm, mine: _Input, k, tag, ws: Workspace):
    rank, size = comm.Get_rank(), comm.Get_size()
    head = mine.header
    idt, vdt = mine.indices.dtype, mine.values.dtype
    cur_idx, cur_val = mine.indices, mine.values
    children = _children(rank, size)
    parent = None if rank == 0 else rank - (rank & -rank)
    history, sent = [], 0  # (child, step) per merge, in round order
    compute = mine.compute_s
    for child in children:  # up: a header, then the child's indices and values
        theirs = np.empty(HEADER_LEN, np.int64)
        yield [comm.Irecv(theirs, source=child, tag=tag)]
        c_idt, c_vdt = _pair_dtypes(theirs, idt, vdt)  # the sender's, even if they differ
        c_idx, c_val = np.empty(theirs[N], c_idt), np.empty(theirs[N], c_vdt)
        yield [comm.Irecv(c_idx, source=child, tag=tag), comm.Irecv(c_val, source=child, tag=tag)]
        _absorb(head, theirs)
        if head[STATUS]:
            continue
        t0 = time.perf_counter()
        step = _merge_step(cur_idx, cur_val, c_idx, c_val, k, ws, len(history))
        compute += time.perf_counter() - t0
        history.append((child, step))
        cur_idx, cur_val = step.indices, step.values
    if parent is None:
        final_idx, final_val = cur_idx, cur_val
        reached = np.ones(cur_idx.size, bool)  # which of cur's pairs are in the result
    else:
        head[N] = 0 if head[STATUS] else cur_idx.size
        up = (head.copy(), cur_idx[:head[N]], cur_val[:head[N]])
        sent += sum(m.nbytes for m in up)
        yield [comm.Isend(m, dest=parent, tag=tag) for m in up]
        # down: a header, then the final pairs and the mask of what this rank sent up
        theirs = np.empty(HEADER_LEN, np.int64)
        yield [comm.Irecv(theirs, source=parent, tag=tag)]
        final_idx, final_val = np.empty(theirs[N], idt), np.empty(theirs[N], vdt)
        reached = np.empty(theirs[M], np.bool_)
        yield [comm.Irecv(final_idx, source=parent, tag=tag),
               comm.Irecv(final_val, source=parent, tag=tag),
               comm.Irecv(reached, source=parent, tag=tag)]
        head[:] = theirs
    sends = []
    if head[STATUS]:  # every child hears of the problem, and nothing else
        down = head.copy()
        down[N] = down[M] = 0
        for child in children:
            sends += [comm.Isend(m, dest=child, tag=tag)
                      for m in (down, final_idx[:0], final_val[:0], np.empty(0, np.bool_))]
    else:
        # back through the merges, last first: what reached the result of each step's
        # output tells what reached of its inputs, the child's (sent down) and this
        # rank's previous pairs; after the first merge, this rank's own sorted input
        for child, step in reversed(history):
            t0 = time.perf_counter()
            reached, mask = step.inputs_reached(reached)
            compute += time.perf_counter() - t0
            down = head.copy()
            down[N], down[M] = final_idx.size, mask.size
            for m in (down, final_idx, final_val, mask):
                sent += m.nbytes
                sends.append(comm.Isend(m, dest=child, tag=tag))
    if sends:
        yield sends
    _raise_if_problem(head, "gtopk_allreduce")
    t0 = time.perf_counter()
    if mine.order is not None:  # back to the caller's input order
        in_order = np.empty(reached.size, bool)
        in_order[mine.order] = reached
        reached = in_order
    compute += time.perf_counter() - t0
    return SparseResult(final_idx, final_val, reached, sent, compute)


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
    Every message carries a small header with the sender's (d, k, dtype) and the status of
    the inputs it has seen, so a disagreement between ranks or a malformed input on any rank
    makes every rank raise the same HvcommError at the end of the collective, at no extra
    message cost. With ``check`` (default) each rank also checks that its indices lie in
    [0, d) and its values are finite (linear time). Indices may come in any order: sorted
    input costs one pass, unsorted input is sorted first.
    """
    mine = _prepare(comm, indices, values, d, k, check)
    return Pending(pooled(_gtopk_steps, comm, mine, k, tag))


def gtopk_allreduce(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int, k: int,
                    *, tag: int = DEFAULT_TAG, check: bool = True) -> SparseResult:
    """Blocking gTopKAllReduce; see :func:`igtopk_allreduce`."""
    return igtopk_allreduce(comm, indices, values, d, k, tag=tag, check=check).wait()


def _sum_runs(idx: np.ndarray, val: np.ndarray, starts: np.ndarray, ws: Workspace):
    """Sum P sorted runs into new arrays, a common index's values added in rank order. Up
    to 4 runs one merge after another (O(kP^2), but a tighter loop than the heap's; the
    partial sums live in ``ws``), else the heap merge (O(kP log P))."""
    p = starts.size - 1
    if p == 1:
        return idx.copy(), val.copy()
    out_idx, out_val = np.empty(idx.size, idx.dtype), np.empty(idx.size, val.dtype)
    if p > 4:
        n = kernels.sum_runs(idx, val, starts, out_idx, out_val)
        return out_idx[:n], out_val[:n]
    acc_idx, acc_val = idx[:starts[1]], val[:starts[1]]
    origin = ws.get("origin", idx.size, np.uint8)  # not needed here
    for r in range(1, p):
        run = slice(starts[r], starts[r + 1])
        last = r == p - 1
        into_idx = out_idx if last else ws.get(("idx", r % 2), idx.size, idx.dtype)
        into_val = out_val if last else ws.get(("val", r % 2), idx.size, val.dtype)
        n = kernels.merge_sum(acc_idx, acc_val, idx[run], val[run], into_idx, into_val, origin)
        acc_idx, acc_val = into_idx[:n], into_val[:n]
    return acc_idx, acc_val


def _allgather_steps(comm, mine: _Input, ws: Workspace):
    size = comm.Get_size()
    idt, vdt = mine.indices.dtype, mine.values.dtype
    head = mine.header
    head[N] = 0 if head[STATUS] else mine.indices.size
    heads = np.empty((size, HEADER_LEN), np.int64)
    yield [comm.Iallgather(head.copy(), heads)]
    head = heads[0].copy()
    for theirs in heads[1:]:  # every rank folds the same headers in the same order
        _absorb(head, theirs)
    _raise_if_problem(head, "topk_allgather")
    counts = heads[:, N]
    total = int(counts.sum())
    all_idx, all_val = ws.get("gathered idx", total, idt), ws.get("gathered val", total, vdt)
    yield [comm.Iallgatherv(mine.indices, (all_idx, counts)),
           comm.Iallgatherv(mine.values, (all_val, counts))]
    t0 = time.perf_counter()
    starts = np.zeros(size + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    out_idx, out_val = _sum_runs(all_idx, all_val, starts, ws)
    pair_bytes = idt.itemsize + vdt.itemsize
    ring = 0 if size == 1 else int(total - counts[(comm.Get_rank() + 1) % size]) * pair_bytes
    return SparseResult(out_idx, out_val, np.ones(mine.indices.size, bool),
                        ring + head.nbytes * (size - 1),
                        mine.compute_s + time.perf_counter() - t0)


def itopk_allgather(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int,
                    k: Optional[int] = None, *, check: bool = True) -> Pending:
    """Start Top-k AllGather: every rank gathers all ranks' pairs and sums them.

    Ranks may pass different numbers of pairs (at most k each, when k is given). Volume
    O(kP): cost ~ 2*ceil(log2 P)*alpha + (P-1)*k*(w_idx + w_val)*beta (headers with the
    counts, then pairs). The gathered runs are summed in rank order by linear merges.
    Checks as for :func:`igtopk_allreduce`; the headers travel with the counts.
    """
    mine = _prepare(comm, indices, values, d, k, check)
    return Pending(pooled(_allgather_steps, comm, mine))


def topk_allgather(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int,
                   k: Optional[int] = None, *, check: bool = True) -> SparseResult:
    """Blocking Top-k AllGather; see :func:`itopk_allgather`."""
    return itopk_allgather(comm, indices, values, d, k, check=check).wait()
