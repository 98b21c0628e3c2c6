"""A deterministic synthetic image set for the image mode (`mariana gen images`):
ten classes of drawn shapes at any size (64x64 by default), so memory and speed
are measured on inputs as large as the wide CNN preset takes, with or without
MNIST at hand.

    class 0 disc      1 ring        2 square       3 triangle     4 cross
          5 h-bars    6 v-bars      7 diagonal     8 two dots     9 L-shape

Each image draws its shape at a random centre, scale, stroke width and
brightness, then adds a random background level and Gaussian noise: nothing is
at a fixed place, so the task needs translation-tolerant features. The set is a
pure function of (n, seed, size): image i depends only on (seed, i), so the
first k images of a set of n are the set of k. Written as IDX files under the
MNIST names (featurizer/image.py's `load_mnist` reads them), or with `--format png|jpeg`
as an image folder of encoded files (featurizer/image_folder.py), whose decoding is then
a stage of the image job's input pipeline.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from mariana.featurizer.idx import MNIST_IMAGES, MNIST_LABELS, write_idx
from mariana.sparse.files import file_sha256

CLASSES = ("disc", "ring", "square", "triangle", "cross", "h-bars", "v-bars", "diagonal", "two dots", "L-shape")


def draw(label: int, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """One (size, size) uint8 image of class `label`.

    >>> img = draw(0, np.random.default_rng(0), 32)
    >>> img.shape, img.dtype, int(img.max()) > int(np.median(img))
    ((32, 32), dtype('uint8'), True)
    """
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    r = rng.uniform(0.15, 0.3)                      # half the shape's extent, as a share of the side
    cy, cx = rng.uniform(r + 0.03, 0.97 - r, 2)
    w = rng.uniform(0.04, 0.08)                     # stroke width
    dy, dx = yy - cy, xx - cx
    ay, ax = np.abs(dy), np.abs(dx)
    if label == 0:
        mask = dy ** 2 + dx ** 2 <= r ** 2
    elif label == 1:
        mask = np.abs(np.sqrt(dy ** 2 + dx ** 2) - r * 0.8) <= w / 2
    elif label == 2:
        mask = (np.maximum(ay, ax) <= r) & (np.maximum(ay, ax) >= r - w)
    elif label == 3:
        mask = (dy <= r) & (dy >= -r) & (ax <= (dy + r) / 2)
    elif label == 4:
        mask = ((ay <= w / 2) & (ax <= r)) | ((ax <= w / 2) & (ay <= r))
    elif label == 5:
        mask = (ax <= r) & (ay <= r) & (np.mod(dy + r, 2 * w) < w)
    elif label == 6:
        mask = (ax <= r) & (ay <= r) & (np.mod(dx + r, 2 * w) < w)
    elif label == 7:
        mask = (np.abs(dy - dx) <= w / 1.4) & (ax <= r) & (ay <= r)
    elif label == 8:
        d = r * 0.6
        mask = ((dy ** 2 + (dx - d) ** 2) <= (w * 1.5) ** 2) | ((dy ** 2 + (dx + d) ** 2) <= (w * 1.5) ** 2)
    else:  # a bar down the left side and one along the bottom
        mask = ((np.abs(dx + r) <= w / 2) & (ay <= r)) | ((np.abs(dy - r) <= w / 2) & (ax <= r))
    background = rng.uniform(0, 60)
    ink = rng.uniform(150, 255)
    img = background + mask * (ink - background) + rng.normal(0, 18, (size, size))
    return np.clip(img, 0, 255).astype(np.uint8)


FORMATS = ("idx", "png", "jpeg")
JPEG_QUALITY = 90  # gen images --format jpeg's default


MAX_BYTES = 8 << 30  # pixels gen images draws in memory before it writes them


def generate_images(out: str | os.PathLike, n: int, seed: int = 0, size: int = 64, fmt: str = "idx",
                    quality: int = JPEG_QUALITY) -> dict:
    """Write OUT/t10k-images-idx3-ubyte.gz ((n, size, size) uint8) and OUT/t10k-labels-idx1-ubyte.gz
    (labels 0..9, each image's drawn uniformly); returns a record with the class counts and hashes.
    `fmt` png or jpeg: an image folder instead (featurizer/image_folder.py), OUT/<k>-<class>/<i>.png
    (or .jpg at `quality`), the files named by their index so the folder's order is the IDX's."""
    if n < 1 or not 8 <= size <= 4096:
        raise ValueError(f"gen images: --rows >= 1 and --size in 8..4096, got {n}, {size}")
    if n * size * size > MAX_BYTES:  # held at once: past this, numpy's MemoryError said to lower hashing.bits
        raise ValueError(f"gen images: {n:,} images of {size}x{size} are {n * size * size / 2**30:.1f} GiB, more "
                         f"than the {MAX_BYTES >> 30} GiB gen images holds at once: fewer --rows or a smaller --size")
    if fmt not in FORMATS:
        raise ValueError(f"gen images: --format {fmt!r}: use one of {list(FORMATS)}")
    if not 1 <= quality <= 95:
        raise ValueError(f"gen images: --quality {quality}: between 1 and 95")
    d = Path(out)
    if d.is_dir() and any(d.iterdir()):  # what was there stayed, and was read with the new set (100 images for 10)
        raise ValueError(f"gen images: {out} holds files already: images left there would be read with the new "
                         "ones; name a new or empty directory (or remove that one)")
    images = np.empty((n, size, size), np.uint8)
    labels = np.empty(n, np.uint8)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        labels[i] = int(rng.integers(10))
        images[i] = draw(int(labels[i]), rng, size)
    record = {"out": str(d), "images": n, "size": size, "seed": seed, "format": fmt, "classes": list(CLASSES),
              "per_class": np.bincount(labels, minlength=10).tolist(),
              "content_sha256": _sha256(images, labels)}
    d.parent.mkdir(parents=True, exist_ok=True)
    stage = d.parent / f".{d.name}.tmp-{os.getpid()}"  # the set appears whole or not at all: a Ctrl-C left
    stage.mkdir()  # 3,901 of 200,000 images, which trained without a word
    try:
        if fmt != "idx":
            record["bytes"] = write_folder(stage, images, labels, fmt, quality)
        else:
            write_idx(stage / MNIST_IMAGES, images)
            write_idx(stage / MNIST_LABELS, labels)
            record["images_sha256"] = file_sha256(stage / MNIST_IMAGES)
        if d.is_dir():
            d.rmdir()  # empty (checked above): an OSError if something was written there meanwhile
        stage.rename(d)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return record


def _sha256(*arrays: np.ndarray) -> str:
    """The sha256 of the arrays' bytes one after another, read in place: `tobytes()` and its
    concatenation held the pixels three times over (gen images draws up to MAX_BYTES of them)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def write_folder(d: Path, images: np.ndarray, labels: np.ndarray, fmt: str, quality: int = JPEG_QUALITY) -> int:
    """Each image as d/<label>-<class>/<index>.png|.jpg; returns the bytes written."""
    from PIL import Image

    kind, suffix, options = ("JPEG", "jpg", {"quality": quality}) if fmt == "jpeg" else ("PNG", "png", {})
    dirs = [d / f"{k}-{name.replace(' ', '-')}" for k, name in enumerate(CLASSES)]
    for sub in dirs:
        sub.mkdir(exist_ok=True)
    total = 0
    for i, (img, label) in enumerate(zip(images, labels)):
        path = dirs[label] / f"{i:06d}.{suffix}"
        Image.fromarray(img).save(path, kind, **options)
        total += path.stat().st_size
    return total
