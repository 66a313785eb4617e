"""The in-place sums every layer above builds on: the dense sum of a tensor over the ranks (on
:mod:`collectives.ring`, torch's kernels doing the additions) and Horovod's Adasum. Below
:mod:`hvcomm.torch.methods` and :mod:`hvcomm.torch.ops`, which both call them; importing this
needs no MPI library (mpi4py is imported when a sum runs)."""
from __future__ import annotations

import numpy as np
import torch

from collectives.errors import HvcommError
from collectives.workspace import Workspace


def as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view for collectives that only move data: bfloat16 as its raw 16 bits."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()


def add_torch(dst: np.ndarray, src: np.ndarray, ws: Workspace) -> None:
    """The ring's in-place addition with torch's vectorised kernels: float16 and bfloat16
    (uint16 bits) summed in float32 and rounded once, several times faster than NumPy's."""
    if dst.dtype == np.uint16:  # (torch reads uint16 arrays from 2.3 on: through int16)
        torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16).add_(
            torch.from_numpy(src.view(np.int16)).view(torch.bfloat16))
    else:
        torch.from_numpy(dst).add_(torch.from_numpy(src))


_RING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _ring_buffer(tensor: torch.Tensor):
    """(the NumPy array the ring sums for ``tensor``, whether it holds bfloat16 bits,
    whether the ring can scale it: float32 and float64)."""
    brain = tensor.dtype == torch.bfloat16
    buf = as_bits(tensor).view(np.uint16) if brain else tensor.detach().numpy()
    return buf, brain, tensor.dtype in (torch.float32, torch.float64)


def sum_in_place(comm, tensor: torch.Tensor, scale: float = 1.0) -> None:
    """Sum a contiguous CPU tensor over the ranks in place, then multiply it by ``scale``
    (as ``tensor.mul_(scale)`` would). Floating-point tensors go over
    :func:`collectives.ring.allreduce_sum` (hvcomm's pipelined ring for large tensors, Open
    MPI's allreduce for small ones; float16 and bfloat16 on the wire as 16 bits, each addition
    in float32; float32 and float64 scaled inside the ring, on 1/P of the tensor per rank);
    other dtypes over Open MPI's allreduce."""
    from collectives.ring import allreduce_sum  # (loads numba: not at import)
    wide = False
    if tensor.dtype in _RING_DTYPES:
        buf, brain, wide = _ring_buffer(tensor)
        allreduce_sum(comm, buf, bfloat16=brain, add=add_torch, scale=scale if wide else 1.0,
                      check=False)
    else:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, tensor.detach().numpy(), op=MPI.SUM)
    _scale_after_sum(tensor, scale, wide)


def _scale_after_sum(tensor: torch.Tensor, scale: float, scaled_in_ring: bool) -> torch.Tensor:
    """``tensor.mul_(scale)`` where the sum did not scale it (16-bit and non-floating sums:
    a 16-bit sum scaled in the ring would be rounded twice); returns ``tensor``."""
    return tensor.mul_(scale) if scale != 1.0 and not scaled_in_ring else tensor


def start_ring_sum(comm, tensor: torch.Tensor, scale: float, tag: int):
    """:func:`sum_in_place` started without waiting, where it goes over the ring (a floating
    tensor of the ring's sizes, more than one rank): a :class:`collectives.handle.Pending`
    whose ``wait()`` returns ``tensor`` holding the sum; None where it would go over Open MPI's
    blocking allreduce (call :func:`sum_in_place` then). Sums in flight together need
    distinct ``tag``s."""
    from collectives.ring import iring_allreduce, kind_of, use_ring
    if tensor.dtype not in _RING_DTYPES:
        return None
    buf, brain, wide = _ring_buffer(tensor)
    if not use_ring(buf.nbytes, comm.Get_size(), kind_of(buf, brain)):
        return None
    pending = iring_allreduce(comm, buf, bfloat16=brain, add=add_torch,
                              scale=scale if wide else 1.0, tag=tag, check=False)
    return pending.then(lambda _: _scale_after_sum(tensor, scale, wide))


def adasum_(comm, tensor: torch.Tensor) -> None:
    """Horovod's adaptive summation, in place: pairs of ranks' tensors are combined as
    a' = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, up a binary tree over the ranks (any P;
    a rank without a partner goes up unchanged), computed in float64 on every rank alike."""
    if not tensor.dtype.is_floating_point:
        raise HvcommError(f"Adasum needs floating-point tensors, got {tensor.dtype}")
    level = [torch.from_numpy(x) for x in comm.allgather(tensor.double().numpy())]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            a, b = level[i].reshape(-1), level[i + 1].reshape(-1)
            dot, aa, bb = a @ b, a @ a, b @ b
            ca = 1 - dot / (2 * aa) if aa > 0 else 1.0
            cb = 1 - dot / (2 * bb) if bb > 0 else 1.0
            nxt.append((ca * a + cb * b).reshape(level[i].shape))
        level = nxt + level[len(level) - len(level) % 2:]
    tensor.copy_(level[0])
