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
cache, not an error. A command Redis answers with an error is not an outage
and is not waited out: a write refused for memory (maxmemory, noeviction),
credentials it refuses (a wrong password in redis.url, or one it began to
require), a read-only replica raise `CacheRefused` at once, and the job that
needed the command fails saying so.
"""
from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections import Counter
from typing import Awaitable, Callable, TypeVar

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import (AuthenticationError, AuthenticationWrongNumberOfArgsError, AuthorizationError,
                              BusyLoadingError, ClusterDownError, ConnectionError as RedisConnectionError,
                              NoPermissionError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError,
                              TimeoutError as RedisTimeout, TryAgainError)

from mariana.services import protocol
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.redis_url import check_redis_url, redact
from mariana.sparse.batch import SparseBatch
from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "mariana"


class CacheUnavailable(MarianaError):
    """Redis stayed unreachable longer than redis.retry_seconds."""


class CacheRefused(MarianaError):
    """Redis answered a command with an error that waiting does not cure (see `refusal`)."""


# Errors of a Redis that is away, or busy for a moment: waited out (`SampleCache.retry`).
OUTAGE = (RedisConnectionError, RedisTimeout, BusyLoadingError, TryAgainError, ClusterDownError, OSError)
AUTH = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError)


def refusal(e: BaseException, url: str | None = None) -> str | None:
    """What Redis refused and what to do, for an error that waiting does not cure; None for
    an outage (OUTAGE) or an error that is not Redis's answer. Credentials come first: redis-py
    counts a refused password as a ConnectionError. `url`: redis.url, when known, to say whether
    it gives a password (a password set on the Redis later was "refused the credentials in
    redis.url", whose url had none).

    >>> refusal(OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")).split(":")[0]
    'refused a write'
    >>> refusal(AuthenticationError("invalid username-password pair or user is disabled.")).split(":")[0]
    'refused the credentials in redis.url'
    >>> refusal(ResponseError("NOAUTH Authentication required.")).split(":")[0]
    'refused the credentials in redis.url'
    >>> refusal(ResponseError("NOAUTH Authentication required."), "redis://h:6379/0").split(":")[0]
    'requires a password, and redis.url gives none'
    >>> refusal(RedisConnectionError("Connection refused")) is None
    True
    """
    if isinstance(e, AUTH) or (isinstance(e, ResponseError) and str(e).startswith(("NOAUTH", "WRONGPASS"))):
        said = ("requires a password, and redis.url gives none" if url and urllib.parse.urlsplit(url).password is None
                else "refused the credentials in redis.url")
        return f"{said}: {e} (give the user and password it expects: redis://USER:PASSWORD@HOST:PORT/DB)"
    if isinstance(e, NoPermissionError):
        return f"does not let the user in redis.url run a command: {e} (grant it with ACL SETUSER)"
    if isinstance(e, OutOfMemoryError):
        return ("refused a write: OOM command not allowed when used memory > 'maxmemory': raise its maxmemory, "
                "or lower cache.max_bytes below it so batches past that expire after use (see the config)")
    if isinstance(e, ReadOnlyError):
        return f"refused a write: {e} (redis.url names a read-only replica: name the primary)"
    if isinstance(e, ResponseError) and not isinstance(e, OUTAGE):
        return f"refused a command: {e}"
    return None


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
        """Run `op`, waiting out a Redis outage (logged once) up to redis.retry_seconds;
        CacheRefused at once for a command Redis refuses (`refusal`)."""
        t_down, delay, url = None, 0.05, redact(self.cfg.redis.url)
        while True:
            try:
                result = await op()
                if t_down is not None:
                    log.info("redis is back after %.1fs (%s)", time.monotonic() - t_down, what)
                return result
            except (RedisError, OSError) as e:
                if (why := refusal(e, self.cfg.redis.url)) is not None:
                    self.counters["redis_refused"] += 1
                    raise CacheRefused(f"{what}: the sample cache's Redis at {url} {why}") from None
                if not isinstance(e, OUTAGE):
                    raise
                self.counters["redis_retries"] += 1
                now = time.monotonic()
                if t_down is None:
                    t_down = now
                    log.warning("redis at %s unreachable (%s): %s; waiting", url, what, e)
                if now - t_down > self.cfg.redis.retry_seconds:
                    raise CacheUnavailable(f"redis at {url} unreachable for {now - t_down:.0f}s ({what}): {e}") \
                        from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def ping(self, timeout: float = 1.0) -> str | None:
        """None when Redis answers PING; why not when it is away (an outage, not waited for);
        CacheRefused when it refuses (the credentials)."""
        try:
            await asyncio.wait_for(self.redis.ping(), timeout)
            return None
        except asyncio.TimeoutError:
            return f"no answer to PING in {timeout:g}s"
        except (RedisError, OSError) as e:
            if (why := refusal(e, self.cfg.redis.url)) is not None:
                raise CacheRefused(f"the sample cache's Redis at {redact(self.cfg.redis.url)} {why}") from None
            return str(e) or type(e).__name__

    async def identity(self, timeout: float = 1.0) -> dict:
        """Which Redis server and database this cache reaches: {"server": its run_id, "db",
        "url": redis.url without its password}; "server" is "" when Redis does not answer within
        `timeout` (an outage here is not waited for) or refuses. Two services agree on their
        sample cache when server and db agree, whatever address each dials (coord_hello.py)."""
        db = int(self.redis.connection_pool.connection_kwargs.get("db", 0) or 0)
        try:
            info = await asyncio.wait_for(self.redis.info("server"), timeout)
        except (asyncio.TimeoutError, RedisError, OSError):
            info = {}
        return {"server": str(info.get("run_id", "")), "db": db, "url": redact(self.cfg.redis.url)}

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
                # the first error as Redis said it (raised, redis-py prefixes the command and a batch's bytes)
                failed = [r for r in await pipe.execute(raise_on_error=False) if isinstance(r, Exception)]
            if failed:
                raise failed[0]
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

    async def drop_late(self, job: str, chunk: str, batches: int) -> int:
        """The keys a preprocess wrote for a chunk of a job that ended meanwhile (its cleanup ran
        before they came; they outlived it for cache.ttl_seconds, a week, and filled a
        bounded Redis), with the job's counters written since; returns how many."""
        keys = [batch_key(job, chunk, k) for k in range(batches)] + [f"{PREFIX}:{job}:bytes", f"{PREFIX}:{job}:loader"]
        return await self.retry(f"dropping late batches of job {job}", lambda: self.redis.unlink(*keys))

    async def set_offset(self, job: str, where: dict) -> None:
        key = f"{PREFIX}:{job}:loader"

        async def op():  # expires as the batches do: a job that ends without its cleanup leaves nothing for ever
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping={k: str(v) for k, v in where.items()})
                pipe.expire(key, self.cfg.cache.ttl_seconds)
                await pipe.execute()
        await self.retry("recording the loader offset", op)

    async def get_offset(self, job: str) -> dict:
        raw = await self.retry("reading the loader offset", lambda: self.redis.hgetall(f"{PREFIX}:{job}:loader"))
        return {k.decode(): int(v) for k, v in raw.items()}
