"""Per-rank checkpoints that survive a rank killed mid-write, and the step every rank can resume.

hvcomm's optimizer state differs between ranks (error-feedback residuals, delayed weights), so
an exact resume needs one file per rank: ``DIR/step<S>.rank<R>.pt``. Each is written
durably (:mod:`hvcomm.durable`: a temporary name, fsync, rename, fsync of DIR), so a reader
sees a whole file or none, and a rank or node killed while writing leaves its previous
checkpoint intact. ``newest_common`` (collective) is the newest step that every rank has
finished saving: the step to resume from.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence, Union

import torch

from collectives.errors import HvcommError

from .. import durable

PathLike = Union[str, Path]


def path(directory: PathLike, step: int, rank: Optional[int] = None) -> Path:
    """``DIR/step<S>.rank<R>.pt`` (``rank`` defaults to this process's hvcomm rank)."""
    if rank is None:
        from .runtime import rank as _rank
        rank = _rank()
    return Path(directory) / f"step{step}.rank{rank}.pt"


def save(directory: PathLike, step: int, state: Any, rank: Optional[int] = None) -> Path:
    """Write this rank's ``state`` (anything ``torch.save`` takes) for ``step`` atomically and
    durably (:mod:`hvcomm.durable`), after removing the temporaries an earlier, killed write
    of this rank left (DIR is made if need be); not collective. Returns the file's path."""
    final = path(directory, step, rank)
    final.parent.mkdir(parents=True, exist_ok=True)
    rank_suffix = final.name.split(".", 1)[1]  # rank<R>.pt
    durable.remove_stale(final.parent, f".step*.{rank_suffix}.*.tmp")
    return durable.write(final, lambda f: torch.save(state, f))


def saved_steps(directory: PathLike, rank: Optional[int] = None) -> List[int]:
    """The steps this rank has a complete checkpoint of in DIR, oldest first ([] if none or
    no DIR)."""
    if rank is None:
        from .runtime import rank as _rank
        rank = _rank()
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = re.compile(rf"step(\d+)\.rank{rank}\.pt$")
    return sorted(int(m.group(1)) for f in directory.iterdir() if (m := pattern.match(f.name)))


def newest_in_all(every: Sequence[Iterable[int]]) -> Optional[int]:
    """The largest number that every one of ``every`` holds, or None."""
    common = set(every[0]).intersection(*every[1:]) if every else set()
    return max(common) if common else None


def newest_common(directory: PathLike, comm=None) -> Optional[int]:
    """COLLECTIVE over ``comm`` (default hvcomm's communicator): the newest step that every
    rank has saved; None when some rank has saved none (a first save cut short: start
    afresh). When every rank has saved steps but none in common, every rank raises
    :class:`HvcommError`."""
    if comm is None:
        from .runtime import mpi_comm
        comm = mpi_comm()
    every = comm.allgather(saved_steps(directory, comm.Get_rank()))
    if not all(every):
        return None
    step = newest_in_all(every)
    if step is None:
        raise HvcommError(f"{directory}: the ranks have saved steps, but no step in common "
                          f"({dict(enumerate(every))}): files from another run? Start from an "
                          "empty directory", everywhere=True)
    return step


def prune(directory: PathLike, keep: int = 2, rank: Optional[int] = None) -> None:
    """Remove this rank's checkpoints but the ``keep`` newest (at least 2: the ranks may be one
    step apart, and ``newest_common`` needs a step that all of them still have)."""
    if keep < 2:
        raise ValueError(f"keep must be at least 2, got {keep}")
    for step in saved_steps(directory, rank)[:-keep]:
        path(directory, step, rank).unlink(missing_ok=True)


def load(directory: PathLike, step: int, rank: Optional[int] = None) -> Any:
    """This rank's checkpoint of ``step`` (on the CPU)."""
    return torch.load(path(directory, step, rank), map_location="cpu", weights_only=False)
