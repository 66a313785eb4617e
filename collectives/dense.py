"""Dense allreduce wrappers with the same conventions as the sparse collectives."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .errors import HvcommError, check_agree
from .handle import Pending
from .ring import segments
from .workspace import Workspace, pooled


def _dense_error(array) -> Optional[str]:
    if not isinstance(array, np.ndarray):
        return f"expected a numpy array, got {type(array).__name__}"
    if not array.flags.c_contiguous:
        return "array must be contiguous (use np.ascontiguousarray)"
    return None


def _schedule(comm, array, out, op):
    yield [comm.Iallreduce(array, out, op=op)]
    return out


def iallreduce(comm: MPI.Comm, array: np.ndarray, out: Optional[np.ndarray] = None,
               op: MPI.Op = MPI.SUM, *, check: bool = True) -> Pending:
    """Start a dense Allreduce of ``array`` into ``out`` (new array if None).

    Cost (ring): 2(P-1)*alpha + 2(P-1)/P * bytes * beta. With ``check`` the shape and dtype
    are verified to agree on all ranks first (one small allgather).
    """
    err = _dense_error(array)
    if check:
        key = None if err else (array.shape, str(array.dtype))
        check_agree(comm, key, "allreduce", err)
    elif err:
        raise HvcommError(f"allreduce: {err}")
    if out is None:
        out = np.empty_like(array)
    return Pending(_schedule(comm, array, out, op))


def allreduce(comm: MPI.Comm, array: np.ndarray, out: Optional[np.ndarray] = None,
              op: MPI.Op = MPI.SUM, *, check: bool = True) -> np.ndarray:
    """Blocking dense Allreduce; see :func:`iallreduce`."""
    return iallreduce(comm, array, out, op, check=check).wait()


def sum_pieces(pieces: np.ndarray, ws: Optional[Workspace] = None,
               acc_dtype=np.float32) -> np.ndarray:
    """The sum over axis 0 of (P, m) ``pieces``, in rank order, added in ``acc_dtype`` and
    rounded back to the pieces' dtype once. ``ws`` lends the accumulator."""
    total = np.empty(pieces.shape[1], acc_dtype) if ws is None else \
        ws.get("acc", pieces.shape[1], acc_dtype)
    total[:] = pieces[0]
    for q in range(1, pieces.shape[0]):
        total += pieces[q]
    return total.astype(pieces.dtype)


@functools.lru_cache(maxsize=256)
def _chunks(n: int, p: int, r: int):
    """Rank q's chunk of n elements (counts, offsets), and where the P pieces of rank r's
    chunk land in its receive buffer: Python ints, built once per (n, p, r)."""
    offsets, counts = segments(n, p)
    mine = counts[r]
    return (counts, offsets), ([mine] * p, [q * mine for q in range(p)])


def _cast_steps(comm, x, add, ws: Workspace):
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return x
    flat = x.reshape(-1)  # a view, x being contiguous
    layout, pieces_layout = _chunks(flat.size, p, r)
    # reduce-scatter as an alltoall: chunk c of every rank goes to rank c, in x.dtype
    mine = layout[0][r]
    pieces = ws.get("pieces", p * mine, x.dtype).reshape(p, mine)
    yield [comm.Ialltoallv((flat, layout), (pieces, pieces_layout))]
    yield [comm.Iallgatherv(add(pieces, ws), (flat, layout))]
    return x


def icast_allreduce(comm: MPI.Comm, x: np.ndarray,
                    add: Callable[[np.ndarray, Workspace], np.ndarray] = sum_pieces) -> Pending:
    """Sum ``x`` over ranks in place, moving ``x.dtype`` on the wire but adding in a wider
    type: for float16, whose MPI reduction runs several times slower than float32's in
    Open MPI (scripts/bench_collectives.py measures both), and which loses precision when
    summed in float16.

    A reduce-scatter done as one Alltoallv (rank c receives chunk c of every rank and sums
    the P pieces in rank order), then an Allgatherv of the reduced chunks: two MPI
    collectives, 2(P-1)/P * d * itemsize bytes per rank, as a ring allreduce in x.dtype.
    Every rank ends with the same values (each chunk is rounded to x.dtype once, by its
    owner). Any shape: the chunks are cut from the flat view of ``x`` (C-contiguous).
    ``add(pieces, ws)`` sums the (P, m) pieces a rank receives, with scratch from the
    call's workspace ``ws`` (default :func:`sum_pieces`, NumPy, in float32); a caller with
    a faster float16 conversion (torch's) passes its own.
    """
    err = _dense_error(x)
    if err:
        raise HvcommError(f"cast_allreduce: {err}")
    return Pending(pooled(_cast_steps, comm, x, add))
