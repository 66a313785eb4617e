"""The top-k selectors: the sampled one returns exactly the top-k, or falls back; both keep the
tie rule (equal magnitudes: the lower index) of an independent reference."""
import numpy as np
import pytest

from hvcomm.torch.methods.selection import SampledTopk, exact_topk, recall


@pytest.mark.parametrize("n,density", [(200_000, 0.001), (500_000, 0.01), (300_000, 0.1)])
def test_sampled_equals_exact(n, density):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    k = int(n * density)
    sel = SampledTopk(seed=1)
    got = sel(x, k)
    assert got.size == k and np.unique(got).size == k
    assert recall(got, x, k) == 1.0
    assert set(got.tolist()) == set(exact_topk(x, k).tolist())


def test_heavy_tails_and_duplicates_still_exact():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_cauchy(150_000), np.full(50_000, 3.0)]).astype(np.float32)
    rng.shuffle(x)
    sel = SampledTopk(seed=2)
    got = sel(x, 1000)
    assert recall(got, x, 1000) == 1.0


def test_fallback_when_the_sample_misleads():
    x = np.zeros(400_000, np.float32)
    x[:5000] = np.arange(1, 5001)            # only 5000 nonzeros, all outside a small sample
    sel = SampledTopk(sample=20_000, seed=3, retries=0)
    got = sel(x, 3000)
    assert recall(got, x, 3000) == 1.0       # exact through the fallback or the threshold


def test_recall_counts_partial_hits():
    x = np.arange(10, dtype=np.float32)
    assert recall(np.array([9, 8, 0]), x, 3) == pytest.approx(2 / 3)


def lower_index_first(x, k):
    """The reference: indices sorted by (-|x|, index), the first k, ascending."""
    return np.sort(np.lexsort((np.arange(x.size), -np.abs(x)))[:k])


@pytest.mark.parametrize("n,k", [(50, 7), (200_000, 300), (200_000, 60_000)])
def test_ties_go_to_the_lower_index(n, k):
    """Integers in [-3, 3]: most magnitudes are tied, at the k-th one too."""
    x = np.random.default_rng(n + k).integers(-3, 4, n).astype(np.float32)
    want = lower_index_first(x, k)
    assert np.array_equal(np.sort(exact_topk(x, k)), want)
    sel = SampledTopk(seed=4)
    assert np.array_equal(np.sort(sel(x, k)), want)
    assert sel.fallbacks == 0  # the sampled cut itself, not the exact fallback
