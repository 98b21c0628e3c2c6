"""Stable, vectorized feature hashing.

A feature is a (field, token) pair. Its id is

    id = fmix64(token_hash ^ field_key(field)) & (2**bits - 1)

where, all in unsigned 64-bit arithmetic that wraps:

- `field_key(name) = fmix64(fnv1a64(name.encode()) ^ FIELD_SALT)` puts every
  field in its own namespace;
- a string token (a categorical value, as raw bytes) hashes to
  `fnv1a64(value)`; an empty value is the field's missing token;
- an integer token (a numeric bucket, an hour of day) hashes to
  `fmix64(int64_as_uint64 ^ INT_SALT)`;
- the missing token hashes to `MISSING_SALT`;
- the reserved RARE token, which stands for every id of the field not yet
  admitted (`HashSpec.min_count`, sparse/admission.py), hashes to `RARE_SALT`.
  Like the missing token it is no string or integer a parser makes: a 64-bit
  constant that no integer token within +-2^62 reaches (fmix64 is a bijection;
  its one integer preimage is 5057063046737484600) and a string would hit only
  by a 2^-64 chance. After masking to `bits` the rare id may share a row with
  some value's id, as any two ids may.

FNV-1a (64-bit) and MurmurHash3's `fmix64` finalizer are fixed public
algorithms, so ids are the same in every process, machine and Python version
(Python's salted `hash()` is never used). Everything is numpy over whole
columns (a few very long strings are hashed one at a time, also in numpy);
`token_id` is the plain-Python reference the tests hold them to.

>>> int(token_id("C1", b"68fd1e64", bits=20))
652390
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mariana.sparse.errors import ConfigError

U64 = np.uint64
# bucket_scale at most: log1p(1e300) (691) times it stays below 2**53. Above, a file's buckets
# (int64) overflowed to one for every large value, and a request's (Python ints) did not.
MAX_BUCKET_SCALE = 1e12
FNV_OFFSET = U64(0xCBF29CE484222325)
FNV_PRIME = U64(0x100000001B3)
FIELD_SALT = U64(0x9E3779B97F4A7C15)
INT_SALT = U64(0xD6E8FEB86659FD93)
MISSING_SALT = U64(0xA0761D6478BD642F)
RARE_SALT = U64(0xE7037ED1A0B428DB)  # wyhash's second secret, as MISSING_SALT is its first
_M1 = U64(0xFF51AFD7ED558CCD)
_M2 = U64(0xC4CEB9FE1A85EC53)
_S33 = U64(33)
_MASK64 = (1 << 64) - 1

NUMERIC_MODES = ("bucket", "dense", "both")
MAX_MIN_COUNT = (1 << 16) - 1  # counts are saturating uint16


class Reserved(enum.Enum):
    """Tokens no record can hold; `token_id(field, RARE)` is the field's rare id."""

    RARE = "rare"


RARE = Reserved.RARE


@dataclass(frozen=True)
class HashSpec:
    """How rows become ids: table size and the numeric transform.

    `numeric`: 'bucket' turns a number into an id of its log bucket
    (`sign(x) * floor(log1p(|x|) * bucket_scale)`); 'dense' puts
    `sign(x) * log1p(|x|)` in the dense block (0 when missing); 'both' does both.

    `min_count` (K): an id gets rows of its own only once training has seen it
    K times; until then its entries use the row of its field's RARE token
    (sparse/admission.py). 1 = every id is admitted at once (off).
    """

    bits: int = 22
    numeric: str = "bucket"
    bucket_scale: float = 4.0
    min_count: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 32:
            raise ConfigError(f"hashing.bits must be in 1..32 (tables have 2^bits rows), got {self.bits}")
        if self.numeric not in NUMERIC_MODES:
            raise ConfigError(f"hashing.numeric must be one of {NUMERIC_MODES}, got {self.numeric!r}")
        if not (0 < self.bucket_scale <= MAX_BUCKET_SCALE):  # (False for NaN)
            raise ConfigError(f"hashing.bucket_scale must be a positive number of at most {MAX_BUCKET_SCALE:g} "
                              f"(the bucket of the largest |x|, log1p(1e300) x scale, a whole number a float holds "
                              f"exactly), got {self.bucket_scale}")
        if not (isinstance(self.min_count, int) and not isinstance(self.min_count, bool)
                and 1 <= self.min_count <= MAX_MIN_COUNT):
            raise ConfigError(f"hashing.min_count must be an integer in 1..{MAX_MIN_COUNT} (an id gets rows of "
                              f"its own after that many occurrences; 1 = off), got {self.min_count!r}")

    @property
    def num_ids(self) -> int:
        return 1 << self.bits

    @property
    def mask(self) -> np.uint64:
        return U64(self.num_ids - 1)


# ---- the two primitives, over numpy arrays --------------------------------

