"""Horovod's tensor fusion / PyTorch DDP's buckets: fill each message in order until
``threshold_bytes`` (a baseline of MG-WFBP)."""
from __future__ import annotations

from collectives.merged import BucketPlan
from hvcomm import planner

from .schedule import PlannedSchedule


def plan_threshold(trace: planner.Trace, cost: planner.Cost, threshold_bytes: int):
    plan = BucketPlan.by_threshold(trace.nbytes, threshold_bytes, keys=trace.keys)
    return planner.predict(trace, plan, cost, "threshold")


class Threshold(PlannedSchedule):
    def plan(self, trace, cost, threshold_bytes):
        return plan_threshold(trace, cost, threshold_bytes)


METHOD = Threshold("threshold", "messages filled in order up to the fusion threshold")
