"""Image features for a training job: find the creatives, get a frozen
featurizer (the one named, the cached one, or train one on first use), embed
every creative once, and hand back the id -> features table.

    prepare_image_features(cfg.images) -> (CreativeFeatures (C ids -> (C, d)), info for the record)

The table is what a model version stores and what serving looks a creative id
up in; in cluster mode each creative's features are cached in Redis
(services/creative_cache.py) and preprocess looks them up there.

A creatives dir is `creatives.npy` + `creatives.json` (what `gen
ads-with-images` writes) plus, optionally, one file per creative added later in
`uploads/`: `<id>.png|.jpg|.jpeg|.gif|.bmp|.webp` (any size and colour: made
28x28 grey by `featurizer.image.decode_encoded`), `<id>.raw` (784 bytes) or
`<id>.npy` (28x28 uint8). An upload that cannot be read as one of these (a
damaged file, a .raw of another size, a .npy whose header promises other than
the bytes it holds, a JPEG of more than MAX_JPEG_SCANS scans, a file of another
kind, one over MAX_FILE_BYTES, which is not read; a directory, FIFO or dangling
symlink) is corrupt: counted, named in the log and the record, and left out, so
rows naming it get the unknown-creative fallback. An id is its file name's bytes,
UTF-8 or not (shown escaped in messages: featurizer.idx.printable).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mariana.featurizer.creatives import FALLBACK, META_FILE, CreativeFeatures, load_creatives
from mariana.featurizer.idx import load_npy, printable
from mariana.featurizer.image import (ENCODED_SUFFIXES, MANIFEST, MAX_FILE_BYTES, BadImage, ImageFeaturizer,
                                      decode_encoded, load_mnist, stack_images)
from mariana.sparse.errors import ConfigError
from mariana.trainer.config import ImagesConfig
from mariana.trainer.featurizer_train import FeaturizerTrainConfig, TrainProgress, progress_logger, train_and_export

log = logging.getLogger(__name__)
CACHE_DIR = "featurizer"
UPLOADS_DIR = "uploads"
SHOWN_CORRUPT = 5
UPLOAD_SUFFIXES = (".raw", ".npy", *ENCODED_SUFFIXES)


@dataclass
class CreativeSet:
    """The creatives of a dir: ids, their images (C, 28, 28) uint8, and the uploads that were corrupt."""

    dir: Path
    ids: list[bytes]
    images: np.ndarray
    meta: dict
    corrupt: list[str] = field(default_factory=list)  # one reason per corrupt upload

    def tags(self) -> list[bytes]:
        """8 bytes of each image's sha256: a cached feature row is reused only for the same pixels."""
        return [hashlib.sha256(img.tobytes()).digest()[:8] for img in self.images]

    def digest(self) -> str:
        """Names this set of (id, image) pairs: the cache records which sets it holds whole."""
        h = hashlib.sha256()
        for cid, tag in zip(self.ids, self.tags()):
            h.update(len(cid).to_bytes(2, "little") + cid + tag)
        return h.hexdigest()[:16]

    def info(self) -> dict:
        return {"creatives_dir": str(self.dir.resolve()), "creatives": len(self.ids),
                "corrupt_images": len(self.corrupt), "first_corrupt": self.corrupt[:SHOWN_CORRUPT]}


def creatives_dir(path: str) -> Path:
    """The dir holding creatives.json: `path` itself or `path`/creatives."""
    d = Path(path)
    for cand in (d, d / "creatives"):
        if (cand / META_FILE).exists():
            return cand
    raise ConfigError(f"--images {path}: no {META_FILE} there or in {d / 'creatives'} "
                      f"(make creatives with 'mariana gen ads-with-images')")


def load_creative_set(path: str) -> CreativeSet:
    """The creatives of `path` (see creatives_dir) with their uploads; corrupt uploads counted and skipped."""
    cdir = creatives_dir(path)
    ids, images, meta = load_creatives(cdir)
    corrupt: list[str] = []
    up = cdir / UPLOADS_DIR
    if up.is_dir():
        items, names = [], []
        for p in sorted(q for q in up.iterdir() if not q.name.startswith(".")):
            try:
                items.append(read_upload(p))
                names.append(p)
            except BadImage as e:
                corrupt.append(str(e))
        good, keep, bad = stack_images(items, [printable(p.name) for p in names])
        corrupt += bad
        known = set(ids)
        new_ids = [os.fsencode(names[i].stem) for i in keep]  # the name's bytes, UTF-8 or not
        if new_ids:
            twice = sorted(i for i, n in Counter(new_ids).items() if n > 1)
            if twice:
                raise ConfigError(f"{up}: several uploads name creative {printable(os.fsdecode(twice[0]))} "
                                  "(e.g. a .png and a .jpg); an id names one image")
            replaced = [i for i in new_ids if i in known]
            if replaced:
                raise ConfigError(f"{up}: uploads reuse creative ids of creatives.json "
                                  f"({', '.join(printable(os.fsdecode(i)) for i in replaced[:3])}); an id names one "
                                  "image")
            ids = ids + new_ids
            images = np.concatenate([images, good]) if len(images) else good
        if corrupt:
            log.warning("%d corrupt creative uploads in %s skipped (rows naming them get the fallback): %s",
                        len(corrupt), up, "; ".join(corrupt[:SHOWN_CORRUPT]))
    return CreativeSet(cdir, ids, images, meta, corrupt)


