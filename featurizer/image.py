"""The frozen image featurizer: uint8 images -> float32 features, and the
image data it needs (MNIST IDX files, the fixed train/test split, checks).

    DIR/manifest.json        format, d, input normalisation, the ops, accuracy, source sha256
    DIR/weights.safetensors  the weights the ops name, and the output standardisation

    ImageFeaturizer.load(DIR).embed(uint8 (N, 28, 28)) -> float32 (N, d)

The network is defined once, in trainer/models/image_cnn.py; training there
(trainer/featurizer_train.py) exports it as a list of plain ops (conv2d, relu,
max_pool2d, flatten, linear) that `ImageFeaturizer` runs with
torch.nn.functional. So this layer needs no training code (DESIGN.md: the
featurizer sits below the trainer) and preprocess and serving load only
weights and JSON, never pickle.

`embed` is a pure function of the pixels: no dropout, no batch statistics, and
the same bits for an image whatever batch it comes in (see `ROW_BLOCK`) at one
torch thread count, so training, preprocess and serving get the same features
for a creative; processes on other thread counts get them within float32
rounding (~1e-6: intra-op threads split the work otherwise).
"""
from __future__ import annotations

import io
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from mariana.featurizer.idx import (MNIST_IMAGES, MNIST_LABELS, MNIST_TRAIN, BadImage, IdxFormatError, mnist_file,
                                   read_idx)
from mariana.sparse import finite
from mariana.sparse.errors import DataFormatError, ModelDirError
from mariana.sparse.files import file_sha256, loads_json

log = logging.getLogger(__name__)

FORMAT = "mariana-featurizer/1"
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"
SPLIT_SEED = 20140621
TEST_IMAGES = 2000
# The embed GEMM computes rows in blocks; a partial block may sum in another
# order. Padding every call to whole blocks gives each image the same bits in
# any batch (checked by tests/unit/test_featurizer.py).
ROW_BLOCK = 8
# A big image is box-averaged by an integer factor down to >= this many times the target
# size before its colour conversion and the Lanczos fit (Pillow's `reducing_gap`: 3 is
# "indistinguishable from fair resampling in most cases"); smaller ones are fitted directly.
REDUCING_GAP = 3


# ---- data ------------------------------------------------------------------------

@dataclass
class ImageSet:
    images: np.ndarray   # (N, S, S) uint8
    labels: np.ndarray   # (N,) uint8
    source: dict         # paths and sha256 of the files read


