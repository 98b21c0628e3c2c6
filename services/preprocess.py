"""Preprocess: raw chunks of a source -> parsed, hashed `SparseBatch`es in the
Redis sample cache -> the coordinator, which hands them to workers.

    Chunk{job, chunk, path, first_line, lines, first_of_file} + data   (PULL, from the loader)
      parse (sparse.parse.BlockTask, the same checks as local mode; bad rows counted)
      image features (a job with images): each row's creative id looked up in Redis
            (services/creative_cache.py, memoized per job) and appended to the dense
            block as local mode's encoder does; an unknown creative gets the fallback, counted
      hash  (sparse.encode.Encoder), split into train.batch_size rows
      cache (one Redis pipeline per chunk)
      Cached{job, chunk, batches: [[k, rows], ...], stats} -> coordinator
                                   (its reply is held while workers lag: back-pressure)

Several instances share the loader's stream (it round-robins). A garbage
message on the PULL socket is counted and dropped; there is no one to answer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zmq

from mariana.featurizer.creatives import CreativeFeatures, ImageFeatureEncoder
from mariana.services import protocol
from mariana.services.creative_cache import CreativeLookup
from mariana.services.jobspec import JobSpec
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.lifecycle import Service, run_service
from mariana.services.sample_cache import CacheUnavailable, SampleCache, pack_batch
from mariana.services.transport import (PEER_LOG, HandshakeCounter, PeerTimeout, RemoteError, bind, make_socket,
                                        timeout_log)
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import MarianaError
from mariana.sparse.parse import BlockParser, BlockTask, Chunk, ParseStats, preload

log = logging.getLogger(__name__)

# Seconds a stopping preprocess waits on a chunk's Cached report whose reply the coordinator
# holds (back-pressure), past which the drain lets it go: the coordinator journaled it when it
# came, and one that never came is read again on the coordinator's timeout.
REPORT_GRACE_S = 1.0


@dataclass
class JobCodec:
    encoder: Encoder
    parser: BlockParser
    batch_rows: int
    creatives: CreativeLookup | None = None  # a job with image features
    field: str = ""                          # the column naming a row's creative


class Preprocess(Service):
    role = "preprocess"
    COUNTERS = Service.COUNTERS + Service.REDIS_COUNTERS + Service.CREATIVE_COUNTERS + (
        "chunks", "batches", "rows_bad", "creative_lookups", "creatives_unknown", "unknown_jobs",
        "chunks_refused_stopping", "creative_fetches", "creative_values_bad")

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        super().__init__(cfg, index)
        self.jobs: dict[str, JobCodec] = {}
        self.cache: SampleCache | None = None
        self.pull = None
        self.handshakes: HandshakeCounter | None = None
        self.in_flight: set[asyncio.Task] = set()
        self.reporting: dict[asyncio.Task, float] = {}  # chunk task -> when it sent its Cached report
        self.failure: BaseException | None = None
        self.codec_lock = asyncio.Lock()

    async def start(self) -> None:
        self.pull = make_socket(self.ctx, zmq.PULL, hwm=2)
        self.handshakes = HandshakeCounter(self.ctx, self.pull, self.counters, self.name)
        bind(self.pull, self.cfg.preprocess.endpoints[self.index])
        self.connect_coordinator()
        self.cache = SampleCache(self.cfg, self.counters)
        await self.register()

    async def main(self) -> None:
        # `threads` chunks in flight: one parses while another is hashed, cached or held back.
        slots = asyncio.Semaphore(self.cfg.preprocess.threads)
        while True:
            await slots.acquire()
            frames = await self.pull.recv_multipart(copy=False)
            if self.stopping.is_set():  # draining: a chunk taken now would outlive the drain
                self.counters["chunks_refused_stopping"] += 1
                slots.release()
                continue  # the coordinator reads it again on its timeout
            try:
                msg = protocol.decode(frames, self.cfg.cluster.max_message_bytes)
                if msg.type != "Chunk" or msg.arrays.get("data") is None or msg.arrays["data"].dtype != np.uint8:
                    raise BadMessage("unexpected", f"preprocess takes Chunk messages with uint8 data, got {msg.type}")
            except BadMessage as e:
                self.counters["bad_messages"] += 1
                PEER_LOG.warning("%s: bad message dropped: %s", self.name, e)
                slots.release()
                continue
            task = asyncio.create_task(self.process(msg))
            self.in_flight.add(task)
            task.add_done_callback(self.chunk_done)
            task.add_done_callback(lambda _: slots.release())
            if self.failure is not None:
                raise self.failure  # e.g. Redis gone longer than redis.retry_seconds: exit non-zero

    def chunk_done(self, task: asyncio.Task) -> None:
        self.in_flight.discard(task)
        self.reporting.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()

    async def drain(self) -> None:
        # Chunks in hand are cached and reported; queued ones are re-sent on the coordinator's timeout.
        # A report whose reply the coordinator holds (workers behind, or none running) is let go
        # after REPORT_GRACE_S: waiting for it, a stop took the whole drain limit (20 s).
        while self.in_flight:  # (one may have started while the signal arrived)
            await asyncio.wait(set(self.in_flight), timeout=0.1)
            now = time.monotonic()
            if self.in_flight and all(now - self.reporting.get(t, now) >= REPORT_GRACE_S for t in self.in_flight):
                log.info("%s: %d chunk report(s) held by the coordinator (back-pressure): the coordinator has "
                         "them, or reads those chunks again", self.name, len(self.in_flight))
                return

    async def close(self) -> None:
        if self.pull is not None:
            self.handshakes.close()
            self.pull.close(linger=0)
        if self.cache:
            await self.cache.close()

    def status(self) -> dict:
        return {**self.counters, "busy": len(self.in_flight)}

    # ---- one chunk ------------------------------------------------------------------------

    async def process(self, msg: Message) -> None:
        job, chunk = msg["job"], msg["chunk"]
        codec = await self.codec(job)
        if codec is None:
            return
        data = memoryview(msg.arrays["data"])  # the received frame, parsed in place
        try:
            rows, parse, parse_s = await asyncio.to_thread(self.parse, codec, msg, data)
            table, lookup_s = None, 0.0
            if codec.creatives is not None and rows.num_rows:
                t0 = time.perf_counter()
                table = await codec.creatives.table_for(distinct_ids(rows.columns[codec.field]))
                lookup_s = time.perf_counter() - t0
            batches, stats = await asyncio.to_thread(self.encode, codec, rows, parse, table, job, chunk)
            stats.update(parse_s=parse_s, image_s=lookup_s + stats.pop("attach_s", 0.0))
            t0 = time.perf_counter()
            size, kept = await self.cache.put_batches(job, chunk, [b for b, _ in batches]) if batches else (0, True)
            stats.update(cache_s=time.perf_counter() - t0, bytes=size, kept=kept)
            error = ""
        except CacheUnavailable:
            raise  # Redis gone longer than redis.retry_seconds: this process exits non-zero (main)
        except MarianaError as e:  # the file is not in the job's format, the creatives are unreadable, Redis
            batches, stats, error = [], {}, str(e)  # refused the write (full, credentials): the job fails
            log.warning("%s: chunk %s of job %s: %s", self.name, chunk, job, e)
        except Exception as e:  # a bug: the job fails with it; the chunk would fail the same on every resend,
            batches, stats = [], {}  # and this process, had it exited, would have been restarted to meet it again
            error = f"internal error in {self.name} on chunk {chunk}: {type(e).__name__}: {e}"
            log.exception("%s: chunk %s of job %s failed", self.name, chunk, job)
        self.counters["chunks"] += 1
        self.counters["batches"] += len(batches)
        self.counters["rows_bad"] += stats.get("rows_bad", 0)
        self.counters["creative_lookups"] += stats.get("image_rows", 0)
        self.counters["creatives_unknown"] += stats.get("image_unknown", 0)
        self.reporting[asyncio.current_task()] = time.monotonic()
        await self.report(job, chunk, [[k, rows] for k, (_, rows) in enumerate(batches)], stats, error)

    def parse(self, codec: JobCodec, msg: Message, data: bytes) -> tuple[Chunk, ParseStats, float]:
        """Runs on a thread (pyarrow releases the GIL)."""
        t0 = time.perf_counter()
        first = msg["first_of_file"]
        task = BlockTask(codec.parser, msg["path"], msg["first_line"], data, msg["lines"],
                         skip_rows=1 if first and codec.encoder.schema.header else 0, first_of_file=first)
        rows, parse = task.run()
        if parse.rows_bad:
            log.warning("%s: chunk %s: %s", self.name, msg["chunk"], parse.summary())
        return rows, parse, time.perf_counter() - t0

    def encode(self, codec: JobCodec, rows: Chunk, parse: ParseStats, table: CreativeFeatures | None,
               job: str, chunk: str):
        """(packed batches with their row counts, stats); runs on a thread (numpy and torch release the GIL)."""
        t0 = time.perf_counter()
        out = []
        image_unknown, attach_s = 0, 0.0
        if rows.num_rows:
            block = codec.encoder.encode(rows, batch_id=chunk)
            if table is not None:  # what local mode's ImageFeatureEncoder does, timed on its own
                t1 = time.perf_counter()
                block = ImageFeatureEncoder(codec.encoder, table, codec.field).attach(block, rows)
                image_unknown = int(block.dense[:, -1].sum())  # the flag column: 1.0 where the creative was unknown
                attach_s = time.perf_counter() - t1
            for k, b in enumerate(block.split(codec.batch_rows)):
                b.batch_id = f"{chunk}:{k}"
                out.append((pack_batch(job, b), b.num_rows))
        stats = {"rows_ok": parse.rows_ok, "rows_bad": parse.rows_bad, "clicks": parse.clicks,
                 "first_bad": parse.to_dict()["first_bad"], "hash_s": time.perf_counter() - t0 - attach_s}
        if table is not None:
            stats.update(image_rows=rows.num_rows, image_unknown=image_unknown, attach_s=attach_s)
        return out, stats

    async def report(self, job: str, chunk: str, batches: list, stats: dict, error: str) -> None:
        """Cached -> coordinator; retried: it is idempotent, and a held reply is back-pressure."""
        while True:
            try:
                await self.coordinator.call("Cached", job=job, chunk=chunk, batches=batches, stats=stats,
                                            error=error, timeout=600.0)
                return
            except PeerTimeout as e:
                if self.stopping.is_set() and self.coordinator.closed:
                    return  # shut down: the coordinator reads the chunk again on its timeout
                timeout_log(log, e)("%s: Cached %s not acknowledged (%s); again", self.name, chunk, e)
            except RemoteError as e:
                log.warning("%s: coordinator refused Cached %s: %s", self.name, chunk, e)
                return

    async def codec(self, job: str) -> JobCodec | None:
        async with self.codec_lock:  # chunks in flight ask at once when a job starts: one codec, one memo
            return await self._codec(job)

    async def _codec(self, job: str) -> JobCodec | None:
        codec = self.jobs.get(job)
        if codec is None:
            try:
                spec = JobSpec.from_dict((await self.coordinator.call("GetJob", job=job)).get("spec"))
            except (PeerTimeout, RemoteError, BadMessage) as e:
                self.counters["unknown_jobs"] += 1
                log.warning("%s: dropping a chunk of job %s: %s", self.name, job, e)
                return None
            config, schema, images = spec.config, spec.schema, spec.images
            codec = JobCodec(Encoder(schema, config.hashing),
                             BlockParser(schema, labeled=True, threads=config.data.parse_threads),
                             config.train.batch_size)
            if config.images.creatives:
                if not images:  # the coordinator sets it before any chunk is read
                    self.counters["unknown_jobs"] += 1
                    log.warning("%s: job %s has image features but no creative cache in its spec", self.name, job)
                    return None
                codec.creatives = CreativeLookup(self.cache, config.images, images["redis_key"], images["dim"],
                                                 images["set"], self.counters)
                codec.field = config.images.field
            self.jobs = {job: codec}
            log.info("%s: job %s: %s rows, batches of %d", self.name, job, schema.name, codec.batch_rows)
        return codec


def distinct_ids(column) -> list[bytes]:
    """The distinct values of a creative-id column (nulls and empty ids left out)."""
    col = column.cast(pa.binary()) if not pa.types.is_binary(column.type) else column
    return [v for v in pc.unique(col).drop_null().to_pylist() if v]


def main(cfg: ClusterConfig, index: int) -> int:
    preload()  # before any thread: pyarrow's pandas check answered, pandas not imported
    return run_service(Preprocess(cfg, index))

