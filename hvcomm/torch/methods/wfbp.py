"""Wait-free backpropagation (WFBP): every gradient its own message, sent as soon as it is
ready (a baseline of MG-WFBP)."""
from __future__ import annotations

from collectives.merged import BucketPlan
from hvcomm import planner

from .schedule import PlannedSchedule


def plan_wfbp(trace: planner.Trace, cost: planner.Cost, threshold_bytes: int = 0):
    plan = BucketPlan(tuple((i,) for i in range(len(trace.nbytes))))
    return planner.predict(trace, plan, cost, "wfbp")


class WFBP(PlannedSchedule):
    def plan(self, trace, cost, threshold_bytes):
        return plan_wfbp(trace, cost)


METHOD = WFBP("wfbp", "every gradient its own message, as soon as it is ready")
