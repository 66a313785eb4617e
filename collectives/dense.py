"""Dense allreduce wrappers with the same conventions as the sparse collectives."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .errors import HvcommError, check_agree
from .handle import Pending
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


CAST_TAG = 7302  # the point-to-point messages of icast_allreduce (gTop-k's: 7301)


@functools.lru_cache(maxsize=1)
def _one_node_keyval() -> int:
    """The MPI attribute that keeps :func:`one_node`'s answer on a communicator (created at
    first use: MPI may not be initialised at import)."""
    return MPI.Comm.Create_keyval()


def one_node(comm: MPI.Comm) -> bool:
    """Whether every rank of ``comm`` shares this rank's node (shared memory). Collective the
    first time on a communicator; the answer is kept on it."""
    cached = comm.Get_attr(_one_node_keyval())
    if cached is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        cached = comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.Get_size()
        node.Free()
        comm.Set_attr(_one_node_keyval(), cached)
    return cached


@functools.lru_cache(maxsize=256)
def _chunks(n: int, p: int):
    """The P chunks of n elements (counts, offsets): Python ints, built once per (n, p)."""
    counts = [n // p + (q < n % p) for q in range(p)]
    return counts, [sum(counts[:q]) for q in range(p)]


def _cast_steps(comm, x, add, tag, point_to_point, ws: Workspace):
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return x
    flat = x.reshape(-1)  # a view, x being contiguous
    counts, offsets = _chunks(flat.size, p)
    m = counts[r]
    pieces = ws.get("pieces", p * m, x.dtype).reshape(p, m)
    if point_to_point is None:
        point_to_point = one_node(comm)
    if not point_to_point:
        # reduce-scatter as one alltoall: chunk c of every rank goes to rank c
        yield [comm.Ialltoallv((flat, (counts, offsets)),
                               (pieces, ([m] * p, [q * m for q in range(p)])))]
        yield [comm.Iallgatherv(add(pieces, ws), (flat, (counts, offsets)))]
        return x
    chunk = [flat[o:o + c] for o, c in zip(offsets, counts)]
    peers = [(r + s) % p for s in range(1, p)]  # each rank starts with its right neighbour
    requests = [comm.Irecv(pieces[q], source=q, tag=tag) for q in peers]
    requests += [comm.Isend(chunk[q], dest=q, tag=tag) for q in peers]
    pieces[r] = chunk[r]
    yield requests
    total = add(pieces, ws)
    requests = [comm.Irecv(chunk[q], source=q, tag=tag) for q in peers]
    requests += [comm.Isend(total, dest=q, tag=tag) for q in peers]
    chunk[r][:] = total
    yield requests
    return x


def icast_allreduce(comm: MPI.Comm, x: np.ndarray,
                    add: Callable[[np.ndarray, Workspace], np.ndarray] = sum_pieces, *,
                    tag: int = CAST_TAG, point_to_point: Optional[bool] = None) -> Pending:
    """Sum ``x`` over ranks in place, moving ``x.dtype`` on the wire but adding in a wider
    type: for float16, whose MPI reduction runs ~100x slower than float32's in
    Open MPI (measured here), and which loses precision when summed in float16.

    A reduce-scatter (rank c receives chunk c of every rank and sums the P pieces in rank
    order), then an allgather of the reduced chunks: 2(P-1)/P * d * itemsize bytes per rank,
    as a ring allreduce in x.dtype. Every rank ends with the same values (each chunk is
    rounded to x.dtype once, by its owner). Any shape: the chunks are cut from the flat view
    of ``x`` (C-contiguous). ``add(pieces, ws)`` sums the (P, m) pieces a rank receives, with
    scratch from the call's workspace ``ws`` (default :func:`sum_pieces`, NumPy, in float32);
    a caller with a faster float16 conversion (torch's) passes its own.

    The two exchanges go as ``point_to_point`` messages between every pair of ranks, or as
    libnbc's Ialltoallv and Iallgatherv. Each wins on one transport (P=4, measured here):
    point-to-point on shared memory (0.92 against 1.09 ms for 301K halves), the collectives
    over TCP (0.83 against 1.0-1.2 s for 26.2M halves at emulated 1 Gbit). None (default):
    point-to-point when every rank shares one node (:func:`one_node`). Point-to-point calls
    in flight together on one communicator need distinct tags.
    """
    err = _dense_error(x)
    if err:
        raise HvcommError(f"cast_allreduce: {err}")
    return Pending(pooled(_cast_steps, comm, x, add, tag, point_to_point))
