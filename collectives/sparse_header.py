"""The input checks of the sparse collectives, carried in their messages themselves.

Every message of a sparse collective starts with a small header: the sender's status (0, or
the code of a problem with some rank's input), who it is about, and the sender's signature
(d, k, value dtype). A receiver compares the signature with its own, so a disagreement or a
malformed input anywhere reaches every rank through the collective's own messages: every
rank raises the same HvcommError, with no extra collective on the hot path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import kernels
from .errors import HvcommError
from .plans import index_dtype

VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
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
class SparseInput:
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


def prepare(comm, indices, values, d, k, check: bool) -> SparseInput:
    """This rank's pairs sorted by index (one linear pass when they already are), checked,
    with the header that carries the verdict. ``check=False`` skips the range and
    finiteness checks, not the structural ones or the signature comparison."""
    t0 = time.perf_counter()
    header = np.zeros(HEADER_LEN, np.int64)
    header[RANK], header[RANK2] = comm.Get_rank(), -1
    problem = _structural_problem(indices, values, d, k)
    if problem:
        header[STATUS], header[D:DT + 1] = problem, -1
        return SparseInput(np.empty(0, np.int64), np.empty(0), None, header, 0.0)
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
    return SparseInput(indices, values, order, header, time.perf_counter() - t0)


def absorb(mine: np.ndarray, theirs: np.ndarray) -> None:
    """Fold a received header into this rank's: the first problem seen wins."""
    if mine[STATUS]:
        return
    if theirs[STATUS]:
        mine[STATUS], mine[RANK:] = theirs[STATUS], theirs[RANK:]
    elif not np.array_equal(mine[D:DT + 1], theirs[D:DT + 1]):
        mine[RANK2:] = mine[RANK:DT + 1]
        mine[RANK:DT + 1] = theirs[RANK:DT + 1]
        mine[STATUS] = DISAGREE


def raise_if_problem(header: np.ndarray, what: str) -> None:
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


def pair_dtypes(header: np.ndarray, idt, vdt):
    """The index and value dtypes of the pairs that follow a header (own ones if unknown)."""
    if header[D] > 0 and int(header[DT]) in _DTYPE_NAME and header[DT] > 0:
        return index_dtype(int(header[D])), np.dtype(_DTYPE_NAME[int(header[DT])])
    return idt, vdt