def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer (a bijection with full avalanche).

    >>> int(fmix64(np.array([1], dtype=np.uint64))[0])
    12994781566227106604
    """
    h = np.array(h, dtype=U64, copy=True)
    h ^= h >> _S33
    h *= _M1
    h ^= h >> _S33
    h *= _M2
    h ^= h >> _S33
    return h


# `fnv1a64` steps every string in numpy, one step (~5 us) per byte position, while at least this many
# strings are that long; the few longer strings are finished one by one (`_fnv1a64_rest`), so one
# 1 MB value among short ones costs its own bytes, not a million steps. 32 strings hashed by a Python
# loop cost about one numpy step per byte.
_MIN_LIVE = 32
_PY_MAX = 1024  # up to this many bytes a Python loop (~0.15 us a byte) beats a block's ~100 us fixed cost
_BLOCK = 1 << 16  # bytes of one long string per `_fnv1a64_block`
_POW_DESC = np.multiply.accumulate(np.full(_BLOCK, FNV_PRIME, dtype=U64))[::-1].copy()  # p^B, ..., p^1
_PRIME_LOW = np.uint8(int(FNV_PRIME) & 0xFF)


def fnv1a64(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """FNV-1a over n byte strings packed as `data[offsets[i]:offsets[i+1]]`.

    Byte positions are stepped in numpy over all the strings still that long
    while there are many; the few strings longer than that are finished one at
    a time, so the work is the total byte count however long one value is.

    >>> int(fnv1a64(np.array([0, 1]), np.frombuffer(b"a", np.uint8))[0])
    12638187200555641996
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    h = np.full(len(offsets) - 1, FNV_OFFSET, dtype=U64)
    rest, done = _fnv1a64_positions(h, offsets, data)
    for i in rest.tolist():
        h[i] = _fnv1a64_rest(int(h[i]), data[offsets[i] + done:offsets[i + 1]])
    return h


def _fnv1a64_positions(h: np.ndarray, offsets: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, int]:
    """Steps the states `h` (n,) in place over the first byte positions of every string,
    one numpy step per position, while at least `_MIN_LIVE` strings are that long.
    Returns (the indices of the strings longer than that, how many bytes of them are done).

    >>> rest, done = _fnv1a64_positions(np.zeros(41, U64), np.cumsum([0] + [3] * 40 + [100]), np.zeros(220, np.uint8))
    >>> rest.tolist(), done
    ([40], 3)
    """
    starts, lengths = offsets[:-1], np.diff(offsets)
    live = np.flatnonzero(lengths > 0)
    if live.size < _MIN_LIVE:
        return live, 0
    width = int(lengths[live[0]])
    if (lengths[live] == width).all():
        # Every non-empty string is `width` bytes (hex ids, the usual case): they lie
        # back to back, so they are the rows of a (k, width) matrix; two plain array
        # ops per byte position instead of a gather and a scatter.
        m = data[offsets[0]:offsets[-1]].reshape(live.size, width).astype(U64)
        hv = np.full(live.size, FNV_OFFSET, dtype=U64)
        for j in range(width):
            hv ^= m[:, j]
            hv *= FNV_PRIME
        h[live] = hv
        return live[:0], width
    j = 0
    while live.size >= _MIN_LIVE:
        h[live] = (h[live] ^ data[starts[live] + j].astype(U64)) * FNV_PRIME
        j += 1
        live = live[lengths[live] > j]
    return live, j


def _fnv1a64_rest(h: int, rest: np.ndarray) -> int:
    """The FNV-1a state `h` carried on over the bytes `rest` (uint8) of one string."""
    for k in range(0, rest.size, _BLOCK):
        chunk = rest[k:k + _BLOCK]
        h = _fnv1a64_loop(h, chunk.tobytes()) if chunk.size <= _PY_MAX else _fnv1a64_block(h, chunk)
    return h


def _fnv1a64_loop(h: int, chunk: bytes) -> int:
    # `py_fnv1a64` from a given state; kept apart so that the reference stays independent of this code.
    prime = _FNV_PRIME
    for b in chunk:
        h = ((h ^ b) * prime) & _MASK64
    return h


