"""Tensor and object collectives with Horovod's names, run in order by the engine."""
from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from collectives.dense import iring_allreduce
from collectives.errors import HvcommError, check_agree

from .compression import Compression
from .engine import Handle
from .runtime import runtime

Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
_MPI_OPS = {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}

_handles: Dict[int, Tuple[Handle, Callable[[Any], Any]]] = {}
_next_handle = itertools.count(1)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor (clear error for what NumPy cannot hold)."""
    if tensor.dtype == torch.bfloat16:
        raise HvcommError("bfloat16 tensors cannot be communicated by hvcomm; use float32 "
                          "(or compression=Compression.fp16)")
    return tensor.detach().numpy()


def _as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view for collectives that only move data: bfloat16 as its raw 16 bits."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _signature_hash(sig: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=7).digest(), "little")


def check_signature(comm: MPI.Comm, sig: tuple, what: str) -> None:
    """Raise on every rank unless all ranks submit the same (kind, name, shape, dtype, op)."""
    h = _signature_hash(sig)
    both = np.array([h, -h], np.int64)
    comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    if both[0] != -both[1]:
        raise HvcommError(f"{what}: ranks submitted different collectives (this rank: {sig}); "
                          "every rank must call hvcomm collectives in the same order with "
                          "tensors of the same shape and dtype")


def sum_in_place(comm: MPI.Comm, buf: np.ndarray) -> None:
    """Sum ``buf`` over the ranks in place. float16 goes over hvcomm's ring (float16 on the
    wire, float32 additions): Open MPI's float16 sum is about 100x slower than float32's."""
    if buf.dtype == np.float16:
        iring_allreduce(comm, buf).wait()
    else:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def _register(handle: Handle, finish: Callable[[Any], Any]) -> int:
    hid = next(_next_handle)
    _handles[hid] = (handle, finish)
    return hid


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` has finished."""
    return _lookup(handle)[0].done()


def synchronize(handle: int) -> Any:
    """Wait for ``handle`` and return its output tensor."""
    job, finish = _lookup(handle)
    if not job.done():
        runtime().engine.check_can_wait("synchronize")
    del _handles[handle]
    return finish(job.wait())


def _lookup(handle: int):
    if handle not in _handles:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return _handles[handle]


def _resolve_op(average: Optional[bool], op: Optional[str]) -> str:
    if average is not None and op is not None:
        raise ValueError("pass either average (deprecated) or op, not both")
    op = op if op is not None else (Sum if average is False else Average)
    if op == Adasum:
        raise NotImplementedError("Adasum is not implemented by hvcomm; use Average or Sum")
    if op not in _MPI_OPS:
        raise ValueError(f"unknown op {op!r}; use hvcomm.torch.Average, Sum, Min, Max or Product")
    return op


_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
              torch.int8, torch.int16, torch.int32, torch.int64)


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place as Horovod scales: integers in float64 and float16/bfloat16 in
    float32, the product cast back to the tensor's dtype (integers truncated towards zero)."""
    if factor == 1.0:
        return
    if tensor.dtype in (torch.float32, torch.float64):
        tensor.mul_(factor)
    else:
        wide = torch.float32 if tensor.dtype.is_floating_point else torch.float64
        tensor.copy_(tensor.to(wide) * factor)


def _reduce_in_place(comm: MPI.Comm, tensor: torch.Tensor, op: str) -> None:
    """Reduce a contiguous host tensor over the ranks. bfloat16 (which NumPy lacks) is
    reduced as float32, and so is float16 under Min, Max and Product."""
    wide = tensor.dtype == torch.bfloat16 or (tensor.dtype == torch.float16
                                              and op not in (Sum, Average))
    buf = tensor.float() if wide else tensor
    if op in (Sum, Average):
        sum_in_place(comm, as_numpy(buf))
    else:
        comm.Allreduce(MPI.IN_PLACE, as_numpy(buf), op=_MPI_OPS[op])
    if wide:
        tensor.copy_(buf)


