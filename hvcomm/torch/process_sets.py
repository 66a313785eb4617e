"""Horovod's process sets on MPI sub-communicators: collectives among a subset of the ranks."""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

from mpi4py import MPI

from collectives.errors import HvcommError, check_agree

from . import fault
from .runtime import runtime


class ProcessSet:
    """A set of ranks (of ``hvcomm.torch.init``'s communicator) that run collectives among
    themselves. Create one on every rank with :func:`add_process_set`; pass it as
    ``process_set=`` to any collective or to DistributedOptimizer."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks: List[int] = sorted(int(r) for r in ranks)
        self.process_set_id: Optional[int] = None
        self.comm: Optional[MPI.Comm] = None  # None on ranks outside the set

    def included(self) -> bool:
        return self.comm is not None

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This rank's position in the set."""
        return self._member().Get_rank()

    def _member(self) -> MPI.Comm:
        if self.process_set_id is None:
            raise HvcommError(f"process set {self.ranks} is not registered; call "
                              "hvcomm.torch.add_process_set on every rank first")
        if self.comm is None:
            raise HvcommError(f"this rank ({runtime().comm.Get_rank()}) is not in process set "
                              f"{self.ranks}; call collectives on a process set only from its "
                              "ranks")
        return self.comm

    def forget(self) -> None:
        """No longer registered (removed, or hvcomm shut down): its communicator is not
        this set's any more."""
        self.comm, self.process_set_id = None, None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank: the engine's own communicator (whatever init() was given)."""

    def __init__(self):  # no ranks of its own: they follow init()
        self.process_set_id = 0

    ranks = property(lambda self: list(range(runtime().comm.Get_size())))
    comm = property(lambda self: runtime().engine.comm)


global_process_set = _GlobalProcessSet()


def comm_of(process_set: Optional[ProcessSet]) -> MPI.Comm:
    """The communicator a collective on ``process_set`` runs on (None: every rank)."""
    if process_set is None:
        return runtime().engine.comm
    if not isinstance(process_set, ProcessSet):
        raise HvcommError(f"process_set must be an hvcomm ProcessSet (from add_process_set), "
                          f"got {type(process_set).__name__}")
    return process_set._member()


def set_rank(process_set: Optional[ProcessSet], rank: int) -> int:
    """The position in ``process_set`` of ``rank`` (a rank of init()'s communicator, as
    Horovod's root_rank always is)."""
    if process_set is None or process_set is global_process_set:
        return int(rank)
    if rank not in process_set.ranks:
        raise HvcommError(f"root rank {rank} is not in process set {process_set.ranks}")
    return process_set.ranks.index(rank)


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    rt = runtime()
    size = rt.comm.Get_size()
    problem = None
    if ps.process_set_id is not None:
        problem = f"process set {ps.ranks} is already registered"
    elif not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) \
            or not all(0 <= r < size for r in ps.ranks):
        problem = f"process set ranks must be distinct ranks in [0, {size}), got {ps.ranks}"
    elif any(p.ranks == ps.ranks for p in rt.process_sets.values()):
        problem = f"a process set with ranks {ps.ranks} is already registered"

    def job(comm):
        check_agree(comm, tuple(ps.ranks), "add_process_set", problem)
        sub = comm.Create(comm.Get_group().Incl(ps.ranks))
        fault.track(sub)
        return None if sub == MPI.COMM_NULL else sub

    ps.comm = rt.engine.submit(job).wait()
    ps.process_set_id = max(rt.process_sets, default=0) + 1
    rt.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective: every rank). False if it was not registered."""
    rt = runtime()
    if process_set is global_process_set or process_set.process_set_id not in rt.process_sets:
        return False
    rt.engine.submit(lambda comm: comm.Barrier()).wait()
    del rt.process_sets[process_set.process_set_id]
    if process_set.comm is not None:
        process_set.comm.Free()
    process_set.forget()
    return True
