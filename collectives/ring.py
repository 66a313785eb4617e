"""hvcomm's own dense allreduce: a pipelined ring over non-blocking point-to-point messages.

The sum is a ring reduce-scatter followed by a ring allgather, 2(P-1) steps in all. The flat
array is cut into P segments; at step s rank r receives segment (r - s - 1) mod P from rank
r - 1 (both phases alike): in the first P - 1 steps it adds what arrives into its own copy,
after which it holds segment r + 1 summed over every rank; in the last P - 1 it receives the
finished segments in place. Each rank sends to r + 1 and receives from r - 1: every link
carries 2(P-1)/P of the array each way, the bandwidth bound.

Each segment travels in chunks of ``chunk_bytes``. A chunk is forwarded as soon as it has
been added (or, in the allgather, has arrived), so the reduction of one chunk overlaps the
transfer of the next and a step starts before the previous one has finished; the received
chunks are added in place from a reused workspace.

16-bit floats (float16, and bfloat16 held as its raw bits in uint16) travel as 16 bits; each
addition is formed in float32 and rounded back once, so segment c's sum is the serial one
``x[c+1] + x[c] -> x[c+2] + that -> ...`` with one rounding per hop. Small messages go to Open
MPI's own allreduce (:func:`use_ring`: the sizes differ for 16-bit kinds), 16-bit ones widened
to float32 there.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import os
from typing import Callable, Optional

import numpy as np

from . import kernels, tcp
from .errors import HvcommError, check_agree, env_number
from .handle import Pending, completed
from .workspace import Workspace, pooled

RING_TAG = 7411
TRANSPORTS = ("mpi", "tcp")
# The pipeline's unit by transport (HVCOMM_RING_TRANSPORT): over collectives.tcp larger
# chunks cost less CPU and no time on emulated 1 and 10 Gbit links (scripts/bench_transport.py,
# results/ring_transport.md).
CHUNK_BYTES = {"mpi": 1 << 20, "tcp": 4 << 20}
# Below these sizes Open MPI's own allreduce is at least as fast as the ring, by
# scripts/bench_ring.py on shared memory and emulated 1 and 10 Gbit/s at P = 2 and 4
# (results/ring_crossover.md). float32/float64: the ring ties Open MPI's ring from 256 KiB at
# 1 Gbit but wins only from 4-16 MiB at 10 Gbit and from 16-64 MiB on shared memory. 16-bit:
# from 256 KiB the ring beats Open MPI's sum of the widened float32 (and its own float16 sum,
# slower still). HVCOMM_RING_MIN_BYTES overrides both.
RING_MIN_BYTES = {"wide": 16 << 20, "16-bit": 256 << 10}

FLOAT16, BFLOAT16 = "float16", "bfloat16"
_DTYPES = {np.dtype(np.float32): np.dtype(np.float32), np.dtype(np.float64): np.dtype(np.float64),
           np.dtype(np.float16): FLOAT16}

# add(dst, src, ws): dst += src in place, for dst's kind of element
Add = Callable[[np.ndarray, np.ndarray, Workspace], None]


def kind_of(array: np.ndarray, bfloat16: bool) -> Optional[object]:
    """The element kind the ring sums (a NumPy dtype, or FLOAT16 / BFLOAT16 for 16-bit bits),
    None if it sums no such array."""
    if bfloat16:
        return BFLOAT16 if array.dtype == np.uint16 else None
    return _DTYPES.get(array.dtype)


def numpy_add(kind) -> Add:
    """The torch-free addition for ``kind``: NumPy for float32/64, :mod:`kernels` for the
    16-bit kinds (float32 sums rounded once)."""
    if kind in (FLOAT16, BFLOAT16):
        brain = kind == BFLOAT16

        def add16(dst, src, ws):
            wide = ws.get("wide", 2 * dst.size, np.uint32)
            kernels.add16(dst.view(np.uint16), src.view(np.uint16), wide[:dst.size],
                          wide[dst.size:], brain)
        return add16

    def add(dst, src, ws):
        np.add(dst, src, out=dst)
    return add


def ring_min_bytes(kind=np.dtype(np.float32)) -> int:
    """The size from which :func:`use_ring` picks the ring for ``kind``
    (HVCOMM_RING_MIN_BYTES, or the measured :data:`RING_MIN_BYTES`)."""
    default = RING_MIN_BYTES["16-bit" if kind in (FLOAT16, BFLOAT16) else "wide"]
    return env_number("HVCOMM_RING_MIN_BYTES", default, "a whole number of bytes", 0, parse=int)


def use_ring(nbytes: int, size: int, kind=np.dtype(np.float32)) -> bool:
    """Whether a sum of ``nbytes`` of ``kind`` over ``size`` ranks goes over the ring."""
    return size > 1 and nbytes >= ring_min_bytes(kind)


@functools.lru_cache(maxsize=256)
def segments(n: int, p: int):
    """(offsets, counts) of the P segments of n elements: the first n mod P one longer."""
    counts = [n // p + (q < n % p) for q in range(p)]
    offsets = [sum(counts[:q]) for q in range(p)]
    return offsets, counts


def _chunks(offset: int, count: int, per: int):
    return [(s, min(per, offset + count - s)) for s in range(offset, offset + count, per)]


def ring_transport() -> str:
    """How the ring's chunks travel (HVCOMM_RING_TRANSPORT, the same on every rank): "mpi",
    Open MPI's point-to-point messages (the default), or "tcp", :mod:`collectives.tcp`'s own
    connections."""
    value = os.environ.get("HVCOMM_RING_TRANSPORT", "mpi")
    if value not in TRANSPORTS:
        raise HvcommError(f"HVCOMM_RING_TRANSPORT must be one of {', '.join(TRANSPORTS)}, got "
                          f"{value!r}; unset it for the default (mpi)")
    return value


@contextlib.contextmanager
def _messages(comm, transport: str, tag: int):
    """(send, receive) for ``transport``: each ``(buffer, rank, tag)`` -> a request (for
    "tcp", collective on the communicator's and the tag's first ring: the links are made)."""
    if transport == "tcp":
        with tcp.links_of(comm).ring(comm, tag) as messages:
            yield messages
        return
    yield ((lambda buf, rank, tag: comm.Isend(buf, dest=rank, tag=tag)),
           (lambda buf, rank, tag: comm.Irecv(buf, source=rank, tag=tag)))


def _ring_steps(comm, x, add: Add, scale: float, per: int, tag: int, transport: str,
               ws: Workspace):
    with _messages(comm, transport, tag) as (isend, irecv):
        return (yield from _ring_schedule(comm, x, add, scale, per, tag, isend, irecv, ws))


def scale_in_place(x: np.ndarray, scale: float) -> np.ndarray:
    """``x *= scale`` in x's (float32 or float64) precision, as torch multiplies a tensor by
    a Python number; returns ``x``."""
    if scale != 1.0:
        np.multiply(x, x.dtype.type(scale), out=x)
    return x


def _ring_schedule(comm, x, add: Add, scale: float, per: int, tag: int, isend, irecv,
                   ws: Workspace):
    flat = x.reshape(-1)  # a view: x is C-contiguous
    p, r = comm.Get_size(), comm.Get_rank()
    nxt, prv = (r + 1) % p, (r - 1) % p
    offsets, counts = segments(flat.size, p)
    steps = 2 * (p - 1)

    def chunks(s):  # the chunks of the segment received at step s (sent at step s + 1)
        seg = (r - s - 1) % p
        return _chunks(offsets[seg], counts[seg], per)

    inbox = ws.get("inbox", max(counts), flat.dtype)
    sends = {}  # flat offset -> the send that reads it (the allgather overwrites it later)

    def send(start, n):
        sends[start] = isend(flat[start:start + n], nxt, tag)

    def post_recv(s, start, n):  # step s's chunk: into the inbox to be added, or in place
        if s < p - 1:
            at = start - offsets[(r - s - 1) % p]
            return irecv(inbox[at:at + n], prv, tag)
        return irecv(flat[start:start + n], prv, tag)

    for start, n in _chunks(offsets[r], counts[r], per):  # step 0 sends this rank's segment
        send(start, n)
    pending = [post_recv(0, start, n) for start, n in chunks(0)]
    for s in range(steps):
        mine, seg_start = chunks(s), offsets[(r - s - 1) % p]
        following = chunks(s + 1) if s + 1 < steps else []
        for j, (start, n) in enumerate(mine):
            yield [pending[j]]
            if s < p - 1:
                add(flat[start:start + n], inbox[start - seg_start:start - seg_start + n], ws)
            if s == p - 2:  # the chunk's sum is complete here: scaled before the allgather
                scale_in_place(flat[start:start + n], scale)
            if s + 1 < steps:
                send(start, n)  # this chunk is step s + 1's
                if j < len(following):  # the receive that takes its place, in step order
                    yield from _free(sends, following[j][0], s + 1 >= p - 1)
                    pending[j] = post_recv(s + 1, *following[j])
        for j in range(len(mine), len(following)):  # a longer next segment's extra chunk
            yield from _free(sends, following[j][0], s + 1 >= p - 1)
            pending.append(post_recv(s + 1, *following[j]))
        del pending[len(following):]
    yield list(sends.values())
    return x


def _free(sends, start, in_place):
    """Before receiving in place over ``start``, the send that reads it must be complete."""
    old = sends.pop(start, None) if in_place else None
    if old is not None:
        yield [old]


def _checked_kind(comm, array, bfloat16: bool, check: bool, what: str,
                  bad_setting: Optional[str] = None, agree=(), scale: float = 1.0):
    """The kind ``array`` is summed as; raises HvcommError (on every rank with ``check``,
    which also makes the ranks agree on its size and kind, on ``scale`` and on ``agree``)
    if it cannot be (or be scaled), or with ``bad_setting``, the error of a setting."""
    kind = kind_of(array, bfloat16) if isinstance(array, np.ndarray) else None
    if not isinstance(array, np.ndarray):
        err = f"expected a numpy array, got {type(array).__name__}"
    elif not array.flags.c_contiguous:
        err = "array must be contiguous (use np.ascontiguousarray)"
    elif not array.flags.writeable:
        err = "array must be writeable: the sum is written into it"
    elif kind is None and bfloat16:
        err = f"bfloat16=True takes uint16 arrays holding bfloat16 bits, got {array.dtype}"
    elif kind is None:
        err = (f"cannot sum {array.dtype} arrays: use float32, float64, float16, or uint16 "
               "holding bfloat16 bits with bfloat16=True")
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        err = f"scale must be a real number, got {scale!r}"
    elif scale != 1.0 and kind in (FLOAT16, BFLOAT16):
        err = ("scale= is for float32 and float64 sums: multiply a 16-bit sum after it "
               "(it would be rounded twice here)")
    else:
        err = bad_setting
    if check:
        check_agree(comm, None if err else (array.size, str(kind), ("scale", scale), *agree),
                    what, err)
    elif err:
        raise HvcommError(f"{what}: {err}")
    return kind


def iring_allreduce(comm, x: np.ndarray, *, bfloat16: bool = False, add: Optional[Add] = None,
                    scale: float = 1.0, chunk_bytes: Optional[int] = None, tag: int = RING_TAG,
                    check: bool = True) -> Pending:
    """Start summing ``x`` over the ranks of ``comm`` in place, over the ring (whatever its
    size; see :func:`iallreduce_sum` for the choice of ring or Open MPI); ``wait()`` returns
    ``x``. Every rank ends with the same values.

    ``x``: C-contiguous float32, float64 or float16, or uint16 holding bfloat16 bits with
    ``bfloat16=True``; any shape (the ring runs over its flat view). ``add(dst, src, ws)``:
    the in-place addition (default :func:`numpy_add`; hvcomm.torch passes torch's, several
    times faster for 16-bit). ``scale``: the sum comes back multiplied by it, float32 and
    float64 only (each segment's owner scales it before the allgather: 1/P of the array, where
    a pass after the sum would touch all of it). ``chunk_bytes``: the pipeline's unit (default
    :data:`CHUNK_BYTES` of the transport, :func:`ring_transport`). Calls in flight together
    on one communicator need distinct tags. ``check``: the ranks first agree (one small
    allgather) that they pass the same size, kind, ``scale``, ``chunk_bytes`` and ``tag`` and
    have the same transport, else every rank raises HvcommError.

    Cost: 2(P-1) chunk latencies to fill the pipeline, 2(P-1)/P * bytes on every link.
    """
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool)
                                    or not isinstance(chunk_bytes, int) or chunk_bytes < 1):
        raise HvcommError(f"ring allreduce: chunk_bytes must be a positive integer, got "
                          f"{chunk_bytes!r}")
    try:
        transport, bad_setting = ring_transport(), None
    except HvcommError as err:  # raised on every rank by the agreement
        transport, bad_setting = None, str(err)
    kind = _checked_kind(comm, x, bfloat16, check, "ring allreduce", bad_setting,
                         agree=(("chunk_bytes", chunk_bytes), ("tag", tag),
                                ("HVCOMM_RING_TRANSPORT", transport)), scale=scale)
    if comm.Get_size() == 1 or x.size == 0:
        return completed(scale_in_place(x, scale))
    per = max(1, (chunk_bytes or CHUNK_BYTES[transport]) // x.itemsize)
    return Pending(pooled(_ring_steps, comm, x, add or numpy_add(kind), scale, per, tag,
                          transport))


def ring_allreduce(comm, x: np.ndarray, **kw) -> np.ndarray:
    """Blocking :func:`iring_allreduce`."""
    return iring_allreduce(comm, x, **kw).wait()


def _open_mpi_steps(comm, x, kind, scale: float, blocking: bool, ws: Workspace):
    """Open MPI's allreduce in place, 16-bit kinds widened to float32 for it, the sum then
    multiplied by ``scale`` (float32 and float64 only). ``blocking``:
    MPI_Allreduce itself, whose algorithm Open MPI tunes (on the emulated cluster: its ring);
    MPI_Iallreduce (libnbc) took 2.0-2.1x the ring model at P = 2 on 1 Gbit."""
    from mpi4py import MPI
    brain = kind == BFLOAT16
    buf = x
    if kind in (FLOAT16, BFLOAT16):
        flat16 = x.reshape(-1).view(np.uint16)
        wide = ws.get("widened", flat16.size, np.uint32)
        kernels.widen16(flat16, wide, brain)
        buf = wide.view(np.float32)
    if blocking:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        yield [comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)]
    if kind in (FLOAT16, BFLOAT16):
        kernels.narrow16(wide, flat16, brain)
    return scale_in_place(x, scale)


def _start_sum(comm, x, bfloat16: bool, add: Optional[Add], scale: float, tag: int,
               check: bool, blocking: bool) -> Pending:
    if isinstance(x, np.ndarray) and use_ring(x.nbytes, comm.Get_size(), kind_of(x, bfloat16)):
        return iring_allreduce(comm, x, bfloat16=bfloat16, add=add, scale=scale, tag=tag,
                               check=check)
    kind = _checked_kind(comm, x, bfloat16, check, "allreduce", scale=scale)
    if comm.Get_size() == 1 or x.size == 0:
        return completed(scale_in_place(x, scale))
    return Pending(pooled(_open_mpi_steps, comm, x, kind, scale, blocking))


def iallreduce_sum(comm, x: np.ndarray, *, bfloat16: bool = False, add: Optional[Add] = None,
                   scale: float = 1.0, tag: int = RING_TAG, check: bool = True) -> Pending:
    """Start summing ``x`` in place: over the ring from :func:`ring_min_bytes` bytes, else
    over Open MPI's allreduce (16-bit kinds widened to float32 for it and rounded back once:
    a small 16-bit sum is rounded once, a ring's once per hop). The arguments are
    :func:`iring_allreduce`'s (its default chunk size)."""
    return _start_sum(comm, x, bfloat16, add, scale, tag, check, blocking=False)


def allreduce_sum(comm, x: np.ndarray, *, bfloat16: bool = False, add: Optional[Add] = None,
                  scale: float = 1.0, tag: int = RING_TAG, check: bool = True) -> np.ndarray:
    """:func:`iallreduce_sum`, blocking: below the ring's sizes, Open MPI's blocking
    MPI_Allreduce, not its non-blocking one."""
    return _start_sum(comm, x, bfloat16, add, scale, tag, check, blocking=True).wait()
