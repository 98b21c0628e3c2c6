"""Synthetic Criteo-format click logs that drift over time: a second planted
click model, built to be unlike `sparse/synth.py`'s.

Rows are in time order: row i of an N-row file happens at t = (i + 0.5) / N
in [0, 1), ten "days" of traffic. docs/synthetic-data.md ("A drifting click
log") describes the model; in short:

    logit(row, t) = bias + trend * t
                  + sum_c  main_c(value_c, t)           26 categorical fields; two rotate over t
                  + sum_j  g_j(I_j, t)                   13 integer fields; I1 is the hour of day
                  + gain(t) * X12[C1, C2]  +  X57[C5, C7]     pair crosses, a weight per value pair
                  + 0.3 * <u[C6], v[C23]>                     a rank-2 pair
                  + X3[C1, C5, C13]                           a three-way cross
                  + slope[C14] * z(I5)                        numeric x categorical
    click ~ Bernoulli(sigmoid(logit))

- categorical values are Zipf-distributed with a per-field exponent from 0.4
  (flat) to 1.4 (steep), over 2 to 1.5M values; five fields are mostly
  singletons (s < 1 over 250k+ values);
- four fields are *conveyors*: the value at popularity rank r at time t is
  `card - 1 + floor(t * P) - r`, so new ids enter at the top of the
  popularity list, age down it and retire at the tail;
- missing values at rates up to 90%, and a missing value has its own effect;
- integers: counts with bursts of bot traffic (huge values, almost no clicks),
  signed values with outliers, zero-inflated and capped fields, pure noise;
- `bias` is solved on a pilot sample so that about 4% of rows are clicks; the
  trend lifts the click rate over time (3.5% in the first fifth, 4.8% in the last).

`generate_drift` writes a file and returns its counts and the planted model's
own AUC and logloss on its rows (the Bayes-optimal score: the model knows t);
`planted_probabilities` recomputes the true click probabilities of any row
range without writing anything, so a benchmark can score the oracle on its
own test split.

>>> r = generate_drift(os.devnull, 2_000, seed=1)
>>> r["rows"], 0.02 < r["ctr"] < 0.07, r["true_auc"] > 0.7
(2000, True, True)
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from mariana.sparse.hashing import fmix64
from mariana.sparse.metrics import BinaryMetrics
from mariana.sparse.schema import CRITEO_CATEGORICAL, CRITEO_NUMERIC
from mariana.sparse.synth import check_rows, output_stream

DEFAULT_MODEL_SEED = 1515
CHUNK_ROWS = 100_000        # fixed: each chunk has its own generator, so a row range can be redrawn alone
TARGET_CTR = 0.04
TREND = 0.5                 # logit added between t = 0 and t = 1
DAYS = 10                   # the stream spans this many days; I1 is the hour of day
PILOT_ROWS = 100_000

# Per categorical field C1..C26: (cardinality, Zipf exponent, missing rate, sigma of the main effect).
CAT_SPEC = (
    (8, 0.6, 0.0, 0.3),            # C1   in the C1 x C2 cross and the 3-way cross
    (60, 0.9, 0.0, 0.25),          # C2
    (5_000, 1.0, 0.0, 0.5),        # C3   conveyor
    (400_000, 0.85, 0.05, 0.6),    # C4   conveyor, mostly rare ids
    (7, 0.5, 0.0, 0.2),            # C5   in the C5 x C7 cross and the 3-way cross
    (900, 1.2, 0.1, 0.4),          # C6   main effect rotates over t; rank-2 pair with C23
    (45, 0.8, 0.0, 0.2),           # C7
    (1_500_000, 0.8, 0.3, 0.4),    # C8   user-like: almost every value is rare
    (120, 1.0, 0.6, 0.3),          # C9
    (30_000, 0.95, 0.0, 0.5),      # C10  conveyor
    (300, 1.1, 0.15, 0.35),        # C11  main effect rotates over t
    (2, 0.5, 0.0, 0.25),           # C12
    (20, 0.7, 0.0, 0.0),           # C13  only in the 3-way cross
    (30, 0.9, 0.0, 0.1),           # C14  its value sets the slope of z(I5)
    (70_000, 1.05, 0.5, 0.3),      # C15
    (3_000, 1.3, 0.0, 0.0),        # C16  noise
    (11, 0.4, 0.0, 0.15),          # C17
    (250_000, 0.9, 0.85, 0.3),     # C18  mostly missing
    (500, 1.0, 0.9, 0.5),          # C19  90% missing; missing carries the signal
    (4, 0.8, 0.0, 0.1),            # C20
    (800_000, 0.9, 0.2, 0.0),      # C21  high-cardinality noise
    (16, 0.6, 0.7, 0.2),           # C22
    (1_000, 1.4, 0.0, 0.3),        # C23  steep Zipf
    (50_000, 1.0, 0.4, 0.3),       # C24
    (200, 0.9, 0.0, 0.2),          # C25
    (10_000, 1.15, 0.25, 0.25),    # C26  conveyor
)
# Conveyor fields (0-based) and P, the ids that enter at the top over the whole stream.
CONVEYORS = {2: 400, 3: 150_000, 9: 10_000, 25: 1_000}
ROTATING = (1, 5, 10)       # C2, C6, C11: main_c(v, t) = cos(ROTATION t) a_c[v] + sin(ROTATION t) b_c[v]
ROTATION = 0.75 * np.pi
CROSS_A = (0, 1)            # C1 x C2: N(0, 1) per pair, gain 0.2 -> 0.8 over t
CROSS_B = (4, 6)            # C5 x C7: N(0, 0.5^2) per pair
LOW_RANK = (5, 22)          # C6 x C23: 0.3 * <u, v>, rank 2
TRIPLE = (0, 4, 12)         # C1 x C5 x C13: N(0, 0.7^2) per triple
SLOPE_FIELD, SLOPE_INT = 13, 4   # slope[C14] * z(I5)
INT_MISSING = (0.0, 0.10, 0.30, 0.0, 0.20, 0.60, 0.05, 0.15, 0.50, 0.75, 0.90, 0.0, 0.40)


@dataclass
class DriftWorld:
    """The planted click model drawn from `model_seed` (see the module docstring)."""

    values: list[np.ndarray]       # per categorical field: (vocab, 8) uint8 hex digits
    cdfs: list[np.ndarray]         # per field: Zipf CDF over popularity ranks
    main: list[np.ndarray]         # per field: (vocab,) main effect (a_c for rotating fields)
    main_late: dict                # rotating field -> (vocab,) b_c
    miss_effect: np.ndarray        # (26,) effect of a missing categorical value
    cross_a: np.ndarray            # (8, 60)
    cross_b: np.ndarray            # (7, 45)
    low_rank: tuple                # ((900, 2), (1000, 2))
    triple: np.ndarray             # (8, 7, 20)
    slope: np.ndarray              # (30,)
    int_curve: np.ndarray          # (13, 3): amplitude, center, width of tanh curves in log1p space
    int_miss_effect: np.ndarray    # (13,)
    hour_phase: float
    bias: float = 0.0


@functools.lru_cache(maxsize=2)
def make_world(model_seed: int = DEFAULT_MODEL_SEED) -> DriftWorld:
    rng = np.random.default_rng([model_seed, 15])
    values, cdfs, main, late = [], [], [], {}
    for c, (card, s, _, sigma) in enumerate(CAT_SPEC):
        vocab = card + CONVEYORS.get(c, 0)
        values.append(_hex_vocab(model_seed, c, vocab))
        w = np.arange(1, card + 1, dtype=np.float64) ** -s
        cdfs.append(np.cumsum(w) / w.sum())
        main.append(rng.normal(0.0, sigma, vocab).astype(np.float32))
        if c in ROTATING:
            late[c] = rng.normal(0.0, sigma, vocab).astype(np.float32)
    card = [spec[0] for spec in CAT_SPEC]
    world = DriftWorld(
        values, cdfs, main, late,
        miss_effect=np.where([spec[2] > 0 for spec in CAT_SPEC], rng.normal(0, 0.3, 26), 0.0),
        cross_a=rng.normal(0, 1.0, (card[0], card[1])),
        cross_b=rng.normal(0, 0.5, (card[4], card[6])),
        low_rank=(rng.normal(0, 1, (card[5], 2)), rng.normal(0, 1, (card[22], 2))),
        triple=rng.normal(0, 0.7, (card[0], card[4], card[12])),
        slope=rng.normal(0, 0.5, card[13]),
        int_curve=np.stack([rng.uniform(-0.6, 0.6, 13), rng.uniform(0.5, 4.0, 13),
                            rng.uniform(0.5, 2.0, 13)], axis=1),
        int_miss_effect=rng.normal(0, 0.25, 13),
        hour_phase=float(rng.uniform(0, 2 * np.pi)),
    )
    world.bias = _solve_bias(world)
    return world


def _hex_vocab(model_seed: int, field_idx: int, vocab: int) -> np.ndarray:
    """(vocab, 8) ASCII hex digits, 32 pseudo-random bits per id (salted apart from synth.py's)."""
    k = np.arange(vocab, dtype=np.uint64) | np.uint64((field_idx + 64) << 40)
    h = fmix64(k ^ np.uint64(model_seed) ^ np.uint64(0x5EED_D21F7)) & np.uint64(0xFFFFFFFF)
    nib = ((h[:, None] >> np.arange(28, -4, -4, dtype=np.uint64)) & np.uint64(0xF)).astype(np.uint8)
    return np.frombuffer(b"0123456789abcdef", np.uint8)[nib]


# ---- one chunk of rows -------------------------------------------------------------------

def _categoricals(world: DriftWorld, t: np.ndarray, rng: np.random.Generator):
    """(n, 26) ids (-1 missing) and their logit: main effects, missing effects."""
    n = t.size
    cats = np.empty((n, 26), dtype=np.int64)
    logit = np.zeros(n)
    for c, (card, _, miss_rate, _) in enumerate(CAT_SPEC):
        rank = np.minimum(np.searchsorted(world.cdfs[c], rng.random(n)), card - 1)
        k = card - 1 + np.floor(t * CONVEYORS[c]).astype(np.int64) - rank if c in CONVEYORS else rank
        miss = rng.random(n) < miss_rate
        effect = world.main[c][k]
        if c in ROTATING:
            effect = np.cos(ROTATION * t) * effect + np.sin(ROTATION * t) * world.main_late[c][k]
        logit += np.where(miss, world.miss_effect[c], effect)
        cats[:, c] = np.where(miss, -1, k)
    return cats, logit


def _crosses(world: DriftWorld, cats: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Logit of the planted interactions; the crossed fields are never missing (C6 aside)."""
    c1, c2, c5, c7, c13 = (cats[:, i] for i in (0, 1, 4, 6, 12))
    logit = (0.2 + 0.6 * t) * world.cross_a[c1, c2] + world.cross_b[c5, c7] + world.triple[c1, c5, c13]
    c6, c23 = cats[:, LOW_RANK[0]], cats[:, LOW_RANK[1]]
    u, v = world.low_rank
    dot = np.einsum("ij,ij->i", u[np.maximum(c6, 0)], v[c23])
    return logit + np.where(c6 >= 0, 0.3 * dot, 0.0)


def _draw_ints(n: int, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(n, 13) raw integer values before missingness; see docs/synthetic-data.md for each."""
    x = np.empty((n, 13))
    x[:, 0] = np.floor(24 * np.mod(t * DAYS, 1.0))                          # I1 hour of day
    bots = rng.random(n) < 0.005
    x[:, 1] = np.where(bots, np.floor(10 ** rng.uniform(4, 7, n)),           # I2 counts, bot bursts
                       rng.poisson(rng.gamma(0.7, 3.0 / 0.7, n)))
    x[:, 2] = np.floor(rng.lognormal(4.0, 2.5, n))                           # I3 very heavy tail
    x[:, 3] = np.where(rng.random(n) < 0.02,                                 # I4 signed, outliers
                       np.sign(rng.normal(size=n)) * np.floor(10 ** rng.uniform(6, 8, n)),
                       np.round(rng.normal(0, 20, n)))
    x[:, 4] = np.floor(rng.lognormal(2.0, 1.2, n))                           # I5 x C14 slope
    x[:, 5] = rng.integers(0, 101, n)                                        # I6 a percentage
    x[:, 6] = np.floor(rng.lognormal(1.0, 1.0, n))                           # I7 effect flips over t
    x[:, 7] = np.where(rng.random(n) < 0.8, 0, np.floor(rng.lognormal(3, 1.5, n)))  # I8 zero-inflated
    x[:, 8] = np.where(rng.random(n) < 0.01, 1e9, np.floor(rng.lognormal(5, 2, n)))  # I9 noise
    x[:, 9] = rng.poisson(1.0, n)                                            # I10 small counts
    x[:, 10] = np.floor(rng.lognormal(6, 1.8, n))                            # I11
    x[:, 11] = np.where(rng.random(n) < 0.01, 1e8, rng.integers(0, 10_001, n))  # I12 noise
    x[:, 12] = np.floor(rng.lognormal(0.5, 1.0, n))                          # I13
    return x


def _z(x: np.ndarray, center: float, scale: float) -> np.ndarray:
    return np.clip((np.log1p(np.maximum(x, 0)) - center) / scale, -3, 3)


def _int_logit(world: DriftWorld, x: np.ndarray, miss: np.ndarray, cats: np.ndarray, t: np.ndarray):
    """Logit of the 13 integer fields (a missing value has its own effect)."""
    g = np.zeros_like(x)
    amp, center, width = world.int_curve.T
    for j in (2, 10, 12):                                        # smooth curves of log1p(x)
        g[:, j] = amp[j] * np.tanh((np.log1p(np.maximum(x[:, j], 0)) - center[j]) / width[j])
    g[:, 0] = 0.4 * np.sin(2 * np.pi * x[:, 0] / 24 + world.hour_phase)
    g[:, 1] = np.where(x[:, 1] >= 1e4, -1.5, 0.5 * np.tanh((np.log1p(x[:, 1]) - 1.0) / 0.8))
    g[:, 3] = 0.3 * np.tanh(np.clip(x[:, 3], -1e3, 1e3) / 20)
    g[:, 4] = world.slope[cats[:, SLOPE_FIELD]] * _z(x[:, 4], 2.11, 1.09)
    g[:, 5] = 0.006 * (x[:, 5] - 50)
    g[:, 6] = (1 - 2 * t) * 0.5 * _z(x[:, 6], 1.23, 0.83)                 # mean 0: the flip is no trend
    g[:, 7] = np.where(x[:, 7] > 0, 0.4, 0.0)
    g[:, 9] = np.array([-0.3, 0.0, 0.2, 0.3, 0.35, 0.4])[np.minimum(x[:, 9], 5).astype(np.int64)]
    return np.where(miss, world.int_miss_effect, g).sum(axis=1)


def _draw(world: DriftWorld, t: np.ndarray, rng: np.random.Generator):
    """(logit, ints with NaN missing, cats with -1 missing) for rows at times `t`."""
    cats, logit = _categoricals(world, t, rng)
    logit += _crosses(world, cats, t)
    x = _draw_ints(t.size, t, rng)
    miss = rng.random(x.shape) < np.asarray(INT_MISSING)
    logit += _int_logit(world, x, miss, cats, t) + world.bias + TREND * t
    return logit, np.where(miss, np.nan, x), cats


def _solve_bias(world: DriftWorld) -> float:
    world.bias = 0.0
    t = (np.arange(PILOT_ROWS) + 0.5) / PILOT_ROWS
    logit, _, _ = _draw(world, t, np.random.default_rng(12345))
    lo, hi = -15.0, 5.0
    for _ in range(50):  # bisection: mean sigmoid(logit + b) = TARGET_CTR
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _sigmoid(logit + mid).mean() > TARGET_CTR else (mid, hi)
    return (lo + hi) / 2


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _chunks(world: DriftWorld, rows: int, seed: int, model_seed: int, start: int = 0, stop: int | None = None):
    """Yield (first row, probs, labels, ints, cats) per chunk overlapping [start, stop)."""
    stop = rows if stop is None else min(stop, rows)
    for k in range(start // CHUNK_ROWS, math.ceil(stop / CHUNK_ROWS)):
        lo, hi = k * CHUNK_ROWS, min((k + 1) * CHUNK_ROWS, rows)
        rng = np.random.default_rng([seed, model_seed, k])
        logit, ints, cats = _draw(world, (np.arange(lo, hi) + 0.5) / rows, rng)
        p = _sigmoid(logit)
        labels = rng.random(hi - lo) < p
        a, b = max(start, lo) - lo, min(stop, hi) - lo
        yield lo + a, p[a:b], labels[a:b], ints[a:b], cats[a:b]


def planted_probabilities(rows: int, seed: int = 0, model_seed: int = DEFAULT_MODEL_SEED,
                          start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(labels, true click probabilities) of rows [start, stop) of the file that
    `generate_drift(path, rows, seed, model_seed)` writes, without writing it.

    >>> y, p = planted_probabilities(1_000, seed=1, start=900)
    >>> y.shape, p.shape, bool(((p > 0) & (p < 1)).all())
    ((100,), (100,), True)
    """
    world = make_world(model_seed)
    parts = [(lab, p) for _, p, lab, _, _ in _chunks(world, rows, seed, model_seed, start, stop)]
    if not parts:
        return np.zeros(0, np.int8), np.zeros(0)
    return np.concatenate([lab for lab, _ in parts]).astype(np.int8), np.concatenate([p for _, p in parts])


# ---- the file --------------------------------------------------------------------------

def _table(world: DriftWorld, labels: np.ndarray, ints: np.ndarray, cats: np.ndarray) -> pa.Table:
    cols = {"label": pa.array(labels.astype(np.int8))}
    for j, name in enumerate(CRITEO_NUMERIC):
        miss = np.isnan(ints[:, j])
        cols[name] = pa.array(np.where(miss, 0, ints[:, j]).astype(np.int64), mask=miss)
    offsets = pa.py_buffer(np.arange(0, 8 * len(labels) + 1, 8, dtype=np.int32))
    for c, name in enumerate(CRITEO_CATEGORICAL):
        k = cats[:, c]
        raw = world.values[c][np.maximum(k, 0)].reshape(-1)
        arr = pa.Array.from_buffers(pa.binary(), len(k), [None, offsets, pa.py_buffer(raw)])
        cols[name] = pc.if_else(pa.array(k < 0), pa.scalar(None, pa.binary()), arr)
    return pa.table(cols)


def generate_drift(path: str | os.PathLike, rows: int, seed: int = 0, model_seed: int = DEFAULT_MODEL_SEED,
                   progress: Callable[[int, float], None] | None = None) -> dict:
    """Write `rows` time-ordered rows of drifting synthetic Criteo TSV to `path`
    (gzip if it ends in .gz); the same (rows, seed, model_seed) give the same bytes.

    Returns {rows, positives, ctr, ctr_by_fifth, true_auc, true_logloss, seconds, path}:
    `true_*` score the planted probabilities against the drawn labels (the best
    any model can do on these rows in expectation).
    """
    check_rows(rows)
    world = make_world(model_seed)
    opts = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    metrics, fifths = BinaryMetrics(), np.zeros((5, 2))
    t0, done = time.perf_counter(), 0
    with output_stream(path, rows) as (sink, out):
        for first, p, labels, ints, cats in _chunks(world, rows, seed, model_seed):
            pa_csv.write_csv(_table(world, labels, ints, cats), sink, opts)
            metrics.update(labels, p)
            fifth = np.arange(first, first + p.size) * 5 // rows
            fifths += np.stack([np.bincount(fifth, labels, 5), np.bincount(fifth, minlength=5)], axis=1)
            done += p.size
            if progress:
                progress(done, time.perf_counter() - t0)
    r = metrics.result()
    return {"rows": done, "positives": int(metrics.positives), "ctr": metrics.positives / max(done, 1),
            "ctr_by_fifth": [round(float(a / b), 5) if b else None for a, b in fifths],
            "true_auc": r["auc"], "true_logloss": r["logloss"],
            "seconds": round(time.perf_counter() - t0, 3), "path": out}
