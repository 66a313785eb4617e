"""Handles (submit, poll, synchronize) and the allreduce family with Horovod's names, run in order
by the engine; the other collectives are in :mod:`hvcomm.torch.exchange_ops`."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from mpi4py import MPI

from collectives.errors import HvcommError

from .negotiation import join_loop, negotiate
from .process_sets import comm_of, global_process_set
from .runtime import new_handle_id, runtime
from .sums import adasum_, sum_in_place

Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
_MPI_OPS = {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def check_name(kind: str, name: Optional[str]) -> Optional[str]:
    """Horovod's rule: no two operations in flight with the same name (a ValueError)."""
    if name is not None and (kind, name) in runtime().names_in_flight:
        raise HvcommError(f"{kind}: an operation named {name!r} is still in flight; "
                          "synchronize it first or give this one another name")
    return name


def submit(kind: str, name: Optional[str], job: Callable[[MPI.Comm], Any],
           finish: Callable[[Any], Any], process_set=None,
           tensor: Optional[torch.Tensor] = None) -> int:
    """Queue ``job`` on the engine (on the process set's communicator); returns the handle
    whose synchronize() gives ``finish(job's result)``. ``tensor``'s shape and dtype show in
    stall reports."""
    check_name(kind, name)
    comm, rt = comm_of(process_set), runtime()
    hid = new_handle_id()
    span = f"{kind.upper()} {kind}.{name or 'noname'}"  # Horovod's timeline names
    detail = None if tensor is None else f"shape {list(tensor.shape)}, {tensor.dtype}"
    rt.handles[hid] = (rt.engine.submit(job, span, comm, detail), finish,
                       None if name is None else (kind, name))
    if name is not None:
        rt.names_in_flight.add((kind, name))
    return hid


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` has finished."""
    return _lookup(handle)[0].done()


def synchronize(handle: int) -> Any:
    """Wait for ``handle`` and return its output tensor."""
    job, finish, name = _lookup(handle)
    rt = runtime()
    if not job.done():
        rt.engine.check_can_wait("synchronize")
    del rt.handles[handle]
    rt.names_in_flight.discard(name)
    return finish(job.wait())


def _lookup(handle: int):
    handles = runtime().handles
    if handle not in handles:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return handles[handle]


def _resolve_op(average: Optional[bool], op: Optional[str]) -> str:
    if average is not None and op is not None:
        raise ValueError("pass either average (deprecated) or op, not both")
    op = op if op is not None else (Sum if average is False else Average)
    if op not in _MPI_OPS and op != Adasum:
        raise ValueError(f"unknown op {op!r}; use hvcomm.torch.Average, Sum, Min, Max or Product")
    return op


_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
              torch.int8, torch.int16, torch.int32, torch.int64)


def check_reducible(what: str, dtype: torch.dtype) -> None:
    """Called after the negotiation, so every rank (same dtype) raises together."""
    if dtype not in _REDUCIBLE:
        raise HvcommError(f"{what}: {dtype} tensors cannot be reduced; reductions take "
                          f"{', '.join(str(d) for d in _REDUCIBLE)} (allgather and broadcast "
                          "take any dtype)", everywhere=True)


def scale_(tensor: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """Multiply by ``factor / divisor`` in place as Horovod scales: integers in float64 and
    float16/bfloat16 in float32, cast back to the tensor's dtype (integers truncated towards
    zero). The division by ``divisor`` (the size, for an average) is a division, not a product
    with its reciprocal: an average is the correctly rounded quotient (and for integers the
    exact truncated one), as a serial ``sum / size`` gives."""
    if factor == 1.0 and divisor == 1:
        return
    if tensor.dtype in (torch.float32, torch.float64):
        tensor.mul_(factor).div_(divisor)
    else:
        wide = torch.float32 if tensor.dtype.is_floating_point else torch.float64
        tensor.copy_(tensor.to(wide) * factor / divisor)


def _reduce_in_place(comm: MPI.Comm, tensor: torch.Tensor, op: str) -> None:
    """Reduce a contiguous host tensor over the ranks. Sums go through :func:`sum_in_place`;
    Min, Max and Product of float16 and bfloat16 (which Open MPI cannot reduce at speed, or
    at all) are taken in float32."""
    if op in (Sum, Average):
        sum_in_place(comm, tensor)
        return
    wide = tensor.dtype in (torch.float16, torch.bfloat16)
    buf = tensor.float() if wide else tensor
    comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=_MPI_OPS[op])
    if wide:
        tensor.copy_(buf)


def _zeros_for(sig: tuple) -> torch.Tensor:
    """A joined rank's contribution to the allreduce ``sig``."""
    _kind, _name, shape, dtype, _op = sig
    return torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]))


def _contribute_zeros(comm: MPI.Comm, sig: tuple) -> None:
    _reduce_in_place(comm, _zeros_for(sig), sig[4])


def _allreduce_into(out: torch.Tensor, target: Optional[torch.Tensor], result: torch.Tensor,
                    name, op, prescale, postscale, process_set=None) -> int:
    """Reduce host buffer ``out`` in place, copy it into ``target`` (if any), give ``result``.
    Horovod's order: ``prescale`` each rank's tensor, reduce, then scale the result by
    ``postscale`` (divided by the size for an average). Ranks that have joined contribute
    zeros (the average still divides by the size)."""
    sig = ("allreduce", name, tuple(out.shape), str(out.dtype), op)
    what = f"allreduce {name or ''}".strip()

    def job(comm):
        negotiate(comm, sig, what, joinable=op != Adasum)
        check_reducible(what, out.dtype)
        scale_(out, prescale)
        if op == Adasum:
            adasum_(comm, out)
        else:
            _reduce_in_place(comm, out, op)
        scale_(out, postscale, comm.Get_size() if op == Average else 1)

    def finish(_):
        if target is not None:
            target.copy_(out)
        return result

    return submit("allreduce", name, job, finish, process_set, out)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start an in-place allreduce of ``tensor``; returns a handle for synchronize()."""
    op = _resolve_op(average, op)
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return _allreduce_into(tensor.data, None, tensor, name, op, prescale_factor,
                               postscale_factor, process_set)
    return _allreduce_into(_host_copy(tensor), tensor.data, tensor, name, op, prescale_factor,
                           postscale_factor, process_set)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start an allreduce into a new tensor; returns a handle for synchronize()."""
    op = _resolve_op(average, op)
    out = _host_copy(tensor)
    result = out if tensor.device.type == "cpu" else torch.empty_like(tensor)
    return _allreduce_into(out, None if result is out else result, result, name, op,
                           prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _group_names(name: Optional[str], n: int) -> List[Optional[str]]:
    return [None if name is None else f"{name}.{i}" for i in range(n)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start allreducing a list of tensors together; synchronize() returns the list."""
    handles = [allreduce_async(t, average, n, op, prescale_factor, postscale_factor, process_set)
               for t, n in zip(tensors, _group_names(name, len(tensors)))]
    return _group_handle(handles)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    handles = [allreduce_async_(t, average, n, op, prescale_factor, postscale_factor, process_set)
               for t, n in zip(tensors, _group_names(name, len(tensors)))]
    return _group_handle(handles)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def _group_handle(handles: List[int], finish: Callable[[list], Any] = list) -> int:
    """One handle for several: synchronize() returns ``finish(list of their results)``."""
    hid = new_handle_id()
    runtime().handles[hid] = (_GroupWait(handles), finish, None)
    return hid


class _GroupWait:
    def __init__(self, handles: List[int]):
        self.handles = handles

    def done(self) -> bool:
        return all(poll(h) for h in self.handles)

    def wait(self) -> list:
        return [synchronize(h) for h in self.handles]


def join(device=-1) -> int:
    """Horovod's join: this rank has no more data. Until every rank has joined, it takes part
    in the others' allreduces with zeros (other collectives raise on every rank meanwhile).
    Returns the last rank to join, the same on every rank."""
    engine = runtime().engine
    engine.check_can_wait("join")
    return engine.submit(lambda comm: join_loop(comm, lambda sig: _contribute_zeros(comm, sig))
                         ).wait()
