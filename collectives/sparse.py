"""Sparse gradient collectives: gTopKAllReduce (log P tree) and the Top-k AllGather baseline.

The tree's merge step is :mod:`collectives.topk`'s; the input checks each message carries,
:mod:`collectives.sparse_header`'s."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from . import kernels
from .handle import Pending
from .plans import ceil_log2
from .sparse_header import (HEADER_LEN, M, N, STATUS, SparseInput, absorb, pair_dtypes, prepare,
                            raise_if_problem)
from .topk import merge_step
from .workspace import Workspace, pooled

if TYPE_CHECKING:
    from mpi4py import MPI

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


def _gtopk_steps(comm, mine: SparseInput, k, tag, ws: Workspace):
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
        c_idt, c_vdt = pair_dtypes(theirs, idt, vdt)  # the sender's, even if they differ
        c_idx, c_val = np.empty(theirs[N], c_idt), np.empty(theirs[N], c_vdt)
        yield [comm.Irecv(c_idx, source=child, tag=tag), comm.Irecv(c_val, source=child, tag=tag)]
        absorb(head, theirs)
        if head[STATUS]:
            continue
        t0 = time.perf_counter()
        step = merge_step(cur_idx, cur_val, c_idx, c_val, k, ws, len(history))
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
    raise_if_problem(head, "gtopk_allreduce")
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
    mine = prepare(comm, indices, values, d, k, check)
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


def _allgather_steps(comm, mine: SparseInput, ws: Workspace):
    size = comm.Get_size()
    idt, vdt = mine.indices.dtype, mine.values.dtype
    head = mine.header
    head[N] = 0 if head[STATUS] else mine.indices.size
    heads = np.empty((size, HEADER_LEN), np.int64)
    yield [comm.Iallgather(head.copy(), heads)]
    head = heads[0].copy()
    for theirs in heads[1:]:  # every rank folds the same headers in the same order
        absorb(head, theirs)
    raise_if_problem(head, "topk_allgather")
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
    mine = prepare(comm, indices, values, d, k, check)
    return Pending(pooled(_allgather_steps, comm, mine))


def topk_allgather(comm: MPI.Comm, indices: np.ndarray, values: np.ndarray, d: int,
                   k: Optional[int] = None, *, check: bool = True) -> SparseResult:
    """Blocking Top-k AllGather; see :func:`itopk_allgather`."""
    return itopk_allgather(comm, indices, values, d, k, check=check).wait()