def mnist_dir(root: str | os.PathLike | None = None) -> Path:
    """`root`, else $MARIANA_DATA/mnist, else ../shared/data/mnist beside the checkout."""
    if root:
        return Path(root)
    data = os.environ.get("MARIANA_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
    return Path(data) / "mnist"


TRAIN_NOT_READ = (" (MNIST's train-* files are not: its 10k test set, t10k-*, is split into 8k training and 2k "
                  "held-out images)")


def load_mnist(root: str | os.PathLike | None = None) -> ImageSet:
    """The MNIST images and labels in `root` (see `mnist_dir`), gzipped or plain, checked
    against each other. Only MNIST's 10k test files are read: the featurizer and the image job
    split them 8k/2k, and `gen ads-with-images` draws its creatives from the 2k."""
    d = mnist_dir(root)
    paths = {"images": mnist_file(d, MNIST_IMAGES), "labels": mnist_file(d, MNIST_LABELS)}
    for name, p in zip((MNIST_IMAGES, MNIST_LABELS), paths.values()):
        if p is None:
            train = any(mnist_file(d, t) for t in MNIST_TRAIN)
            raise DataFormatError(f"{d}: no {name} (or {name.removesuffix('.gz')}): the MNIST IDX files read are "
                                  f"{MNIST_IMAGES} and {MNIST_LABELS}, gzipped or plain"
                                  f"{TRAIN_NOT_READ if train else ''}; set MARIANA_DATA or pass the dir")
    images, labels = read_idx(paths["images"], ndim=3), read_idx(paths["labels"], ndim=1)
    if len(images) != len(labels):
        raise IdxFormatError(f"{d}: {len(images)} images but {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise IdxFormatError(f"{paths['labels']}: labels must be digits 0..9, found {labels.max()}")
    source = {"dir": str(d.resolve())} | {f"{k}_sha256": file_sha256(p) for k, p in paths.items()}
    return ImageSet(images, labels, source)


def split_indices(n: int, test: int = TEST_IMAGES, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: a fixed permutation, its last `test` items held out.
    gen ads-with-images draws its creatives from the held-out part.

    >>> tr, te = split_indices(10, test=2); len(tr), len(te), sorted(np.concatenate([tr, te]).tolist()) == list(range(10))
    (8, 2, True)
    """
    if not 0 < test < n:
        raise ValueError(f"test split of {test} images out of {n}")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[:n - test]), np.sort(perm[n - test:])


# ---- checking images ---------------------------------------------------------------

def check_images(images, name: str = "images", size: int = 28) -> np.ndarray:
    """A (N, size, size) uint8 array, or BadImage naming what is wrong."""
    if not isinstance(images, np.ndarray):
        raise BadImage(f"{name}: expected a numpy array, got {type(images).__name__}")
    if images.dtype != np.uint8:
        raise BadImage(f"{name}: expected uint8 pixels, got {images.dtype}")
    if images.ndim != 3 or images.shape[1:] != (size, size):
        raise BadImage(f"{name}: expected shape (N, {size}, {size}), got {images.shape}")
    return images


def decode_image(raw, name: str, size: int = 28) -> np.ndarray:
    """One image from raw bytes (size*size pixels, row-major) or a (size, size) uint8
    array -> (size, size) uint8; BadImage naming `name` otherwise.

    >>> decode_image(bytes(784), "creative 7").shape
    (28, 28)
    >>> decode_image(bytes(10), "creative 7")
    Traceback (most recent call last):
    mariana.featurizer.idx.BadImage: creative 7: 10 bytes, expected 784 (a 28x28 uint8 image)
    """
    if isinstance(raw, (bytes, bytearray, memoryview)):
        if len(raw) != size * size:
            raise BadImage(f"{name}: {len(raw)} bytes, expected {size * size} (a {size}x{size} uint8 image)")
        return np.frombuffer(raw, np.uint8).reshape(size, size)
    if isinstance(raw, np.ndarray) and raw.shape != (size, size):  # (3, 28, 28) was taken as its first image
        raise BadImage(f"{name}: expected one {size}x{size} image (shape ({size}, {size})), got shape "
                       f"{tuple(raw.shape)}")
    return check_images(raw[None], name, size)[0]


# Image files a creative may be uploaded as (trainer/images.py): decoded by Pillow.
ENCODED_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp")
MAX_PIXELS = 40_000_000  # a larger image is refused before it is decoded (a decompression bomb)
MAX_FILE_BYTES = 64 << 20  # a larger image file is refused unread (ad creatives are KBs to a few MB)
BAND_PIXELS = 1 << 20      # 16-bit grey is cut to 8 bits this many pixels at a time (see _top_bits)
# Each scan of a progressive JPEG decodes the whole image again: 1,000 repeated scans in a 200 KB
# file took 40 s. Encoders write ~10 (libjpeg's progressive script; mozjpeg's a few more) and
# libjpeg-turbo's tools stop at 500 (-maxscans); a JPEG (or MPO) with more than this is refused.
MAX_JPEG_SCANS = 100
FORMATS = ("PNG", "JPEG", "MPO", "GIF", "BMP", "WEBP")  # Pillow's names; MPO: a JPEG with a Multi-Picture block


def decode_encoded(raw: bytes, name: str, size: int = 28) -> np.ndarray:
    """An image file's bytes (PNG, JPEG, GIF, BMP or WebP, any size and colour) ->
    (size, size) uint8 grey levels, as the featurizer takes them: transparent pixels
    black (an alpha channel or a PNG's transparent colour), colour to luma (ITU-R 601-2),
    16-bit grey to its top 8 bits, turned upright as its EXIF says, the whole image scaled
    to fit (Lanczos, after box averages for a big one: `REDUCING_GAP`; a JPEG is decoded at
    a reduced scale first) and centred on black, so a 300x250 banner keeps its proportions.
    A (size, size) grey PNG comes back pixel for pixel. BadImage naming `name` and the
    reason otherwise.

    >>> import io; from PIL import Image
    >>> buf = io.BytesIO(); Image.new("RGB", (300, 150), (255, 255, 255)).save(buf, "JPEG")
    >>> img = decode_encoded(buf.getvalue(), "banner.jpg")
    >>> img.shape, int(img[0].max()), int(img[14].min())   # letterboxed: black bars above and below
    ((28, 28), 0, 255)
    >>> decode_encoded(b"GIF89a?", "ad.gif")
    Traceback (most recent call last):
    mariana.featurizer.idx.BadImage: ad.gif: not an image file Pillow can read (PNG, JPEG, GIF, BMP or WebP)
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not raw:
        raise BadImage(f"{name}: an empty file")
    try:
        img = Image.open(io.BytesIO(raw))
        if img.format not in FORMATS:
            raise BadImage(f"{name}: a {img.format} image; uploads are PNG, JPEG, GIF, BMP or WebP")
        w, h = img.size
        if w * h > MAX_PIXELS:
            raise BadImage(f"{name}: {w}x{h} pixels, over the {MAX_PIXELS:,} allowed")
        if img.format in ("JPEG", "MPO"):  # an MPO's first frame is its JPEG (what load() decodes)
            # SOS markers: entropy-coded data stuffs each 0xFF as 0xFF00, so this counts the scans
            if (scans := raw.count(b"\xff\xda")) > MAX_JPEG_SCANS:
                raise BadImage(f"{name}: a JPEG of {scans:,} scans, over the {MAX_JPEG_SCANS} allowed (each scan "
                               "decodes the whole image again)")
            img.draft("L", (size, size))  # DCT scaling: decodes at 1/2..1/8 while still >= size
        img.load()
        fmt = img.format
        try:
            ImageOps.exif_transpose(img, in_place=True)  # a phone's JPEG stored sideways, turned as its EXIF says
        except Exception:  # damaged EXIF (Pillow raises several kinds): the pixels as stored
            pass
        key = img.info.get("transparency")
        if img.mode.startswith("I"):  # 16-bit grey (a PNG's I;16): its top 8 bits, as convert("L") would clip
            img = _top_bits(img, key)
        elif key is not None and fmt == "PNG" and img.mode in ("1", "L", "RGB"):
            img.info["transparency"] = _png_key(raw, key)
        alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info  # an alpha channel or a tRNS colour
        if alpha:  # premultiplied: each colour times its alpha, which is the image composited on black
            img = (img if img.mode == "RGBA" else img.convert("RGBA")).convert("RGBa")
        elif img.mode not in ("L", "RGB"):  # palette, 1-bit, CMYK: to grey before any averaging
            img = img.convert("L")
        w, h = img.size
        if (k := max(w, h) // (REDUCING_GAP * size)) >= 2:
            img = img.reduce(k)  # box averages first: a 4000 px upload's colour work on 1/k^2 of its pixels
        else:
            k = 1
        grey = Image.merge("RGB", img.split()[:3]).convert("L") if alpha else img.convert("L")
    except BadImage:
        raise
    except UnidentifiedImageError:
        raise BadImage(f"{name}: not an image file Pillow can read (PNG, JPEG, GIF, BMP or WebP)") from None
    except Image.DecompressionBombError:  # Pillow's own bound, met before ours when the header says more
        raise BadImage(f"{name}: over the {MAX_PIXELS:,} pixels allowed") from None
    except (OSError, ValueError, SyntaxError):
        raise BadImage(f"{name}: not a readable image file (truncated or damaged)") from None
    if (w, h) != (size, size):  # the fit from the file's own size: reduce() rounds a partial last box up
        scale = size / max(w, h)
        fit = grey.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS,
                          box=(0, 0, w / k, h / k))
        grey = Image.new("L", (size, size), 0)
        grey.paste(fit, ((size - fit.width) // 2, (size - fit.height) // 2))
    return np.asarray(grey, dtype=np.uint8).copy()


def _top_bits(img, key):
    """A 16- or 32-bit grey Pillow image -> "L" of each pixel's top 8 bits (of 16; negatives 0,
    more bits 255), black where a tRNS grey level `key` makes it clear (what compositing its
    alpha on black gives, averaged or not). A band of rows at a time: beside Pillow's own copy
    only the (H, W) uint8 result, never the whole image widened (int64 is 8 bytes a pixel: a
    90 KB 16-bit PNG once took 1 GB).

    >>> from PIL import Image
    >>> img = Image.fromarray(np.array([[0, 255, 256, 40000, 65535]], np.uint16))
    >>> np.asarray(_top_bits(img, None)).tolist(), np.asarray(_top_bits(img, 256)).tolist()
    ([[0, 0, 1, 156, 255]], [[0, 0, 0, 156, 255]])
    """
    from PIL import Image

    w, h = img.size
    out = np.empty((h, w), np.uint8)
    rows = max(1, BAND_PIXELS // max(w, 1))
    for y in range(0, h, rows):
        band = np.asarray(img.crop((0, y, w, min(h, y + rows))))  # (rows, W) uint16 or int32: one band's copy
        top = np.right_shift(band.clip(0, 65535), 8)
        out[y:y + len(band)] = np.where(band == key, 0, top) if isinstance(key, int) else top
    return Image.fromarray(out)


def _png_key(raw: bytes, key):
    """A PNG's tRNS colour in the 8 bits a pixel has once Pillow has read it, taken from the
    file's own tRNS chunk: 1/2/4-bit grey is scaled to 0-255 and 16-bit cut to its top byte,
    while the key Pillow reports stays at the file's bit depth in some of its versions and
    not in others (1-bit grey: 1 before Pillow 13, 255 from it). `key` (Pillow's) where the
    chunk is not found.

    >>> import struct
    >>> chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", 0)
    >>> ihdr = lambda bits: chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, bits, 0, 0, 0, 0))
    >>> png = lambda bits, key: (b"\\x89PNG\\r\\n\\x1a\\n" + ihdr(bits) + chunk(b"tRNS", struct.pack(">H", key))
    ...                          + chunk(b"IDAT", b""))
    >>> _png_key(png(1, 1), 255), _png_key(png(2, 2), 2), _png_key(png(16, 40000), 40000), _png_key(png(2, 2)[:42], 2)
    (255, 170, 156, 2)
    """
    if raw[12:16] != b"IHDR" or len(raw) < 29:
        return key
    depth, colour = raw[24], raw[25]
    if depth not in (1, 2, 4, 8, 16):
        return key
    at = 8
    while at + 8 <= len(raw) and raw[at + 4:at + 8] not in (b"tRNS", b"IDAT", b"IEND"):
        at += 12 + int.from_bytes(raw[at:at + 4], "big")
    n = 2 if colour == 0 else 6 if colour == 2 else 0
    if not n or raw[at + 4:at + 8] != b"tRNS" or int.from_bytes(raw[at:at + 4], "big") < n or len(raw) < at + 8 + n:
        return key
    levels = struct.unpack(f">{n // 2}H", raw[at + 8:at + 8 + n])
    to8 = [(v >> 8) if depth == 16 else v * 255 // ((1 << depth) - 1) if depth < 8 else v for v in levels]
    return to8[0] if colour == 0 else tuple(to8)


def stack_images(items: Sequence, names: Sequence[str], size: int = 28) -> tuple[np.ndarray, list[int], list[str]]:
    """(good images (G, size, size), their positions, one reason per bad item):
    for a pipeline stage that counts and skips undecodable images."""
    good, keep, bad = [], [], []
    for i, (raw, name) in enumerate(zip(items, names)):
        try:
            good.append(decode_image(raw, name, size))
            keep.append(i)
        except BadImage as e:
            bad.append(str(e))
    arr = np.stack(good) if good else np.zeros((0, size, size), np.uint8)
    return arr, keep, bad


# ---- export and load ------------------------------------------------------------------

def pixel_stats(images: np.ndarray) -> tuple[float, float]:
    """(mean, std) of pixels / 255: the input normalisation."""
    x = images.astype(np.float64) / 255.0
    return float(x.mean()), float(x.std())


def to_input(images: np.ndarray, mean: float, std: float) -> torch.Tensor:
    """uint8 (N, S, S) -> normalised float32 (N, 1, S, S)."""
    x = torch.from_numpy(images.astype(np.float32)).div_(255.0)  # a fresh array: the input may be read-only
    return x.sub_(mean).div_(std).unsqueeze(1)


class ImageFeaturizer:
    """A frozen CNN: uint8 (N, S, S) images -> float32 (N, d) features.

    `ops` (what trainer.models.image_cnn.frozen_ops wrote) run over `weights`;
    the features are then standardised with `output.mean` / `output.std`.
    `embed` works in chunks of `batch_size` images, each padded to whole row blocks.
    """

    def __init__(self, manifest: dict, weights: dict[str, torch.Tensor]):
        self.manifest, self.weights = manifest, weights
        self.ops, self.head_ops = manifest["ops"], manifest.get("head_ops", [])
        self.size, self.dim = int(manifest["input"]["size"]), int(manifest["dim"])
        self.pixel_mean = float(manifest["input"]["pixel_mean"])
        self.pixel_std = float(manifest["input"]["pixel_std"])
        self.out_mean = weights.get("output.mean", torch.zeros(self.dim))
        self.out_std = weights.get("output.std", torch.ones(self.dim))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ImageFeaturizer":
        d = Path(path)
        try:
            manifest = loads_json((d / MANIFEST).read_text())
        except FileNotFoundError:
            if (d / "CURRENT").is_file() or any(d.glob("v[0-9][0-9][0-9][0-9][0-9][0-9]*")):
                raise ModelDirError(f"{d}: a model directory (versions of a click or speech model), not a "
                                    "featurizer: name the featurizer directory ('mariana featurizer train --out DIR' "
                                    "makes one)") from None
            raise ModelDirError(f"{d}: no featurizer here (no {MANIFEST}); train one with "
                                f"'mariana featurizer train --out {d}'") from None
        except ValueError as e:
            raise ModelDirError(f"{d}/{MANIFEST}: not valid JSON: {e}") from None
        found = manifest.get("format") if isinstance(manifest, dict) else None
        if found != FORMAT:
            raise ModelDirError(f"{d}: unknown featurizer format {found!r} (expected {FORMAT})")
        try:
            weights = load_file(str(d / WEIGHTS))
            sha = file_sha256(d / WEIGHTS)
        except (OSError, SafetensorError) as e:
            raise ModelDirError(f"{d}: cannot read {WEIGHTS}: {e}") from None
        if manifest.get("weights_sha256") not in (None, sha):  # its features are cached under this digest
            raise ModelDirError(f"{d}: {WEIGHTS} is not the file {MANIFEST} was written with (sha256 {sha[:12]}, "
                                f"expected {str(manifest['weights_sha256'])[:12]}): restore it or train the "
                                "featurizer again")
        try:
            featurizer = cls(manifest, weights)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelDirError(f"{d}/{MANIFEST}: a missing or bad field ({type(e).__name__}: {e}): "
                                "train the featurizer again") from None
        featurizer.check_weights(str(d))
        return featurizer

    def check_weights(self, where: str) -> None:
        """ModelDirError unless the ops are known, their weights present and finite, and they
        take (N, size, size) images to (N, dim) features (tried on one blank row block)."""
        unknown = sorted({op.get("op") for op in self.ops + self.head_ops} - set(_OPS), key=str)
        if unknown:
            raise ModelDirError(f"{where}: unknown ops {unknown} in {MANIFEST}")
        named = {op[k] for op in self.ops + self.head_ops for k in ("weight", "bias") if k in op}
        missing = sorted(named - set(self.weights))
        if missing:
            raise ModelDirError(f"{where}: weights lack {missing[:3]}")
        bad = finite.nonfinite(self.weights)
        if bad:
            raise ModelDirError(f"{where}: {WEIGHTS} holds {finite.describe(bad)}: a corrupt featurizer, not loaded")
        self._check_shapes(where)

    def _check_shapes(self, where: str) -> None:
        """A manifest whose dim or ops do not fit its weights, refused at load (not as a broadcast
        error in the first embed)."""
        try:
            with torch.inference_mode():
                h = self.run(self.ops, torch.zeros(ROW_BLOCK, 1, self.size, self.size))  # (ROW_BLOCK, dim)
                self.run(self.head_ops, h)
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
            why = " ".join(str(e).split())[:200]
            raise ModelDirError(f"{where}: the ops in {MANIFEST} do not fit the weights in {WEIGHTS} ({why}): "
                                "a corrupt featurizer, not loaded") from None
        shapes = {"features": tuple(h.shape[1:]), "output.mean": tuple(self.out_mean.shape),
                  "output.std": tuple(self.out_std.shape)}
        wrong = [f"{k} {v}" for k, v in shapes.items() if v != (self.dim,)]
        if wrong:
            raise ModelDirError(f"{where}: {MANIFEST} says dim {self.dim} but {WEIGHTS} gives {', '.join(wrong)}: "
                                "the manifest does not fit the weights, not loaded")

    def embed(self, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """uint8 (N, S, S) -> float32 (N, d); BadImage when the array is not that.

        The same image gets the same bits in any batch and any batch_size at one torch
        thread count (checked at 2; a 16-thread AVX-512 host broke it); on another thread
        count, the same features within float32 rounding (~1e-6).
        """
        check_images(images, size=self.size)
        step = max(ROW_BLOCK, batch_size - batch_size % ROW_BLOCK)
        out = np.empty((len(images), self.dim), np.float32)
        with torch.inference_mode():
            for i in range(0, len(images), step):
                chunk = images[i:i + step]
                h = self.run(self.ops, _pad_rows(to_input(chunk, self.pixel_mean, self.pixel_std)))
                out[i:i + len(chunk)] = ((h[:len(chunk)] - self.out_mean) / self.out_std).numpy()
        return out

    def classify(self, images: np.ndarray) -> np.ndarray:
        """(N,) predicted classes (the exported head over the raw features): a check of a loaded featurizer."""
        check_images(images, size=self.size)
        with torch.inference_mode():
            x = _pad_rows(to_input(images, self.pixel_mean, self.pixel_std))
            return self.run(self.head_ops, self.run(self.ops, x)).argmax(1).numpy()[:len(images)]

    def run(self, ops: list[dict], x: torch.Tensor) -> torch.Tensor:
        for op in ops:
            x = _OPS[op["op"]](x, op, self.weights)
        return x


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """(N, ...) -> (ceil(N / ROW_BLOCK) * ROW_BLOCK, ...), zero images appended."""
    extra = -len(x) % ROW_BLOCK
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) if extra else x


_OPS = {
    "conv2d": lambda x, op, w: F.conv2d(x, w[op["weight"]], w[op["bias"]], stride=tuple(op["stride"]),
                                        padding=tuple(op["padding"])),
    "linear": lambda x, op, w: F.linear(x, w[op["weight"]], w[op["bias"]]),
    "max_pool2d": lambda x, op, w: F.max_pool2d(x, op["kernel"]),
    "relu": lambda x, op, w: F.relu(x),
    "flatten": lambda x, op, w: x.flatten(1),
}
