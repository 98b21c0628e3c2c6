"""Image files as a training set for the image mode (`mariana train image --data DIR`):
the folder layout users keep, decoded when a batch needs them, so decoding is a stage
of the input pipeline (trainer/image.py runs it on background threads).

    DIR/<class>/<file>      one sub-directory per class (the labels: the sorted class
                            names' positions); files PNG, JPEG, GIF, BMP or WebP, any
                            size and colour, made (size, size) grey as the featurizer takes
                            them (featurizer.image.decode_encoded: scaled to fit, centred)

    data = load_image_folder(DIR)       an ImageSet whose `images` decode when indexed
    data.images.size = 64               the side the model takes
    data.images.decode(positions, pool) (n, 64, 64) uint8, on the pool's threads

The order of the set is the files' names, then their class (`00042.png` before
`00043.png` whatever their classes), so the fixed train/test split
(featurizer.image.split_indices) does not hang on how the classes are named, and a
folder written by `mariana gen images --format png` is in the order of its IDX twin.

Bad input: a file of another kind, one over `MAX_FILE_BYTES` (each decode reads it
whole), one whose header Pillow cannot read or says is too large, a directory inside a
class directory, or a file outside any class directory is counted, named in `source`
and left out before the set is formed (every rank of a job lists the same files). A class
entry that leads to no directory (a symlink to nothing or a loop) or cannot be listed stays a
class with no images, as an empty class folder does (the classes after it keep their labels),
and is named in `source` with why. A file that passes that check but cannot be decoded
later (damaged past its header, or a JPEG of more than MAX_JPEG_SCANS scans) is a black
image under its label, named once in `failures` however often it is decoded: the
job goes on, and says so in its record. (Leaving it out of the loss would need its
rank to tell the last partition's rank, which holds the labels and decodes nothing.)
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from mariana.featurizer.idx import mnist_file, printable
from mariana.featurizer.image import (ENCODED_SUFFIXES, FORMATS, MAX_FILE_BYTES, MAX_PIXELS, MNIST_IMAGES, BadImage,
                                      ImageSet, decode_encoded)
from mariana.sparse.errors import DataFormatError

SHOWN = 5  # skipped files or decode failures named in a record


class EncodedImages:
    """(N, size, size) uint8 images kept as files, decoded when indexed."""

    dtype = np.uint8
    ndim = 3

    def __init__(self, files: list[Path], size: int):
        self.files, self.size = files, size
        self.failures: dict[int, str] = {}  # file's position -> "file: reason": each image given as black
        self._lock = threading.Lock()

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.files), self.size, self.size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index) -> np.ndarray:
        positions = np.arange(len(self.files))[index]
        return self.decode(positions) if positions.ndim else self.decode(positions[None])[0]

    def decode(self, positions, pool: Executor | None = None, workers: int = 1) -> np.ndarray:
        """The images at `positions` (n, size, size): decoded here, or in `workers` slices on
        `pool`'s threads (Pillow lets go of the GIL while it decodes and scales)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty((len(positions), self.size, self.size), np.uint8)

        def part(ks: np.ndarray) -> None:
            for k in ks:
                path = self.files[positions[k]]
                try:
                    out[k] = decode_encoded(path.read_bytes(), printable(path), self.size)
                except (BadImage, OSError) as e:
                    out[k] = 0
                    with self._lock:  # a file once, however often it is decoded
                        self.failures.setdefault(int(positions[k]), str(e) if isinstance(e, BadImage)
                                                 else f"{printable(path)}: {e}")
        if pool is None or workers < 2:
            part(np.arange(len(positions)))
        else:
            list(pool.map(part, np.array_split(np.arange(len(positions)), workers)))
        return out


def is_image_folder(path: str | os.PathLike) -> bool:
    """A directory with at least one class sub-directory (and not the MNIST IDX files)."""
    d = Path(path)
    return d.is_dir() and mnist_file(d, MNIST_IMAGES) is None and any(_classes(d))


def _classes(d: Path) -> list[Path]:
    """The class entries: sub-directories, and symlinks that lead nowhere (to nothing, or a loop), which
    stay classes as an empty class folder does, so the classes after them keep their labels."""
    return sorted(p for p in d.iterdir() if not p.name.startswith(".") and (p.is_dir() or _dangling(p)))


