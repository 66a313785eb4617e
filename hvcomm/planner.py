"""Which gradients travel together, planned from a measured trace (pure: no MPI, no torch).

A :class:`Trace` says, for one iteration, when each gradient became ready (seconds from the
start of the iteration, in the order the hooks were observed to fire), how many bytes it has,
and how long the optimizer update after communication takes. A :class:`Cost` is the fitted
allreduce time T(M) = a + b*M of the live communicator. From them:

- :func:`simulate` predicts, for any grouping, when each bucket's allreduce starts and ends
  (one collective at a time, in launch order, as hvcomm's engine runs them), the
  non-overlapped communication time and the iteration time;
- :func:`plan_wfbp`, :func:`plan_single`, :func:`plan_threshold` are the baselines (one tensor
  per message; everything in one message after backward; Horovod/DDP fusion by bytes);
- :func:`plan_merge_rule` is MG-WFBP's rule (ALGORITHMS.md section 3);
- :func:`plan_optimal` finds the grouping that minimises the predicted end of communication
  exactly (dynamic programme over contiguous groups, O(L^2)); hvcomm's ``"mgwfbp"`` schedule
  uses it, so it is never predicted slower than the merge rule or any baseline.

Groups are contiguous in the observed order and never mix ``keys`` (dtypes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from collectives.errors import HvcommError
from collectives.merged import BucketPlan

SCHEDULES = ("mgwfbp", "merge_rule", "wfbp", "single", "threshold")


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


def simulate(trace: Trace, plan: BucketPlan, cost: Cost, schedule: str = "") -> Prediction:
    """Predict the pipeline: bucket j starts when its last gradient is ready and bucket j-1
    has finished (one collective at a time, in launch order)."""
    if plan.num_arrays != len(trace.nbytes):
        raise HvcommError(f"simulate: plan covers {plan.num_arrays} gradients, trace has "
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


def _split_by_key(trace: Trace, groups: List[List[int]]) -> BucketPlan:
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


def plan_wfbp(trace: Trace, cost: Cost) -> Prediction:
    """Wait-free backprop: every gradient its own message, sent as soon as it is ready."""
    plan = BucketPlan(tuple((i,) for i in range(len(trace.nbytes))))
    return simulate(trace, plan, cost, "wfbp")


def plan_single(trace: Trace, cost: Cost) -> Prediction:
    """Everything in one message after backward (one per dtype)."""
    return simulate(trace, _split_by_key(trace, [list(range(len(trace.nbytes)))]), cost,
                    "single")


def plan_threshold(trace: Trace, cost: Cost, threshold_bytes: int) -> Prediction:
    """Horovod-style fusion / PyTorch DDP buckets: fill in order until threshold_bytes."""
    plan = BucketPlan.by_threshold(trace.nbytes, threshold_bytes, keys=trace.keys)
    return simulate(trace, plan, cost, "threshold")


def plan_merge_rule(trace: Trace, cost: Cost) -> Prediction:
    """MG-WFBP's rule: scanning gradients in ready order, merge the next one into the current
    bucket iff it becomes ready less than the startup time a after the current bucket's
    allreduce could start (waiting costs less than a second startup)."""
    groups: List[List[int]] = [[0]]
    prev_end = 0.0
    for i in range(1, len(trace.nbytes)):
        cur = groups[-1]
        start = max(prev_end, max(trace.ready(j) for j in cur))
        if trace.ready(i) - start < cost.a_s and trace.key(i) == trace.key(cur[-1]):
            cur.append(i)
        else:
            prev_end = start + cost(sum(trace.nbytes[j] for j in cur))
            groups.append([i])
    return simulate(trace, BucketPlan(tuple(tuple(g) for g in groups)), cost, "merge_rule")


def plan_optimal(trace: Trace, cost: Cost) -> Prediction:
    """The contiguous grouping with the earliest predicted end of communication.

    end[j] = min over i of max(end[i], ready(i..j-1)) + T(bytes(i..j-1)): exact, because a
    bucket's end only grows with the previous bucket's end. Ties go to fewer messages.
    """
    n = len(trace.nbytes)
    ready = [trace.ready(i) for i in range(n)]
    best: List[Tuple[float, int]] = [(0.0, 0)] + [(float("inf"), 0)] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        nbytes, last_ready = 0, 0.0
        for i in range(j - 1, -1, -1):  # bucket = positions i..j-1
            if i < j - 1 and trace.key(i) != trace.key(i + 1):
                break
            nbytes += trace.nbytes[i]
            last_ready = max(last_ready, ready[i])
            end = max(best[i][0], last_ready) + cost(nbytes)
            cand = (end, best[i][1] + 1)
            tie = 1e-12 * end  # relative: one startup of a few picoseconds is not a tie
            if cand[0] < best[j][0] - tie or (abs(cand[0] - best[j][0]) <= tie
                                              and cand[1] < best[j][1]):
                best[j], cut[j] = cand, i
    groups, j = [], n
    while j > 0:
        groups.append(tuple(range(cut[j], j)))
        j = cut[j]
    return simulate(trace, BucketPlan(tuple(reversed(groups))), cost, "mgwfbp")


def predict(schedule: str, trace: Trace, cost: Cost, threshold_bytes: int = 25 << 20) -> Prediction:
    """The plan and prediction of one named schedule (see :data:`SCHEDULES`)."""
    planners: Dict[str, Callable[[], Prediction]] = {
        "mgwfbp": lambda: plan_optimal(trace, cost),
        "merge_rule": lambda: plan_merge_rule(trace, cost),
        "wfbp": lambda: plan_wfbp(trace, cost),
        "single": lambda: plan_single(trace, cost),
        "threshold": lambda: plan_threshold(trace, cost, threshold_bytes),
    }
    if schedule not in planners:
        raise HvcommError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES} or 'p3'")
    return planners[schedule]()


def compare(trace: Trace, cost: Cost, threshold_bytes: int = 25 << 20) -> List[Prediction]:
    """Every schedule's prediction on one trace, in :data:`SCHEDULES` order."""
    return [predict(s, trace, cost, threshold_bytes) for s in SCHEDULES]


def trace_from_layers(backward_s: Sequence[float], nbytes: Sequence[int], forward_s: float = 0.0,
                      update_s: float = 0.0) -> Trace:
    """A trace from per-layer backward times in backward order (output layer first), as in
    the MG-WFBP paper: layer i is ready at forward_s + sum(backward_s[:i+1])."""
    ready, t = [], forward_s
    for tb in backward_s:
        t += tb
        ready.append(t)
    return Trace(tuple(ready), tuple(nbytes), update_s)
