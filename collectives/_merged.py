"""The MPI half of :mod:`collectives.merged` (the merged allreduce itself), loaded on first use
so that ``collectives.merged.BucketPlan`` needs no MPI library. Import from
:mod:`collectives.merged`."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

from .errors import HvcommError, check_agree
from .handle import Pending
from .plans import BucketPlan


def _bucket_dtype(arrays, bucket):
    dtypes = {arrays[i].dtype for i in bucket}
    if len(dtypes) != 1:
        raise HvcommError(f"merged allreduce: bucket {bucket} mixes dtypes "
                          f"{sorted(map(str, dtypes))}; plan one bucket per dtype")
    return dtypes.pop()


def _schedule(comm, arrays, plan, op):
    packed = []
    for bucket in plan.buckets:
        buf = np.concatenate([arrays[i].ravel() for i in bucket]).astype(
            _bucket_dtype(arrays, bucket), copy=False)
        packed.append(buf)
    requests = [comm.Iallreduce(MPI.IN_PLACE, buf, op=op) for buf in packed]
    yield requests
    for bucket, buf in zip(plan.buckets, packed):
        offset = 0
        for i in bucket:
            n = arrays[i].size
            arrays[i][...] = buf[offset:offset + n].reshape(arrays[i].shape)
            offset += n
    return arrays


def imerged_allreduce(comm: MPI.Comm, arrays: Sequence[np.ndarray], plan: BucketPlan,
                      op: MPI.Op = MPI.SUM, *, check: bool = True) -> Pending:
    """Start one Allreduce per bucket of ``plan``; ``wait()`` writes the sums back in place.

    Cost: sum over buckets of the ring cost of that bucket's bytes; merging n small arrays
    saves (n-1) * 2(P-1) * alpha against one Allreduce each. With ``check`` (default) the
    plan, shapes and dtypes are verified to agree on all ranks first (one small allgather).
    """
    err = None
    if plan.num_arrays != len(arrays):
        err = f"plan covers {plan.num_arrays} arrays, got {len(arrays)}"
    elif not all(isinstance(a, np.ndarray) for a in arrays):
        err = "expected a list of numpy arrays"
    if check:
        key = None if err else (plan.buckets, tuple((a.shape, str(a.dtype)) for a in arrays))
        check_agree(comm, key, "merged_allreduce", err)
    elif err:
        raise HvcommError(f"merged_allreduce: {err}")
    return Pending(_schedule(comm, list(arrays), plan, op))


def merged_allreduce(comm: MPI.Comm, arrays: Sequence[np.ndarray], plan: BucketPlan,
                     op: MPI.Op = MPI.SUM, *, check: bool = True) -> Sequence[np.ndarray]:
    """Blocking merged allreduce; see :func:`imerged_allreduce`."""
    return imerged_allreduce(comm, arrays, plan, op, check=check).wait()
