"""The schedule planner on hand-made traces whose best grouping is known."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import HvcommError
from collectives.merged import BucketPlan
from hvcomm import planner as P
from hvcomm.torch import methods
from hvcomm.torch.methods.merge_rule import plan_merge_rule
from hvcomm.torch.methods.mgwfbp import plan_optimal
from hvcomm.torch.methods.schedule import PlannedSchedule
from hvcomm.torch.methods.single import plan_single
from hvcomm.torch.methods.threshold import plan_threshold
from hvcomm.torch.methods.wfbp import plan_wfbp

PLANNED = [m for m in methods.REGISTRY.values() if isinstance(m, PlannedSchedule)]


def test_latency_dominated_gives_one_bucket():
    # 10 layers ready 1 ms apart, startup 50 ms, bytes nearly free: one message is best
    trace = P.trace_from_layers([1e-3] * 10, [1000] * 10)
    cost = P.Cost(50e-3, 1e-12)
    for pred in (plan_optimal(trace, cost), plan_merge_rule(trace, cost)):
        assert pred.plan.buckets == (tuple(range(10)),), pred.schedule
    wfbp = plan_wfbp(trace, cost)
    assert wfbp.comm_end_s == pytest.approx(1e-3 + 10 * 50e-3 + 10 * 1000e-12, rel=1e-6)
    assert plan_optimal(trace, cost).comm_end_s < wfbp.comm_end_s / 5


def test_bandwidth_dominated_slow_layers_gives_wfbp():
    # each layer's message (5 ms) is sent while the next layer computes (10 ms): no merging
    trace = P.trace_from_layers([10e-3] * 6, [5_000_000] * 6)
    cost = P.Cost(1e-5, 1e-9)
    for pred in (plan_optimal(trace, cost), plan_merge_rule(trace, cost)):
        assert pred.plan.buckets == tuple((i,) for i in range(6)), pred.schedule
        assert pred.non_overlapped_s == pytest.approx(5e-3 + 1e-5)
    single = plan_single(trace, cost)
    assert single.non_overlapped_s == pytest.approx(1e-5 + 30e-3)


def test_prediction_arithmetic():
    trace = P.Trace((0.010, 0.020, 0.050), (100, 200, 300), update_s=0.004)
    cost = P.Cost(0.001, 1e-4)  # 100 bytes -> 10 ms
    pred = P.predict(trace, BucketPlan(((0, 1), (2,))), cost)
    # bucket 0 (300 B) runs 20-51 ms, so bucket 1 (ready at 50 ms) waits for it
    assert pred.starts_s == pytest.approx((0.020, 0.051))
    assert pred.ends_s == pytest.approx((0.051, 0.082))
    assert pred.non_overlapped_s == pytest.approx(0.032)
    assert pred.iteration_s == pytest.approx(0.086)


def test_unused_gradients_are_ready_at_backward_end():
    trace = P.Trace((0.01, None, 0.03), (10, 10, 10))
    assert trace.backward_end_s == 0.03 and trace.ready(1) == 0.03
    pred = plan_wfbp(trace, P.Cost(0.0, 1e-3))
    assert pred.starts_s == pytest.approx((0.01, 0.03, 0.04))


def test_dtypes_never_share_a_bucket():
    trace = P.Trace((0.0, 0.0, 0.0, 0.0), (8, 8, 4, 4), keys=("f64", "f64", "f32", "f32"))
    cost = P.Cost(1.0, 0.0)
    for schedule in PLANNED:
        plan = schedule.plan(trace, cost, 25 << 20).plan
        for b in plan.buckets:
            assert len({trace.keys[i] for i in b}) == 1, (schedule, plan)
    assert plan_optimal(trace, cost).plan.buckets == ((0, 1), (2, 3))


def test_threshold_follows_observed_order():
    trace = P.Trace((0.0, 0.1, 0.2, 0.3), (10, 10, 10, 10))
    assert plan_threshold(trace, P.Cost(0, 0), 20).plan.buckets == ((0, 1), (2, 3))


def test_bad_traces_are_refused():
    with pytest.raises(HvcommError, match="one entry per"):
        P.Trace((0.0,), (1, 2))
    with pytest.raises(HvcommError, match=">= 0"):
        P.Trace((-1.0,), (1,))
    with pytest.raises(HvcommError, match="unknown schedule"):
        methods.get("fastest", "schedule")


def _partitions(n):
    for cuts in itertools.product([False, True], repeat=n - 1):
        groups, cur = [], [0]
        for i, c in enumerate(cuts, start=1):
            if c:
                groups.append(tuple(cur))
                cur = []
            cur.append(i)
        groups.append(tuple(cur))
        yield BucketPlan(tuple(groups))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.02), st.integers(0, 4_000_000)), min_size=1, max_size=7),
       st.floats(0, 0.01), st.floats(0, 1e-8))
def test_optimal_is_the_best_contiguous_grouping(layers, a, b):
    trace = P.trace_from_layers([t for t, _ in layers], [m for _, m in layers])
    cost = P.Cost(a, b)
    best = min(P.predict(trace, plan, cost).comm_end_s for plan in _partitions(len(layers)))
    opt = plan_optimal(trace, cost)
    assert opt.comm_end_s == pytest.approx(best, rel=1e-9, abs=1e-12)
    for other in (m.plan(trace, cost, 1_000_000) for m in PLANNED):
        assert opt.iteration_s <= other.iteration_s + 1e-12, other.schedule
