"""Creative features in Redis: each creative is embedded once per featurizer,
cached, and looked up by preprocess (the pipeline's featurizer stage) and by
the coordinator when it writes the model version.

    mariana:creatives:<featurizer sha256[:16]>        hash: creative id -> tag (8 bytes) + float32[d]
    mariana:creatives:<featurizer sha256[:16]>:sets   set: digests of the creative sets cached whole

The tag is the first 8 bytes of the image's sha256, so a creative whose
pixels changed is embedded again instead of reusing stale features. Keys do
not expire: features are a pure function of (featurizer, image). A value of
the wrong length (another writer, a corrupt entry) is counted and treated as
unknown, never raised. A restarted Redis is empty: a reader that misses an id
and finds its set no longer recorded as cached embeds the set again (counted
as `creative_cache_rebuilt`) instead of training or publishing with fallbacks.

    info = await featurize_creatives(cache, images_cfg, counters)   # the batch job: embed what is missing
    lookup = CreativeLookup(cache, cfg, key, dim, digest, counters)  # preprocess, one per job
    table = await lookup.table_for(column)                           # -> CreativeFeatures of the chunk's ids
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import numpy as np

from mariana.featurizer.creatives import FALLBACK, CreativeFeatures
from mariana.services.runtime.creatives import (CHUNK, bad_value, namespace_of, split_value, stack_features,
                                               valid_features)
from mariana.services.sample_cache import SampleCache
from mariana.trainer.config import ImagesConfig

log = logging.getLogger(__name__)


async def read_values(cache: SampleCache, key: str, ids: list[bytes]) -> list[bytes | None]:
    out: list[bytes | None] = []
    for i in range(0, len(ids), CHUNK):
        part = ids[i:i + CHUNK]
        out += await cache.retry("reading creative features", lambda p=part: cache.redis.hmget(key, p))
    return out


async def featurize_creatives(cache: SampleCache, cfg: ImagesConfig, counters: Counter) -> dict:
    """The batch job: embed every creative of `cfg.creatives` whose features are not
    cached yet (or whose image changed) and cache them. Returns what the job record
    shows: the featurizer, the Redis key, how many were embedded now and how many
    were cached already, and the corrupt uploads skipped."""
    from mariana.trainer.images import featurizer_info, load_creative_set, open_featurizer

    cset = await asyncio.to_thread(load_creative_set, cfg.creatives)
    featurizer, fdir, how = await asyncio.to_thread(open_featurizer, cfg, cset)
    info = featurizer_info(featurizer, fdir, how)
    key, dim = namespace_of(info["featurizer_sha256"] or "unversioned"), featurizer.dim
    tags = cset.tags()
    have = await read_values(cache, key, cset.ids)
    todo = [i for i, (v, tag) in enumerate(zip(have, tags)) if (s := split_value(v, dim)) is None or s[0] != tag]
    seconds = 0.0
    if todo:
        t0 = time.perf_counter()
        features = await asyncio.to_thread(featurizer.embed, cset.images[todo])
        seconds = time.perf_counter() - t0
        for i in range(0, len(todo), CHUNK):
            mapping = {cset.ids[j]: tags[j] + features[n].tobytes()
                       for n, j in enumerate(todo[i:i + CHUNK], start=i)}
            await cache.retry("caching creative features", lambda m=mapping: cache.redis.hset(key, mapping=m))
    digest = cset.digest()
    await cache.retry("recording the creative set", lambda: cache.redis.sadd(f"{key}:sets", digest))
    counters["creatives_embedded"] += len(todo)
    counters["corrupt_images"] += len(cset.corrupt)
    log.info("creative features in %s: %d embedded now (%.0f images/s), %d cached before, %d corrupt uploads",
             key, len(todo), len(todo) / max(seconds, 1e-9), len(cset.ids) - len(todo), len(cset.corrupt))
    return {**cset.info(), **info, "field": cfg.field, "redis_key": key, "set": digest, "embedded": len(todo),
            "cached_before": len(cset.ids) - len(todo), "ids": [i.decode() for i in cset.ids],
            "unknown_creative": FALLBACK}


async def ensure_cached(cache: SampleCache, cfg: ImagesConfig, key: str, digest: str, counters: Counter) -> bool:
    """Embed the set again if Redis no longer holds it whole (it restarted empty); True if it did."""
    held = await cache.retry("checking the creative set", lambda: cache.redis.sismember(f"{key}:sets", digest))
    if held:
        return False
    log.warning("creative set %s is gone from %s (redis restarted?): embedding it again", digest, key)
    counters["creative_cache_rebuilt"] += 1
    await featurize_creatives(cache, cfg, counters)
    return True


async def creative_table(cache: SampleCache, key: str, dim: int, ids: list[bytes]) -> CreativeFeatures:
    """The features of `ids` that are cached, as the table a model version stores."""
    return CreativeFeatures(*valid_features(zip(ids, await read_values(cache, key, ids)), dim))


class CreativeLookup:
    """Preprocess's view of one job's creative features: a local memo in front of
    Redis. A chunk costs one HMGET for the ids this process has not seen; an id
    Redis does not have is remembered as unknown for the job (its rows get the
    fallback and are counted)."""

    def __init__(self, cache: SampleCache, cfg: ImagesConfig, key: str, dim: int, digest: str, counters: Counter):
        self.cache, self.cfg, self.key, self.dim, self.digest = cache, cfg, key, dim, digest
        self.counters = counters
        self.known: dict[bytes, np.ndarray] = {}
        self.missing: set[bytes] = set()
        self._table: CreativeFeatures | None = None
        self._lock = asyncio.Lock()  # chunks in flight share the memo (and one rebuild)

    async def table_for(self, ids: list[bytes]) -> CreativeFeatures:
        """A table holding every id of `ids` that is cached (distinct ids expected)."""
        async with self._lock:
            new = [i for i in ids if i not in self.known and i not in self.missing]
            if new:
                self.counters["creative_fetches"] += len(new)
                values = await read_values(self.cache, self.key, new)
                if None in values and await ensure_cached(self.cache, self.cfg, self.key, self.digest,
                                                          self.counters):
                    values = await read_values(self.cache, self.key, new)
                for cid, value in zip(new, values):
                    split = split_value(value, self.dim)
                    if split is None:
                        if value is not None:
                            self.counters["creative_values_bad"] += 1
                            log.warning("creative %r in %s: %s; treated as unknown", cid, self.key,
                                        bad_value(value, self.dim))
                        self.missing.add(cid)
                    else:
                        self.known[cid] = split[1]
                self._table = None
        if self._table is None:
            self._table = CreativeFeatures(list(self.known), stack_features(list(self.known.values()), self.dim))
        return self._table
