"""The state an elastic job commits, restores and synchronises (Horovod 0.28.1's names and
semantics): :class:`State`, :class:`ObjectState` (and :class:`TorchState`, in
:mod:`hvcomm.torch.elastic.torch_state`).

- ``commit()``: ``save()`` a copy in host memory, numbered (:attr:`State.commit_id`), then
  ``check_host_updates()``. The two newest commits are kept.
- ``restore(commit_id=None)``: back to that commit (default the newest). After a failure the
  survivors may be one commit apart (a step's collective can complete on some ranks and fail
  on others, and only the first go on to commit): ``hvcomm.torch.elastic.run`` restores the
  newest commit that every survivor has.
- ``sync()``: every rank takes the lowest rank's state (rank 0 of the current world), which
  becomes the newest commit's copy: ``restore()`` after ``sync()`` goes back to it.
- On disk (``HVCOMM_ELASTIC_SAVE_EVERY=N`` with ``HVCOMM_CHECKPOINT_DIR``): every N-th commit
  each rank also writes its copy to ``$HVCOMM_CHECKPOINT_DIR/elastic`` (one file per rank,
  the two newest kept; :mod:`hvcomm.torch.checkpoint`), and ``hvcomm.torch.elastic.run``
  starts from the newest commit there that every rank of the new job has: a job relaunched
  after losing a node (slurm/common.sh) goes on from it, on as many ranks as are left (rank r
  takes rank r's copy).

What a DistributedOptimizer keeps travels with its ``state_dict()`` (the "hvcomm" entry: step
counter, this rank's error-feedback residuals, the compressor's and the delayed methods'
state): a commit saves this rank's, ``restore()`` brings it back, and ``sync()`` sends rank
0's, all but the residuals (``PER_RANK_STATE``), which stay each rank's own. A failed rank's
residuals are lost with it.
"""
from __future__ import annotations

import copy
import os
import queue
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple


from collectives.errors import HvcommError

from .. import checkpoint
from ..exchange_ops import allgather_object
from ..runtime import mpi_comm, rank, size


REMOVED, ADDED = 1, 2  # Horovod's HostUpdateResult flags (removed | added = mixed)
KEEP_COMMITS = 2


def saved_on_disk() -> Optional[Tuple[Path, int]]:
    """(the directory, every how many commits) elastic state goes to disk, or None (the
    environment: HVCOMM_ELASTIC_SAVE_EVERY, HVCOMM_CHECKPOINT_DIR)."""
    every = os.environ.get("HVCOMM_ELASTIC_SAVE_EVERY", "")
    if every in ("", "0"):
        return None
    if not every.isdigit():
        raise HvcommError(f"HVCOMM_ELASTIC_SAVE_EVERY must be a whole number of commits, got "
                          f"{every!r}")
    base = os.environ.get("HVCOMM_CHECKPOINT_DIR")
    if not base:
        raise HvcommError("HVCOMM_ELASTIC_SAVE_EVERY is set but HVCOMM_CHECKPOINT_DIR is not: "
                          "say where the elastic state goes (a shared file system)")
    return Path(base) / "elastic", int(every)


class Kept:
    """The :data:`KEEP_COMMITS` newest saved copies of one thing, by commit number."""

    def __init__(self):
        self._by_id: Dict[int, Any] = {}

    def put(self, commit_id: int, make: Callable[[Any], Any]) -> None:
        """Save ``make(reuse)`` as ``commit_id``; ``reuse`` is the copy it replaces (the same
        number saved again, or the oldest kept), whose buffers it may fill, or None."""
        reuse = self._by_id.pop(commit_id, None)
        if reuse is None and len(self._by_id) >= KEEP_COMMITS:
            reuse = self._by_id.pop(min(self._by_id))
        self._by_id[commit_id] = make(reuse)

    def ids(self) -> set:
        return set(self._by_id)

    def get(self, commit_id: int) -> Any:
        if commit_id not in self._by_id:
            raise HvcommError(f"elastic state: commit {commit_id} is not kept (kept: "
                              f"{sorted(self._by_id)})")
        return self._by_id[commit_id]

    def forget_newer(self, commit_id: int) -> None:
        """After a restore of ``commit_id``: the commits after it are not the job's any more."""
        for newer in [c for c in self._by_id if c > commit_id]:
            del self._by_id[newer]


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: every rank stops at the same commit and resets.
    ``skip_sync``: only hosts were removed, so the survivors' state is already the same."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts have changed")
        self.skip_sync = skip_sync


