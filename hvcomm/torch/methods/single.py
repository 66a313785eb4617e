"""Everything in one message after backward (one per dtype): a baseline of MG-WFBP."""
from __future__ import annotations

from hvcomm import planner

from .schedule import PlannedSchedule


def plan_single(trace: planner.Trace, cost: planner.Cost, threshold_bytes: int = 0):
    return planner.predict(trace, planner.split_by_key(trace, [list(range(len(trace.nbytes)))]),
                            cost, "single")


class Single(PlannedSchedule):
    def plan(self, trace, cost, threshold_bytes):
        return plan_single(trace, cost)


METHOD = Single("single", "one message after backward")
