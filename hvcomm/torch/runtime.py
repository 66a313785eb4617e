"""The state of hvcomm.torch in this process, in one place.

:class:`Runtime` is what lives from :func:`init` to :func:`shutdown`: the communicators, the
engine, the collectives in flight by handle and the registered process sets; shutdown()
forgets all of it. Beside it, what outlives one runtime: the communicator the next init()
starts on (:func:`world`, :func:`ran_on`) and every DistributedOptimizer (:func:`optimizers`),
which :mod:`hvcomm.torch.elastic` rebuilds on the next runtime after a failure.

Elsewhere, and why: :mod:`fault` tracks the communicators to revoke from the moment each is
made (a failure during init(), before a Runtime exists, must revoke them) and counts failures
across worlds; :mod:`preemption`'s flag is set by a signal handler at any time; :mod:`timeline`
is the file each span is written to, from any thread; :mod:`collectives.workspace` is a cache
of scratch buffers, not state.
"""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Union

from mpi4py import MPI

from collectives.errors import HvcommError, env_number

from . import ending, fault, timeline
from .engine import Engine
from .watchdog import Watchdog


@dataclass
class Runtime:
    comm: MPI.Comm          # the user's communicator (duplicated): object collectives
    local_comm: MPI.Comm    # ranks sharing this node
    cross_comm: MPI.Comm    # ranks with the same local rank, one per node
    engine: Engine          # tensor collectives, on a second duplicate
    fusion_threshold_bytes: int  # default bucket cap of DistributedOptimizer
    world: MPI.Comm         # the communicator init() was given (elastic: shrinks it)
    # handle -> (the engine's Handle, what synchronize() makes of its result, (kind, name))
    handles: Dict[int, tuple] = field(default_factory=dict)
    names_in_flight: Set[tuple] = field(default_factory=set)  # Horovod: one op per name
    process_sets: Dict[int, Any] = field(default_factory=dict)  # id -> registered ProcessSet


_runtime: Optional[Runtime] = None
_world: Optional[MPI.Comm] = None  # init()'s default once a failure has shrunk COMM_WORLD
_ran_on: Optional[MPI.Comm] = None  # the world of the latest init()
_handle_ids = itertools.count(1)   # never reused, so a stale handle is never another's
_optimizers: List["weakref.ref"] = []  # every DistributedOptimizer, in the order made


def new_handle_id() -> int:
    """A handle number no earlier collective of this process had."""
    return next(_handle_ids)


def remember_optimizer(optimizer) -> None:
    """Keep (weakly) a DistributedOptimizer, for :func:`optimizers`."""
    _optimizers.append(weakref.ref(optimizer))


def optimizers() -> list:
    """Every DistributedOptimizer still in use, in the order they were made (the same on
    every rank). (One lives while its parameters do: their gradient hooks hold it.)"""
    alive = [opt for opt in (ref() for ref in _optimizers) if opt is not None]
    _optimizers[:] = [weakref.ref(opt) for opt in alive]
    return alive


def _horovod_initialized() -> bool:
    hvd = sys.modules.get("horovod.torch")
    try:
        return bool(hvd is not None and hvd.is_initialized())
    except Exception:  # noqa: BLE001 - an unusable Horovod counts as not initialised
        return False


# glibc's malloc hands a large freed block back to the kernel (munmap, or trimming the heap), so
# the next step's bucket of the same size is new pages, each paid with a page fault on first
# touch: a 20 MB float16 -> float32 copy took 13-15 ms on fresh pages and 2.5 ms on reused
# ones here, and the fp16 step at P = 2 on shared memory 0.30 s instead of 0.21 s. DDP keeps its
# buckets; hvcomm's steps allocate theirs, so the process keeps freed memory instead.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_ABOVE = 2 ** 31 - 1  # bytes: the largest value mallopt takes


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process (allocations below 2 GiB from the
    heap, which is never trimmed), unless HVCOMM_KEEP_FREED_MEMORY=0. The resident size then
    stays at its peak, as a training step's does anyway. True if applied."""
    if os.environ.get("HVCOMM_KEEP_FREED_MEMORY", "1") == "0" \
            or not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_ABOVE) and mallopt(_M_TRIM_THRESHOLD, _KEEP_ABOVE))