class State:
    """What an elastic job keeps in step across a reset. ``bcast_object(obj)`` gives every
    rank rank 0's ``obj``; ``get_rank()`` is this rank."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]):
        self._bcast_object, self._rank = bcast_object, get_rank
        self._host_messages: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []
        self.commit_id = 0
        """How many commits this state has made (the number its newest saved copy has)."""

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Call these after every reset (ranks lost or added), e.g. to rescale the learning
        rate by the new size."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int = REMOVED | ADDED) -> None:
        """A change of hosts was announced (``timestamp`` grows with each announcement;
        ``update_res``: :data:`REMOVED`, :data:`ADDED` or both, as Horovod's driver says)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (a copy in host memory), then check for host changes: raises
        :class:`HostsUpdatedInterrupt` on every rank when there are any. Collective."""
        self.save_commit()
        self.check_host_updates()

    def save_commit(self) -> None:
        """What :meth:`commit` does on this rank before its collective check: number the next
        commit, save it (and to disk when due)."""
        self.commit_id += 1
        self.save()
        self._save_to_disk_if_due()

    def check_host_updates(self) -> None:
        """Collective: every rank learns rank 0's newest host change, and raises
        :class:`HostsUpdatedInterrupt` together when there is a new one."""
        newest, update = self._last_updated_timestamp, 0
        while not self._host_messages.empty():
            timestamp, update_res = self._host_messages.get()
            if timestamp > newest:
                newest = timestamp
                update |= update_res
        previous = self._last_updated_timestamp
        previous, newest, update = self._bcast_object((previous, newest, update))
        self._last_updated_timestamp = newest
        if newest > previous:
            raise HostsUpdatedInterrupt(skip_sync=update == REMOVED)

    def save(self) -> None:
        raise NotImplementedError

    def _save_to_disk_if_due(self) -> None:
        """Every N-th commit, this rank's copy to disk (see the module); states that cannot
        say what they hold (a user's State) are not saved."""

    def restore(self, commit_id: Optional[int] = None) -> None:
        """Back to commit ``commit_id`` (default: the newest); subclasses that keep one copy
        only accept the newest."""
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called on a reset, before the reset callbacks."""


class ObjectState(State):
    """Picklable attributes, given as keyword arguments (``state.epoch``, ``state.batch``)."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)
        self._kept_objects = Kept()
        self._kept_objects.put(self.commit_id, lambda _: kwargs)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}
        self._kept_objects.put(self.commit_id, lambda _: self._saved_state)

    def kept_commits(self) -> set:
        """The commits this rank can restore (saved whole: a failure can interrupt a save)."""
        return self._kept_objects.ids()

    def _save_to_disk_if_due(self) -> None:
        where = saved_on_disk()
        if where is None or self.commit_id % where[1]:
            return
        checkpoint.save(where[0], self.commit_id, self._copy_of(self.commit_id))
        checkpoint.prune(where[0], keep=KEEP_COMMITS)

    def _copy_of(self, commit_id: int) -> Dict[str, Any]:
        """What this rank has kept of commit ``commit_id``, as one picklable dict (with the
        number of ranks that saved it)."""
        return {"objects": self._kept_objects.get(commit_id), "size": size()}

    def _keep(self, commit_id: int, copy_of: Dict[str, Any]) -> None:
        """Keep ``copy_of`` (a :meth:`_copy_of` read from disk) as commit ``commit_id``."""
        if set(copy_of["objects"]) != set(self._saved_state):
            raise HvcommError(f"the elastic state on disk holds {sorted(copy_of['objects'])}, "
                              f"this state {sorted(self._saved_state)}: another job's state? "
                              "Point HVCOMM_CHECKPOINT_DIR elsewhere")
        self._kept_objects.put(commit_id, lambda _: copy_of["objects"])

    def resume_from_disk(self) -> Optional[int]:
        """COLLECTIVE: restore the newest commit on disk that every rank has (see the
        module); the commit's number, or None (nothing saved, a first save cut short, or not
        saving). State saved by fewer ranks than this job has is refused on every rank."""
        where = saved_on_disk()
        if where is None:
            return None
        directory = where[0]
        mine = checkpoint.saved_steps(directory, rank())
        newest = checkpoint.load(directory, mine[-1]) if mine else None
        saved_by = {n for n in allgather_object(newest and newest.get("size")) if n}
        if any(n < size() for n in saved_by):
            raise HvcommError(f"{directory}: the elastic state there was saved by "
                              f"{sorted(saved_by)} ranks and this job has {size()}: an elastic "
                              "job resumes on as many ranks as saved it or fewer; start from an "
                              "empty HVCOMM_CHECKPOINT_DIR", everywhere=True)
        commit_id = checkpoint.newest_common(directory, mpi_comm())
        if commit_id is None:
            return None
        self._keep(commit_id, newest if commit_id == mine[-1]
                   else checkpoint.load(directory, commit_id))
        self.restore(commit_id)
        return commit_id

    def restore(self, commit_id: Optional[int] = None) -> None:
        commit_id = self.commit_id if commit_id is None else commit_id
        self._restore(commit_id)
        self.commit_id = commit_id

    def _restore(self, commit_id: int) -> None:
        self._saved_state = self._kept_objects.get(commit_id)
        self._kept_objects.forget_newer(commit_id)
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._kept_objects.put(self.commit_id, lambda _: self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
