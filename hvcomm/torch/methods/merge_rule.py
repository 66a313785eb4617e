"""MG-WFBP's merge rule (Shi et al., INFOCOM 2019; ALGORITHMS.md section 3): scanning gradients
in ready order, merge the next one into the current bucket iff it becomes ready less than the
startup time a after the current bucket's allreduce could start (waiting costs less than a
second startup)."""
from __future__ import annotations

from typing import List

from collectives.merged import BucketPlan
from hvcomm import planner

from .schedule import PlannedSchedule


def plan_merge_rule(trace: planner.Trace, cost: planner.Cost, threshold_bytes: int = 0):
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
    return planner.predict(trace, BucketPlan(tuple(tuple(g) for g in groups)), cost,
                            "merge_rule")


class MergeRule(PlannedSchedule):
    def plan(self, trace, cost, threshold_bytes):
        return plan_merge_rule(trace, cost)


METHOD = MergeRule("merge_rule", "MG-WFBP's merge rule as published")