def init(comm: Union[MPI.Comm, Sequence[int], None] = None, *,
         abort_on_error: Optional[bool] = None, stall_check_s: Optional[float] = None,
         stall_shutdown_s: Optional[float] = None) -> None:
    """Start hvcomm on ``comm`` (default MPI.COMM_WORLD, also when Horovod is initialised).

    ``comm`` may be an mpi4py communicator or, as in Horovod, a list of world ranks; the
    default is MPI.COMM_WORLD, or the survivors of it after :mod:`hvcomm.torch.elastic` has
    gone on without a failed process.
    ``abort_on_error`` (default: env HVCOMM_ABORT_ON_ERROR, else True) installs an excepthook
    that aborts the whole job on an uncaught exception when more than one rank runs. Under
    fault tolerance (``mpirun --with-ft ulfm``) it is ignored: the hook is always installed
    (see :mod:`hvcomm.torch.ending`).
    ``stall_check_s`` (env HVCOMM_STALL_CHECK_S, default 60) and ``stall_shutdown_s``
    (HVCOMM_STALL_SHUTDOWN_S, default off): see :mod:`hvcomm.torch.watchdog`.
    Calling init again with the same communicator does nothing.
    """
    global _runtime, _ran_on
    if _runtime is not None:
        return
    if fault.enabled() and os.environ.get("HVCOMM_RING_TRANSPORT") == "tcp":
        raise HvcommError("init: HVCOMM_RING_TRANSPORT=tcp does not work under fault tolerance "
                          "(mpirun --with-ft ulfm): revoking a communicator does not reach its "
                          "TCP links, so a failure could leave ranks waiting; unset it")
    # the settings first, so that a bad one raises before any collective
    threshold = env_number("HVCOMM_FUSION_THRESHOLD_BYTES", 25 * 2**20,  # DDP's default
                           "a whole number of bytes", 0, parse=int)
    if stall_check_s is None:
        stall_check_s = env_number("HVCOMM_STALL_CHECK_S", 60.0, "a number of seconds", 0.01)
    if stall_shutdown_s is None and os.environ.get("HVCOMM_STALL_SHUTDOWN_S"):
        stall_shutdown_s = env_number("HVCOMM_STALL_SHUTDOWN_S", "off", "a number of seconds",
                                      0.01)  # (read only when set: "off" is for the message)
    keep_freed_memory()
    if comm is None:
        comm = world()
    elif not isinstance(comm, MPI.Comm):
        ranks = list(comm)
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        comm = MPI.COMM_WORLD.Create(group)
        if comm == MPI.COMM_NULL:
            raise HvcommError(f"init: this rank is not in the ranks {ranks}")
    if _horovod_initialized():
        import horovod.torch as hvd
        if hvd.size() != comm.Get_size():
            raise HvcommError(f"init: Horovod runs on {hvd.size()} ranks but the communicator has "
                              f"{comm.Get_size()}; pass the communicator Horovod was given")
    _ran_on = comm
    ending.install(ran_on)  # first: a failure during init() must not end in MPI_Finalize
    # each communicator is tracked as soon as it exists: a failure during init() revokes it
    fault.track(comm)
    user = comm.Dup()
    fault.track(user)
    local = user.Split_type(MPI.COMM_TYPE_SHARED, key=user.Get_rank())
    cross = user.Split(local.Get_rank(), user.Get_rank())
    fault.track(local, cross)
    engine = Engine(user.Dup())
    fault.track(engine.comm)
    engine.watchdog = Watchdog(engine.comm.Dup(), engine, stall_check_s, stall_shutdown_s)
    fault.track(engine.watchdog.comm)
    _runtime = Runtime(user, local, cross, engine, threshold, comm)
    if abort_on_error is None:
        abort_on_error = os.environ.get("HVCOMM_ABORT_ON_ERROR", "1") != "0"
    ending.abort_on_uncaught(fault.enabled()
                             or (abort_on_error and MPI.COMM_WORLD.Get_size() > 1))
    if os.environ.get("HVCOMM_TIMELINE"):
        start_timeline(os.environ["HVCOMM_TIMELINE"])
    atexit.register(shutdown)


