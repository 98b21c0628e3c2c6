"""The reliability table (predicted vs observed CTR by score bucket) and its ECE."""
import json

import numpy as np
import pytest

from mariana.sparse.metrics import BinaryMetrics, rounded, wilson_interval


def metrics_of(labels, scores) -> BinaryMetrics:
    m = BinaryMetrics()
    m.update(np.asarray(labels), np.asarray(scores, np.float64))
    return m


def calibrated(n: int, a: float, b: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose click probability is exactly the prediction: p ~ Beta(a, b), y ~ Bernoulli(p)."""
    rng = np.random.default_rng(seed)
    p = rng.beta(a, b, n)
    return (rng.random(n) < p).astype(np.int64), p


@pytest.mark.parametrize("a, b, n, ece_max", [
    (1.0, 199.0, 400_000, 0.0005),   # a 0.5%-CTR log: ten populated buckets, not one
    (2.0, 3.56, 100_000, 0.01),      # a 36%-CTR log
])
def test_a_calibrated_predictor_has_ece_near_zero_in_equal_count_buckets(a, b, n, ece_max):
    y, p = calibrated(n, a, b, seed=3)
    r = metrics_of(y, p).result()
    table = r["reliability"]
    assert len(table) == 10
    assert all(abs(t["rows"] - n // 10) <= 1 for t in table), [t["rows"] for t in table]
    assert sum(t["rows"] for t in table) == n and sum(t["clicks"] for t in table) == int(y.sum())
    assert r["ece"] < ece_max, (r["ece"], r["ctr"])
    covered = sum(t["ctr_lo"] <= t["mean_pctr"] <= t["ctr_hi"] for t in table)
    assert covered >= 8, table  # 95% intervals: about one bucket in twenty misses
    for lo, hi in zip(table, table[1:]):  # ascending, disjoint score ranges
        assert lo["score_min"] <= lo["score_max"] < hi["score_min"]


def test_a_predictor_that_doubles_the_probabilities_predicts_twice_the_observed_rate():
    rng = np.random.default_rng(5)
    p = rng.uniform(0.01, 0.2, 200_000)
    y = (rng.random(p.size) < p).astype(np.int64)
    r = metrics_of(y, 2 * p).result()
    ratios = [t["mean_pctr"] / t["ctr"] for t in r["reliability"]]
    assert len(ratios) == 10 and all(1.8 < x < 2.2 for x in ratios), ratios
    assert r["ece"] == pytest.approx(p.mean(), rel=0.05)  # |2p - p| on average
    assert all(t["ctr_hi"] < t["mean_pctr"] for t in r["reliability"])  # far outside every interval


def test_merge_equals_all_at_once_with_ties_across_parts():
    rng = np.random.default_rng(7)
    p = np.round(rng.beta(1, 30, 30_000), 3)  # few distinct scores: many ties, some across parts
    y = (rng.random(p.size) < p).astype(np.int64)
    whole = metrics_of(y, p)
    parts = [metrics_of(y[i], p[i]) for i in np.array_split(rng.permutation(p.size), 4)]
    merged = parts[0].merge(parts[1]).merge(parts[2].merge(parts[3]))
    assert merged.reliability() == whole.reliability()
    assert merged.result()["ece"] == whole.result()["ece"]


def test_ties_across_a_bucket_edge_go_to_one_bucket_by_the_middle_of_their_ranks():
    # 10 rows, 2 buckets: the edge is after rank 5. Score 0.2 holds ranks 4..7 (middle 5.0),
    # so all four rows go up, whatever the order the rows came in.
    scores = [0.1] * 3 + [0.2] * 4 + [0.3] * 3
    labels = [0, 0, 1, 0, 1, 0, 0, 1, 1, 0]
    expected = [{"score_min": 0.1, "score_max": 0.1, "rows": 3, "clicks": 1},
                {"score_min": 0.2, "score_max": 0.3, "rows": 7, "clicks": 3}]
    order = np.random.default_rng(0).permutation(10)
    for m in (metrics_of(labels, scores), metrics_of(np.array(labels)[order], np.array(scores)[order])):
        table = m.reliability(buckets=2)
        assert [{k: t[k] for k in expected[0]} for t in table] == expected
        assert table[1]["mean_pctr"] == pytest.approx((4 * 0.2 + 3 * 0.3) / 7)
        assert table[1]["ctr"] == pytest.approx(3 / 7)


def test_a_score_held_by_many_rows_leaves_buckets_empty_and_they_are_dropped():
    table = metrics_of([0] * 7 + [1] + [1, 0], [0.5] * 8 + [0.9] * 2).reliability(buckets=10)
    assert [(t["score_min"], t["rows"], t["clicks"]) for t in table] == [(0.5, 8, 1), (0.9, 2, 1)]


def test_empty_one_class_and_json():
    empty = BinaryMetrics().result()
    assert empty["reliability"] == [] and empty["ece"] is None
    r = metrics_of([0, 0, 0, 0], [0.01, 0.02, 0.03, 0.04]).result()  # no clicks: intervals still defined
    assert [t["ctr"] for t in r["reliability"]] == [0.0] * 4
    assert all(t["ctr_lo"] == 0.0 and 0 < t["ctr_hi"] < 1 for t in r["reliability"])
    assert r["ece"] == pytest.approx(0.025)
    keys = {"count", "auc", "logloss", "calibration", "ne", "ctr", "mean_pctr", "ece", "reliability"}
    assert set(r) == keys
    json.dumps(r, allow_nan=False)


def test_wilson_interval_by_hand():
    lo, hi = wilson_interval(2, 10)  # p = 0.2, n = 10, z = 1.96
    assert (lo, hi) == (pytest.approx(0.05668, abs=1e-5), pytest.approx(0.50984, abs=1e-5))
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_rounded_keeps_ints_and_shortens_floats():
    table = metrics_of([1, 0, 0], [1 / 3, 1 / 7, 1 / 9]).reliability(buckets=1)
    short = rounded(table)
    assert short[0]["rows"] == 3 and short[0]["clicks"] == 1
    assert short[0]["mean_pctr"] == 0.1958 and short[0]["score_max"] == 0.3333
