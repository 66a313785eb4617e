"""The synchronous collectives as autograd functions, as in Horovod: gradients flow back
through ``allreduce`` (the same reduction of the gradient), ``allgather`` (the averaged
gradient's own rows), ``broadcast`` (the averaged gradient on the root, zeros elsewhere),
``alltoall`` (the gradient sent back) and ``reducescatter`` (the gradients gathered)."""
from __future__ import annotations

import torch

from . import exchange_ops as g
from .methods import Compression
from .ops import (Average, Sum, _resolve_op, allreduce_async, synchronize)
from .process_sets import comm_of, global_process_set, set_rank


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (synchronize(allreduce_async(grad.contiguous(), None, None, op, prescale,
                                            postscale, process_set)),
                None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks (default: average) and return the result."""
    op = _resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                           process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    return [allreduce(t, average, None if name is None else f"{name}.{i}", compression, op,
                      prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(g.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        averaged = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        rows = synchronize(g.allgather_async(torch.tensor([ctx.rows]), None, ctx.process_set))
        mine = comm_of(ctx.process_set).Get_rank()
        offset = int(rows[:mine].sum())
        return averaged.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    return [allgather(t, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(g.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        averaged = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        if comm_of(ctx.process_set).Get_rank() != set_rank(ctx.process_set, ctx.root_rank):
            averaged = averaged * 0
        return averaged, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """``root_rank``'s tensor, on every rank."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(g.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        back, _ = synchronize(g.alltoall_async(grad.contiguous(), ctx.received, None,
                                               ctx.process_set))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[i]`` of dimension 0 (default: equal parts) to rank i. Returns the
    received tensor, and with ``splits`` also the received splits (Horovod's convention)."""
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.op, ctx.process_set = op, process_set
        return synchronize(g.reducescatter_async(tensor, name, op, process_set, prescale,
                                                 postscale))

    @staticmethod
    def backward(ctx, grad):
        gathered = synchronize(g.allgather_async(grad.contiguous(), None, ctx.process_set))
        if ctx.op == Sum:
            gathered = gathered * comm_of(ctx.process_set).Get_size()
        return gathered, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """Reduce (Sum or Average) and keep this rank's rows of dimension 0."""
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    return [reducescatter(t, None if name is None else f"{name}.{i}", compression, op,
                          process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]