def shutdown() -> None:
    """Stop the engine and free hvcomm's communicators. init() may be called again later."""
    global _runtime
    if _runtime is None:
        return
    rt = _runtime
    watchdog = rt.engine.watchdog
    usable = not MPI.Is_finalized() and not fault.broken()  # a failure revoked them
    if rt.comm.Get_size() > 1 and usable:
        watchdog.announce("bye", "")
    rt.engine.close()
    if rt.engine.stuck and usable:
        watchdog.wait_for_departures(10.0)
        ending.abort_job("shut down with a collective that can never finish")
    watchdog.close()
    for process_set in rt.process_sets.values():
        process_set.forget()
    timeline.stop_timeline()
    _runtime = None
    if usable:
        for c in (watchdog.comm, rt.engine.comm, rt.cross_comm, rt.local_comm, rt.comm):
            c.Free()
    fault.untrack_all()
    if not fault.enabled():  # (under fault tolerance the hook stays: see hvcomm.torch.ending)
        ending.abort_on_uncaught(False)


def ran_on() -> MPI.Comm:
    """The communicator hvcomm runs on, or ran on last, or the survivors it is to go on with
    (the job's final world at exit). Unlike :func:`world`, not COMM_WORLD after
    ``init(comm)`` and ``shutdown()``."""
    return _runtime.world if _runtime is not None else _ran_on


def world() -> MPI.Comm:
    """The communicator hvcomm runs on, or will run on at the next init()."""
    if _runtime is not None:
        return _runtime.world
    return _world if _world is not None else MPI.COMM_WORLD


def continue_on(survivors: MPI.Comm) -> None:
    """After a failure: the next init() (without a communicator) starts on ``survivors``,
    which are the job's final world from now on (also if hvcomm never starts on them)."""
    global _world, _ran_on
    _world = _ran_on = survivors


def is_initialized() -> bool:
    return _runtime is not None


def runtime() -> Runtime:
    if _runtime is None:
        raise ValueError("hvcomm has not been initialized; run hvcomm.torch.init() first")
    return _runtime


def size() -> int:
    return runtime().comm.Get_size()


def rank() -> int:
    return runtime().comm.Get_rank()


def local_size() -> int:
    return runtime().local_comm.Get_size()


def local_rank() -> int:
    return runtime().local_comm.Get_rank()


def cross_size() -> int:
    return runtime().cross_comm.Get_size()


def cross_rank() -> int:
    return runtime().cross_comm.Get_rank()


def mpi_comm() -> MPI.Comm:
    """hvcomm's duplicate of the user's communicator, for mpi4py calls of your own."""
    return runtime().comm


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's name: start writing this rank's timeline (Chrome trace JSON) to
    ``file_path`` (ranks > 0: ``stem.rank<R>.json``); ``mark_cycles`` adds a CYCLE_START mark
    per engine job; see :mod:`hvcomm.torch.timeline`."""
    timeline.start(file_path, rank(), size(), mark_cycles)


# -- Horovod's build queries: hvcomm runs on MPI (mpi4py), on the CPU ----------------------------
def mpi_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return True


def mpi_threads_supported() -> bool:
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return False


gloo_enabled = nccl_built = ddl_built = ccl_built = cuda_built = rocm_built = gloo_built
