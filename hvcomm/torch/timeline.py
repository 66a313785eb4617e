"""Chrome-trace timeline of each rank's compute, compression and communication spans.

Enable with ``HVCOMM_TIMELINE=path`` (read by ``init()``) or ``hvcomm.torch.start_timeline(path)``
(defined in :mod:`hvcomm.torch.runtime`, which knows the rank).
Each rank writes its own file (rank 0 ``path`` itself, as Horovod's timeline, the others
``stem.rank<R>.json``),
in the Trace Event Format's JSON array form: open it in chrome://tracing or
https://ui.perfetto.dev. pid is the rank, so :func:`merge` can put all ranks in one view.
Threads: "main" (forward+backward, compression, waits, the update) and "comm" (the engine).
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterable, List, Optional

_TIDS = {"main": 1, "comm": 2}


class Timeline:
    def __init__(self, path: str, rank: int, size: int, mark_cycles: bool = False):
        if rank > 0:
            stem, ext = os.path.splitext(path)
            path = f"{stem}.rank{rank}{ext or '.json'}"
        self.path, self.rank, self.mark_cycles = path, rank, mark_cycles
        self._lock = threading.Lock()
        self._events: List[dict] = [
            {"name": "process_name", "ph": "M", "pid": rank,
             "args": {"name": f"rank {rank}",
                      "start_time_since_epoch_in_micros": int(self.now_us())}}]
        self._events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                          "args": {"name": name}} for name, tid in _TIDS.items()]
        self._written = 0
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(self.path, "w") as f:
            f.write("[\n")

    @staticmethod
    def now_us() -> float:
        return time.time_ns() / 1000.0

    def span(self, name: str, start_us: float, end_us: float, thread: str = "main",
             **args) -> None:
        event = {"name": name, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                 "pid": self.rank, "tid": _TIDS[thread]}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)
            if len(self._events) >= 2000:
                self._flush_locked()

    def instant(self, name: str, thread: str = "comm") -> None:
        with self._lock:
            self._events.append({"name": name, "ph": "i", "s": "t", "ts": self.now_us(),
                                 "pid": self.rank, "tid": _TIDS[thread]})

    @contextmanager
    def measure(self, name: str, thread: str = "main", **args):
        t0 = self.now_us()
        try:
            yield
        finally:
            self.span(name, t0, self.now_us(), thread, **args)

    def _flush_locked(self) -> None:
        with open(self.path, "a") as f:
            for e in self._events:
                f.write(("," if self._written else "") + json.dumps(e) + "\n")
                self._written += 1
        self._events = []

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            with open(self.path, "a") as f:
                f.write("]\n")


_active: Optional[Timeline] = None


def active() -> Optional[Timeline]:
    return _active


def start(file_path: str, rank: int, size: int, mark_cycles: bool = False) -> None:
    """Start writing this rank's timeline to ``file_path`` (see module doc); the Horovod-named
    ``hvcomm.torch.start_timeline`` passes the rank and size."""
    global _active
    stop_timeline()
    _active = Timeline(file_path, rank, size, mark_cycles)


def cycle() -> None:
    """The engine starts a job: a CYCLE_START mark when cycles are marked (Horovod's name)."""
    tl = _active
    if tl is not None and tl.mark_cycles:
        tl.instant("CYCLE_START")


def stop_timeline() -> None:
    """Finish and close the timeline file (also done by shutdown())."""
    global _active
    if _active is not None:
        tl, _active = _active, None
        tl.close()


@contextmanager
def measure(name: str, thread: str = "main", **args):
    """Record a span on the active timeline; free when none is active."""
    tl = _active
    if tl is None:
        yield
        return
    with tl.measure(name, thread, **args):
        yield


def merge(paths: Iterable[str], out: str) -> None:
    """Concatenate per-rank timeline files into one trace with every rank."""
    events = []
    for p in paths:
        with open(p) as f:
            events += json.load(f)
    with open(out, "w") as f:
        json.dump(events, f)
