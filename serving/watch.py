"""Learning of new versions: the model directory's CURRENT is the truth; a
Redis pub/sub message (services/runtime/model_events.py) makes the server look at it
at once, and a poll every `serve.watch_seconds` catches what a message
missed (Redis down, no Redis configured, a version promoted by hand).

A new version is loaded on a thread of its own beside the one in service,
warmed up, then swapped in; requests in flight finish on the version they
started with. The version swapped out stays loaded, so going back to it (a
rollback) is a swap without a load. A version that fails to load is logged and counted and not
tried again until CURRENT changes; the old one keeps serving.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from mariana.serving.config import ServeSection
from mariana.serving.dataplane import ModelHolder
from mariana.serving.predictor import Predictor
from mariana.serving.speech import load_version
from mariana.services.runtime import model_events
from mariana.sparse.errors import MarianaError
from mariana.trainer import checkpoint

log = logging.getLogger(__name__)


class VersionWatcher:
    def __init__(self, cfg: ServeSection, holder: ModelHolder, name: str,
                 on_event: Callable[[str, dict], None] = lambda kind, info: None):
        self.cfg, self.holder, self.name, self.on_event = cfg, holder, name, on_event
        self.poke = asyncio.Event()
        self.failed: str | None = None  # a CURRENT that would not load: not retried until it changes
        self.unreadable: str | None = None  # why CURRENT named no version at the last look (said once)
        self.previous: Predictor | None = None  # the version swapped out, kept loaded: rollbacks are instant
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="mariana-load")
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks.append(asyncio.create_task(self._poll(), name="watch-poll"))
        if self.cfg.redis_url:
            self.tasks.append(asyncio.create_task(self._listen(), name="watch-redis"))
            if self.cfg.creatives_seconds:
                self.tasks.append(asyncio.create_task(self._creatives(), name="watch-creatives"))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.loader.shutdown(wait=True)

    async def check(self) -> bool:
        """Load and swap in CURRENT if it is not the version in service; True on a swap."""
        try:
            version = checkpoint.current_version(self.cfg.model_dir)
        except MarianaError as e:  # no model yet, or a CURRENT naming no version: said once, until it changes
            self._unreadable(str(e))
            return False
        self.unreadable = None
        if version == self.holder.version or version == self.failed:
            return False
        t0 = time.perf_counter()
        kept = self.previous is not None and self.previous.version == version
        try:
            if kept:
                new = self.previous  # a rollback: the version just replaced is still loaded
            else:
                # one torch thread: a server's worker processes are its parallelism
                new = await asyncio.get_running_loop().run_in_executor(self.loader, load_version,
                                                                       self.cfg.model_dir, version, 1)
        except Exception as e:  # whatever a version's files hold, the watcher goes on watching
            self.failed = version
            if not isinstance(e, (MarianaError, OSError, KeyError, ValueError)):
                e = f"{type(e).__name__}: {e}"  # not one of the reasons a load names: say what it was
            log.error("%s: cannot load %s/%s: %s; serving %s still", self.name, self.cfg.model_dir, version, e,
                      self.holder.version or "nothing")
            self.on_event("load_failed", {"version": version, "error": str(e)})
            return False
        shared = new.share_ids(self.holder.current)  # the ids met so far, kept
        old = self.holder.swap(new)
        self.previous, self.failed = old, None
        seconds = time.perf_counter() - t0
        log.info("%s: serving %s (was %s), %s%s", self.name, version, old.version if old else "nothing",
                 "kept loaded since it was swapped out" if kept else f"loaded in {seconds:.2f}s",
                 ", its id cache taken over" if shared else "")
        self.on_event("swapped", {"version": version, "previous": old.version if old else None, "seconds": seconds,
                                  "ids_shared": shared})
        return True

    def _unreadable(self, why: str) -> None:
        """Log (and, when a CURRENT names something that is not a version here, count as a
        failed load) why CURRENT gives no version, once per reason."""
        if why == self.unreadable:
            return
        self.unreadable = why
        if self.holder.current is None:
            log.warning("%s: no model to serve yet: %s; /readyz says 503 until CURRENT names a version", self.name, why)
        else:
            log.error("%s: %s; serving %s still", self.name, why, self.holder.version)
        if os.path.exists(os.path.join(self.cfg.model_dir, "CURRENT")):
            self.on_event("load_failed", {"version": None, "error": why})

    async def _poll(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.poke.wait(), self.cfg.watch_seconds)
            except asyncio.TimeoutError:
                pass
            self.poke.clear()
            await self.check()

    async def _creatives(self) -> None:
        """An image model's table grows with creatives featurized since it was trained
        (`mariana featurize-creatives`, or a later job, cached them in Redis under the
        same featurizer): a new ad is scored from its pixels instead of the fallback."""
        import redis
        import redis.asyncio as aioredis

        from mariana.services.runtime.creatives import namespace_of, read_all

        client, warned = aioredis.Redis.from_url(self.cfg.redis_url, socket_connect_timeout=2), False
        seen: tuple = ()  # (version, creatives cached) at the last read: nothing new, nothing to read
        try:
            while True:
                await asyncio.sleep(self.cfg.creatives_seconds)
                p = self.holder.current
                key = p.creative_key() if p is not None else None
                if key is None:
                    continue
                try:
                    now = (p.version, await client.hlen(namespace_of(key[0])))
                    if now == seen:
                        continue
                    ids, features = await read_all(client, *key)
                    seen, warned = now, False
                except (redis.RedisError, OSError) as e:
                    if not warned:
                        log.warning("%s: creative features unreadable on %s: %s", self.name, self.cfg.redis_url, e)
                        warned = True
                    continue
                added = p.add_creatives(ids, features) if ids else 0
                if added:
                    log.info("%s: %s: %d creatives featurized since training added to its table (now %d)",
                             self.name, p.version, added, len(p.bundle.images.ids))
                    self.on_event("creatives_added", {"version": p.version, "added": added})
        finally:
            await client.aclose()

    async def _listen(self) -> None:
        """Subscribe to the announcements; reconnect with a growing delay when Redis is away."""
        import redis
        import redis.asyncio as aioredis

        delay, down_since = 0.5, None
        while True:
            client = aioredis.Redis.from_url(self.cfg.redis_url, socket_connect_timeout=2)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(self.cfg.channel)
                    log.info("%s: listening for new versions on %s (%s)", self.name, self.cfg.redis_url,
                             self.cfg.channel)
                    delay, down_since = 0.5, None
                    self.poke.set()  # anything announced while we were away
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        msg = model_events.parse(message.get("data"))
                        if msg is not None and model_events.concerns(msg, self.cfg.model_dir):
                            log.info("%s: announced: %s %s", self.name, msg["event"], msg.get("version"))
                            self.poke.set()
            except (redis.RedisError, OSError) as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("%s: redis %s unreachable (%s); polling CURRENT every %.1fs meanwhile", self.name,
                                self.cfg.redis_url, e, self.cfg.watch_seconds)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
            finally:
                await client.aclose()
