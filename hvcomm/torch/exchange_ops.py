"""Every collective but the dense allreduce family (:mod:`hvcomm.torch.ops`), with Horovod's
names and semantics: those that exchange data without reducing it (allgather, broadcast,
alltoall), the reduce-scatter, the sparse allreduce (an allgather of the pairs), the object
collectives and the barrier."""
from __future__ import annotations

import functools
from typing import Any, Callable, List

import numpy as np
import torch
from mpi4py import MPI

from collectives.errors import HvcommError

from .negotiation import negotiate
from .ops import (Average, Adasum, Sum, _group_handle, check_reducible, _group_names, _host_copy,
                  _reduce_in_place, _resolve_op, scale_, submit, synchronize)
from .process_sets import comm_of, global_process_set, set_rank
from .runtime import runtime
from .sums import as_bits


def _rows_sig(t: torch.Tensor) -> tuple:
    return tuple(t.shape[1:]), str(t.dtype)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start gathering ``tensor`` from every rank, concatenated along dimension 0 (the first
    dimension may differ between ranks)."""
    src = _host_copy(tensor if tensor.dim() else tensor.reshape(1))
    what = f"allgather {name or ''}".strip()

    def job(comm):
        negotiate(comm, ("allgather", name), what)
        rows = comm.allgather((src.shape[0], _rows_sig(src)))
        if any(s != rows[0][1] for _, s in rows):
            raise HvcommError(f"{what}: tensors differ beyond dimension 0 or in dtype across "
                              f"ranks: {[s for _, s in rows]}")
        per_row = int(np.prod(src.shape[1:], dtype=np.int64))
        counts = [n * per_row for n, _ in rows]
        out = torch.empty((sum(n for n, _ in rows), *src.shape[1:]), dtype=src.dtype)
        comm.Allgatherv(as_bits(src).ravel(), (as_bits(out).ravel(), counts))
        return out

    return submit("allgather", name, job, lambda out: out.to(tensor.device), process_set, tensor)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    return _group_handle([allgather_async(t, n, process_set)
                          for t, n in zip(tensors, _group_names(name, len(tensors)))])


def sparse_allreduce_async(tensor, name=None, op=Average,
                           process_set=global_process_set) -> Callable[[], torch.Tensor]:
    """Allreduce of a sparse COO tensor (Horovod's way: every rank's indices and values are
    gathered, then summed; the result is coalesced). Returns, as Horovod, a handle to call
    for the result."""
    if not tensor.is_sparse:
        raise HvcommError("sparse_allreduce_async takes a sparse tensor; use allreduce_async")
    t = tensor.coalesce()
    hi = allgather_async(t.indices().t().contiguous(), None if name is None else f"{name}.i",
                         process_set)
    hv = allgather_async(t.values(), None if name is None else f"{name}.v", process_set)
    size = comm_of(process_set).Get_size()

    def finish(parts):
        idx, val = parts
        if op == Average:
            val = val / size
        return torch.sparse_coo_tensor(idx.t(), val, t.shape).coalesce()

    return functools.partial(synchronize, _group_handle([hi, hv], finish))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start an in-place broadcast of ``tensor`` from ``root_rank`` (a rank of init()'s
    communicator, also with a process set)."""
    in_place = tensor.device.type == "cpu" and tensor.is_contiguous()
    host = tensor.data if in_place else _host_copy(tensor)
    sig = ("broadcast", name, tuple(host.shape), str(host.dtype), int(root_rank))
    what = f"broadcast {name or ''}".strip()
    size = runtime().comm.Get_size()
    root = set_rank(process_set, root_rank) if 0 <= root_rank < size else -1

    def job(comm):
        negotiate(comm, sig, what)
        if root < 0:
            raise HvcommError(f"{what}: root_rank {root_rank} outside [0, {size})")
        comm.Bcast(as_bits(host), root=root)

    def finish(_):
        if not in_place:
            tensor.data.copy_(host)
        return tensor

    return submit("broadcast", name, job, finish, process_set, tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall: rows ``splits[i]`` (default: equal parts) of dimension 0 go to rank
    i; synchronize() returns (received tensor, received splits)."""
    src = _host_copy(tensor if tensor.dim() else tensor.reshape(1))
    size = comm_of(process_set).Get_size()
    if splits is None:
        if src.shape[0] % size:
            raise HvcommError(f"alltoall: the first dimension ({src.shape[0]}) must divide into "
                              f"{size} equal parts, or pass splits")
        splits = [src.shape[0] // size] * size
    elif isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64) or splits.dim() != 1:
            raise HvcommError("alltoall: splits must be a 1-D int32 or int64 tensor")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != src.shape[0]:
        raise HvcommError(f"alltoall: splits {splits} must have one entry >= 0 per rank ({size}) "
                          f"summing to the first dimension ({src.shape[0]})")
    what = f"alltoall {name or ''}".strip()

    def job(comm):
        negotiate(comm, ("alltoall", name, _rows_sig(src)), what)
        received = comm.alltoall(splits)
        per_row = int(np.prod(src.shape[1:], dtype=np.int64))
        out = torch.empty((sum(received), *src.shape[1:]), dtype=src.dtype)
        send = [s * per_row for s in splits]
        recv = [s * per_row for s in received]
        comm.Alltoallv((as_bits(src).ravel(), send), (as_bits(out).ravel(), recv))
        return out.to(tensor.device), torch.tensor(received, dtype=torch.int32)

    return submit("alltoall", name, job, lambda res: res, process_set, tensor)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reduce-scatter: the tensors are reduced (Sum or Average) and split along
    dimension 0, the first ``rows % size`` ranks getting one row more."""
    op = _resolve_op(None, op)
    if op not in (Sum, Average):
        raise HvcommError(f"reducescatter supports op=Sum or Average, got {op!r}"
                          + (" (Adasum has no reduce-scatter)" if op == Adasum else ""))
    if tensor.dim() == 0:
        raise HvcommError("reducescatter needs a tensor with at least one dimension")
    out = _host_copy(tensor)
    sig = ("reducescatter", name, tuple(out.shape), str(out.dtype), op)
    what = f"reducescatter {name or ''}".strip()

    def job(comm):
        negotiate(comm, sig, what)
        check_reducible(what, out.dtype)
        size, rows = comm.Get_size(), out.shape[0]
        scale_(out, prescale_factor)
        _reduce_in_place(comm, out, op)
        counts = [rows // size + (r < rows % size) for r in range(size)]
        lo = sum(counts[:comm.Get_rank()])
        mine = out[lo:lo + counts[comm.Get_rank()]].clone()
        scale_(mine, postscale_factor, size if op == Average else 1)
        return mine.to(tensor.device)

    return submit("reducescatter", name, job, lambda res: res, process_set, tensor)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    return _group_handle([reducescatter_async(t, n, op, process_set, prescale_factor,
                                              postscale_factor)
                          for t, n in zip(tensors, _group_names(name, len(tensors)))])


def _object_job(what: str, fn: Callable[[MPI.Comm], Any], process_set) -> Any:
    engine = runtime().engine
    engine.check_can_wait(what)

    def job(comm):
        negotiate(comm, (what,), what)
        return fn(comm)

    return engine.submit(job, what.upper(), comm_of(process_set)).wait()


def broadcast_object(obj: Any, root_rank: int = 0, name=None,
                     process_set=global_process_set) -> Any:
    """Pickle ``obj`` on root_rank and return it on every rank."""
    root = set_rank(process_set, root_rank)
    return _object_job("broadcast_object", lambda comm: comm.bcast(obj, root=root), process_set)


def allgather_object(obj: Any, name=None, process_set=global_process_set) -> List[Any]:
    """Return the list of every rank's ``obj``, in rank order."""
    return _object_job("allgather_object", lambda comm: comm.allgather(obj), process_set)


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank arrives (after every collective submitted before it)."""
    _object_job("barrier", lambda comm: None, process_set)
