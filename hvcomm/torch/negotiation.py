"""Before each user collective, one small Allreduce that (a) checks that every rank submitted
the same collective (kind, name, shape, dtype, op) and (b) serves Horovod's ``join``: a rank
that has joined answers every negotiation from its join loop and, for an allreduce, contributes
zeros; the other collectives raise on every rank while a rank has joined.

The buffer (int64, MAX): [h, -h, any joined, -(lowest active rank), rank joining now]. A joined
rank sends INT64_MIN for the first two and for the fourth, so the active ranks agree iff
max(h) == min(h) over them, and all have joined iff the fourth stays INT64_MIN."""
from __future__ import annotations

import hashlib
import pickle
from typing import Optional

import numpy as np
from mpi4py import MPI

from collectives.errors import HvcommError

from . import timeline

LOWEST = np.iinfo(np.int64).min


def _signature_hash(sig: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=7).digest(), "little")


def negotiate(comm: MPI.Comm, sig: tuple, what: str, joinable: bool = False) -> Optional[tuple]:
    """Collective. Raise on every rank unless all active ranks submitted ``sig``. Returns
    None when no rank has joined; else (only for a ``joinable`` collective, which the joined
    ranks then run with zeros) the signature they were sent."""
    h = _signature_hash(sig)
    buf = np.array([h, -h, 0, -comm.Get_rank(), -1], np.int64)
    with timeline.measure(f"NEGOTIATE_{str(sig[0]).upper()}", "comm"):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    if buf[0] != -buf[1]:
        raise HvcommError(f"{what}: ranks submitted different collectives (this rank: {sig}); "
                          "every rank must call hvcomm collectives in the same order with "
                          "tensors of the same shape and dtype", everywhere=True)
    if not buf[2]:
        return None
    comm.bcast(pickle.dumps(sig) if joinable else None, root=int(-buf[3]))
    if not joinable:
        raise HvcommError(f"{what}: a rank has called join(); only allreduce can run until "
                          "every rank has joined (Horovod's rule). Call join() here too",
                          everywhere=True)
    return sig


def join_loop(comm: MPI.Comm, contribute) -> int:
    """A joined rank's side of every negotiation until all ranks have joined; for each
    joinable collective the active ranks run, ``contribute(sig)`` takes part with zeros.
    Returns the last rank to join (the same on every rank)."""
    me = comm.Get_rank()
    first = True
    while True:
        buf = np.array([LOWEST, LOWEST, 1, LOWEST, me if first else -1], np.int64)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        first = False
        if buf[3] == LOWEST:  # nobody active: everyone has joined
            return int(buf[4])
        if buf[0] != -buf[1]:  # the active ranks disagree and raise; nothing to join
            continue
        sig = comm.bcast(None, root=int(-buf[3]))
        if sig is not None:
            contribute(pickle.loads(sig))
