"""IDX files (the MNIST format), gzip or plain: read, check, write.

    magic   4 bytes: 0, 0, dtype code (0x08 = uint8), number of dims
    dims    one big-endian uint32 per dim
    data    prod(dims) items, row-major

Only uint8 payloads are read (MNIST images and labels). A short, long or
mislabelled file is an `IdxFormatError` that names the file and what is wrong.

>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "x.idx.gz")
>>> write_idx(p, np.arange(6, dtype=np.uint8).reshape(2, 3))
>>> read_idx(p).tolist()
[[0, 1, 2], [3, 4, 5]]
"""
from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from mariana.sparse.errors import DataFormatError
from mariana.sparse.parse import open_binary

# An MNIST-format set's two files in its directory (featurizer/image.py reads them,
# featurizer/shapes.py writes them; here, so writing needs no torch).
MNIST_IMAGES = "t10k-images-idx3-ubyte.gz"
MNIST_LABELS = "t10k-labels-idx1-ubyte.gz"
MNIST_TRAIN = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")  # MNIST's 60k: not what the jobs read


def mnist_file(d: str | os.PathLike, name: str) -> Path | None:
    """`d`'s file `name` (one of the names above), gzipped or plain (the name less `.gz`, as
    MNIST is often unpacked: read_idx reads both); None when it has neither.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); write_idx(os.path.join(d, "t10k-labels-idx1-ubyte"), np.zeros(2, np.uint8))
    >>> mnist_file(d, MNIST_LABELS).name, mnist_file(d, MNIST_IMAGES)
    ('t10k-labels-idx1-ubyte', None)
    """
    for p in (Path(d) / name, Path(d) / name.removesuffix(".gz")):
        if p.is_file():
            return p
    return None


UBYTE = 0x08
MAX_DIMS = 4
READ_CHUNK = 16 << 20  # bytes read at a time: all a header that lies about its size makes us hold


class IdxFormatError(DataFormatError):
    """An IDX file that is truncated, too long, or not IDX at all."""


class NotIdxError(IdxFormatError):
    """A file that does not start as IDX files do (another kind of file); `why` without the path."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.why = why


def read_idx(path: str | os.PathLike, ndim: int | None = None) -> np.ndarray:
    """The array in an IDX file (gz or plain); `ndim` checks the number of dims. At most the
    bytes its header promises (and one more, to tell a long file) are read: a gzip of 1 MB
    holding 1 GiB behind a (1, 28, 28) header was inflated whole before it was refused."""
    path = os.fspath(path)
    with open_binary(path) as f:  # gunzips by the magic, as data files are; FileNotFoundError carries the path
        magic = _read_bytes(f, path, 4)
        if len(magic) < 4 or magic[0] != 0 or magic[1] != 0:
            raise NotIdxError(path, f"not an IDX file (bad magic {magic.hex() or 'empty'})")
        dtype, dims = magic[2], magic[3]
        if dtype != UBYTE:
            raise IdxFormatError(f"{path}: IDX dtype code 0x{dtype:02x}, only uint8 (0x08) is supported")
        if not 1 <= dims <= MAX_DIMS or (ndim is not None and dims != ndim):
            want = f"{ndim}" if ndim is not None else f"1..{MAX_DIMS}"
            raise IdxFormatError(f"{path}: IDX file has {dims} dims, expected {want}")
        sides = _read_bytes(f, path, 4 * dims)
        if len(sides) < 4 * dims:
            raise IdxFormatError(f"{path}: truncated IDX header")
        shape = tuple(int(s) for s in np.frombuffer(sides, ">u4"))
        need = int(np.prod(shape, dtype=np.int64))
        data = _read_bytes(f, path, need + 1)
    if len(data) != need:
        more = f"more than {need:,}" if len(data) > need else f"{len(data):,}"
        raise IdxFormatError(f"{path}: header says {shape} = {need:,} bytes of data, the file holds {more} "
                             "(truncated or corrupt)")
    return np.frombuffer(data, np.uint8, need).reshape(shape)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write a uint8 array as IDX (gzip when the name ends in .gz)."""
    a = np.ascontiguousarray(array)
    if a.dtype != np.uint8 or not 1 <= a.ndim <= MAX_DIMS:
        raise ValueError(f"write_idx takes uint8 arrays of 1..{MAX_DIMS} dims, got {a.dtype} {a.shape}")
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "wb") as f:  # the header, then the pixels from where they are (no copy of them)
        f.write(bytes([0, 0, UBYTE, a.ndim]) + np.array(a.shape, ">u4").tobytes())
        f.write(memoryview(a).cast("B"))


def _read_bytes(f, path: str, n: int) -> bytearray:
    """Up to `n` bytes of `f` (fewer at its end), `READ_CHUNK` at a time: a read of `n` at once
    would allocate `n` whatever the file holds."""
    out = bytearray()
    try:
        while len(out) < n and (chunk := f.read(min(READ_CHUNK, n - len(out)))):
            out += chunk
    except (OSError, EOFError, zlib.error) as e:
        if not isinstance(f, gzip.GzipFile):
            raise
        raise IdxFormatError(f"{path}: corrupt gzip data ({e})") from None
    return out


def printable(name: str | os.PathLike) -> str:
    """A file name as a message shows it: bytes that are not UTF-8 (which Python keeps as
    surrogates) and control characters as backslash escapes, so a message never fails to encode.

    >>> printable(os.fsdecode(b"caf\\xe9.png")), printable("a\\nb.png"), printable("ok.png")
    ('caf\\\\xe9.png', 'a\\\\nb.png', 'ok.png')
    """
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class BadImage(DataFormatError):
    """An image that is not uint8 of the featurizer's size (the pipeline counts and skips it)."""


def load_npy(path: str | os.PathLike, name: str | None = None) -> np.ndarray:
    """A .npy file's array (never pickled objects), its header checked against the file's size
    first: a 1 KB file whose header says (10**6, 10**6) was a MemoryError, not a bad file.
    BadImage naming `name` (default the file's name) when it is not a readable .npy.
    """
    name = name or printable(Path(path).name)
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)  # 3.0 differs from 2.0 only in a UTF-8 header (never an image's)
            need, held = math.prod(shape) * dtype.itemsize, os.fstat(f.fileno()).st_size - f.tell()
            if not dtype.hasobject and need != held:  # objects: np.load refuses them below
                raise BadImage(f"{name}: header says {shape} {dtype} = {need:,} bytes of data, the file holds "
                               f"{held:,} (truncated or corrupt)")
            f.seek(0)
            return np.load(f, allow_pickle=False)
        except (ValueError, EOFError) as e:
            raise BadImage(f"{name}: not a readable .npy ({e})") from None
