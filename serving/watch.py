"""Learning of new versions: the model directory's CURRENT is the truth; a
Redis pub/sub message (services/runtime/model_events.py) makes the server look at it
at once, and a poll every `serve.watch_seconds` catches what a message
missed (Redis down, no Redis configured, a version promoted by hand).

A new version is loaded on a thread of its own beside the one in service,
warmed up, then swapped in; requests in flight finish on the version they
started with. The version swapped out stays loaded, so going back to it (a
rollback) is a swap without a load. A version is known by its name and its manifest file
(`files_of`): a version deleted and its name given again, or a version dir replaced in place,
is loaded afresh, never taken for what is in memory under that name. A version that fails to
load (or to swap in) is logged and counted and not tried again until CURRENT (or the version's
files) changes; the old one keeps serving. No error of one attempt ends a background task: each
says it once and goes on.
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
from mariana.services.runtime.redis_url import redact
from mariana.sparse.errors import MarianaError
from mariana.trainer import checkpoint

log = logging.getLogger(__name__)


def files_of(model_dir: str, version: str) -> tuple | None:
    """What a version's name stands for now, at the cost of two stats: its manifest's and its
    weights' identities. A version written anew (the name given again after a deletion, a dir
    restored from a backup, even with its times kept) has a new manifest file, so another inode
    or change time (st_ctime cannot be set back); weights put back by hand into a version that
    would not load change the key too, and it is tried again. None when there is no manifest."""
    try:
        st = os.stat(os.path.join(model_dir, version, checkpoint.MANIFEST))
    except OSError:
        return None
    try:
        w = os.stat(os.path.join(model_dir, version, checkpoint.WEIGHTS))
        weights = (w.st_ino, w.st_mtime_ns, w.st_ctime_ns, w.st_size)
    except OSError:
        weights = None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, weights


class VersionWatcher:
    def __init__(self, cfg: ServeSection, holder: ModelHolder, name: str,
                 on_event: Callable[[str, dict], None] = lambda kind, info: None):
        self.cfg, self.holder, self.name, self.on_event = cfg, holder, name, on_event
        self.poke = asyncio.Event()
        self.failed: tuple | None = None  # (version, files) that would not load: not retried until it changes
        self.serving: tuple | None = None  # (version, files) of holder.current, as it was loaded
        self.unreadable: str | None = None  # why CURRENT named no version at the last look (said once)
        self.previous: Predictor | None = None  # the version swapped out, kept loaded: rollbacks are instant
        self.kept: tuple | None = None  # (version, files) of `previous`
        self.crashed: str | None = None  # the error a look for a new version last died of (said once)
        self.bad_seen: set[bytes] = set()  # creatives whose cached value is no features (said once each)
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
            first = str(e) != self.unreadable
            self._unreadable(str(e))
            if first and self.holder.current is None:
                await self._fall_back_to_record()
            return False
        self.unreadable = None
        key = (version, files_of(self.cfg.model_dir, version))  # taken before the load: a change after it shows
        if key == self.serving or key == self.failed:
            return False
        t0 = time.perf_counter()
        kept = self.previous is not None and key == self.kept
        try:
            if kept:
                new = self.previous  # a rollback: the version just replaced is still loaded
            else:
                # one torch thread: a server's worker processes are its parallelism
                new = await asyncio.get_running_loop().run_in_executor(self.loader, load_version,
                                                                       self.cfg.model_dir, version, 1, self.cfg.tables)
            shared = new.share_ids(self.holder.current)  # the ids met so far, kept
        except Exception as e:  # whatever a version's files hold, the watcher goes on watching
            self._load_failed(key, e)
            if self.holder.current is None:
                await self._fall_back(version)
            return False
        old = self.holder.swap(new)
        self.previous, self.kept, self.serving, self.failed = old, self.serving, key, None
        seconds = time.perf_counter() - t0
        log.info("%s: serving %s (was %s), %s%s", self.name, version, old.version if old else "nothing",
                 "kept loaded since it was swapped out" if kept else f"loaded in {seconds:.2f}s",
                 ", its id cache taken over" if shared else "")
        self.on_event("swapped", {"version": version, "previous": old.version if old else None, "seconds": seconds,
                                  "ids_shared": shared})
        return True

    async def _fall_back(self, version: str) -> None:
        """Nothing in service and CURRENT's `version` does not load: the version served before it."""
        try:
            target = checkpoint.rollback_target(self.cfg.model_dir, version)
        except MarianaError:  # nothing was served before it
            return
        await self._serve_instead(target, f"the version served before {version}")

    async def _fall_back_to_record(self) -> None:
        """Nothing in service and CURRENT names no version here: for NUL bytes or a garbled
        name, the version promotions.jsonl says CURRENT was moved to last; for a version since
        deleted (or that one, deleted), the version served before it (`_fall_back`). A worker
        started after the version in service was deleted answered 503 while its siblings
        served from memory, though the version before it was on disk."""
        moves = checkpoint.promotions(self.cfg.model_dir)
        last = checkpoint.named_version(self.cfg.model_dir) or (moves[-1]["to"] if moves else None)
        if not (isinstance(last, str) and checkpoint.VERSION_RE.match(last)):
            return
        if os.path.isdir(os.path.join(self.cfg.model_dir, last)):
            await self._serve_instead(last, "the version CURRENT was last moved to (promotions.jsonl)")
        if self.holder.current is None:
            await self._fall_back(last)

    async def _serve_instead(self, target: str, what: str) -> None:
        """Serve `target` (`what`, in the log) while nothing is in service and CURRENT gives no
        version that loads, until CURRENT or its version's files change. A worker started or
        restarted after the version in service was damaged on disk, or CURRENT was, answered
        503 while the others served that version from memory (29 of 60 requests)."""
        try:
            new = await asyncio.get_running_loop().run_in_executor(self.loader, load_version, self.cfg.model_dir,
                                                                   target, 1, self.cfg.tables)
        except Exception as e:  # gone, or damaged too: 503 it is
            log.error("%s: nor does %s, %s, load (%s): /readyz says 503 until CURRENT names a version that loads",
                      self.name, target, what, e if isinstance(e, MarianaError) else type(e).__name__)
            return
        self.holder.swap(new)
        self.serving = (target, files_of(self.cfg.model_dir, target))
        log.error("%s: serving %s, %s, until CURRENT names a version that loads", self.name, target, what)
        self.on_event("swapped", {"version": target, "previous": None, "seconds": 0.0, "ids_shared": False})

    def _load_failed(self, key: tuple, e: BaseException) -> None:
        """Log and count a version that would not load or swap in: not tried again until CURRENT
        (or the version's files) changes."""
        self.failed, version = key, key[0]
        if not isinstance(e, (MarianaError, OSError, KeyError, ValueError)):
            e = f"{type(e).__name__}: {e}"  # not one of the reasons a load names: say what it was
        log.error("%s: cannot load %s/%s: %s; serving %s still", self.name, self.cfg.model_dir, version, e,
                  self.holder.version or "nothing")
        self.on_event("load_failed", {"version": version, "error": str(e)})

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
            try:
                await self.check()
            except Exception as e:  # a bug, not a bad version (`check` says those): the watch goes on
                why = f"{type(e).__name__}: {e}"
                if why != self.crashed:
                    self.crashed = why
                    log.exception("%s: looking for a new version in %s failed: %s; serving %s still",
                                  self.name, self.cfg.model_dir, why, self.holder.version or "nothing")
                    self.on_event("load_failed", {"version": None, "error": why})
            else:
                self.crashed = None

    async def _creatives(self) -> None:
        """An image model's table grows with creatives featurized since it was trained
        (`mariana featurize-creatives`, or a later job, cached them in Redis under the
        same featurizer): a new ad is scored from its pixels instead of the fallback.
        Creatives added this way follow the cache: one whose image was replaced (featurized
        again) gets its new features; those it was trained with stay as trained. Whatever
        one read meets, the task goes on. (`serve.redis_url` was checked at config load.)"""
        import redis
        import redis.asyncio as aioredis

        client, warned = aioredis.Redis.from_url(self.cfg.redis_url, socket_connect_timeout=2), None
        seen: tuple = ()  # (version, creatives cached) at the last full read
        try:
            while True:
                await asyncio.sleep(self.cfg.creatives_seconds)
                p = self.holder.current
                if p is None or p.creative_key() is None:
                    continue
                try:
                    seen, warned = await self._read_creatives(client, p, seen), None
                except (redis.RedisError, OSError) as e:
                    if warned is None:
                        log.warning("%s: creative features unreadable on %s: %s", self.name,
                                    redact(self.cfg.redis_url), e)
                    warned = "redis"
                except Exception as e:  # a bug: the table stays as it was; said once until it changes
                    if f"{type(e).__name__}: {e}" != warned:
                        log.exception("%s: %s: reading new creatives failed; its table stays as it is", self.name,
                                      p.version)
                    warned = f"{type(e).__name__}: {e}"
        finally:
            await client.aclose()

    async def _read_creatives(self, client, p: Predictor, seen: tuple) -> tuple:
        """One look at the creative cache for `p`; returns what `seen` becomes. A turn costs
        an HLEN, and an HMGET of the creatives added since loading (an image replaced keeps the
        count); the whole hash is read only when its count changed."""
        from mariana.services.runtime.creatives import namespace_of, read_all, read_ids

        key, bad = p.creative_key(), []
        now = (p.version, await client.hlen(namespace_of(key[0])))
        if now != seen:
            ids, features = await read_all(client, *key, bad)
        elif p.served_creatives:
            ids, features = await read_ids(client, *key, list(p.served_creatives), bad)
        else:
            return now
        self._bad_creatives(p, bad)
        added, changed = p.add_creatives(ids, features)
        if added or changed:
            log.info("%s: %s: creatives featurized since training: %d added to its table (now %d), %d with new "
                     "features", self.name, p.version, added, len(p.bundle.images.ids), changed)
        if added:
            self.on_event("creatives_added", {"version": p.version, "added": added})
        return now

    def _bad_creatives(self, p: Predictor, bad: list[tuple[bytes, str]]) -> None:
        """Log the cache entries that are no features (NaN, absurd sizes, wrong lengths), once
        per creative: they are scored as unknown (or keep the features last read)."""
        new = [(cid, why) for cid, why in bad if cid not in self.bad_seen]
        if not new:
            return
        self.bad_seen.update(cid for cid, _ in new)
        cid, why = new[0]
        log.warning("%s: %s: %d creative cache entries hold no usable features (first: %r: %s): left out, the "
                    "creative scored as unknown or with the features last read; 'mariana featurize-creatives' "
                    "embeds them again", self.name, p.version, len(new), cid, why)
        self.on_event("creatives_bad", {"version": p.version, "bad": len(new)})

    async def _listen(self) -> None:
        """Subscribe to the announcements; reconnect with a growing delay when Redis is away."""
        import redis
        import redis.asyncio as aioredis

        delay, down_since = 0.5, None
        while True:
            try:
                async with aioredis.Redis.from_url(self.cfg.redis_url, socket_connect_timeout=2) as client, \
                        client.pubsub() as pubsub:
                    await pubsub.subscribe(self.cfg.channel)
                    log.info("%s: listening for new versions on %s (%s)", self.name, redact(self.cfg.redis_url),
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
            except Exception as e:  # Redis away, or anything else: CURRENT is still polled
                if down_since is None:
                    down_since = time.monotonic()
                    if not isinstance(e, (redis.RedisError, OSError)):
                        e = f"{type(e).__name__}: {e}"
                    log.warning("%s: redis %s unreachable (%s); polling CURRENT every %.1fs meanwhile", self.name,
                                redact(self.cfg.redis_url), e, self.cfg.watch_seconds)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
