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
import logging
import os
import time

from aiohttp import web

from mariana.services import protocol
from mariana.services.coord_api import CoordinatorAPI
from mariana.services.coord_hello import admit, bye, touch
from mariana.services.remote_inputs import RemoteInputs
from mariana.services.coord_jobs import EpochValidation, JobJournal, JobRunner, rejoined
from mariana.services.coord_state import JobRun, ServiceInfo, numbers
from mariana.services.jobstore import JobStore
from mariana.services.ledger import ChunkInfo, chunk_event, parse_step, stage_seconds_of
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime.auth import check_exposed
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.http_idle import IdleClosingRunner
from mariana.services.runtime.lifecycle import HOST, Service, cancel_and_wait, run_service
from mariana.services.sample_cache import SampleCache, batch_key
from mariana.services.transport import Client, Server
from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)


OWN_COUNTERS = ("late_reports", "late_batches_dropped",  # reports about, and batches cached for, ended jobs
                "http_unauthorized", "jobs_refused")  # admin requests refused: no valid token; a bad job (400)


class Coordinator(Service):
    role = "coordinator"
    COUNTERS = Service.COUNTERS + Service.REDIS_COUNTERS + Service.CREATIVE_COUNTERS + OWN_COUNTERS

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
        self._redis_id: tuple[float, dict | None] = (float("-inf"), None)  # coord_hello.redis_identity
        self.refused: dict[str, tuple[float, str]] = {}  # service name -> (when, why) of its last refused Hello
        self.hello_said: dict[tuple, float] = {}  # coord_hello.admit: when each refusal was last logged
        self.api, self.job_runner = CoordinatorAPI(self), JobRunner(self)
        self.validation, self.book = EpochValidation(self), JobJournal(self)
        self.inputs = RemoteInputs(self)  # a job's files on the loader's host (coordinator.data_via_loader)

    # ---- life -----------------------------------------------------------------------------

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.store = JobStore(self.cfg.coordinator_state_dir)
        self.book.restore()  # before any service can report on a job
        self.server = Server(self.ctx, self.cfg.coordinator.endpoint, self.handle, self.counters,
                             max_bytes=self.cfg.cluster.max_message_bytes, name=self.name)
        self.shards = [Client(self.ctx, ep, self.counters, timeout=30.0) for ep in self.cfg.ps.endpoints]
        self.cache = SampleCache(self.cfg, self.counters)
        self.runner = IdleClosingRunner(self.api.http_app(), access_log=None, handle_signals=False,
                                        keepalive_timeout=self.cfg.cluster.keepalive_seconds)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.coordinator.http_host, self.cfg.coordinator.http_port)
        await site.start()
        self.services[self.name] = ServiceInfo(self.role, 0, os.getpid(), self.boot, last_seen=time.time(), host=HOST)
        log.info("%s: ZeroMQ at %s, HTTP at http://%s:%d", self.name, self.cfg.coordinator.endpoint,
                 self.cfg.coordinator.http_host, self.cfg.coordinator.http_port)

    async def main(self) -> None:
        ticker = asyncio.create_task(self.job_runner.tick())
        try:
            while True:
                run = self.jobs[await self.queue.get()]
                if run.state not in ("queued", "running") or run.task is not None:
                    continue
                run.task = asyncio.create_task(self.job_runner.run_job(run))
                await asyncio.gather(run.task, return_exceptions=True)
        finally:
            ticker.cancel()

    async def drain(self) -> None:
        await self.server.drain(timeout=2.0)

    async def close(self) -> None:
        # A job left running resumes when the coordinator starts again; one that ends here first
        # tells its shards (EndJob, up to 10 s each): the time it gets before another cancel.
        await cancel_and_wait((run.task for run in self.jobs.values() if run.task), grace=30.0)
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
        handler = getattr(self, f"on_{msg.type}", None) or getattr(self.inputs, f"on_{msg.type}", None)
        if handler is None:
            raise BadMessage("unexpected", f"the coordinator does not take {msg.type}")
        return await handler(peer, msg)

    async def on_Hello(self, peer: bytes, msg: Message) -> list:
        name = f"{msg['role']}-{msg['index']}"
        await admit(self, msg, name)  # Refused / NameTaken: services/coord_hello.py
        info = self.services.get(name)
        restarted = info is not None and info.boot != msg.get("boot")
        if info is None or restarted:
            info = self.services[name] = ServiceInfo(msg["role"], msg["index"],
                                                     restarts=info.restarts + 1 if restarted else 0)
            log.info("%s: %s %s (pid %s)", self.name, name, "restarted" if restarted else "registered",
                     msg.get("pid"))
        info.pid, info.boot, info.peer = msg.get("pid", 0), msg.get("boot", 0.0), peer
        info.host, info.place = str(msg.get("host") or ""), str(msg.get("place") or "")
        info.update(msg.get("status") if isinstance(msg.get("status"), dict) else {}, time.time())
        if restarted:
            self.spawn(self.rejoin(info))
        return protocol.encode("Welcome", msg.msg_id, boot=self.boot, bye=True)  # it takes a Bye

    async def on_Bye(self, peer: bytes, msg: Message) -> list:
        return bye(self, msg)  # services/coord_hello.py

    async def on_Lease(self, peer: bytes, msg: Message) -> list:
        """Up to `want` steps at once; the steps finished since the last Lease ride along in `done`, recorded first."""
        worker, want = msg["worker"], msg.get("want", 1)
        if not isinstance(want, int) or isinstance(want, bool) or not 1 <= want <= protocol.MAX_LEASE:
            raise BadMessage("field", f"Lease.want must be an integer in [1, {protocol.MAX_LEASE}], got {want!r:.40}")
        self.record_reports(worker, msg.get("done", []), "Lease.done")  # steps done are done, whoever did them
        touch(self, worker, peer, lease=True)  # NameTaken for a process that lost its name while silent
        deadline = time.monotonic() + 1.0  # held up to a second: no busy polling
        while True:
            run = self.active()
            if run is None:
                return protocol.encode("Idle", msg.msg_id)
            led, items = run.ledger, []
            active = self.active_workers()
            while len(items) < want and led.may_lease(worker, active):
                step = led.lease(worker, self.cfg.coordinator.lease_seconds, len(active | {worker}))
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
        touch(self, worker, peer)
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
        await self.job_runner.pump_refills(run)
        self.pulse()
        return protocol.encode("Ok", msg.msg_id)

    async def on_GetJob(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg, running=False)
        return protocol.encode("JobSpec", msg.msg_id, job=run.id, spec=run.spec.to_dict())

    async def on_ChunkSent(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg)
        c = ChunkInfo(msg["chunk"], msg["file"], msg["offset"], msg["length"], msg["first_line"], msg["lines"])
        self.book.journal(run, "sent", chunk_event(c, float(msg["seconds"])))
        return protocol.encode("Ok", msg.msg_id)

    async def on_SourceDone(self, peer: bytes, msg: Message) -> list:
        run = self.job_of(msg)
        if msg["error"] and msg.get("chunk"):  # one chunk could not be read again
            self.book.journal(run, "lost", {"chunk": msg["chunk"]})
            log.warning("%s: job %s: chunk %s lost: %s", self.name, run.id, msg["chunk"], msg["error"])
            await self.job_runner.pump_refills(run)
        elif msg["error"]:
            self.job_runner.fail(run, f"reading the source: {msg['error']}")
        else:
            self.book.journal(run, "source_done", {"chunks": msg["chunks"]})
            log.info("%s: job %s: source read (%d chunks)", self.name, run.id, msg["chunks"])
        self.pulse()
        return protocol.encode("Ok", msg.msg_id)

    async def on_Cached(self, peer: bytes, msg: Message) -> list:
        await drop_late(self, msg)  # a job that ended meanwhile: refused below, as any report about one
        run = self.job_of(msg)
        if msg.get("error"):
            self.job_runner.fail(run, msg["error"])
            return protocol.encode("Ok", msg.msg_id)
        led = run.ledger
        known = len(led.batches)
        try:
            if not all(isinstance(b, list) and len(b) == 2 for b in msg["batches"]):
                raise ValueError("batches")
            cached = self.book.journal(run, "cached", {"chunk": msg["chunk"], "batches": msg["batches"],
                                                  "stats": numbers(msg["stats"])})
        except (TypeError, ValueError):
            raise BadMessage("cached", "Cached.batches must be [[k, rows], ...] and stats numbers") from None
        if cached:
            await self.job_runner.pump_refills(run)
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
            if run.state == "running" and (run.ledger.epoch <= run.ledger.epochs or run.ledger.replaying()):
                return run
        return None

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
            await self.job_runner.start_shard(run, info.index)
        elif info.role == "loader" and not run.ledger.source_done and run.ledger.epoch == 1:
            await self.job_runner.read_source(run)
        await rejoined(self.job_runner, run, info.role, f"{info.role}-{info.index}")

    def bad_message_counts(self) -> dict:
        counts = {n: int(s.status.get("bad_messages", 0)) for n, s in self.services.items() if n != self.name}
        counts[self.name] = self.counters["bad_messages"]
        return counts

    def bad_messages_since(self, baseline: dict) -> int:
        now = self.bad_message_counts()
        # a restarted service counts from zero again: never subtract more than it has
        return sum(max(0, n - baseline.get(name, 0)) if n >= baseline.get(name, 0) else n
                   for name, n in now.items())


def main(cfg: ClusterConfig, index: int) -> int:
    check_exposed(cfg.coordinator.http_host, cfg.coordinator.token, "coordinator")
    return run_service(Coordinator(cfg, index))


async def drop_late(coord: Coordinator, msg: Message) -> None:
    """A chunk cached after its job ended (a preprocess still at work when the job was cancelled
    or failed in epoch 1): its batches deleted now, since the job's cleanup has run already (they
    stayed for cache.ttl_seconds, a week, and filled a bounded Redis)."""
    run = coord.jobs.get(msg["job"])
    if run is None or run.state not in ("done", "failed", "cancelled") or not isinstance(msg["batches"], list):
        return
    try:
        n = await coord.cache.drop_late(run.id, str(msg["chunk"]), len(msg["batches"]))
    except Exception as e:  # Redis away: they expire with cache.ttl_seconds
        log.warning("%s: job %s: could not drop the batches of %s, cached after the job ended: %s", coord.name,
                    run.id, msg["chunk"], e)
        return
    coord.counters["late_batches_dropped"] += n
    log.info("%s: job %s is %s: dropped %d keys of chunk %s, cached after it ended", coord.name, run.id,
             run.state, n, msg["chunk"])
