"""The creative features cache's layout in Redis, and its read side: what the pipeline's
services (services/creative_cache.py, which also writes it) and the serving endpoint (a new
creative scored from its pixels) share.

    mariana:creatives:<featurizer sha256[:16]>   hash: creative id -> tag (8 bytes) + float32[d]
"""
from __future__ import annotations

import numpy as np

from mariana.services.sample_cache import PREFIX

TAG = 8
CHUNK = 1000  # ids per HMGET / HSET / HSCAN


def namespace_of(featurizer_sha: str) -> str:
    return f"{PREFIX}:creatives:{featurizer_sha[:16]}"


def split_value(value: bytes | None, dim: int) -> tuple[bytes, np.ndarray] | None:
    if value is None or len(value) != TAG + 4 * dim:
        return None
    return value[:TAG], np.frombuffer(value, np.float32, offset=TAG)


def stack_features(rows: list[np.ndarray], dim: int) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, dim), np.float32)


def valid_features(pairs, dim: int) -> tuple[list[bytes], np.ndarray]:
    """(ids, features) of the (id, cached value) pairs whose value is well formed."""
    ids, rows = [], []
    for cid, value in pairs:
        split = split_value(value, dim)
        if split is not None:
            ids.append(cid)
            rows.append(split[1])
    return ids, stack_features(rows, dim)


async def read_all(redis, featurizer_sha: str, dim: int) -> tuple[list[bytes], np.ndarray]:
    """Every creative cached for a featurizer: (ids, (n, dim) features); values of the
    wrong length are skipped. `redis`: a redis.asyncio client (serving has no SampleCache)."""
    return valid_features([pair async for pair in redis.hscan_iter(namespace_of(featurizer_sha), count=CHUNK)], dim)
