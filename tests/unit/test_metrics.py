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
