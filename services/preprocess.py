"""Preprocess: raw chunks of a source -> parsed, hashed `SparseBatch`es in the
Redis sample cache -> the coordinator, which hands them to workers.

    Chunk{job, chunk, path, first_line, lines, first_of_file} + data   (PULL, from the loader)
      parse (sparse.parse.BlockTask, the same checks as local mode; bad rows counted)
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
import zmq

from services import protocol
from services.protocol import BadMessage, Message
from services.runtime.config import ClusterConfig
from services.runtime.lifecycle import Service, run_service
from services.sample_cache import SampleCache, pack_batch
from services.transport import PeerTimeout, RemoteError, make_socket
from sparse.encode import Encoder
from sparse.errors import DataFormatError, MarianaError
from sparse.parse import BlockParser, BlockTask
from sparse.schema import Schema
from trainer.config import JobConfig, from_dict

log = logging.getLogger(__name__)


@dataclass
class JobCodec:
    encoder: Encoder
    parser: BlockParser
    batch_rows: int


class Preprocess(Service):
    role = "preprocess"

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        super().__init__(cfg, index)
        self.jobs: dict[str, JobCodec] = {}
        self.cache: SampleCache | None = None
        self.pull = None
        self.in_flight: set[asyncio.Task] = set()
        self.failure: BaseException | None = None

    async def start(self) -> None:
        self.pull = make_socket(self.ctx, zmq.PULL, hwm=2)
        self.pull.bind(self.cfg.preprocess.endpoints[self.index])
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
                log.warning("%s: bad message dropped: %s", self.name, e)
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
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()

    async def drain(self) -> None:
        # chunks in hand are cached and reported; queued ones are re-sent on the coordinator's timeout
        while self.in_flight:  # (one may have started while the signal arrived)
            await asyncio.wait(set(self.in_flight))

    async def close(self) -> None:
        if self.pull is not None:
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
            batches, stats = await asyncio.to_thread(self.encode, codec, msg, data, job, chunk)
            error = ""
        except DataFormatError as e:  # e.g. the file is not in the job's format: the job fails with this
            batches, stats, error = [], {}, str(e)
            log.warning("%s: chunk %s of job %s: %s", self.name, chunk, job, e)
        t0 = time.perf_counter()
        size, kept = await self.cache.put_batches(job, chunk, [b for b, _ in batches]) if batches else (0, True)
        stats.update(cache_s=time.perf_counter() - t0, bytes=size, kept=kept)
        self.counters["chunks"] += 1
        self.counters["batches"] += len(batches)
        self.counters["rows_bad"] += stats.get("rows_bad", 0)
        await self.report(job, chunk, [[k, rows] for k, (_, rows) in enumerate(batches)], stats, error)

    def encode(self, codec: JobCodec, msg: Message, data: bytes, job: str, chunk: str):
        """(packed batches with their row counts, stats); runs on a thread (pyarrow, numpy, torch release the GIL)."""
        t0 = time.perf_counter()
        first = msg["first_of_file"]
        task = BlockTask(codec.parser, msg["path"], msg["first_line"], data, msg["lines"],
                         skip_rows=1 if first and codec.encoder.schema.header else 0, first_of_file=first)
        rows, parse = task.run()
        t1 = time.perf_counter()
        out = []
        if rows.num_rows:
            block = codec.encoder.encode(rows, batch_id=chunk)
            for k, b in enumerate(block.split(codec.batch_rows)):
                b.batch_id = f"{chunk}:{k}"
                out.append((pack_batch(job, b), b.num_rows))
        t2 = time.perf_counter()
        if parse.rows_bad:
            log.warning("%s: chunk %s: %s", self.name, chunk, parse.summary())
        stats = {"rows_ok": parse.rows_ok, "rows_bad": parse.rows_bad,
                 "first_bad": parse.to_dict()["first_bad"], "parse_s": t1 - t0, "hash_s": t2 - t1}
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
                log.warning("%s: Cached %s not acknowledged (%s); again", self.name, chunk, e)
            except RemoteError as e:
                log.warning("%s: coordinator refused Cached %s: %s", self.name, chunk, e)
                return

    async def codec(self, job: str) -> JobCodec | None:
        codec = self.jobs.get(job)
        if codec is None:
            try:
                spec = (await self.coordinator.call("GetJob", job=job))["spec"]
                config = from_dict(JobConfig, spec["config"])
                schema = Schema.from_dict(spec["schema"])
            except (PeerTimeout, RemoteError, KeyError, MarianaError) as e:
                self.counters["unknown_jobs"] += 1
                log.warning("%s: dropping a chunk of job %s: %s", self.name, job, e)
                return None
            codec = JobCodec(Encoder(schema, config.hashing),
                             BlockParser(schema, labeled=True, threads=config.data.parse_threads),
                             config.train.batch_size)
            self.jobs = {job: codec}
            log.info("%s: job %s: %s rows, batches of %d", self.name, job, schema.name, codec.batch_rows)
        return codec


def main(cfg: ClusterConfig, index: int) -> int:
    return run_service(Preprocess(cfg, index))

