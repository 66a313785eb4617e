"""MG-WFBP as hvcomm runs it: the contiguous grouping with the earliest predicted end of
communication, found exactly (a dynamic programme over contiguous groups, O(L^2)), so it is
never predicted slower than the merge rule or any baseline; then raced on the live job against
the single, threshold and WFBP plans, keeping the fastest."""
from __future__ import annotations

from typing import List, Tuple

from collectives.merged import BucketPlan
from hvcomm import planner

from .schedule import PlannedSchedule


def plan_optimal(trace: planner.Trace, cost: planner.Cost, threshold_bytes: int = 0):
    """end[j] = min over i of max(end[i], ready(i..j-1)) + T(bytes(i..j-1)): exact, because a
    bucket's end only grows with the previous bucket's end. Ties go to fewer messages."""
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
    return planner.predict(trace, BucketPlan(tuple(reversed(groups))), cost, "mgwfbp")


class MGWFBP(PlannedSchedule):
    race_against = ("single", "threshold", "wfbp")

    def plan(self, trace, cost, threshold_bytes):
        return plan_optimal(trace, cost)


METHOD = MGWFBP("mgwfbp", "MG-WFBP: the optimal merge of gradients, raced against baselines")
