"""Scratch buffers kept from one collective call to the next.

A collective's temporaries (merged pairs, gathered runs, received pieces) are as large as its
messages. Fresh allocations of that size come from new pages, each paid with a page fault,
which on this kind of machine takes as long as the arithmetic on them. A schedule run through
:func:`pooled` borrows a :class:`Workspace` for its whole life: calls in flight together each
hold their own, and a finished call hands it back. Nothing a call returns lives in one.
"""
from __future__ import annotations

from typing import List

import numpy as np


class Workspace:
    """Named scratch arrays, each grown as needed and reused."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, n: int, dtype) -> np.ndarray:
        """An uninitialised array of ``n`` elements of ``dtype``, the same memory every time
        for the same ``name`` (any hashable) and dtype."""
        dtype = np.dtype(dtype)
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.size < n:
            buf = self._buffers[(name, dtype)] = np.empty(max(n, 1024), dtype)
        return buf[:n]


_idle: List[Workspace] = []


def pooled(steps, *args):
    """Run the schedule ``steps(*args, ws)`` with a workspace of its own, handed back to the
    idle ones when the schedule ends."""
    ws = _idle.pop() if _idle else Workspace()
    try:
        return (yield from steps(*args, ws))
    finally:
        _idle.append(ws)
