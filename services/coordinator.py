"""Coordinator: jobs, the batch ledger, counters, and the HTTP API.

A job, read top to bottom (`run_job`):

    StartJob -> every shard                  (tables + optimizer state for the job)
    ReadSource -> loader                     (epoch 1 streams through preprocess into the cache)
    for epoch in 1..E:
        lease steps to workers until every step is done
                                             (lapsed leases re-issued; cache misses refilled from the source)
        reconcile: ShardStats from every shard; replay steps a shard lacks
        epoch += 1                           (epochs >= 2 replay batches from the cache)
    Export <- every shard -> one ModelBundle -> evaluate -> a model version (as in local mode)
    EndJob -> every shard; drop the job's cache keys

Jobs outlive the coordinator: each job and every ledger change it acknowledges
are written to its job store (SQLite, services/jobstore.py) first; a restarted
coordinator reads them back, replays the journal of a running job and goes on
with it (steps done stay done; the shards ignore a step issued twice).

HTTP (loopback by default): GET /healthz, /v1/status, /v1/jobs, /v1/jobs/{id},
/v1/jobs/{id}/history, /v1/models, /metrics, and the web UI at /ui/;
POST /v1/jobs and /v1/jobs/{id}/cancel need `Authorization: Bearer <coordinator.token>`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web
from redis.exceptions import RedisError

from mariana.services import protocol, webui
from mariana.services.runtime import model_events
from mariana.services.assemble import assemble_and_publish, check_request, job_validation, validate_exports
from mariana.services.creative_cache import creative_table, ensure_cached, featurize_creatives
from mariana.services.jobstore import JobStore
from mariana.services.ledger import STAGES, ChunkInfo, JobLedger, parse_step, stage_seconds_of
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime.config import ROLES, ClusterConfig
from mariana.services.runtime.exporter import render_service
from mariana.services.runtime.lifecycle import Service, run_service
from mariana.services.sample_cache import SampleCache, batch_key
from mariana.services.transport import Client, PeerTimeout, RemoteError, Server
from mariana.sparse.errors import ConfigError, MarianaError
from mariana.sparse.metrics import histogram_auc
from mariana.trainer import checkpoint
from mariana.trainer.config import JobConfig, from_dict
from mariana.trainer.strategies.local import best_epoch, valid_record

log = logging.getLogger(__name__)
TICK_SECONDS = 0.25
POINT_SECONDS = 1.0      # a history point of the running job this often
REDIS_STATS_SECONDS = 2.0  # /v1/status's Redis INFO is at most this old
ENDED = ("done", "failed", "cancelled")
# The counter of each role's heartbeat status shown as its throughput: (counter, unit, scale).
RATES = {"worker": ("rows", "rows/s", 1.0), "ps": ("rows_applied", "rows/s", 1.0),
         "preprocess": ("batches", "batches/s", 1.0), "loader": ("bytes_sent", "MB/s", 1e-6)}
MAX_RESENDS = 5
MAX_RECONCILE_ROUNDS = 10


@dataclass
class ServiceInfo:
    role: str
    index: int
    pid: int = 0
    boot: float = 0.0
    peer: bytes = b""
    last_seen: float = 0.0
    status: dict = field(default_factory=dict)
    rate: dict | None = None           # {"value", "unit"}: its throughput between two heartbeats
    sampled: tuple = ()                # (time, counter) of the last heartbeat; last_seen moves with any request

    def alive(self, within: float) -> bool:
        return time.time() - self.last_seen <= within

    def update(self, status: dict, now: float) -> None:
        """A heartbeat's numbers; the throughput from the change of the role's counter."""
        counter, unit, scale = RATES.get(self.role, (None, "", 1.0))
        value = status.get(counter) if counter else None
        if isinstance(value, (int, float)):
            if self.sampled and now - self.sampled[0] > 0.1 and value >= self.sampled[1]:
                self.rate = {"value": round((value - self.sampled[1]) * scale / (now - self.sampled[0]), 2),
                             "unit": unit}
            self.sampled = (now, value)
        self.status, self.last_seen = status, now


@dataclass
class JobRun:
    id: str
    request: dict                  # what was submitted (files, out, epochs, mode, ...)
    spec: dict                     # what services need: {"config": ..., "schema": ...}
    ledger: JobLedger
    state: str = "queued"          # queued -> running -> done | failed | cancelled
    error: str = ""
    submitted: float = field(default_factory=time.time)
    started: float = 0.0
    ended: float = 0.0
    record: dict = field(default_factory=dict)
    baseline: dict = field(default_factory=dict)  # services' bad_messages when the job started
    task: asyncio.Task | None = None
    restarts: int = 0              # coordinator restarts this job lived through
    final: dict | None = None      # the summary's numbers when it ended (an ended job keeps no ledger)
    last_point: tuple | None = None  # (t, rows, loss_sum, hist) at the last history point
    phase: str | None = None       # what a running job does after its epochs ("evaluating on test.tsv")
    best_export: tuple | None = None  # (epoch, valid logloss, the shards' exports) of the best epoch so far

    def summary(self) -> dict:
        out = {"id": self.id, "state": self.state, "error": self.error, "submitted": self.submitted,
               "started": self.started, "ended": self.ended, "model": self.request.get("model"),
               "mode": self.request.get("mode"), "data": self.request.get("data"), "restarts": self.restarts,
               "phase": self.phase if self.state == "running" else None}
        if self.final is not None:
            out.update(progress=self.final["progress"], cache=self.final["cache"])
        else:
            out.update(progress=self.ledger.progress(), cache=self.ledger.cache_stats())
        if self.record:
            out["record"] = self.record
        return out

    def epochs(self) -> list[dict]:
        return self.final["epochs"] if self.final is not None else self.ledger.epoch_summaries

    def to_saved(self) -> dict:
        """What the job store keeps of the job (the ledger is its journal)."""
        s = self.summary()
        return {"id": self.id, "request": self.request, "spec": self.spec, "state": self.state,
                "error": self.error, "submitted": self.submitted, "started": self.started, "ended": self.ended,
                "record": self.record, "restarts": self.restarts, "data_bytes": self.ledger.data_bytes,
                "final": {"progress": s["progress"], "cache": s["cache"], "epochs": self.epochs()}}

    @classmethod
    def from_saved(cls, d: dict) -> "JobRun":
        spec, request = d["spec"], d["request"]
        ledger = job_ledger(d["id"], request, spec, d.get("data_bytes", 0))
        run = cls(d["id"], request, spec, ledger, state=d["state"], error=d["error"], submitted=d["submitted"],
                  started=d["started"], ended=d["ended"], record=d.get("record") or {},
                  restarts=d.get("restarts", 0))
        if run.state in ENDED:
            run.final = d["final"]
        return run


class Coordinator(Service):
    role = "coordinator"

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        super().__init__(cfg, index)
        self.services: dict[str, ServiceInfo] = {}
        self.jobs: dict[str, JobRun] = {}
        self.queue: asyncio.Queue | None = None
        self.shards: list[Client] = []
        self.server: Server | None = None
        self.cache: SampleCache | None = None
        self.runner: web.AppRunner | None = None
        self.store: JobStore | None = None
        self.wake = asyncio.Event()
        self._redis_stats: tuple[float, dict] = (float("-inf"), {})

    # ---- life -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.store = JobStore(self.cfg.coordinator_state_dir)
        self.restore()  # before any service can report on a job
        self.server = Server(self.ctx, self.cfg.coordinator.endpoint, self.handle, self.counters,
                             max_bytes=self.cfg.cluster.max_message_bytes, name=self.name)
        self.shards = [Client(self.ctx, ep, self.counters, timeout=30.0) for ep in self.cfg.ps.endpoints]
        self.cache = SampleCache(self.cfg, self.counters)
        self.runner = web.AppRunner(self.http_app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.coordinator.http_host, self.cfg.coordinator.http_port)
        await site.start()
        self.services[self.name] = ServiceInfo(self.role, 0, os.getpid(), self.boot, last_seen=time.time())
        log.info("%s: ZeroMQ at %s, HTTP at http://%s:%d", self.name, self.cfg.coordinator.endpoint,
                 self.cfg.coordinator.http_host, self.cfg.coordinator.http_port)

    def restore(self) -> None:
        """Jobs from the job store: ended ones as they were, queued ones queued again, and a
        running one rebuilt from its journal, to go on where it was."""
        for saved in self.store.load_jobs():
            run = JobRun.from_saved(saved)
            self.jobs[run.id] = run
            if run.state == "running":
                run.restarts += 1
                events = 0
                for kind, data in self.store.events(run.id):
                    run.ledger.apply(kind, data)
                    events += 1
                led = run.ledger
                log.info("%s: job %s resumed from %d journal events: epoch %d/%d, %d steps done, source %s",
                         self.name, run.id, events, led.epoch, led.epochs, len(led.done),
                         "read" if led.source_done else "being read")
                self.save(run)
            if run.state in ("queued", "running"):
                self.queue.put_nowait(run.id)
        if self.jobs:
            log.info("%s: %d jobs in %s", self.name, len(self.jobs), self.store.path)

    def journal(self, run: JobRun, kind: str, data: dict):
        """A ledger change, recorded before it is acknowledged; returns what the ledger did
        (False: nothing new). Raises ValueError for a bad event, changing nothing."""
        changed = run.ledger.apply(kind, data)
        if changed is not False:
            self.store.append(run.id, kind, data)
        return changed

    def save(self, run: JobRun) -> None:
        self.store.save_job(run.id, run.to_saved(), run.submitted)

    def ended(self, run: JobRun) -> None:
        """A job reached done, failed or cancelled: freeze its numbers, keep its history,
        drop its journal."""
        self.add_point(run)
        run.final = run.to_saved()["final"]
        self.save(run)
        self.store.drop_events(run.id)

    async def main(self) -> None:
        ticker = asyncio.create_task(self.tick())
        try:
            while True:
                run = self.jobs[await self.queue.get()]
                if run.state not in ("queued", "running") or run.task is not None:
                    continue
                run.task = asyncio.create_task(self.run_job(run))
                await asyncio.gather(run.task, return_exceptions=True)
        finally:
            ticker.cancel()

    async def drain(self) -> None:
        await self.server.drain(timeout=2.0)

    async def close(self) -> None:
        for run in self.jobs.values():
            if run.task and not run.task.done():
                run.task.cancel()
        for run in self.jobs.values():
            if run.task:
                await asyncio.gather(run.task, return_exceptions=True)
        if self.runner:
            await self.runner.cleanup()
        for c in self.shards:
            c.close()
        if self.cache:
            await self.cache.close()
        if self.server:
            self.server.close()
        if self.store:
            self.store.close()

    def pulse(self) -> None:
        """Wake every held lease: steps became ready or a worker finished one."""
        self.wake.set()
        self.wake = asyncio.Event()

    # ---- ZeroMQ requests ------------------------------------------------------------------

    async def handle(self, peer: bytes, msg: Message) -> list | None:
        handler = getattr(self, f"on_{msg.type}", None)
        if handler is None:
            raise BadMessage("unexpected", f"the coordinator does not take {msg.type}")
        return await handler(peer, msg)

    async def on_Hello(self, peer: bytes, msg: Message) -> list:
        role, index = msg["role"], msg["index"]
        if role not in ROLES or role == "coordinator" or not 0 <= index < self.cfg.count(role):
            raise BadMessage("hello", f"no {role!r} #{index} in this cluster's config")
        name = f"{role}-{index}"
        info = self.services.get(name)
        restarted = info is not None and info.boot != msg.get("boot")
        if info is None or restarted:
            info = self.services[name] = ServiceInfo(msg["role"], msg["index"])
            log.info("%s: %s %s (pid %s)", self.name, name, "restarted" if restarted else "registered",
                     msg.get("pid"))
        info.pid, info.boot, info.peer = msg.get("pid", 0), msg.get("boot", 0.0), peer
        info.update(msg.get("status") if isinstance(msg.get("status"), dict) else {}, time.time())
        if restarted:
            self.spawn(self.rejoin(info))
        return protocol.encode("Welcome", msg.msg_id, boot=self.boot)

    async def on_Lease(self, peer: bytes, msg: Message) -> list:
        """Up to `want` steps at once (one round trip per few steps); the steps the worker
        finished since its last Lease ride along in `done`, recorded before anything is leased."""
        worker, want = msg["worker"], msg.get("want", 1)
        if not isinstance(want, int) or isinstance(want, bool) or not 1 <= want <= protocol.MAX_LEASE:
            raise BadMessage("field", f"Lease.want must be an integer in [1, {protocol.MAX_LEASE}], got {want!r:.40}")
        self.touch(worker)
        self.record_reports(worker, msg.get("done", []), "Lease.done")
        deadline = time.monotonic() + 1.0  # held up to a second: no busy polling
        while True:
            run = self.active()
            if run is None:
                return protocol.encode("Idle", msg.msg_id)
            led, items = run.ledger, []
            active = self.active_workers()
            while len(items) < want and led.may_lease(worker, active):
                step = led.lease(worker, self.cfg.coordinator.lease_seconds)
                if step is None:
                    break
                epoch, batch = parse_step(step)
                chunk, k = batch.rsplit(":", 1)
                items.append({"job": run.id, "epoch": epoch, "step": step, "key": batch_key(run.id, chunk, int(k)),
                              "rows": led.batch_rows.get(batch, 0)})
            if items:
                more = {"more": items[1:]} if len(items) > 1 else {}
                return protocol.encode("Work", msg.msg_id, **items[0], **more)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return protocol.encode("Wait", msg.msg_id)
            try:
                await asyncio.wait_for(self.wake.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def on_Done(self, peer: bytes, msg: Message) -> list:
        """Steps done (sent at once while a Lease is held, or when the worker stops), and
        `released`: steps a stopping worker hands back untrained, issued again at once."""
        worker, released = msg["worker"], msg.get("released", [])
        if not isinstance(released, list) or not all(isinstance(s, str) for s in released):
            raise BadMessage("field", "Done.released must be a list of step ids")
        self.touch(worker)
        self.record_reports(worker, msg["reports"], "Done.reports")
        run = self.active()
        if released and run is not None and run.ledger.release(released, worker):
            log.info("%s: %s handed back %d steps", self.name, worker, len(released))
            self.pulse()
        return protocol.encode("Ok", msg.msg_id)

    def record_reports(self, worker: str, reports, where: str) -> None:
        """Steps a worker finished, journaled (one commit per message) before the reply.
        Reports of a job that is no longer running change nothing and are counted. A bad
        report is refused (BadMessage) after the good ones before it are recorded: the
        others' leases lapse and they are trained again, which the shards ignore."""
        if not isinstance(reports, list):
            raise BadMessage("field", f"{where} must be a list, got {type(reports).__name__}")
        events: dict[str, list[dict]] = {}
        try:
            for i, report in enumerate(reports):
                r = protocol.check_record("Report", report, f"{where}[{i}]")
                run = self.jobs.get(r["job"])
                if run is None or run.state != "running":
                    self.counters["late_reports"] += 1
                    continue
                stats = r["stats"]
                try:  # the journal gets numbers, never what a peer sent in their place
                    times = stage_seconds_of(stats.get("times") or {})
                except ValueError as e:
                    raise BadMessage("field", f"{where}[{i}]: {e}") from None
                event = {"step": r["step"], "worker": worker, "rows": r["rows"], "loss_sum": float(r["loss_sum"]),
                         "times": times, "hist": stats.get("hist")}
                try:
                    if run.ledger.apply("done", event):
                        events.setdefault(run.id, []).append(event)
                except ValueError as e:
                    raise BadMessage("step", f"{where}[{i}]: {e}") from None
        finally:
            for job, done in events.items():
                self.store.append_many(job, "done", done)
            if events:
                self.pulse()

    async def on_Miss(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg)
        try:
            chunk = run.ledger.missed(msg["step"])
        except ValueError as e:
            raise BadMessage("step", str(e)) from None
        log.info("%s: job %s: %s not in the cache; chunk %s to be read again", self.name, run.id, msg["step"],
                 chunk or "(already asked)")
        await self.pump_refills(run)
        self.pulse()
        return protocol.encode("Ok", msg.msg_id)

    async def on_GetJob(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg, running=False)
        return protocol.encode("JobSpec", msg.msg_id, job=run.id, spec=run.spec)

    async def on_ChunkSent(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg)
        c = ChunkInfo(msg["chunk"], msg["file"], msg["offset"], msg["length"], msg["first_line"], msg["lines"])
        self.journal(run, "sent", JobLedger.chunk_event(c, float(msg["seconds"])))
        return protocol.encode("Ok", msg.msg_id)

    async def on_SourceDone(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg)
        if msg["error"] and msg.get("chunk"):  # one chunk could not be read again
            self.journal(run, "lost", {"chunk": msg["chunk"]})
            log.warning("%s: job %s: chunk %s lost: %s", self.name, run.id, msg["chunk"], msg["error"])
            await self.pump_refills(run)
        elif msg["error"]:
            self.fail(run, f"reading the source: {msg['error']}")
        else:
            self.journal(run, "source_done", {"chunks": msg["chunks"]})
            log.info("%s: job %s: source read (%d chunks)", self.name, run.id, msg["chunks"])
        self.pulse()
        return protocol.encode("Ok", msg.msg_id)

    async def on_Cached(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg)
        if msg.get("error"):
            self.fail(run, msg["error"])
            return protocol.encode("Ok", msg.msg_id)
        led = run.ledger
        known = len(led.batches)
        try:
            if not all(isinstance(b, list) and len(b) == 2 for b in msg["batches"]):
                raise ValueError("batches")
            cached = self.journal(run, "cached", {"chunk": msg["chunk"], "batches": msg["batches"],
                                                  "stats": _numbers(msg["stats"])})
        except (TypeError, ValueError):
            raise BadMessage("cached", "Cached.batches must be [[k, rows], ...] and stats numbers") from None
        if cached:
            await self.pump_refills(run)
            self.pulse()
        # Back-pressure: hold the reply (and so that preprocess) while workers lag behind
        # new batches; a refill is answered at once (the epoch's queue is long by design).
        while len(led.batches) > known and len(led.ready) >= self.cfg.coordinator.max_ready \
                and run.state == "running":
            await asyncio.sleep(0.01)
        return protocol.encode("Ok", msg.msg_id)

    # ---- helpers for requests ------------------------------------------------------------

    def job_of(self, msg: Message, running: bool = True) -> JobRun:
        """The job a message names; reports about a job that has ended are refused (and change nothing)."""
        run = self.jobs.get(msg["job"])
        if run is None:
            raise MarianaError(f"no job {msg['job']!r}")
        if running and run.state != "running":
            raise MarianaError(f"job {run.id} is {run.state}; {msg.type} ignored")
        return run

    def active(self) -> JobRun | None:
        for run in self.jobs.values():
            if run.state == "running" and run.ledger.epoch <= run.ledger.epochs:
                return run
        return None

    def touch(self, worker: str) -> None:
        info = self.services.get(worker)
        if info is not None:
            info.last_seen = time.time()

    def active_workers(self) -> set[str]:
        within = self.cfg.coordinator.heartbeat_seconds
        return {n for n, s in self.services.items() if s.role == "worker" and s.alive(within)}

    def peer_of(self, role: str, index: int = 0) -> bytes | None:
        info = self.services.get(f"{role}-{index}")
        return info.peer if info else None

    async def command(self, role: str, type_: str, **fields) -> bool:
        """A command to a service that connected to us (the loader)."""
        peer = self.peer_of(role)
        if peer is None:
            return False
        self.server.send(peer, protocol.encode(type_, 0, **fields))
        return True

    async def rejoin(self, info: ServiceInfo) -> None:
        """A service (re)started while a job runs: give it the job again."""
        run = self.active()
        if run is None:
            return
        if info.role == "ps":
            await self.start_shard(run, info.index)
        elif info.role == "loader" and not run.ledger.source_done and run.ledger.epoch == 1:
            await self.read_source(run)

    async def pump_refills(self, run: JobRun) -> None:
        """Read missed chunks again, a few at a time (two per preprocess instance)."""
        for c in run.ledger.next_refills(2 * self.cfg.preprocess.count):
            await self.send_resend(run, c)

    async def resend(self, run: JobRun, c: ChunkInfo) -> None:
        run.ledger.chunk_resent(c)
        await self.send_resend(run, c)

    async def send_resend(self, run: JobRun, c: ChunkInfo) -> None:
        await self.command("loader", "Resend", job=run.id, chunk=c.id, file=c.file, offset=c.offset,
                           length=c.length, first_line=c.first_line, lines=c.lines, files=run.request["data"])

    # ---- periodic work ------------------------------------------------------------------------

    async def tick(self) -> None:
        last_point = 0.0
        while True:
            await asyncio.sleep(TICK_SECONDS)
            run = self.active()
            if run is None:
                continue
            try:
                await self.tick_job(run)
                if time.monotonic() - last_point >= POINT_SECONDS:
                    last_point = time.monotonic()
                    self.add_point(run)
                    self.save(run)
            except Exception:  # a bug here must not stop leases from lapsing for good
                log.exception("%s: job %s: periodic check failed", self.name, run.id)

    def add_point(self, run: JobRun) -> None:
        """A history point: rows, rows/s, and the loss and progressive AUC of the steps
        done since the previous point."""
        led, now = run.ledger, time.time()
        rows = sum(led.rows_done.values())
        loss = sum(led.loss_sum.values())
        hist = sum(led.hist.values()) if led.hist else None
        t0, rows0, loss0, hist0 = run.last_point or (run.started or now, 0, 0.0, None)
        run.last_point = (now, rows, loss, hist)
        if rows == rows0 and run.state == "running":
            return  # nothing new: no flat stretch of points while the job waits
        d_hist = None if hist is None else hist - (0 if hist0 is None else hist0)
        d_rows = rows - rows0
        self.store.add_point(run.id, {
            "t": round(now, 3), "epoch": min(led.epoch, led.epochs), "rows_total": rows,
            "rows_per_s": round(d_rows / max(now - t0, 1e-9), 1),
            "loss": (loss - loss0) / d_rows if d_rows > 0 else None,
            "auc": histogram_auc(d_hist[0], d_hist[1]) if d_hist is not None and d_rows > 0 else None})

    async def tick_job(self, run: JobRun) -> None:
        for step, worker in run.ledger.expire_leases():
            log.warning("%s: job %s: lease of %s by %s lapsed; issuing it again", self.name, run.id,
                        step, worker)
            self.pulse()
        for c in run.ledger.chunks_overdue(self.cfg.coordinator.chunk_seconds):
            if c.resends >= MAX_RESENDS:
                self.journal(run, "lost", {"chunk": c.id})
                log.error("%s: job %s: chunk %s never cached after %d tries; lost", self.name, run.id,
                          c.id, c.resends)
                await self.pump_refills(run)
                self.pulse()
                continue
            log.warning("%s: job %s: chunk %s not cached after %.0fs; reading it again", self.name,
                        run.id, c.id, self.cfg.coordinator.chunk_seconds)
            await self.resend(run, c)

    # ---- a job, top to bottom -------------------------------------------------------------

    async def run_job(self, run: JobRun) -> None:
        led = run.ledger
        run.baseline = self.bad_message_counts()
        if run.state == "running":  # restored from the journal after a restart
            log.info("%s: job %s goes on at epoch %d (restart %d)", self.name, run.id, led.epoch, run.restarts)
        else:
            run.state, run.started = "running", time.time()
            self.journal(run, "start", {"t": run.started})
            self.save(run)
            log.info("%s: job %s started: %s, %d epochs, mode %s, data %s%s%s", self.name, run.id,
                     run.request["model"], led.epochs, run.request["mode"], ",".join(run.request["data"]),
                     f" (validation: {run.request['holdout']['source']})" if run.request.get("holdout") else "",
                     f", warm start from {run.request['init_from']}" if run.request.get("init_from") else "")
        try:
            if run.spec["config"].get("images", {}).get("creatives") and "images" not in run.spec:
                await self.prepare_images(run)  # before any shard or preprocess reads the spec
            for i in range(len(self.shards)):
                await self.start_shard(run, i)
            if not led.source_done:
                await self.read_source(run)  # a loader that is reading it already goes on
            while led.epoch <= led.epochs:
                await self.until(run, led.epoch_complete)
                await self.reconcile(run)
                log.info("%s: job %s: epoch %d done: %d rows, %.2fs", self.name, run.id, led.epoch,
                         led.rows_done[led.epoch], time.time() - led.epoch_started)
                epoch, valid = led.epoch, None
                if job_validation(run.request):  # the workers wait: the export is of this epoch alone
                    valid = await self.validate(run)
                    if self.stop_early(run, valid):
                        self.journal(run, "stop", {"epochs": epoch})
                self.journal(run, "epoch", {"t": time.time()})
                if valid is not None:
                    self.journal(run, "valid", {"epoch": epoch, "metrics": valid})
                self.pulse()
            await self.finish(run)
        except JobStopped:
            pass
        except (MarianaError, OSError) as e:
            self.fail(run, str(e))
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                self.fail(run, "the coordinator stopped")
            else:  # left running in the job store: it goes on when the coordinator starts again
                log.info("%s: job %s left running at epoch %d; it resumes when the coordinator starts",
                         self.name, run.id, led.epoch)
            raise
        except Exception as e:  # a bug: the job fails visibly instead of staying "running"
            log.exception("%s: job %s: unexpected error", self.name, run.id)
            self.fail(run, f"internal error: {type(e).__name__}: {e}")
        finally:
            if run.state != "done" and run.state != "running":
                await self.cleanup(run)

    async def until(self, run: JobRun, cond) -> None:
        while not cond():
            if run.state != "running":
                raise JobStopped()
            try:
                await asyncio.wait_for(self.wake.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def start_shard(self, run: JobRun, i: int) -> None:
        delay = 0.2
        while run.state == "running":
            try:
                await self.shards[i].call("StartJob", job=run.id, spec=run.spec, timeout=10.0)
                return
            except RemoteError as e:  # the shard is up and refuses the job: retrying will not help
                raise MarianaError(f"shard {i} cannot start the job: {e}") from None
            except PeerTimeout as e:
                log.warning("%s: job %s: shard %d not ready: %s", self.name, run.id, i, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def read_source(self, run: JobRun) -> None:
        """Tell the loader to read the job's files (but a held-out tail: `until`, where it starts)."""
        until = {"until": run.request["holdout"]["until"]} if run.request.get("holdout") else {}
        while not await self.command("loader", "ReadSource", job=run.id, files=run.request["data"],
                                     block_bytes=run.spec["config"]["data"]["block_bytes"], **until):
            if run.state != "running":
                raise JobStopped()
            await asyncio.sleep(0.2)  # the loader has not registered yet

    async def reconcile(self, run: JobRun) -> None:
        """Every shard must have applied every step so far; replay what one lacks."""
        led = run.ledger
        for _ in range(MAX_RECONCILE_ROUNDS):
            expected = led.expected_steps() - led.lost
            missing: set[str] = set()
            for i in range(len(self.shards)):
                stats = await self.shard_call(run, i, "ShardStats")
                if "applied" not in stats.arrays:
                    raise MarianaError(f"shard {i} answered ShardStats without its applied steps")
                missing |= expected - set(protocol.array_names(stats.arrays["applied"]))
            if not missing:
                return
            n = len(missing & led.done)
            self.journal(run, "replay", {"steps": sorted(missing)})
            log.warning("%s: job %s: shards lack %d steps (restored from a checkpoint); replaying",
                        self.name, run.id, n)
            self.pulse()
            await self.until(run, led.epoch_complete)
        raise MarianaError(f"job {run.id}: shards still lack steps after {MAX_RECONCILE_ROUNDS} replays")

    async def shard_call(self, run: JobRun, i: int, type_: str, **fields) -> Message:
        """A request to shard i for this job, retried while the shard restarts."""
        delay = 0.2
        while True:
            if run.state != "running":
                raise JobStopped()
            try:
                return await self.shards[i].call(type_, job=run.id, **fields, timeout=60.0)
            except (PeerTimeout, RemoteError) as e:
                log.warning("%s: job %s: shard %d: %s: %s", self.name, run.id, i, type_, e)
                if isinstance(e, RemoteError):
                    if e.code != "UnknownJob":
                        raise MarianaError(f"shard {i} refused {type_}: {e}") from None
                    await self.start_shard(run, i)  # it restarted: give it the job (it restores)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def prepare_images(self, run: JobRun) -> None:
        """The featurizer stage's batch job: embed the creatives not cached in Redis yet,
        and name their cache in the spec that preprocess, workers and shards read."""
        cfg = from_dict(JobConfig, run.spec["config"]).images
        log.info("%s: job %s: image features of %s", self.name, run.id, cfg.creatives)
        info = await featurize_creatives(self.cache, cfg, self.counters)
        info.pop("ids")
        run.spec["images"] = {"redis_key": info["redis_key"], "dim": info["dim"], "field": cfg.field,
                              "set": info["set"], "info": info}
        self.save(run)

    async def image_table(self, run: JobRun):
        """The job's creatives that have cached features: the table its model version stores."""
        if "images" not in run.spec:
            return None
        from mariana.trainer.images import load_creative_set

        img, cfg = run.spec["images"], from_dict(JobConfig, run.spec["config"]).images
        await ensure_cached(self.cache, cfg, img["redis_key"], img["set"], self.counters)  # Redis may have restarted
        cset = await asyncio.to_thread(load_creative_set, cfg.creatives)
        return await creative_table(self.cache, img["redis_key"], int(img["dim"]), cset.ids)

    async def validate(self, run: JobRun) -> dict:
        """Score the model as it stands after this epoch on the job's validation rows (its
        valid_data files, or the tail of its data it holds out); keep the shards' export of the
        best epoch so far (`epochs = "auto"` publishes it)."""
        led, valid = run.ledger, job_validation(run.request)
        names = valid.source if valid.rows else ", ".join(os.path.basename(p) for p in valid.paths)
        self.set_phase(run, f"validating epoch {led.epoch} on {names}")
        exports = [(await self.shard_call(run, i, "Export")).arrays for i in range(len(self.shards))]
        images = await self.image_table(run)
        metrics = await asyncio.to_thread(validate_exports, run.spec, exports, images, valid)
        run.phase = None
        best = run.best_export
        if metrics["logloss"] is not None and (best is None or metrics["logloss"] < best[1]):
            run.best_export = (led.epoch, metrics["logloss"], exports)
        log.info("%s: job %s: epoch %d: valid logloss %s, auc %s", self.name, run.id, led.epoch,
                 metrics["logloss"], metrics["auc"])
        return metrics

    def stop_early(self, run: JobRun, valid: dict) -> bool:
        """`epochs = "auto"`: no better validation logloss for `train.patience` epochs."""
        train = from_dict(JobConfig, run.spec["config"]).train
        if not train.auto:
            return False
        losses = [(s.get("valid") or {}).get("logloss") for s in run.ledger.epoch_summaries] + [valid["logloss"]]
        best = best_epoch(losses)
        return bool(best) and len(losses) - best >= train.patience

    def kept_export(self, run: JobRun, exports: list) -> tuple[list, dict | None]:
        """(the exports to publish, the validation record): with `epochs = "auto"`, the best
        epoch's, when this coordinator still holds them."""
        led, valid = run.ledger, job_validation(run.request)
        if valid is None:
            return exports, None
        train = from_dict(JobConfig, run.spec["config"]).train
        epochs = [{"epoch": s["epoch"], **s["valid"], "train_loss": s.get("loss")}
                  for s in led.epoch_summaries if s.get("valid")]
        best = best_epoch([e.get("logloss") for e in epochs])
        kept = "last"
        if train.auto and best and best != led.epochs:
            if run.best_export is not None and run.best_export[0] == best:
                exports, kept = run.best_export[2], "best"
            else:
                kept = "last (the best epoch's tables were lost when the coordinator restarted)"
        elif train.auto:
            kept = "best"
        return exports, valid_record(valid.source, epochs, best, kept, train.auto, train.patience,
                                     train.max_epochs)

    async def finish(self, run: JobRun) -> None:
        led = run.ledger
        self.set_phase(run, f"exporting the tables of {len(self.shards)} shard(s)")
        applied = [(await self.shard_call(run, i, "ShardStats"))["rows"] for i in range(len(self.shards))]
        exports = [(await self.shard_call(run, i, "Export")).arrays for i in range(len(self.shards))]
        exports, valid = self.kept_export(run, exports)
        run.best_export = None
        images = await self.image_table(run)
        train_seconds = time.time() - run.started
        record = await asyncio.to_thread(assemble_and_publish, run.request, run.spec, exports, led,
                                         len(self.shards), train_seconds, images,
                                         lambda text: self.set_phase(run, text), valid)
        rows_applied = [min(int(a.get(str(e), 0)) for a in applied) for e in range(1, led.epochs + 1)]
        record.update({
            "rows_applied": sum(rows_applied),
            "rows_applied_per_epoch": rows_applied,
            "rows_in_data": led.counters["rows_in_data"],
            "rows_lost": sum(led.batch_rows.get(parse_step(s)[1], 0) for s in led.lost),
            "lines_lost": led.counters["lines_lost"],
            "batches_reissued": led.counters["batches_reissued"],
            "batches_replayed": led.counters["batches_replayed"],
            "cache_hits": led.counters["cache_hits"],
            "cache_misses": led.counters["cache_misses"],
            "bad_messages": self.bad_messages_since(run.baseline),
            "stage_seconds": {s: round(led.stage_seconds[s], 3) for s in STAGES},
            "mode": run.request["mode"], "staleness": led.staleness,
            "workers": self.cfg.worker.count, "ps": self.cfg.ps.count,
            "preprocess": self.cfg.preprocess.count, "job": run.id,
        })
        if run.state != "running":  # cancelled while the model was being assembled
            raise JobStopped()
        await self.cleanup(run)  # a job reported done holds nothing any more (shards, cached batches)
        run.record, run.state, run.ended = record, "done", time.time()
        self.ended(run)
        log.info("%s: job %s done: %s/%s, %d rows applied of %d x %d epochs, auc %s", self.name, run.id,
                 record["model_dir"], record["model_version"], record["rows_applied"],
                 record["rows_in_data"], led.epochs, record.get("auc"))
        await self.announce(record)

    def set_phase(self, run: JobRun, text: str) -> None:
        """What the job does once its epochs are done (status, the web UI and the CLI show it);
        called from the publishing thread too (one attribute store)."""
        run.phase = text
        log.info("%s: job %s: %s", self.name, run.id, text)

    async def announce(self, record: dict) -> None:
        """Tell model servers (Redis pub/sub) that a version was written."""
        promoted = record.get("promoted", True)
        await model_events.publish_async(self.cache.redis, "trained" if promoted else "candidate",
                                         record["model_dir"], record["model_version"],
                                         record["model_version"] if promoted else None)

    async def cleanup(self, run: JobRun) -> None:
        timeout = 2.0 if self.stopping.is_set() else 10.0  # shutting down: do not outwait the drain
        for i, shard in enumerate(self.shards):
            try:
                await shard.call("EndJob", job=run.id, timeout=timeout)
            except (PeerTimeout, RemoteError) as e:
                log.warning("%s: job %s: EndJob on shard %d: %s", self.name, run.id, i, e)
        try:
            await self.cache.drop_job(run.id)
        except MarianaError as e:
            log.warning("%s: job %s: could not drop cached batches: %s", self.name, run.id, e)
        self.pulse()

    def fail(self, run: JobRun, error: str) -> None:
        if run.state in ("done", "failed", "cancelled"):
            return
        run.state, run.error, run.ended = "failed", error, time.time()
        log.error("%s: job %s failed: %s", self.name, run.id, error)
        self.ended(run)
        self.pulse()

    def bad_message_counts(self) -> dict:
        counts = {n: int(s.status.get("bad_messages", 0)) for n, s in self.services.items() if n != self.name}
        counts[self.name] = self.counters["bad_messages"]
        return counts

    def bad_messages_since(self, baseline: dict) -> int:
        now = self.bad_message_counts()
        # a restarted service counts from zero again: never subtract more than it has
        return sum(max(0, n - baseline.get(name, 0)) if n >= baseline.get(name, 0) else n
                   for name, n in now.items())

    # ---- HTTP -------------------------------------------------------------------------------

    def http_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/healthz", lambda r: web.json_response({"ok": True}))
        app.router.add_get("/v1/status", self.http_status)
        app.router.add_get("/v1/jobs", self.http_jobs)
        app.router.add_get("/v1/jobs/{id}", self.http_job)
        app.router.add_get("/v1/jobs/{id}/history", self.http_history)
        app.router.add_get("/v1/models", self.http_models)
        app.router.add_post("/v1/jobs", self.http_submit)
        app.router.add_post("/v1/jobs/{id}/cancel", self.http_cancel)
        app.router.add_get("/metrics", self.http_metrics)
        webui.add_routes(app)  # GET / and /ui/: the web UI of jobs and models
        return app

    def status_dict(self) -> dict:
        self.services[self.name].last_seen = time.time()
        self.services[self.name].status = dict(self.counters)
        within = self.cfg.coordinator.heartbeat_seconds
        return {"services": {n: {"role": s.role, "index": s.index, "pid": s.pid, "alive": s.alive(within),
                                 "last_seen": s.last_seen, "status": s.status,
                                 "rate": s.rate if s.alive(within) else None}
                             for n, s in sorted(self.services.items())},
                "jobs": self.job_summaries(),
                "counters": dict(self.counters)}

    def job_summaries(self) -> list[dict]:
        """Newest first."""
        return [r.summary() for r in sorted(self.jobs.values(), key=lambda r: (r.submitted, r.id), reverse=True)]

    async def http_status(self, request: web.Request) -> web.Response:
        return web.json_response({**self.status_dict(), "redis": await self.redis_stats()})

    async def redis_stats(self) -> dict:
        """The sample cache's Redis as its INFO says: hit rate of reads, memory, keys.
        Asked at most every REDIS_STATS_SECONDS: each open web UI polls /v1/status every second."""
        at, stats = self._redis_stats
        if time.monotonic() - at < REDIS_STATS_SECONDS:
            return stats
        stats = await self._read_redis_stats()
        self._redis_stats = (time.monotonic(), stats)
        return stats

    async def _read_redis_stats(self) -> dict:
        try:
            info = await asyncio.wait_for(self.cache.redis.info(), 1.0)
        except (asyncio.TimeoutError, OSError, RedisError) as e:
            return {"up": False, "error": str(e) or type(e).__name__}
        hits, misses = info.get("keyspace_hits", 0), info.get("keyspace_misses", 0)
        return {"up": True, "hits": hits, "misses": misses,
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                "used_memory": info.get("used_memory"), "keys": sum(
                    v.get("keys", 0) for k, v in info.items() if k.startswith("db") and isinstance(v, dict))}

    async def http_jobs(self, request: web.Request) -> web.Response:
        return web.json_response({"jobs": self.job_summaries()})

    def job_or_404(self, request: web.Request) -> JobRun:
        run = self.jobs.get(request.match_info["id"])
        if run is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no job {request.match_info['id']!r}"}),
                                   content_type="application/json")
        return run

    async def http_job(self, request: web.Request) -> web.Response:
        return web.json_response(self.job_or_404(request).summary())

    async def http_history(self, request: web.Request) -> web.Response:
        run = self.job_or_404(request)
        try:
            since = float(request.query.get("since", 0))
        except ValueError:
            return _bad_request(f"since must be a number (unix seconds), got {request.query['since']!r}")
        return web.json_response({"job": run.id, "points": self.store.points(run.id, since),
                                  "epochs": run.epochs()})

    async def http_models(self, request: web.Request) -> web.Response:
        dirs = list(dict.fromkeys([*self.cfg.coordinator.model_dirs,
                                   *(r.record.get("model_dir") or r.request.get("out") for r in self.jobs.values())]))
        models = await asyncio.to_thread(lambda: [checkpoint.overview(d) for d in dirs if d])
        return web.json_response({"models": [m for m in models if m is not None]})

    def authorize(self, request: web.Request) -> None:
        token = self.cfg.coordinator.token
        if not token:
            return
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise web.HTTPUnauthorized(text=json.dumps({"error": "a valid bearer token is required"}),
                                       content_type="application/json")

    async def http_submit(self, request: web.Request) -> web.Response:
        self.authorize(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _bad_request("the body must be a JSON object")
        try:
            run = await asyncio.to_thread(self.new_job, body)  # probes the files: off the loop
        except (ConfigError, MarianaError, OSError) as e:
            return _bad_request(str(e) if not isinstance(e, OSError) else f"{e.filename}: {e.strerror}")
        self.jobs[run.id] = run
        self.save(run)
        self.queue.put_nowait(run.id)
        log.info("%s: job %s submitted (%s, %d epochs)", self.name, run.id, run.request["model"], run.ledger.epochs)
        return web.json_response({"job": run.id, "state": run.state}, status=201)

    async def http_cancel(self, request: web.Request) -> web.Response:
        self.authorize(request)
        run = self.jobs.get(request.match_info["id"])
        if run is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "no such job"}), content_type="application/json")
        if run.state in ("queued", "running"):
            run.state, run.ended, run.error = "cancelled", time.time(), "cancelled by request"
            log.info("%s: job %s cancelled", self.name, run.id)
            self.ended(run)
            self.pulse()
        return web.json_response(run.summary())

    async def http_metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.prometheus(), content_type="text/plain")

    def prometheus(self) -> str:
        """Its own counters as every service renders them (role and index labels), then the
        cluster's: which services are up, jobs by state, the active job's progress."""
        own = render_service(self.role, self.index, self.counters, {}, self.boot)
        lines = []
        within = self.cfg.coordinator.heartbeat_seconds
        lines.append("# TYPE mariana_service_up gauge")
        for n, s in sorted(self.services.items()):
            lines.append(f'mariana_service_up{{service="{n}",role="{s.role}"}} {int(s.alive(within))}')
        lines.append("# TYPE mariana_jobs gauge")
        states = Counter(r.state for r in self.jobs.values())
        for state in ("queued", "running", "done", "failed", "cancelled"):
            lines.append(f'mariana_jobs{{state="{state}"}} {states[state]}')
        run = self.active()
        if run is not None:
            p = run.ledger.progress()
            lines += ["# TYPE mariana_job_rows_per_second gauge",
                      f'mariana_job_rows_per_second{{job="{run.id}"}} {p["rows_per_s"]}',
                      "# TYPE mariana_job_epoch gauge", f'mariana_job_epoch{{job="{run.id}"}} {p["epoch"]}']
            for key in ("batches_reissued", "cache_hits", "cache_misses", "batches_replayed"):
                lines += [f"# TYPE mariana_job_{key}_total counter",
                          f'mariana_job_{key}_total{{job="{run.id}"}} {run.ledger.counters[key]}']
        return own + "\n".join(lines) + "\n"

    def new_job(self, body: dict) -> JobRun:
        request, spec = check_request(body)
        job = time.strftime("j%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)
        # gzip offsets count uncompressed bytes: no size to estimate epoch 1's progress from
        size = 0 if any(str(f).endswith(".gz") for f in request["data"]) else sum(
            os.path.getsize(f) for f in request["data"])
        if request.get("holdout"):  # the loader reads the lines before the held-out tail
            rows = request["holdout"]["rows"]
            size = size * rows["start"] // max(rows["stop"], 1)
        return JobRun(job, request, spec, job_ledger(job, request, spec, size))


def job_ledger(job: str, request: dict, spec: dict, data_bytes: int) -> JobLedger:
    """A job's empty ledger (a new job, or one a restarted coordinator replays its journal into)."""
    staleness = {"async": None, "bsp": 0, "ssp": request.get("staleness")}[request["mode"]]
    epochs = from_dict(JobConfig, spec["config"]).train.epoch_limit  # "auto": at most max_epochs
    return JobLedger(job, epochs=epochs, staleness=staleness, data_bytes=data_bytes)


class JobStopped(Exception):
    """The job was cancelled or failed while the coordinator waited for it."""


def _numbers(stats: dict) -> dict:
    """The numbers of a Cached report's stats (what the ledger reads), for the journal."""
    return {k: v for k, v in stats.items() if isinstance(v, (int, float))}


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def main(cfg: ClusterConfig, index: int) -> int:
    return run_service(Coordinator(cfg, index))

