"""Loader: streams raw chunks (whole lines, ~data.block_bytes) of a job's
sources to the preprocess instances, and records how far it got so a
restarted loader resumes there.

    ReadSource{job, files, block_bytes, until?}   <- coordinator (a command)
        for each chunk:  ChunkSent{...} -> coordinator, then Chunk + data -> preprocess (PUSH)
        (until = [file, lines]: nothing past that many lines of that file, nor of later files:
         the tail a job holds out for validation, train.valid_fraction, is never sent)
        SourceDone{job, chunks, error} -> coordinator
    Resend{job, chunk, file, offset, length, ...}  <- coordinator (a chunk lost or evicted)
    CheckJob, FetchInput <- coordinator: a job's files checked and sent from here
        (coordinator.data_via_loader, services/remote_inputs.py)

A chunk's id is `f<file>o<offset>`, so a chunk read twice is recognized.
"""
from __future__ import annotations

import asyncio
import os
import logging
import time

import numpy as np
import zmq

from mariana.services import protocol, remote_inputs
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime import failpoints
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.lifecycle import Service, cancel_and_wait, run_service
from mariana.services.sample_cache import SampleCache
from mariana.services.transport import PeerTimeout, RemoteError, as_client, make_socket, timeout_log
from mariana.sparse.errors import DataFormatError, MarianaError
from mariana.sparse.parse import iter_spans, open_binary, read_span, span_end, span_head

log = logging.getLogger(__name__)


class JobEnded(Exception):
    """The coordinator refused a report: the job was cancelled or failed."""


