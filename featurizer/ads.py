"""Semi-synthetic ad click logs whose creatives are real MNIST images
(`mariana gen ads-with-images`; docs/synthetic-data.md has the model).

Rows are the planted Criteo model of sparse/synth.py, except that column C26
holds the row's creative id (8 hex digits) and the creative's *content* moves
the click logit:

    logit = criteo_logit without C26's effect
          + alpha[digit(k)]                     the digit class of creative k
          + beta[digit(k), segment]             class x user segment (C17's value)
          + gamma * ink_z(k)                    standardised mean pixel intensity
          + own[k]                              a per-creative residual
          + offset                              keeps the CTR near 22%

Creatives come from the 2,000 MNIST images held out of the featurizer's
training split. Some of them are *new*: they never appear in train.tsv and
serve a share of test.tsv, so only their pixels can tell a model what they
are worth; the old ones are Zipf-popular, so most are rare.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from mariana.featurizer.creatives import IMAGES_FILE, META_FILE
from mariana.featurizer.image import TEST_IMAGES, load_mnist, split_indices
from mariana.sparse.hashing import fmix64
from mariana.sparse.metrics import BinaryMetrics
from mariana.sparse.synth import World, _draw, _table, ctr_shift, make_world

CREATIVE_FIELD = "C26"
SEGMENT_FIELD = "C17"           # 10 values, never missing: the "user segment"
CREATIVE_COL, SEGMENT_COL = 25, 16
ID_SALT = 0xAD5C0FFEE


@dataclass(frozen=True)
class AdsSpec:
    rows: int
    seed: int = 0
    test_rows: int | None = None     # default rows // 4
    creatives: int = 2000            # at most the 2,000 held-out MNIST images
    new_share: float = 0.3           # of the creatives: never in train.tsv
    new_rows: float = 0.3            # of the test rows: showing a new creative
    zipf: float = 1.1                # popularity of creatives
    model_seed: int = 20140621       # the Criteo world and the planted image effects


@dataclass
class Planted:
    alpha: np.ndarray     # (10,) effect of the digit class
    beta: np.ndarray      # (10, 10) class x segment
    gamma: float          # effect of one std of ink
    own: np.ndarray       # (C,) per-creative residual
    ink_z: np.ndarray     # (C,) standardised ink
    digits: np.ndarray    # (C,) class of each creative
    offset: float = 0.0

    def effect(self, k: np.ndarray, segment: np.ndarray) -> np.ndarray:
        d = self.digits[k]
        return self.alpha[d] + self.beta[d, segment] + self.gamma * self.ink_z[k] + self.own[k] + self.offset


def creative_ids(n: int, model_seed: int) -> list[str]:
    """n distinct 8-hex-digit ids (Criteo-like), a function of the model seed."""
    h = fmix64(np.arange(n, dtype=np.uint64) ^ np.uint64(ID_SALT ^ model_seed)) & np.uint64(0xFFFFFFFF)
    ids = [f"{int(x):08x}" for x in h]
    if len(set(ids)) != n:  # 32-bit collisions: ~n^2 / 2^33, never for a few thousand
        raise RuntimeError("creative id collision; pick another model seed")
    return ids


def plant(images: np.ndarray, digits: np.ndarray, model_seed: int) -> Planted:
    rng = np.random.default_rng([model_seed, 6])
    return Planted(alpha=rng.normal(0, 0.7, 10), beta=rng.normal(0, 0.5, (10, 10)), gamma=0.3,
                   own=rng.normal(0, 0.2, len(images)), ink_z=ink_z(images), digits=digits.astype(np.int64))


def ink_z(images: np.ndarray) -> np.ndarray:
    """(C,) each image's mean pixel, standardised over the C images; 0 where they do not vary
    (one creative, or all with the same ink), which would otherwise be 0/0.

    >>> ink_z(np.array([[0, 0], [2, 2]], np.uint8)).tolist(), ink_z(np.ones((1, 4), np.uint8)).tolist()
    ([-1.0, 1.0], [0.0])
    """
    ink = images.reshape(len(images), -1).mean(1)
    std = ink.std()
    return (ink - ink.mean()) / std if std > 0 else np.zeros_like(ink)


def _zipf_pick(rng: np.random.Generator, pool: np.ndarray, n: int, s: float) -> np.ndarray:
    w = np.arange(1, len(pool) + 1, dtype=np.float64) ** -s
    return pool[np.minimum(np.searchsorted(np.cumsum(w) / w.sum(), rng.random(n)), len(pool) - 1)]


def _pick_creatives(rng, old, new, n, spec: AdsSpec, test: bool) -> np.ndarray:
    k = _zipf_pick(rng, old, n, spec.zipf)
    if test and len(new):
        fresh = rng.random(n) < spec.new_rows
        k[fresh] = _zipf_pick(rng, new, int(fresh.sum()), spec.zipf)
    return k


def _rows(world: World, planted: Planted, rng, old, new, n, spec, test) -> tuple:
    """(true logit, ints, cats, creative index) of n rows."""
    logit, ints, cats = _draw(world, n, rng)
    c26 = cats[:, CREATIVE_COL]
    logit -= np.where(c26 >= 0, world.main[CREATIVE_COL][np.maximum(c26, 0)], 0.0)  # C26 is the creative now
    k = _pick_creatives(rng, old, new, n, spec, test)
    logit += planted.effect(k, cats[:, SEGMENT_COL])
    if not np.isfinite(logit).all():  # rng.random() < NaN is False: every such row would be a silent non-click
        raise ValueError(f"the planted click model gave {int((~np.isfinite(logit)).sum())} of {n} rows a non-finite "
                         "logit (a bug in the generator): no labels written")
    return logit, ints, cats, k


def _solve_offset(world, planted, old, new, spec) -> float:
    """Shift so that ~22% of training rows are clicks, as in the plain Criteo model."""
    planted.offset = 0.0
    logit, *_ = _rows(world, planted, np.random.default_rng(12345), old, new, 100_000, spec, False)
    return ctr_shift(logit)


def _write(path: Path, world, planted, ids_arr, rng, old, new, n, spec, test, chunk=200_000) -> dict:
    opts = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    metrics, pos, done, counts = BinaryMetrics(), 0, 0, np.zeros(len(ids_arr), np.int64)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            while done < n:
                m = min(chunk, n - done)
                logit, ints, cats, k = _rows(world, planted, rng, old, new, m, spec, test)
                p = 1 / (1 + np.exp(-logit))
                labels = rng.random(m) < p
                table = _table(world, labels, ints, cats)
                table = table.set_column(table.schema.get_field_index(CREATIVE_FIELD), CREATIVE_FIELD,
                                         ids_arr.take(k))
                pa_csv.write_csv(table, sink, opts)
                metrics.update(labels.astype(np.float32), p)
                counts += np.bincount(k, minlength=len(ids_arr))
                pos, done = pos + int(labels.sum()), done + m
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()  # a failed run leaves no half-written file behind
    return {"path": str(path), "rows": n, "ctr": round(pos / max(n, 1), 4),
            "oracle_auc": metrics.auc(), "creatives_seen": int((counts > 0).sum()),
            "rows_with_new_creative": int(counts[new].sum())}


def generate_ads_with_images(out_dir: str | os.PathLike, spec: AdsSpec,
                             images_root: str | os.PathLike | None = None) -> dict:
    """Write OUT/train.tsv, OUT/test.tsv, OUT/creatives/{creatives.npy, creatives.json}
    and OUT/planted.json; returns a summary (rows, CTR, the oracle AUC of the true logits)."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    mnist = load_mnist(images_root)
    if mnist.images.shape[1:] != (28, 28):  # written as (C, 64, 64); every reader of creatives then refused it
        side = "x".join(map(str, mnist.images.shape[1:]))
        raise ValueError(f"{images_root or 'MNIST'}: {side} images; ads' creatives are 28x28, as the featurizer "
                         "takes them (`mariana gen images --size 28`)")
    if len(mnist.images) <= TEST_IMAGES:  # it said "test split of 2000 images out of 10"
        raise ValueError(f"{images_root or 'MNIST'}: {len(mnist.images):,} images; the creatives are drawn from the "
                         f"{TEST_IMAGES:,} held out of them, so more than {TEST_IMAGES:,} are needed")
    _, held = split_indices(len(mnist.images))
    if not 1 <= spec.creatives <= len(held):
        raise ValueError(f"--creatives must be in 1..{len(held)} (the held-out MNIST images)")
    order = np.random.default_rng([spec.model_seed, 5]).permutation(held)[:spec.creatives]
    images, digits = mnist.images[order], mnist.labels[order]
    ids = creative_ids(spec.creatives, spec.model_seed)
    n_new = int(round(spec.new_share * spec.creatives))
    old, new = np.arange(spec.creatives - n_new), np.arange(spec.creatives - n_new, spec.creatives)
    world = make_world(spec.model_seed)
    planted = plant(images, digits, spec.model_seed)
    planted.offset = _solve_offset(world, planted, old, new, spec)
    ids_arr = pa.array([i.encode() for i in ids], pa.binary())
    (out / "creatives").mkdir(parents=True, exist_ok=True)
    files = {}
    for name, rows, stream, test in (("train", spec.rows, 1, False),
                                     ("test", spec.test_rows if spec.test_rows is not None else spec.rows // 4, 2, True)):
        rng = np.random.default_rng([spec.seed, spec.model_seed, stream])
        files[name] = _write(out / f"{name}.tsv", world, planted, ids_arr, rng, old, new, rows, spec, test)
    _write_creatives(out / "creatives", ids, images, digits, order, new, mnist.source)
    _write_planted(out / "planted.json", planted, spec)
    return {"out": str(out), **files, "creatives": spec.creatives, "new_creatives": n_new,
            "seconds": round(time.perf_counter() - t0, 2)}


def _write_creatives(d: Path, ids, images, digits, order, new, source) -> None:
    np.save(d / IMAGES_FILE, np.ascontiguousarray(images), allow_pickle=False)
    is_new = np.zeros(len(ids), bool)
    is_new[new] = True
    meta = {"ids": ids, "field": CREATIVE_FIELD, "image_shape": list(images.shape[1:]),
            "digits": digits.tolist(), "new": is_new.tolist(), "mnist_index": order.tolist(),
            "source": source,
            "note": "row k of creatives.npy is the image of ids[k]; digits and new are the generator's "
                    "truth (for analysis): models read only ids and images"}
    (d / META_FILE).write_text(json.dumps(meta))


def _write_planted(path: Path, planted: Planted, spec: AdsSpec) -> None:
    body = {"spec": spec.__dict__, "creative_field": CREATIVE_FIELD, "segment_field": SEGMENT_FIELD,
            "alpha": planted.alpha.round(4).tolist(), "beta": planted.beta.round(4).tolist(),
            "gamma": planted.gamma, "own_sigma": 0.2, "offset": round(planted.offset, 6),
            "logit": "criteo logit without C26 + alpha[digit] + beta[digit, segment] + gamma * ink_z "
                     "+ own[creative] + offset"}
    path.write_text(json.dumps(body, indent=1))
