"""Which gradients travel together, planned from a measured trace (pure: no MPI, no torch).

A :class:`Trace` says, for one iteration, when each gradient became ready (seconds from the
start of the iteration, in the order the hooks were observed to fire), how many bytes it has,
and how long the optimizer update after communication takes. A :class:`Cost` is the fitted
allreduce time T(M) = a + b*M of the live communicator. From them:

- :func:`predict` predicts, for any grouping, when each bucket's allreduce starts and ends
  (one collective at a time, in launch order, as hvcomm's engine runs them), the
  non-overlapped communication time and the iteration time;
- each schedule method's ``plan`` (one module each in :mod:`hvcomm.torch.methods`: wfbp,
  single, threshold, merge_rule, mgwfbp) chooses a grouping and predicts it with
  :func:`predict`.

Groups are contiguous in the observed order and never mix ``keys`` (dtypes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from collectives.errors import HvcommError
from collectives.merged import BucketPlan

@dataclass(frozen=True)
class Trace:
    """One iteration as observed. Position i is the i-th gradient in the observed order.

    ``ready_s[i]``: when gradient i was final, from the start of the iteration (end of the
    previous step), or None if it never got one (an unused parameter: it is sent with zeros
    when backward ends). ``backward_end_s`` defaults to the last ready time. ``update_s``: the
    optimizer step after communication.
    """

    ready_s: Tuple[Optional[float], ...]
    nbytes: Tuple[int, ...]
    update_s: float = 0.0
    keys: Optional[Tuple[object, ...]] = None
    names: Optional[Tuple[str, ...]] = None
    backward_end_s: Optional[float] = None

    def __post_init__(self):
        n = len(self.nbytes)
        if len(self.ready_s) != n or (self.keys is not None and len(self.keys) != n) \
                or (self.names is not None and len(self.names) != n):
            raise HvcommError("Trace: ready_s, nbytes, keys and names must have one entry per "
                              "gradient")
        if n == 0:
            raise HvcommError("Trace: no gradients")
        if any(b < 0 for b in self.nbytes):
            raise HvcommError("Trace: nbytes must be >= 0")
        times = [t for t in self.ready_s if t is not None]
        if any(t < 0 for t in times):
            raise HvcommError("Trace: ready times must be >= 0 (seconds from iteration start)")
        if self.backward_end_s is None:
            object.__setattr__(self, "backward_end_s", max(times, default=0.0))

    def ready(self, i: int) -> float:
        t = self.ready_s[i]
        return self.backward_end_s if t is None else t

    def key(self, i: int) -> object:
        return None if self.keys is None else self.keys[i]


@dataclass(frozen=True)
class Cost:
    """T(M) = a_s + b_s_per_byte * M: the allreduce of one M-byte message."""

    a_s: float
    b_s_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.a_s + self.b_s_per_byte * nbytes


@dataclass(frozen=True)
class Prediction:
    """A grouping and what the model says of it. Times in seconds from iteration start."""

    schedule: str
    plan: BucketPlan                 # positions into the trace's order
    starts_s: Tuple[float, ...]      # allreduce start of each bucket
    ends_s: Tuple[float, ...]
    backward_end_s: float
    update_s: float

    @property
    def comm_end_s(self) -> float:
        return self.ends_s[-1]

    @property
    def non_overlapped_s(self) -> float:
        """Communication still running after the backward pass ended."""
        return max(0.0, self.comm_end_s - self.backward_end_s)

    @property
    def iteration_s(self) -> float:
        return max(self.comm_end_s, self.backward_end_s) + self.update_s

    @property
    def messages(self) -> int:
        return len(self.plan.buckets)

    def summary(self) -> Dict[str, float]:
        return {"schedule": self.schedule, "messages": self.messages,
                "iteration_s": self.iteration_s, "non_overlapped_s": self.non_overlapped_s,
                "backward_end_s": self.backward_end_s}


def predict(trace: Trace, plan: BucketPlan, cost: Cost, schedule: str = "") -> Prediction:
    """Predict the pipeline: bucket j starts when its last gradient is ready and bucket j-1
    has finished (one collective at a time, in launch order)."""
    if plan.num_arrays != len(trace.nbytes):
        raise HvcommError(f"predict: plan covers {plan.num_arrays} gradients, trace has "
                          f"{len(trace.nbytes)}")
    starts, ends = [], []
    end = 0.0
    for bucket in plan.buckets:
        ready = max(trace.ready(i) for i in bucket)
        start = max(end, ready)
        end = start + cost(sum(trace.nbytes[i] for i in bucket))
        starts.append(start)
        ends.append(end)
    return Prediction(schedule, plan, tuple(starts), tuple(ends), trace.backward_end_s,
                      trace.update_s)


def split_by_key(trace: Trace, groups: List[List[int]]) -> BucketPlan:
    """``groups`` with each cut where the key (dtype) changes: no message mixes dtypes."""
    out: List[Tuple[int, ...]] = []
    for g in groups:
        cur = [g[0]]
        for i in g[1:]:
            if trace.key(i) != trace.key(cur[-1]):
                out.append(tuple(cur))
                cur = []
            cur.append(i)
        out.append(tuple(cur))
    return BucketPlan(tuple(out))


def trace_from_layers(backward_s: Sequence[float], nbytes: Sequence[int], forward_s: float = 0.0,
                      update_s: float = 0.0) -> Trace:
    """A trace from per-layer backward times in backward order (output layer first), as in
    the MG-WFBP paper: layer i is ready at forward_s + sum(backward_s[:i+1])."""
    ready, t = [], forward_s
    for tb in backward_s:
        t += tb
        ready.append(t)
    return Trace(tuple(ready), tuple(nbytes), update_s)