def _allreduce_into(out: torch.Tensor, target: Optional[torch.Tensor], result: torch.Tensor,
                    name, op, prescale, postscale):
    """Reduce host buffer ``out`` in place, copy it into ``target`` (if any), give ``result``.
    Horovod's order: ``prescale`` each rank's tensor, reduce, then scale the result by
    ``postscale`` (divided by the size for an average)."""
    sig = ("allreduce", name, tuple(out.shape), str(out.dtype), op)
    what = f"allreduce {name or ''}".strip()

    def job(comm):
        check_signature(comm, sig, what)
        if out.dtype not in _REDUCIBLE:  # the same dtype on every rank: all raise together
            raise HvcommError(f"{what}: {out.dtype} tensors cannot be reduced; allreduce "
                              f"takes {', '.join(str(d) for d in _REDUCIBLE)} (allgather and "
                              "broadcast take any dtype)")
        scale_(out, prescale)
        _reduce_in_place(comm, out, op)
        scale_(out, postscale / comm.Get_size() if op == Average else postscale)

    def finish(_):
        if target is not None:
            target.copy_(out)
        return result

    return _register(runtime().engine.submit(job), finish)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """Start an in-place allreduce of ``tensor``; returns a handle for synchronize()."""
    op = _resolve_op(average, op)
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return _allreduce_into(tensor.data, None, tensor, name, op, prescale_factor,
                               postscale_factor)
    return _allreduce_into(_host_copy(tensor), tensor.data, tensor, name, op, prescale_factor,
                           postscale_factor)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Start an allreduce into a new tensor; returns a handle for synchronize()."""
    op = _resolve_op(average, op)
    out = _host_copy(tensor)
    if tensor.device.type == "cpu":
        return _allreduce_into(out, None, out, name, op, prescale_factor, postscale_factor)
    result = torch.empty_like(tensor)
    return _allreduce_into(out, result, result, name, op, prescale_factor, postscale_factor)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default: average) and return the result."""
    compressed, ctx = compression.compress(tensor)
    out = synchronize(allreduce_async(compressed, average, name, op, prescale_factor,
                                      postscale_factor))
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def allgather_async(tensor, name=None, process_set=None) -> int:
    """Start gathering ``tensor`` from every rank, concatenated along dimension 0."""
    src = _host_copy(tensor if tensor.dim() else tensor.reshape(1))
    sig = (tuple(src.shape[1:]), str(src.dtype))

    def job(comm):
        rows = comm.allgather((src.shape[0], sig))
        if any(s != sig for _, s in rows):
            raise HvcommError(f"allgather {name or ''}: tensors differ beyond dimension 0 or in "
                              f"dtype across ranks: {[s for _, s in rows]}")
        per_row = int(np.prod(src.shape[1:], dtype=np.int64))
        counts = [n * per_row for n, _ in rows]
        out = torch.empty((sum(n for n, _ in rows), *src.shape[1:]), dtype=src.dtype)
        comm.Allgatherv(_as_bits(src).ravel(), (_as_bits(out).ravel(), counts))
        return out

    return _register(runtime().engine.submit(job), lambda out: out.to(tensor.device))


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    return synchronize(allgather_async(tensor, name))


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    """Start an in-place broadcast of ``tensor`` from ``root_rank``."""
    in_place = tensor.device.type == "cpu" and tensor.is_contiguous()
    host = tensor.data if in_place else _host_copy(tensor)
    buf = _as_bits(host)
    sig = ("broadcast", name, tuple(host.shape), str(host.dtype), int(root_rank))

    def job(comm):
        if not 0 <= root_rank < comm.Get_size():
            raise HvcommError(f"broadcast: root_rank {root_rank} outside [0, {comm.Get_size()})")
        check_signature(comm, sig, f"broadcast {name or ''}".strip())
        comm.Bcast(buf, root=root_rank)

    def finish(_):
        if not in_place:
            tensor.data.copy_(host)
        return tensor

    return _register(runtime().engine.submit(job), finish)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name)


def broadcast_(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast(tensor, root_rank, name=None, process_set=None) -> torch.Tensor:
    return synchronize(broadcast_async(tensor, root_rank, name))


def _object_job(fn: Callable[[MPI.Comm], Any]) -> Any:
    engine = runtime().engine
    engine.check_can_wait("object collective")
    return engine.submit(fn).wait()


def broadcast_object(obj: Any, root_rank: int = 0, name=None, process_set=None) -> Any:
    """Pickle ``obj`` on root_rank and return it on every rank."""
    return _object_job(lambda comm: comm.bcast(obj, root=root_rank))


def allgather_object(obj: Any, name=None, process_set=None) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    return _object_job(lambda comm: comm.allgather(obj))


def barrier(process_set=None) -> None:
    """Wait until every rank arrives (after every collective submitted before it)."""
    _object_job(lambda comm: comm.Barrier())


def join(device=-1) -> int:
    """Horovod's join for uneven data is not supported: each rank must run the same steps."""
    raise NotImplementedError("hvcomm does not implement join(); give every rank the same number "
                              "of batches (e.g. drop_last=True in the DistributedSampler)")


def agree(what: str, key: Any, local_error: Optional[str] = None) -> None:
    """Collective check (raises on every rank) that all ranks pass equal keys."""
    check_agree(runtime().comm, key, what, local_error)