def _fnv1a64_block(h: int, b: np.ndarray) -> int:
    """The FNV-1a state `h` carried on over `b` (uint8, 1.._BLOCK bytes) in numpy, with
    no step per byte: ~30 ns a byte where a Python loop takes ~150 and `fnv1a64`'s
    per-position step over one string ~5000.

    With x_i the low byte of the state before byte i, `h ^ b_i = h + d_i`, where
    `d_i = (x_i ^ b_i) - x_i`; so, mod 2^64,

        h_n = h * p^n + sum_i d_i * p^(n - i),

    a dot product once the x_i are known. `x_{i+1} = (x_i ^ b_i) * p mod 256` needs
    only the low bytes, and as p is odd, bit k of a product by p is bit k of the other
    factor flipped by a function of its bits below k: bit k of x_{i+1} is bit k of x_i
    flipped by a function of b_i and bits < k of x_i. So the x_i come bit by bit, each
    bit a prefix XOR of flips computed from the bits below (8 passes over b).

    >>> _fnv1a64_block(int(FNV_OFFSET), np.frombuffer(b"foobar", np.uint8)) == py_fnv1a64(b"foobar")
    True
    """
    n = b.size
    x = np.zeros(n, np.uint8)  # (n,) x_i, filled bit by bit
    for k in range(8):
        bit = np.uint8(k)
        flips = (((x ^ (b & np.uint8((1 << k) - 1))) * _PRIME_LOW) ^ b) >> bit  # bit 0: does bit k flip at i
        flips &= np.uint8(1)
        first = np.uint8((h >> k) & 1)
        x[0] |= first << bit
        x[1:] |= (np.bitwise_xor.accumulate(flips[:-1]) ^ first) << bit
    d = (x ^ b).astype(np.int64) - x  # (n,) in [-255, 255]; as uint64 it wraps mod 2^64
    terms = d.view(U64) * _POW_DESC[_BLOCK - n:]  # d_i * p^(n - i), wrapping
    return (h * int(_POW_DESC[_BLOCK - n]) + int(terms.sum(dtype=U64))) & _MASK64


def field_key(name: str) -> np.uint64:
    raw = np.frombuffer(name.encode(), dtype=np.uint8)
    return fmix64(fnv1a64(np.array([0, raw.size]), raw) ^ FIELD_SALT)[0]


# ---- token hashes ---------------------------------------------------------

def _binary_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets (n+1,), data bytes) of a binary/string array, array offset applied."""
    if pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type):
        off_type = np.int64
    elif pa.types.is_binary(arr.type) or pa.types.is_string(arr.type):
        off_type = np.int32
    else:
        raise TypeError(f"expected a binary or string array, got {arr.type}")
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return offsets.astype(np.int64), data


def _hash_plain(arr: pa.Array) -> np.ndarray:
    """Token hashes of a binary/string array without nulls; '' -> missing."""
    offsets, data = _binary_buffers(arr)
    h = fnv1a64(offsets, data)
    h[np.diff(offsets) == 0] = MISSING_SALT
    return h


def to_ids(token_hashes: np.ndarray, key: np.uint64, spec: HashSpec) -> np.ndarray:
    """Field-namespaced ids in [0, 2**bits) as int64."""
    return (fmix64(token_hashes ^ key) & spec.mask).view(np.int64)


def rare_ids(fields, spec: HashSpec) -> np.ndarray:
    """(F,) int64: each field's id of the RARE token, in `fields` order.

    >>> int(rare_ids(["C1"], HashSpec(bits=20))[0]) == token_id("C1", RARE, bits=20)
    True
    """
    keys = np.array([field_key(f) for f in fields], U64)
    return (fmix64(np.full(len(keys), RARE_SALT) ^ keys) & spec.mask).view(np.int64)


# ---- columns -> codes ---------------------------------------------------------
#
# A column's ids come as `codes`: (table, index) with ids = table[index]. The
# table holds each distinct token's id once (a categorical column's
# dictionary, a numeric column's bucket range), so hashing work scales with
# distinct values, and the encoder can dedupe a whole block cheaply.

def binary_codes(col: pa.Array | pa.ChunkedArray, key: np.uint64,
                 spec: HashSpec) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a categorical column (binary/string, or dictionary-encoded).

    Plain arrays are dictionary-encoded first. Empty and null values get the
    field's missing id.
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    tables, indices, offset = [], [], 0
    for ch in chunks:
        table, index = _dictionary_codes(ch if pa.types.is_dictionary(ch.type) else ch.dictionary_encode(),
                                         key, spec)
        tables.append(table)
        indices.append(index + offset)
        offset += len(table)
    if len(tables) == 1:
        return tables[0], indices[0]
    if not tables:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(tables), np.concatenate(indices)


def _dictionary_codes(arr: pa.DictionaryArray, key: np.uint64, spec: HashSpec) -> tuple[np.ndarray, np.ndarray]:
    table = to_ids(_hash_plain(arr.dictionary), key, spec)
    indices = arr.indices
    if arr.null_count:  # null -> one extra slot holding the missing id
        table = np.append(table, to_ids(np.array([MISSING_SALT]), key, spec))
        indices = pc.fill_null(indices, len(arr.dictionary))
    return table, indices.to_numpy(zero_copy_only=False).astype(np.int64)


def int_codes(values: np.ndarray, key: np.uint64, spec: HashSpec,
              missing: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Codes of integer tokens (int64); `missing` marks missing values.

    Tokens usually span a small range (buckets, hours): the table is that
    range plus one slot for missing. Wide ranges get one table entry per row.
    """
    values = np.asarray(values, dtype=np.int64)
    miss_id = to_ids(np.array([MISSING_SALT]), key, spec)
    if values.size and int(values.max()) - int(values.min()) < max(values.size, 1 << 12):
        lo, hi = int(values.min()), int(values.max())
        table = np.append(to_ids(_int_tokens(np.arange(lo, hi + 1, dtype=np.int64)), key, spec), miss_id)
        index = values - lo
    else:
        table = np.append(to_ids(_int_tokens(values), key, spec), miss_id)
        index = np.arange(values.size, dtype=np.int64)
    if missing is not None and missing.any():
        index = np.where(missing, len(table) - 1, index)
    return table, index


