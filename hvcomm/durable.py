"""Files that survive a crash: written whole or not at all, and on disk before they count.

A file is written to a temporary name beside it, flushed and fsync-ed, renamed over its final
name (``os.replace``: a reader sees the old file or the new one, never a part), and then its
directory is fsync-ed so that the rename itself is on disk. Temporaries are named
``.<name>.<host>.<pid>.tmp`` (writers on different nodes of a shared file system can have the
same pid); :func:`remove_stale` removes those a killed writer left.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable, IO


def _temporary_suffix() -> str:
    return f"{socket.gethostname()}.{os.getpid()}.tmp"


def temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{_temporary_suffix()}")


def write(path: Path, fill: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` durably: ``fill(f)`` writes the content to the open binary file ``f``."""
    path = Path(path)
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # fill() raised: leave no temporary behind
            tmp.unlink()
    sync_directory(path.parent)
    return path


def sync_directory(directory: Path) -> None:
    """fsync a directory, so that a rename or unlink in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(directory: Path, glob: str) -> None:
    """Remove the temporaries matching ``glob`` in ``directory`` that other processes (killed
    writers, or this rank's earlier runs) left; this process's own are kept."""
    mine = f".{_temporary_suffix()}"
    for stale in Path(directory).glob(glob):
        if stale.name.endswith(".tmp") and not stale.name.endswith(mine):
            stale.unlink(missing_ok=True)
