"""Dense allreduce wrappers with the same conventions as the sparse collectives."""
from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from .errors import HvcommError, check_agree
from .handle import Pending


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