class Loader(Service):
    role = "loader"
    COUNTERS = Service.COUNTERS + Service.REDIS_COUNTERS + ("chunks_sent", "bytes_sent", "chunks_resent")

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        super().__init__(cfg, index)
        self.push = None
        self.cache: SampleCache | None = None
        self.reading: dict[str, asyncio.Task] = {}
        self.files: dict[str, list[str]] = {}

    async def start(self) -> None:
        self.push = make_socket(self.ctx, zmq.PUSH, hwm=self.cfg.loader.hwm)
        self.push.setsockopt(zmq.IMMEDIATE, 1)  # only queue chunks to preprocess instances that are up
        for ep in self.cfg.preprocess.endpoints:
            as_client(self.push).connect(ep)
        self.cache = SampleCache(self.cfg, self.counters)
        self.connect_coordinator(on_command=self.on_command)
        await self.register()

    async def drain(self) -> None:
        # The offset is recorded per chunk: a restart resumes. Cancelled until they end: a read
        # left running would outlive the coordinator client.
        await cancel_and_wait(self.reading.values())

    async def close(self) -> None:
        if self.push is not None:
            self.push.close(linger=0)
        if self.cache:
            await self.cache.close()

    def status(self) -> dict:
        return {**self.counters, "reading": sorted(self.reading)}

    # ---- commands ---------------------------------------------------------------------

    async def on_command(self, msg: Message) -> None:
        if msg.type == "ReadSource":
            job = msg["job"]
            if job in self.reading and not self.reading[job].done():
                return  # already streaming it (a repeated command)
            if self.stopping is not None and self.stopping.is_set():  # the next loader is told again on Hello
                log.info("%s: stopping: not reading job %s", self.name, job)
                return
            until = _until(msg.get("until"))
            self.files[job] = [str(f) for f in msg["files"]]
            self.reading[job] = asyncio.create_task(self.read(job, self.files[job], msg["block_bytes"], until))
        elif msg.type == "Resend":
            self.spawn(self.resend(msg))
        elif msg.type == "CheckJob":
            self.spawn(self.check_job(msg))
        elif msg.type == "FetchInput":
            remote_inputs.check_fetch(msg)
            self.spawn(remote_inputs.serve_fetch(msg, self.tell))
        else:
            raise BadMessage("unexpected", f"a loader does not take {msg.type}")

    async def read(self, job: str, files: list[str], block_bytes: int, until: tuple[int, int] | None = None) -> None:
        """Every chunk of `files` (of those before `until` = (file, lines): the training rows of
        a job that holds its tail out), from where a previous run of this loader got to. Once
        done, the job is no longer among those it reads (its status), nor its files kept (a
        Resend names them)."""
        try:
            await self._read(job, files, block_bytes, until)
        finally:
            if self.reading.get(job) is asyncio.current_task():
                del self.reading[job]
                self.files.pop(job, None)

    async def _read(self, job: str, files: list[str], block_bytes: int, until: tuple[int, int] | None) -> None:
        error, chunks = "", 0
        last = len(files) - 1 if until is None else until[0]
        try:
            at = await self.cache.get_offset(job)
            if at:
                log.info("%s: job %s: resuming at file %d offset %d (%d chunks sent)", self.name, job,
                         at["file"], at["offset"], at["chunks"])
            file0, offset0, line0, chunks = (at.get("file", 0), at.get("offset", 0), at.get("line", 1),
                                             at.get("chunks", 0))
            for fi in range(file0, last + 1):
                start = (offset0, line0) if fi == file0 else (0, 1)
                limit = until[1] if until is not None and fi == last else None
                chunks = await self.read_file(job, fi, files[fi], block_bytes, start, chunks, limit)
        except JobEnded:
            log.info("%s: job %s has ended; stopped reading its source", self.name, job)
            return
        except (MarianaError, OSError) as e:  # unreadable, not in the format, Redis gone for good
            error = f"{getattr(e, 'filename', None) or ''}{': ' if getattr(e, 'filename', None) else ''}{e}"
            log.error("%s: job %s: reading stopped: %s", self.name, job, error)
        await self.tell("SourceDone", job=job, chunks=chunks, error=error)
        log.info("%s: job %s: source read: %d chunks%s", self.name, job, chunks, f" ({error})" if error else "")

    async def read_file(self, job: str, fi: int, path: str, block_bytes: int, start: tuple[int, int],
                        chunks: int, limit: int | None = None) -> int:
        """Chunks of one file from `start` (offset, line), up to its line `limit` (None: all).
        MarianaError when the file shrank or was replaced meanwhile: a job trained on part of
        the rows, of neither version of the file, was reported done with no word of it."""
        before = os.stat(path)
        with open_binary(path) as f:
            if start[0]:
                f.seek(start[0])
            spans = iter_spans(f, block_bytes, name=path, offset=start[0], line_no=start[1])
            while True:
                t0 = time.perf_counter()
                span = await asyncio.to_thread(next, spans, None)  # reading and gunzip off the loop
                if span is None or (limit is not None and span[1] > limit):
                    _check_unchanged(path, before)
                    return chunks
                offset, first_line, block, lines = span
                if limit is not None and first_line + lines - 1 > limit:  # the chunk the held-out tail starts in
                    lines = limit - first_line + 1
                    offset, block = span_head(offset, block, lines)
                    log.info("%s: job %s: %s stops at line %d (the rest is held out)", self.name, job, path, limit)
                await self.send_chunk(job, fi, path, offset, first_line, block, lines, time.perf_counter() - t0)
                # tests: sent, its offset not recorded (the chunk on the wire first, as a SIGTERM's drain lets it go)
                failpoints.reached("loader.chunk_sent", flush=lambda: self.ctx.destroy(linger=5000))
                chunks += 1
                await self.cache.set_offset(job, {"file": fi, "offset": span_end(offset, block),
                                                  "line": first_line + lines, "chunks": chunks})

    async def send_chunk(self, job: str, fi: int, path: str, offset: int, first_line: int, block: bytes,
                         lines: int, seconds: float = 0.0, announce: bool = True) -> None:
        chunk = f"f{fi}o{offset}"
        if announce:  # the coordinator learns of a chunk before preprocess can report it cached
            if not await self.tell("ChunkSent", job=job, chunk=chunk, file=fi, offset=offset,
                                   length=len(block), first_line=first_line, lines=lines, seconds=seconds):
                raise JobEnded(job)
        await self.push.send_multipart(
            protocol.encode("Chunk", 0, {"data": np.frombuffer(block, np.uint8)}, job=job, chunk=chunk,
                            path=path, first_line=first_line, lines=lines,
                            first_of_file=offset == 0), copy=False)
        self.counters["chunks_sent"] += 1
        self.counters["bytes_sent"] += len(block)

    async def resend(self, msg: Message) -> None:
        job, fi = msg["job"], msg["file"]
        files = self.files.get(job) or [str(f) for f in msg.get("files", [])]
        try:
            path = files[fi]
            block = await asyncio.to_thread(read_span, path, msg["offset"], msg["length"])
        except (IndexError, DataFormatError, OSError) as e:
            log.warning("%s: cannot re-read chunk %s of job %s: %s", self.name, msg["chunk"], job, e)
            await self.tell("SourceDone", job=job, chunks=-1, error=f"chunk {msg['chunk']}: {e}", chunk=msg["chunk"])
            return
        self.counters["chunks_resent"] += 1
        await self.send_chunk(job, fi, path, msg["offset"], msg["first_line"], block, msg["lines"], announce=False)

    async def check_job(self, msg: Message) -> None:
        """CheckJob: the job's files checked here, where they are (coordinator.data_via_loader)."""
        if not isinstance(msg["body"], dict):
            raise BadMessage("field", "CheckJob.body must be a map")
        fields = await asyncio.to_thread(remote_inputs.check_on_loader, msg["body"], self.cfg.worker.count)
        log.info("%s: checked a job's files for the coordinator: %s", self.name, fields["error"] or "ok")
        await self.tell("JobChecked", ticket=msg["ticket"], **fields)

    async def tell(self, type_: str, arrays: dict | None = None, **fields) -> bool:
        """A report the coordinator must get: retried until it answers; False if it refused
        (the job has ended)."""
        while True:
            try:
                await self.coordinator.call(type_, arrays, **fields)
                return True
            except PeerTimeout as e:
                if self.coordinator.closed:  # stopped: the coordinator learns it again from the next loader
                    raise asyncio.CancelledError(f"{type_} not sent: {self.name} is stopping") from None
                timeout_log(log, e)("%s: %s not acknowledged (%s); again", self.name, type_, e)
            except RemoteError as e:
                log.warning("%s: coordinator refused %s: %s", self.name, type_, e)
                return False


def _check_unchanged(path: str, before: os.stat_result) -> None:
    """MarianaError when `path` is not the file, of at least the size, it was when reading began."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino) or now.st_size < before.st_size:
        what = "removed" if now is None else "replaced" if now.st_ino != before.st_ino else \
            f"truncated from {before.st_size:,} to {now.st_size:,} bytes"
        raise MarianaError(f"{path} was {what} while the job read it: its rows are of neither version; train on a "
                           "file that does not change meanwhile (a copy)")
    if now.st_size > before.st_size:  # appended to (a log being written): what was read is whole rows
        log.warning("%s grew from %s to %s bytes while the job read it: rows written after it was read are not in "
                    "the job", path, f"{before.st_size:,}", f"{now.st_size:,}")


def _until(value) -> tuple[int, int] | None:
    """ReadSource.until: [file index, lines], or absent."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise BadMessage("field", f"ReadSource.until must be [file, lines] (integers >= 0), got {value!r:.60}")
    return value[0], value[1]


def main(cfg: ClusterConfig, index: int) -> int:
    return run_service(Loader(cfg, index))
