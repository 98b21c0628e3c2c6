"""The creative features cache's layout in Redis, and its read side: what the pipeline's
services (services/creative_cache.py, which also writes it) and the serving endpoint (a new
creative scored from its pixels) share.

    mariana:creatives:<featurizer sha256[:16]>   hash: creative id -> tag (8 bytes) + float32[d]

A value is well formed when it is TAG + 4 * d bytes long and its features are finite and at
most `MAX_FEATURE` in size. Any other (another writer, a corrupt entry, a featurizer that
diverged) is treated as an unknown creative, never raised: one NaN in the table would make
every pCTR of its rows NaN, and 1e38 saturates the model's sigmoid.

>>> good = bytes(TAG) + np.array([0.5, -2.0], np.float32).tobytes()
>>> split_value(good, 2)[1].tolist()
[0.5, -2.0]
>>> bad_value(good[:-1], 2)
'a value of 15 bytes, expected 16'
>>> bad_value(bytes(TAG) + np.array([0.5, np.nan], np.float32).tobytes(), 2)
'features not finite or beyond 1e+06 in size'
>>> valid_features([(b"a", good), (b"b", None), (b"c", b"x")], 2)[0]
[b'a']
"""
from __future__ import annotations

import numpy as np

from mariana.services.sample_cache import PREFIX

TAG = 8
CHUNK = 1000  # ids per HMGET / HSET / HSCAN
# Featurizer outputs are O(1)-O(100) (the CNN's embeddings lie within +-5); a value this large
# is no feature but a corrupt one, which would saturate or overflow a model's logit.
MAX_FEATURE = 1e6


def namespace_of(featurizer_sha: str) -> str:
    return f"{PREFIX}:creatives:{featurizer_sha[:16]}"


def bad_value(value: bytes | None, dim: int) -> str | None:
    """Why a cached value is no creative's features (None: it is, or it is missing)."""
    if value is None:
        return None
    if len(value) != TAG + 4 * dim:
        return f"a value of {len(value)} bytes, expected {TAG + 4 * dim}"
    features = np.frombuffer(value, np.float32, offset=TAG)
    if not (np.isfinite(features).all() and (np.abs(features) <= MAX_FEATURE).all()):
        return f"features not finite or beyond {MAX_FEATURE:g} in size"
    return None


def split_value(value: bytes | None, dim: int) -> tuple[bytes, np.ndarray] | None:
    """(tag, (d,) float32 features) of a well formed value; None for a missing or bad one."""
    if value is None or bad_value(value, dim) is not None:
        return None
    return value[:TAG], np.frombuffer(value, np.float32, offset=TAG)


def stack_features(rows: list[np.ndarray], dim: int) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, dim), np.float32)


def valid_features(pairs, dim: int, bad: list | None = None) -> tuple[list[bytes], np.ndarray]:
    """(ids, features) of the (id, cached value) pairs whose value is well formed; the
    others, with why, go to `bad` when given: (id, reason)."""
    ids, rows = [], []
    for cid, value in pairs:
        split = split_value(value, dim)
        if split is not None:
            ids.append(cid)
            rows.append(split[1])
        elif bad is not None and value is not None:
            bad.append((cid, bad_value(value, dim)))
    return ids, stack_features(rows, dim)


async def read_all(redis, featurizer_sha: str, dim: int, bad: list | None = None) -> tuple[list[bytes], np.ndarray]:
    """Every creative cached for a featurizer: (ids, (n, dim) features); values not well
    formed are skipped (and listed in `bad`). `redis`: a redis.asyncio client (serving has no
    SampleCache)."""
    pairs = [pair async for pair in redis.hscan_iter(namespace_of(featurizer_sha), count=CHUNK)]
    return valid_features(pairs, dim, bad)


async def read_ids(redis, featurizer_sha: str, dim: int, ids: list[bytes],
                   bad: list | None = None) -> tuple[list[bytes], np.ndarray]:
    """`read_all` of the given ids only (HMGET, `CHUNK` at a time); missing ones are skipped."""
    values: list[bytes | None] = []
    for i in range(0, len(ids), CHUNK):
        values += await redis.hmget(namespace_of(featurizer_sha), ids[i:i + CHUNK])
    return valid_features(zip(ids, values), dim, bad)
