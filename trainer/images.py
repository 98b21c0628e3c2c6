"""Image features for a training job: find the creatives, get a frozen
featurizer (the one named, the cached one, or train one on first use), embed
every creative once, and hand back the id -> features table.

    prepare_image_features(cfg.images) -> (CreativeFeatures (C ids -> (C, d)), info for the record)

The table is what a model version stores, what preprocess will cache per
creative, and what serving looks a creative id up in.
"""
from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np

from featurizer.creatives import META_FILE, CreativeFeatures, load_creatives
from featurizer.image import ImageFeaturizer, load_mnist
from sparse.errors import ConfigError
from trainer.config import ImagesConfig
from trainer.featurizer_train import FeaturizerTrainConfig, TrainProgress, train_and_export

log = logging.getLogger(__name__)
CACHE_DIR = "featurizer"


def creatives_dir(path: str) -> Path:
    """The dir holding creatives.json: `path` itself or `path`/creatives."""
    d = Path(path)
    for cand in (d, d / "creatives"):
        if (cand / META_FILE).exists():
            return cand
    raise ConfigError(f"--images {path}: no {META_FILE} there or in {d / 'creatives'} "
                      f"(make creatives with 'mariana gen ads-with-images')")


def resolve_featurizer(cfg: ImagesConfig, cdir: Path, meta: dict,
                       progress: Callable[[TrainProgress], None] | None = None) -> tuple[Path, str]:
    """(featurizer dir, how it was found: 'given', 'cached' or 'trained on first use')."""
    if cfg.featurizer:
        return Path(cfg.featurizer), "given"
    cache = cdir / CACHE_DIR
    if (cache / "manifest.json").exists():
        return cache, "cached"
    mnist = cfg.mnist or (meta.get("source") or {}).get("dir")
    log.info("no featurizer in %s: training one on %s (first use)", cache, mnist)
    train_and_export(load_mnist(mnist), cache, FeaturizerTrainConfig(), progress)
    return cache, "trained on first use"


def prepare_image_features(cfg: ImagesConfig,
                           progress: Callable[[TrainProgress], None] | None = None) -> tuple[CreativeFeatures, dict]:
    """Embed every creative with the frozen featurizer; (table, info for the job record)."""
    cdir = creatives_dir(cfg.creatives)
    ids, images, meta = load_creatives(cdir)
    fdir, how = resolve_featurizer(cfg, cdir, meta, progress)
    featurizer = ImageFeaturizer.load(fdir)
    t0 = time.perf_counter()
    features = featurizer.embed(images)                      # (C, d)
    seconds = time.perf_counter() - t0
    info = {"creatives_dir": str(cdir.resolve()), "creatives": len(ids), "field": cfg.field,
            "featurizer": str(fdir.resolve()), "featurizer_source": how, "dim": featurizer.dim,
            "featurizer_accuracy": featurizer.manifest.get("accuracy"),
            "featurizer_sha256": featurizer.manifest.get("weights_sha256"),
            "embed_images_per_s": round(len(ids) / max(seconds, 1e-9)),
            "features_sha256": _sha(features), "unknown_creative": "zero features, flag column = 1"}
    log.info("image features: %d creatives x %d dims from %s (%s)", len(ids), featurizer.dim, fdir, how)
    return CreativeFeatures(ids, features), info


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
