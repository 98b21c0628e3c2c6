"""The Redis sample cache: encoded batches of a job, written once by
preprocess and read by workers in every epoch, so epochs after the first
skip reading and parsing the sources (the seed's in-memory sample cache).

    <prefix>:<job>:b:<chunk>:<k>   a packed `Batch` message (protocol.pack)
    <prefix>:<job>:bytes           bytes cached for the job (the size bound)
    <prefix>:<job>:loader          how far the loader got (a restart resumes)

Keys expire after `cache.ttl_seconds`; past `cache.max_bytes` per job,
batches are still written (workers read them from here) but expire after
`cache.transient_seconds`, so a later epoch misses and falls back to the
source. Every operation waits for Redis to come back (up to
`redis.retry_seconds`) rather than failing: a restarted Redis is an empty
cache, not an error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Awaitable, Callable, TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError, ConnectionError as RedisConnectionError, TimeoutError as RedisTimeout

from mariana.services import protocol
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.redis_url import check_redis_url
from mariana.sparse.batch import SparseBatch
from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "mariana"


class CacheUnavailable(MarianaError):
    """Redis stayed unreachable longer than redis.retry_seconds."""


def batch_key(job: str, chunk: str, k: int) -> str:
    return f"{PREFIX}:{job}:b:{chunk}:{k}"


def pack_batch(job: str, batch: SparseBatch) -> bytes:
    meta, arrays = batch.to_arrays()
    return protocol.pack(protocol.encode("Batch", 0, arrays, job=job, meta=meta))


def unpack_batch(blob: bytes) -> SparseBatch:
    """Raises BadMessage or DataFormatError for a value that is not a good batch."""
    msg = protocol.unpack(blob)
    if msg.type != "Batch":
        raise protocol.BadMessage("type", f"cached value is a {msg.type}, not a Batch")
    # Arrays from a bytes value are read-only views; the step writes nothing into them
    # but torch warns on non-writable arrays, so copy the small ones it wraps.
    arrays = {k: (np.array(v) if k in ("dense", "labels", "values") else v) for k, v in msg.arrays.items()}
    return SparseBatch.from_arrays(msg["meta"], arrays)


class SampleCache:
    def __init__(self, cfg: ClusterConfig, counters: Counter):
        self.cfg, self.counters = cfg, counters
        check_redis_url(cfg.redis.url, "redis.url")  # one error line, not from_url's traceback
        self.redis = aioredis.Redis.from_url(cfg.redis.url, socket_timeout=10, socket_connect_timeout=2,
                                             retry_on_timeout=False)

    async def close(self) -> None:
        await self.redis.aclose()

    async def retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, waiting out a Redis outage (logged once) up to redis.retry_seconds."""
        t_down, delay = None, 0.05
        while True:
            try:
                result = await op()
                if t_down is not None:
                    log.info("redis is back after %.1fs (%s)", time.monotonic() - t_down, what)
                return result
            except (RedisConnectionError, RedisTimeout, BusyLoadingError, OSError) as e:
                self.counters["redis_retries"] += 1
                now = time.monotonic()
                if t_down is None:
                    t_down = now
                    log.warning("redis at %s unreachable (%s): %s; waiting", self.cfg.redis.url, what, e)
                if now - t_down > self.cfg.redis.retry_seconds:
                    raise CacheUnavailable(f"redis at {self.cfg.redis.url} unreachable for "
                                           f"{now - t_down:.0f}s ({what}): {e}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # ---- batches ------------------------------------------------------------------

    async def put_batches(self, job: str, chunk: str, blobs: list[bytes]) -> tuple[int, bool]:
        """Write a chunk's batches; (bytes written, kept for later epochs?)."""
        size = sum(len(b) for b in blobs)
        c = self.cfg.cache

        async def op():
            total = await self.redis.incrby(f"{PREFIX}:{job}:bytes", size)
            keep = total <= c.max_bytes
            ttl = c.ttl_seconds if keep else c.transient_seconds
            async with self.redis.pipeline(transaction=False) as pipe:
                for k, blob in enumerate(blobs):
                    pipe.set(batch_key(job, chunk, k), blob, ex=ttl)
                pipe.expire(f"{PREFIX}:{job}:bytes", c.ttl_seconds)
                await pipe.execute()
            return keep

        keep = await self.retry(f"caching chunk {chunk}", op)
        if not keep:
            self.counters["batches_transient"] += len(blobs)
        return size, keep

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Several values in one round trip (None for each missing one)."""
        return await self.retry(f"reading {len(keys)} batches", lambda: self.redis.mget(keys))

    async def drop_job(self, job: str) -> int:
        """Delete every key of a job; returns how many."""
        async def op():
            n = 0
            async for key in self.redis.scan_iter(match=f"{PREFIX}:{job}:*", count=1000):
                n += await self.redis.unlink(key)
            return n
        return await self.retry(f"dropping job {job}", op)

    # ---- loader offsets --------------------------------------------------------------

    async def set_offset(self, job: str, where: dict) -> None:
        key = f"{PREFIX}:{job}:loader"
        await self.retry("recording the loader offset",
                         lambda: self.redis.hset(key, mapping={k: str(v) for k, v in where.items()}))

    async def get_offset(self, job: str) -> dict:
        raw = await self.retry("reading the loader offset", lambda: self.redis.hgetall(f"{PREFIX}:{job}:loader"))
        return {k.decode(): int(v) for k, v in raw.items()}