def _dangling(p: Path) -> bool:
    return p.is_symlink() and not p.exists()  # exists() is False for a loop (ELOOP) too


def _class_files(cdir: Path, skipped: list[str]) -> list[Path]:
    """The entries of a class directory; none, and a line in `skipped`, when it cannot be listed."""
    try:
        return sorted(cdir.iterdir())
    except OSError as e:
        to = f"a symlink to {printable(os.readlink(cdir))} that leads to no directory" if cdir.is_symlink() else ""
        skipped.append(f"{printable(cdir.name)}/: {to or 'cannot be listed'} ({e.strerror or e}); kept as a "
                       "class with no images, so the classes after it keep their labels")
        return []


def load_image_folder(root: str | os.PathLike, size: int = 28) -> ImageSet:
    """The folder's images (decoded at `size` when indexed; the attribute may be set
    later), its labels, and a `source` record: classes, files, what was left out and why,
    the first image's size, and a digest of the listing (names and sizes)."""
    from PIL import Image, UnidentifiedImageError

    d = Path(root)
    if not d.is_dir():
        raise DataFormatError(f"{d}: no such directory (an image folder: one sub-directory of images per class)")
    classes = _classes(d)
    if len(classes) < 2:
        raise DataFormatError(f"{d}: {len(classes)} class directories; an image folder needs one sub-directory of "
                              "images per class, at least two")
    found, skipped = [], [f"{printable(p.name)}: not in a class directory" for p in sorted(d.iterdir())
                          if p.is_file() and not p.name.startswith(".")]
    for label, cdir in enumerate(classes):
        for p in _class_files(cdir, skipped):
            if p.name.startswith("."):
                continue
            name = printable(f"{cdir.name}/{p.name}")
            if not p.is_file():
                skipped.append(f"{name}: {'a directory' if p.is_dir() else 'not a regular file'} (an image folder "
                               "is DIR/<class>/<image files>, one level)")
                continue
            if p.suffix.lower() not in ENCODED_SUFFIXES:
                skipped.append(f"{name}: not an image file kind ({', '.join(ENCODED_SUFFIXES)})")
                continue
            if (nbytes := p.stat().st_size) > MAX_FILE_BYTES:
                skipped.append(f"{name}: {nbytes:,} bytes, over the {MAX_FILE_BYTES >> 20} MiB an image file may be")
                continue
            try:
                with Image.open(p) as img:  # the header only
                    fmt, (w, h) = img.format, img.size
            except Image.DecompressionBombError:  # Pillow's bound on the header's size, above ours
                skipped.append(f"{name}: over the {MAX_PIXELS:,} pixels allowed")
                continue
            except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
                skipped.append(f"{name}: not an image file Pillow can read")
                continue
            if fmt not in FORMATS or w * h > MAX_PIXELS:
                skipped.append(f"{name}: a {fmt} image of {w}x{h} pixels (PNG, JPEG, GIF, BMP or WebP, at most "
                               f"{MAX_PIXELS:,} pixels)")
                continue
            found.append((p.name, cdir.name, label, p, [w, h]))
    if not found:
        raise DataFormatError(f"{d}: no readable image in its {len(classes)} class directories")
    found.sort()
    listing = hashlib.sha256()
    for name, cls, _, p, _ in found:  # the names' bytes as the file system has them (UTF-8 or not)
        listing.update(os.fsencode(f"{cls}/{name}") + f"\0{p.stat().st_size}\n".encode())
    labels = np.array([label for _, _, label, _, _ in found], dtype=np.int64)
    source = {"dir": str(d.resolve()), "format": "image folder", "classes": [printable(c.name) for c in classes],
              "images": len(found), "per_class": np.bincount(labels, minlength=len(classes)).tolist(),
              "first_image_size": found[0][4], "skipped": len(skipped), "first_skipped": skipped[:SHOWN],
              "listing_sha256": listing.hexdigest()}
    return ImageSet(EncodedImages([p for *_, p, _ in found], size), labels, source)