def read_upload(p: Path):
    """One upload's image as stack_images takes it (784 raw bytes, an array, or decoded from an
    image file), or BadImage naming the file and why. What is not a regular file (a directory,
    a FIFO, a symlink to nothing) and a file over MAX_FILE_BYTES are refused unread; a .npy whose header
    promises other than the bytes it holds is refused before its array is made (featurizer.idx.load_npy)."""
    name = printable(p.name)  # a name that is not UTF-8 is shown escaped, never a UnicodeEncodeError
    if not p.is_file():
        raise BadImage(f"{name}: {_not_a_file(p)}; an upload is one image file")
    suffix = p.suffix.lower()
    if suffix not in UPLOAD_SUFFIXES:
        raise BadImage(f"{name}: not an upload kind ({', '.join(UPLOAD_SUFFIXES)})")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise BadImage(f"{name}: {size:,} bytes, over the {MAX_FILE_BYTES >> 20} MiB an upload may be")
        if suffix == ".npy":
            return load_npy(p, name)
        raw = p.read_bytes()
    except OSError as e:
        raise BadImage(f"{name}: cannot be read ({e.strerror or e})") from None
    return raw if suffix == ".raw" else decode_encoded(raw, name)


def _not_a_file(p: Path) -> str:
    if p.is_symlink() and not p.exists():
        return f"a symlink to {printable(os.readlink(p))}, which does not exist"
    if p.is_dir():
        return "a directory"
    return "not a regular file (a FIFO, socket or device)"


def open_featurizer(cfg: ImagesConfig, cset: CreativeSet,
                    progress: Callable[[TrainProgress], None] | None = None) -> tuple[ImageFeaturizer, Path, str]:
    fdir, how = resolve_featurizer(cfg, cset.dir, cset.meta, progress)
    return ImageFeaturizer.load(fdir), fdir, how


def featurizer_info(featurizer: ImageFeaturizer, fdir: Path, how: str) -> dict:
    return {"featurizer": str(fdir.resolve()), "featurizer_source": how, "dim": featurizer.dim,
            "featurizer_accuracy": featurizer.manifest.get("accuracy"),
            "featurizer_sha256": featurizer.manifest.get("weights_sha256")}


def resolve_featurizer(cfg: ImagesConfig, cdir: Path, meta: dict,
                       progress: Callable[[TrainProgress], None] | None = None) -> tuple[Path, str]:
    """(featurizer dir, how it was found: 'given', 'cached' or 'trained on first use')."""
    if cfg.featurizer:
        return Path(cfg.featurizer), "given"
    cache = cdir / CACHE_DIR
    if (cache / MANIFEST).exists():
        return cache, "cached"
    if os.path.lexists(cache) and not (cache.is_dir() and not any(cache.iterdir())):  # kept, not replaced
        raise ConfigError(f"{cache}: not empty and no featurizer ({MANIFEST}) in it; the one trained on first use "
                          "would replace what is there: move that away, or give --featurizer")
    mnist = cfg.mnist or (meta.get("source") or {}).get("dir")
    if not cfg.mnist and mnist and not os.path.isdir(mnist):  # "set MARIANA_DATA or pass the dir": neither worked
        raise ConfigError(f"{cdir}: no featurizer in {cache}, and the MNIST dir its creatives.json names to train "
                          f"one on, {mnist}, is not there (moved?): give a trained featurizer (--featurizer), or "
                          "set images.mnist to where MNIST is now (--set images.mnist=DIR for train)")
    log.info("no featurizer in %s: training one on %s (first use; once per creatives dir)", cache, mnist)
    train_and_export(load_mnist(mnist), cache, FeaturizerTrainConfig(), progress or progress_logger(10.0))
    return cache, "trained on first use"


def prepare_image_features(cfg: ImagesConfig,
                           progress: Callable[[TrainProgress], None] | None = None) -> tuple[CreativeFeatures, dict]:
    """Embed every creative with the frozen featurizer; (table, info for the job record)."""
    cset = load_creative_set(cfg.creatives)
    featurizer, fdir, how = open_featurizer(cfg, cset, progress)
    t0 = time.perf_counter()
    features = featurizer.embed(cset.images)                 # (C, d)
    seconds = time.perf_counter() - t0
    info = {**cset.info(), "field": cfg.field, **featurizer_info(featurizer, fdir, how),
            "embed_images_per_s": round(len(cset.ids) / max(seconds, 1e-9)),
            "features_sha256": features_sha(features), "unknown_creative": FALLBACK}
    log.info("image features: %d creatives x %d dims from %s (%s)", len(cset.ids), featurizer.dim, fdir, how)
    return CreativeFeatures(cset.ids, features), info


def features_sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
