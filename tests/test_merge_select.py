"""Property tests of the serial merge-and-select step and of the local top-k selection."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import BucketPlan, HvcommError, index_dtype, merge_select, select_topk
from collectives.reference import merge_select_ref


@st.composite
def sparse_pairs(draw, d=64):
    idx = draw(st.lists(st.integers(0, d - 1), unique=True, max_size=20))
    val = draw(st.lists(st.integers(-4, 4), min_size=len(idx), max_size=len(idx)))
    return (np.array(sorted(idx), np.int32),
            np.array([v for _, v in sorted(zip(idx, val))], np.float32))


@settings(max_examples=300, deadline=None)
@given(sparse_pairs(), sparse_pairs(), st.integers(1, 30))
def test_merge_select_matches_reference(a, b, k):
    idx, val = merge_select(a[0], a[1], b[0], b[1], k)
    ref = merge_select_ref(dict(zip(a[0].tolist(), a[1].tolist())),
                           dict(zip(b[0].tolist(), b[1].tolist())), k)
    assert idx.tolist() == sorted(ref)
    assert val.tolist() == [ref[j] for j in sorted(ref)]
    assert len(idx) == min(k, len(set(a[0].tolist()) | set(b[0].tolist())))
    assert np.all(np.diff(idx) > 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=60), st.data())
def test_select_topk_is_exact_with_lower_index_tiebreak(xs, data):
    x = np.array(xs, np.float32)
    k = data.draw(st.integers(1, x.size))
    got = select_topk(x, k)
    want = sorted(sorted(range(x.size), key=lambda i: (-abs(xs[i]), i))[:k])
    assert got.tolist() == want


def test_index_dtype_switches_at_2_31():
    assert index_dtype(2**31) == np.int32
    assert index_dtype(2**31 + 1) == np.int64


@given(st.lists(st.integers(1, 100), min_size=1, max_size=30), st.integers(0, 400))
def test_threshold_plan_covers_every_array_once_and_respects_cap(sizes, cap):
    plan = BucketPlan.by_threshold(sizes, cap)
    assert sorted(i for b in plan.buckets for i in b) == list(range(len(sizes)))
    for b in plan.buckets:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= cap


def test_plan_rejects_gaps_and_duplicates():
    for buckets in (((0, 1), (1,)), ((0, 2),), ((),)):
        try:
            BucketPlan(buckets)
        except HvcommError:
            continue
        raise AssertionError(f"accepted {buckets}")
