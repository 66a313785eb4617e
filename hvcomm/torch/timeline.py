"""Chrome-trace timeline of each rank's compute, compression and communication spans.

Enable with ``HVCOMM_TIMELINE=path`` (read by ``init()``) or ``hvcomm.torch.start_timeline(path)``
(defined in :mod:`hvcomm.torch.runtime`, which knows the rank).
Each rank writes its own file (rank 0 ``path`` itself, as Horovod's timeline, the others
``stem.rank<R>.json``),
in the Trace Event Format's JSON array form: open it in chrome://tracing or
https://ui.perfetto.dev. pid is the rank, so :func:`merge` can put all ranks in one view.
Threads: "main" (forward+backward, compression, waits, the update) and "comm" (the engine;
a collective it runs beside the one before it goes on "comm 2", see :data:`ENGINE_LANES`).
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Sequence

_TIDS = {"main": 1, "comm": 2, "comm 2": 3}
ENGINE_LANES = ("comm", "comm 2")  # the engine's collectives in flight at once, one a lane


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes of a timeline started at ``path``."""
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


class Timeline:
    def __init__(self, path: str, rank: int, size: int, mark_cycles: bool = False):
        path = rank_path(path, rank)
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


def arrival_skew_s(paths: Sequence[str], thread: str = "comm") -> float:
    """How long ranks waited for one another, from their timelines (one file per rank, their
    clocks one machine's): for each span on ``thread`` ("comm": the engine's collectives, on
    either of its :data:`ENGINE_LANES`), the time from the first rank's start to the last's,
    summed over the spans. The n-th last span of a name on each rank is one collective: the
    timelines end with nothing in flight, but may begin with a collective that one rank
    recorded and another had started before its timeline did. Spans that are not on every rank
    are left out."""
    tids = {_TIDS[t] for t in (ENGINE_LANES if thread == "comm" else (thread,))}
    starts = []  # per rank: span name -> start times (us)
    for path in paths:
        with open(path) as f:
            events = json.load(f)
        by_name: Dict[str, List[float]] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("tid") in tids:
                by_name.setdefault(e["name"], []).append(e["ts"])
        starts.append(by_name)
    skew_us = 0.0
    for name in set.intersection(*(set(s) for s in starts)) if starts else ():
        for arrivals in zip(*(sorted(s[name], reverse=True) for s in starts)):
            skew_us += max(arrivals) - min(arrivals)
    return skew_us / 1e6


def merge(paths: Iterable[str], out: str) -> None:
    """Concatenate per-rank timeline files into one trace with every rank."""
    events = []
    for p in paths:
        with open(p) as f:
            events += json.load(f)
    with open(out, "w") as f:
        json.dump(events, f)
