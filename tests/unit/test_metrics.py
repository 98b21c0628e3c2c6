import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mariana.sparse.metrics import BinaryMetrics


def brute_force_auc(y, p):
    pos = [s for s, t in zip(p, y) if t == 1]
    neg = [s for s, t in zip(p, y) if t == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from([0.1, 0.2, 0.25, 0.5, 0.7, 0.9])),
                min_size=2, max_size=60))
def test_auc_equals_brute_force_pair_count_with_ties(rows):
    y = np.array([r[0] for r in rows])
    p = np.array([r[1] for r in rows])
    m = BinaryMetrics()
    m.update(y, p)
    if y.min() == y.max():
        assert m.auc() is None
    else:
        assert m.auc() == pytest.approx(brute_force_auc(y, p), abs=1e-12)


def test_merge_equals_one_pass():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 5000)
    p = np.round(rng.random(5000), 3)  # many ties across parts
    whole = BinaryMetrics()
    whole.update(y, p)
    parts = [BinaryMetrics() for _ in range(3)]
    for part, idx in zip(parts, np.array_split(np.arange(5000), 3)):
        part.update(y[idx], p[idx])
    merged = parts[0].merge(parts[1]).merge(parts[2])
    a, b = whole.result(), merged.result()
    assert a.pop("reliability") == b.pop("reliability")  # same counts per distinct score: the same table
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-12), key


def test_logloss_calibration_and_ne_by_hand():
    m = BinaryMetrics()
    m.update(np.array([1, 0, 1, 0]), np.array([0.9, 0.1, 0.4, 0.4]))
    r = m.result()
    assert r["logloss"] == pytest.approx(-(2 * math.log(0.9) + math.log(0.4) + math.log(0.6)) / 4)
    assert r["calibration"] == pytest.approx((1.8 / 4) / 0.5)
    assert r["ne"] == pytest.approx(r["logloss"] / math.log(2))
    assert r["auc"] == 0.875 and r["count"] == 4


def test_empty_and_extreme_predictions():
    assert BinaryMetrics().result()["auc"] is None
    m = BinaryMetrics()
    m.update(np.array([1, 0]), np.array([0.0, 1.0]))  # clipped, finite
    assert math.isfinite(m.result()["logloss"]) and m.result()["auc"] == 0.0


def placements(y, s):
    """DeLong's structural components from their definition, pair by pair (O(m n))."""
    pos, neg = s[y == 1], s[y == 0]
    psi = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    return psi.mean(axis=1), psi.mean(axis=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(10, 60))
def test_paired_auc_test_equals_delong_by_definition(seed, rows):
    from mariana.sparse.metrics import paired_auc_test

    rng = np.random.default_rng(seed)
    y = np.r_[1, 1, 0, 0, rng.integers(0, 2, rows)]
    a = np.round(y + rng.normal(0, 1, y.size), 1)      # rounded: ties inside and across classes
    b = np.round(0.5 * a + rng.normal(0, 1, y.size), 1)
    (v10a, v01a), (v10b, v01b) = placements(y, a), placements(y, b)
    m, n = v10a.size, v01a.size
    cov = np.cov([v10a, v10b]) / m + np.cov([v01a, v01b]) / n
    sd = math.sqrt(max(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1], 0.0))
    r = paired_auc_test(y, a, b)
    assert r["auc_a"] == pytest.approx(brute_force_auc(y, a)) and r["auc_b"] == pytest.approx(brute_force_auc(y, b))
    assert r["delta"] == pytest.approx(v10a.mean() - v10b.mean())
    assert r["ci95"][1] - r["ci95"][0] == pytest.approx(2 * 1.959963984540054 * sd)


def test_paired_auc_test_sees_what_two_intervals_hide():
    """Two models that agree on most rows: their separate intervals overlap, the paired test
    still finds the better one; the same model against itself differs by exactly 0 (p = 1)."""
    from mariana.sparse.metrics import paired_auc_test

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 4000)
    base = y + rng.normal(0, 1.5, y.size)
    better = base + 0.15 * y
    r = paired_auc_test(y, better, base)
    assert r["delta"] > 0 and r["ci95"][0] > 0 and r["p"] < 1e-3
    assert r["ci95"][1] - r["ci95"][0] < 0.02       # an independent 95% interval of one AUC here is ~0.035 wide
    same = paired_auc_test(y, base, base)
    assert same["delta"] == 0 and same["p"] == 1.0
    with pytest.raises(ValueError, match="at least 2 positives"):
        paired_auc_test(np.array([1, 0, 0]), np.zeros(3), np.zeros(3))


def test_paired_logloss_test_by_hand():
    from mariana.sparse.metrics import paired_logloss_test

    y = np.array([1, 0])
    r = paired_logloss_test(y, np.array([0.8, 0.4]), np.array([0.5, 0.5]))
    d = np.array([-math.log(0.8) + math.log(0.5), -math.log(0.6) + math.log(0.5)])
    assert r["delta"] == pytest.approx(d.mean())
    half = 1.959963984540054 * d.std(ddof=1) / math.sqrt(2)
    assert r["ci95"] == pytest.approx((d.mean() - half, d.mean() + half))