def _int_tokens(values: np.ndarray) -> np.ndarray:
    return fmix64(values.view(U64) ^ INT_SALT)


def bucket_codes(x: np.ndarray, key: np.uint64, spec: HashSpec) -> tuple[np.ndarray, np.ndarray]:
    """Codes of the log buckets of a numeric column (NaN = missing)."""
    return int_codes(log_bucket(x, spec.bucket_scale), key, spec, missing=np.isnan(x))


def binary_ids(col, key: np.uint64, spec: HashSpec) -> np.ndarray:
    """Ids of a categorical column, one per row."""
    table, index = binary_codes(col, key, spec)
    return table[index]


def int_ids(values: np.ndarray, key: np.uint64, spec: HashSpec, missing: np.ndarray | None = None) -> np.ndarray:
    """Ids of integer tokens, one per row."""
    table, index = int_codes(values, key, spec, missing)
    return table[index]


# ---- numeric transforms -----------------------------------------------------

def log_bucket(x: np.ndarray, scale: float) -> np.ndarray:
    """sign(x) * floor(log1p(|x|) * scale) as int64 (NaN -> 0; mask it separately)."""
    x = np.asarray(x, dtype=np.float64)
    x = np.clip(np.where(np.isnan(x), 0.0, x), -1e300, 1e300)  # nan_to_num's result, without its cost on small arrays
    return (np.sign(x) * np.floor(np.log1p(np.abs(x)) * scale)).astype(np.int64)


def log_bucket_few(values: list[float], scale: float) -> list[int]:
    """`log_bucket` of a few finite numbers as Python ints, the same values: one numpy call
    (the log, the function training uses) where `log_bucket` makes nine, ~3 us against ~12
    for a request's one new number. The rest is exact in Python floats: |x| and its clip,
    the product, floor and sign.

    >>> log_bucket_few([0.0, 1.0, 3.0, 1e6, -3.0, -0.0, 1e301], 4.0)
    [0, 2, 5, 55, -5, 0, 2763]
    """
    logs = np.log1p(np.array([min(abs(v), 1e300) for v in values], np.float64)).tolist()
    return [0 if v == 0 else math.floor(lg * scale) if v > 0 else -math.floor(lg * scale)
            for v, lg in zip(values, logs)]


def log_dense(x: np.ndarray) -> np.ndarray:
    """sign(x) * log1p(|x|) as float32, missing (NaN) -> 0."""
    x = np.asarray(x, dtype=np.float64)
    out = np.sign(x) * np.log1p(np.abs(x))
    return np.nan_to_num(out, nan=0.0, posinf=700.0, neginf=-700.0).astype(np.float32)


# ---- plain Python: the reference tests hold the vectorized code to, and the ----
# ---- hashing of a request's few new values (`Encoder._few_ids`) ----------------

_RARE, _MISSING, _INT = int(RARE_SALT), int(MISSING_SALT), int(INT_SALT)
_FNV_OFFSET, _FNV_PRIME = int(FNV_OFFSET), int(FNV_PRIME)


def py_fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK64
    return h ^ (h >> 33)


def py_fnv1a64(data: bytes) -> int:
    h, prime = _FNV_OFFSET, _FNV_PRIME
    for b in data:
        h = ((h ^ b) * prime) & _MASK64
    return h


def py_token(value: bytes | int | Reserved | None) -> int:
    """The hash of one token: bytes (categorical; b'' = missing), int (a numeric bucket or
    an hour), None (missing) or RARE (the field's shared rare id)."""
    if value is RARE:
        return _RARE
    if value is None or value == b"":
        return _MISSING
    if isinstance(value, bytes):
        return py_fnv1a64(value)
    return py_fmix64((value & _MASK64) ^ _INT)


def token_id(field: str, value: bytes | int | Reserved | None, bits: int) -> int:
    """Reference id of one token (`py_token`) of `field`."""
    key = py_fmix64(py_fnv1a64(field.encode()) ^ int(FIELD_SALT))
    return py_fmix64(py_token(value) ^ key) & ((1 << bits) - 1)
