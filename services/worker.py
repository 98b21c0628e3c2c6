"""Worker: leases batches from the coordinator a few at a time, reads them from
the sample cache, pulls the rows each touches from the shards that own them,
computes the gradient with the same pure step as local training, pushes it,
and reports the batch done.

    feed:   Work{job, step, key, more} <- Lease{want, done}   (held by the coordinator while none is ready)
            batches <- Redis[keys]                          (one round trip; a miss: tell the coordinator)
    step:   rows  <- PullRows to each shard (id % S)        (dense parameters from shard 0)
            grads <- trainer.strategies.ps_step.compute_grads
            PushGrads to each shard                         (idempotent per step; carries the next
                                                             batch's ids, and the Ack its rows)
            report -> the next Lease's `done`               (or a Done at once while a Lease is held)

While batches are in hand a step needs one round trip to each shard: its push
brings back the rows of the next batch, read after the update, as a pull right
after it would. One Lease and one cache read per `worker.lease_batches` steps, and the reports
of the steps done since the last Lease ride along with it: the coordinator,
one per cluster, sees two messages per few steps instead of two per step.
The feeder keeps `lease_batches` to twice that in hand, so the next batches
are read while these train. A shard that does not answer is retried until it
does (a restarted shard restores its checkpoint and the coordinator replays
what it lost). A stopping worker finishes the steps it is on, reports them
and hands the rest back.

    Feed       the coordinator side: Lease, the cache read, Miss, Done (the inbox)
    Shards     the parameter servers: who owns an id, PullRows, PushGrads, retries
    JobModels  the model of the job being trained, from its spec (GetJob)
    Worker     the service: step loops that train the batches in the inbox
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from mariana.services import protocol
from mariana.services.jobspec import JobSpec
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.lifecycle import Service, run_service
from mariana.services.sample_cache import CacheRefused, SampleCache, unpack_batch
from mariana.services.transport import Client, PeerTimeout, RemoteError, timeout_log
from mariana.sparse.host import available_cpus
from mariana.sparse import admission
from mariana.sparse.batch import SparseBatch
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import DataFormatError
from mariana.sparse.hashing import rare_ids
from mariana.trainer.config import JobConfig
from mariana.trainer.models.registry import build_model, dense_size, kind_uses_torch, set_dense
from mariana.trainer.strategies.ps_step import compute_grads

log = logging.getLogger(__name__)


class StepAbandoned(Exception):
    """A step given up on (its lease has lapsed; the coordinator issues it again)."""


LEASE_MARGIN = 0.8  # a batch held this fraction of coordinator.lease_seconds is not trained


@dataclass
class JobModel:
    """What a worker keeps per job: the model (dense weights are pulled each step)."""

    job: str
    config: JobConfig
    model: object                    # a torch CTRModel, or numpy's LogisticRegression
    dense_size: int
    gate: asyncio.Semaphore  # steps of this job between pull and push at once (worker.steps_in_flight)
    rare: np.ndarray | None = None  # hashing.min_count > 1: each field's rare id (sparse/admission.py)


@dataclass
class Fetched:
    work: dict  # the Work fields: job, epoch, step, key, rows
    batch: SparseBatch
    seconds: float
    leased_at: float  # time.monotonic() of the Lease's answer
    pull: tuple | None = None  # (ids, occurrences or None) the step pulls, once found (Worker.pull_ids)


class Inbox:
    """Batches leased and read, in lease order; a step may put the next one back in front."""

    def __init__(self):
        self.items: deque[Fetched] = deque()
        self.arrived = asyncio.Event()

    def __len__(self) -> int:
        return len(self.items)

    def put(self, f: Fetched) -> None:
        self.items.append(f)
        self.arrived.set()

    def put_back(self, f: Fetched) -> None:
        self.items.appendleft(f)
        self.arrived.set()

    async def next_job(self) -> str:
        """Wait for a batch; the job of the one in front."""
        while not self.items:
            self.arrived.clear()
            await self.arrived.wait()
        return self.items[0].work["job"]

    def take_now(self, job: str) -> Fetched | None:
        """The next batch if it is of `job` and here already."""
        if self.items and self.items[0].work["job"] == job:
            return self.items.popleft()
        return None


class Feed:
    """The coordinator side of a worker: leases batches a few at a time into the inbox and
    reads them from the sample cache; sends the reports of the steps done (with the next
    Lease, or in a Done of their own while a Lease is held) and the steps handed back."""

    def __init__(self, svc: Service):
        self.svc = svc  # its config, name, counters, coordinator and `stopping`
        self.cache: SampleCache | None = None
        self.inbox = Inbox()
        self.room = asyncio.Event()  # the inbox ran low: lease more
        self.leasing = False         # a Lease is out (the coordinator may hold it)
        self.reports: list[dict] = []  # steps done, for the next Lease
        self.feeder: asyncio.Task | None = None
        self.reporting: set[asyncio.Task] = set()

    def open(self) -> None:
        self.cache = SampleCache(self.svc.cfg, self.svc.counters)

    async def close(self) -> None:
        if self.cache:
            await self.cache.close()

    def start(self) -> asyncio.Task:
        self.feeder = asyncio.create_task(self.run())
        return self.feeder

    async def drain(self) -> None:
        """Hand back the batches in hand; send the reports waiting."""
        self.room.set()  # a feeder waiting for room sees `stopping`; one leasing hands back what it gets
        if self.feeder is not None:
            await asyncio.wait([self.feeder], timeout=2.0)  # a coordinator holds a Lease up to 1 s
        released = [f.work["step"] for f in self.inbox.items]
        self.inbox.items.clear()
        self.flush(released)
        if self.reporting:
            await asyncio.wait(set(self.reporting), timeout=5.0)

    def take(self, job: str) -> Fetched | None:
        """The next batch of `job` in hand, if any. One held so long that its lease has
        (nearly) lapsed is skipped: the coordinator issues it again, maybe to another worker.
        Tells the feeder when the inbox runs low."""
        stale = LEASE_MARGIN * self.svc.cfg.coordinator.lease_seconds
        while (f := self.inbox.take_now(job)) is not None and time.monotonic() - f.leased_at > stale:
            self.svc.counters["lapsed_in_hand"] += 1
        if len(self.inbox) < self.svc.cfg.worker.lease_batches:
            self.room.set()
        return f

    async def run(self) -> None:
        """Keep `lease_batches` to twice that many batches in the inbox."""
        k = self.svc.cfg.worker.lease_batches
        stopping = self.svc.stopping
        while not stopping.is_set():
            if len(self.inbox) >= k:
                self.room.clear()
                await self.room.wait()
                continue
            works = await self.lease(k)
            if works and not self.svc.models.built(works[0]["job"]):  # a lease is of one job
                # Building a job's model may outlast a lease (a DNN's first job in this process
                # imports torch): hand the steps back, first in line again, and lease once built.
                self.flush([w["step"] for w in works])
                if await self.svc.models.get(works[0]["job"]) is None:
                    await asyncio.sleep(0.5)
                continue
            fetched = await self.fetch(works) if not stopping.is_set() else []
            if stopping.is_set():  # stopping meanwhile: hand back what came
                self.flush([w["step"] for w in works])
                return
            for f in fetched:
                self.inbox.put(f)

    async def lease(self, want: int) -> list[dict]:
        """Up to `want` steps' Work fields ([]: nothing to do yet, or the reply was bad); the
        reports waiting go with the request."""
        done, self.reports = self.reports, []
        self.leasing = True
        try:
            reply = await self.svc.coordinator.call("Lease", worker=self.svc.name, want=want, done=done, timeout=30.0)
        except (PeerTimeout, RemoteError) as e:
            if isinstance(e, PeerTimeout):  # maybe never delivered: the reports go with the next request
                self.reports[:0] = done
            timeout_log(log, e, logging.INFO)("%s: lease: %s; asking again", self.svc.name, e)
            await asyncio.sleep(0.5)
            return []
        finally:
            self.leasing = False
        if reply.type == "Idle":
            await asyncio.sleep(0.2)
            return []
        if reply.type != "Work":
            return []
        try:
            more = reply.get("more", [])
            if not isinstance(more, list):
                raise BadMessage("field", "Work.more must be a list")
            extra = [protocol.check_record("Work", w, f"Work.more[{i}]") for i, w in enumerate(more)]
        except BadMessage as e:  # the leases lapse and the coordinator issues them again
            self.svc.counters["bad_messages"] += 1
            log.warning("%s: bad Work from the coordinator: %s", self.svc.name, e)
            return []
        first = {k: v for k, v in reply.fields.items() if k != "more"}
        return [first, *extra]

    async def fetch(self, works: list[dict]) -> list[Fetched]:
        """The leased batches, read from the cache in one round trip and decoded off the loop.
        A missing or corrupt one is reported to the coordinator, which reads it again."""
        if not works:
            return []
        t0, leased_at = time.perf_counter(), time.monotonic()
        try:
            blobs = await self.cache.get_many([w["key"] for w in works])
        except CacheRefused as e:  # not an outage: the job cannot go on (its leases lapse meanwhile)
            await self.report_refused(works[0], e)
            return []
        batches = await asyncio.to_thread(_unpack_all, blobs)
        seconds = (time.perf_counter() - t0) / len(works)
        out = []
        for work, blob, batch in zip(works, blobs, batches):
            if isinstance(batch, SparseBatch):
                out.append(Fetched(work, batch, seconds, leased_at))
                continue
            if blob is None:
                self.svc.counters["cache_misses"] += 1
            else:  # a corrupt value: count it and refill from the source
                self.svc.counters["bad_messages"] += 1
                log.warning("%s: cached batch %s is corrupt: %s", self.svc.name, work["key"], batch)
            await self.report_miss(work)
        return out

    async def report_refused(self, work: dict, e: CacheRefused) -> None:
        """Redis refused the read (credentials, say): the job fails with that line. Told the way
        preprocess tells a chunk it cannot cache (`Cached` with an error: the coordinator fails the
        job); a Miss would only have the chunk read and cached again, and missed again."""
        self.svc.counters["cache_refused"] += 1
        log.error("%s: job %s: %s", self.svc.name, work["job"], e)
        key = work["key"].rsplit(":", 2)  # <prefix>:<job>:b, chunk, k
        try:
            await self.svc.coordinator.call("Cached", job=work["job"], chunk=key[1] if len(key) == 3 else "",
                                            batches=[], stats={}, error=f"{self.svc.name}: {e}")
        except (PeerTimeout, RemoteError) as err:  # ended already; or the next lease finds it out again
            timeout_log(log, err)("%s: could not report it: %s", self.svc.name, err)
        await asyncio.sleep(1.0)  # the next Lease after the coordinator has heard

    async def report_miss(self, work: dict) -> None:
        try:
            await self.svc.coordinator.call("Miss", job=work["job"], step=work["step"], key=work["key"])
        except (PeerTimeout, RemoteError) as e:  # the lease lapses and the batch is issued again
            timeout_log(log, e)("%s: could not report a cache miss for %s: %s", self.svc.name, work["step"], e)

    def report(self, done: dict) -> None:
        """A step done (a `Report` record), for the next Lease; sent now while a Lease is held."""
        self.reports.append(done)
        if self.leasing:  # a held Lease would sit on the report
            self.flush()

    def flush(self, released: list[str] = ()) -> None:
        """Send the reports waiting (and steps handed back) in a Done of their own."""
        if not self.reports and not released:
            return
        reports, self.reports = self.reports, []
        task = asyncio.create_task(self.send_done(reports, list(released)))
        self.reporting.add(task)
        task.add_done_callback(self.reporting.discard)

    async def send_done(self, reports: list[dict], released: list[str]) -> None:
        try:
            await self.svc.coordinator.call("Done", worker=self.svc.name, reports=reports, released=released)
        except PeerTimeout as e:  # the next Lease carries them (a duplicate report is ignored)
            self.reports[:0] = reports
            timeout_log(log, e)("%s: %d reports not delivered: %s", self.svc.name, len(reports), e)
        except RemoteError as e:  # the leases lapse; the re-issued steps are no-ops on the shards
            log.warning("%s: %d reports refused: %s", self.svc.name, len(reports), e)


class Shards:
    """The parameter servers as a worker sees them: which shard owns an id (id % S), what
    a step pulls, the rows of their answers, and the pushes; each request retried while
    its shard may be restarting."""

    def __init__(self, svc: Service):
        self.svc = svc  # its config, name, counters and zmq context
        self.clients: list[Client] = []

    def open(self) -> None:
        self.clients = [Client(self.svc.ctx, ep, self.svc.counters, timeout=self.svc.cfg.worker.rpc_seconds)
                        for ep in self.svc.cfg.ps.endpoints]

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def partition(self, uniq: np.ndarray) -> list[np.ndarray | slice]:
        """For each shard, the positions in `uniq` of the ids it owns (id % S)."""
        s = len(self.clients)
        if s == 1:
            return [slice(None)]
        owner = uniq % s
        return [np.flatnonzero(owner == i) for i in range(s)]

    async def pull(self, jm: JobModel, f: Fetched) -> tuple[dict, np.ndarray | None, np.ndarray | None]:
        """The rows of a step whose pull did not ride on the previous push (see `rows_of`)."""
        ids, occ = self.pull_ids(jm, f)
        owners = self.partition(ids)
        return self.rows_of(jm, ids, owners, await asyncio.gather(*(
            self.call(i, "PullRows", _with_occ({"ids": ids[sel]}, "occ", occ, sel), job=jm.job,
                      dense=(i == 0 and jm.dense_size > 0), step=f.work["step"])
            for i, sel in enumerate(owners))))

    def pull_ids(self, jm: JobModel, f: Fetched) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids, occurrences) a step pulls: the batch's unique ids; with min_count > 1 also
        every field's rare id (the row of the batch's ids not admitted: which they are, the
        pull's answer says) and each id's uint32 occurrences in the batch (0 for rare ids)."""
        if f.pull is None:
            uniq, inverse = f.batch.unique()
            if jm.rare is None:
                f.pull = (uniq, None)
            else:
                occ = np.bincount(inverse, minlength=len(uniq)).astype(np.uint32)
                f.pull = (np.concatenate([uniq, jm.rare]), np.concatenate([occ, np.zeros(len(jm.rare), np.uint32)]))
        return f.pull

    def admit(self, jm: JobModel, f: Fetched, rows: dict, admitted: np.ndarray
              ) -> tuple[SparseBatch, dict, tuple[np.ndarray, np.ndarray]]:
        """(the batch with the entries of ids not admitted on their field's rare id, its
        rows, (ids not admitted, occurrences)): the shards count the last with the push."""
        uniq = f.batch.unique()[0]
        ok = admitted[:len(uniq)]
        batch, src = admission.redirect(f.batch, ok, jm.rare)
        occ = self.pull_ids(jm, f)[1][:len(uniq)]
        return batch, {name: r[src] for name, r in rows.items()}, (uniq[~ok], occ[~ok])

    def rows_of(self, jm: JobModel, uniq: np.ndarray, owners: list, replies: list[Message]
                ) -> tuple[dict, np.ndarray | None, np.ndarray | None]:
        """The shards' answers to a pull as ({table: (U, dim) rows}, dense parameters,
        (U,) bool admitted: min_count > 1 only)."""
        pulled = {}
        for spec in jm.model.tables:
            out = np.empty((len(uniq), spec.dim), np.float32)  # writable: autograd leaves
            for sel, reply in zip(owners, replies):
                rows = reply.arrays.get(spec.name)
                if rows is None or rows.shape != (len(uniq[sel]), spec.dim):
                    raise BadMessage("arrays", f"shard reply lacks rows of {spec.name!r} or has the wrong shape")
                out[sel] = rows
            pulled[spec.name] = out
        dense = None
        if jm.dense_size:
            dense = np.array(replies[0].arrays.get("dense"), np.float32)
            if dense.shape != (jm.dense_size,):
                raise BadMessage("arrays", f"dense parameters of shape {dense.shape}, expected {(jm.dense_size,)}")
        admitted = None
        if jm.rare is not None:
            admitted = np.empty(len(uniq), bool)
            for sel, reply in zip(owners, replies):
                got = reply.arrays.get("admitted")
                if got is None or got.dtype != np.uint8 or got.shape != (len(uniq[sel]),):
                    raise BadMessage("arrays", "shard reply lacks the admitted flags of the ids or has the wrong shape")
                admitted[sel] = got.view(bool)
        return pulled, dense, admitted

    async def push(self, jm: JobModel, step: str, rows: int, uniq: np.ndarray, owners: list,
                   grads: dict[str, np.ndarray], dense_grad: np.ndarray | None,
                   next_ids: np.ndarray | None, next_owners: list | None,
                   seen: tuple | None = None, next_occ: np.ndarray | None = None,
                   next_step: str | None = None) -> list[Message]:
        """Push a step's gradients to each shard, with the pull of the next batch's ids (if
        any, for `next_step`) in the same message; the shards' Acks, in shard order. `seen`:
        (ids not admitted, their occurrences), for their owners to count (min_count > 1)."""
        calls = []
        seen_owners = self.partition(seen[0]) if seen is not None else None
        for i, sel in enumerate(owners):
            arrays = {"ids": uniq[sel], **{f"g.{name}": g[sel] for name, g in grads.items()}}
            if i == 0 and dense_grad is not None:
                arrays["dense"] = dense_grad
            if seen is not None:
                arrays["seen"], arrays["seen_n"] = seen[0][seen_owners[i]], seen[1][seen_owners[i]]
            fields = {}
            if next_ids is not None:
                arrays["next_ids"] = next_ids[next_owners[i]]
                _with_occ(arrays, "next_occ", next_occ, next_owners[i])
                fields["next_dense"] = i == 0 and jm.dense_size > 0
                fields["next_step"] = next_step
            calls.append(self.call(i, "PushGrads", arrays, job=jm.job, step=step, rows=rows, **fields))
        return await asyncio.gather(*calls)

    async def call(self, i: int, type_: str, arrays: dict, **fields) -> Message:
        """A request to shard i, retried while it may be restarting, up to about as long
        as a lease lasts: by then the coordinator has issued the step again anyway."""
        cfg = self.svc.cfg
        delay, give_up = 0.1, time.monotonic() + 2 * max(cfg.coordinator.lease_seconds, cfg.worker.rpc_seconds)
        while True:
            try:
                return await self.clients[i].call(type_, arrays, **fields)
            except (PeerTimeout, RemoteError) as e:
                if isinstance(e, RemoteError) and e.code != "UnknownJob":
                    raise  # JobEnded, or a refusal: this step is over for this worker
                if time.monotonic() > give_up:
                    raise StepAbandoned(f"shard {i} did not serve {type_} in time: {e}") from None
                self.svc.counters["shard_retries"] += 1
                log.warning("%s: shard %d: %s; retrying in %.1fs", self.svc.name, i, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


class JobModels:
    """The model of the job a worker trains (one job at a time), built from its spec the
    first time a batch of it comes."""

    def __init__(self, svc: Service):
        self.svc = svc  # its config, name, counters and coordinator
        self.jobs: dict[str, JobModel] = {}
        self.lock = asyncio.Lock()

    def built(self, job: str) -> bool:
        return job in self.jobs

    async def get(self, job: str) -> JobModel | None:
        async with self.lock:  # the step loops ask at once when a job starts: build one model, not two
            return self.jobs.get(job) or await self.build(job)

    async def build(self, job: str) -> JobModel | None:
        try:
            spec = JobSpec.from_dict((await self.svc.coordinator.call("GetJob", job=job)).get("spec"))
        except (PeerTimeout, RemoteError, BadMessage) as e:
            if isinstance(e, BadMessage):  # a spec that does not decode: counted as any bad message
                self.svc.counters["bad_messages"] += 1
            log.warning("%s: cannot get job %s: %s", self.svc.name, job, e)
            return None
        config, cfg = spec.config, self.svc.cfg
        encoder = Encoder(spec.schema, config.hashing)
        # An LR step is numpy's: its workers never import torch (~2 s of CPU, ~180 MB here).
        # A DNN's first job in this process imports it here, off the loop: heartbeats go on.
        if await asyncio.to_thread(kind_uses_torch, config.model.kind):
            self.set_threads(config)
        model = build_model(config.model, encoder.num_fields, encoder.dense_dim, spec.image_width, config.images.tower)
        in_flight = cfg.worker.steps_in_flight(config.model.kind)
        rare = rare_ids(encoder.sparse_fields, config.hashing) if config.hashing.min_count > 1 else None
        jm = JobModel(job, config, model, dense_size(model),
                      asyncio.Semaphore(in_flight), rare)
        self.jobs = {job: jm}  # one job at a time: forget the previous model
        log.info("%s: job %s: %s model, %d dense parameters, %d shards, %d steps in flight", self.svc.name, job,
                 config.model.kind, jm.dense_size, len(cfg.ps.endpoints), in_flight)
        return jm

    def set_threads(self, config: JobConfig) -> None:
        import torch

        cfg = self.svc.cfg
        n = cfg.worker.threads or config.train.threads
        if not n:
            n = 1 if config.model.kind == "lr" else max(1, available_cpus() // cfg.worker.count)
        torch.set_num_threads(n)


class Worker(Service):
    role = "worker"
    COUNTERS = Service.COUNTERS + Service.REDIS_COUNTERS + (
        "steps", "rows", "steps_abandoned", "separate_pulls", "lapsed_in_hand", "cache_misses", "cache_refused",
        "shard_retries")

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        super().__init__(cfg, index)
        self.feed = Feed(self)
        self.shards = Shards(self)
        self.models = JobModels(self)
        self.busy = 0  # steps being trained

    async def start(self) -> None:
        self.connect_coordinator()
        self.coordinator.timeout = 30.0
        self.shards.open()
        self.feed.open()
        self.cache = self.feed.cache  # which Redis it reads: checked against the coordinator's at register
        await self.register()

    async def close(self) -> None:
        self.shards.close()
        await self.feed.close()

    async def drain(self) -> None:
        while self.busy:  # finish the steps being trained; hand the others back
            await asyncio.sleep(0.05)
        await self.feed.drain()

    def status(self) -> dict:
        return {**self.counters, "busy": self.busy, "in_hand": len(self.feed.inbox)}

    # ---- the loop ---------------------------------------------------------------------

    async def main(self) -> None:
        # `worker.pipeline` step loops: one computes while another waits on the shards.
        # A job may allow fewer at once (JobModel.gate).
        loops = [self.step_loop() for _ in range(self.cfg.worker.steps_in_flight("lr"))]
        await asyncio.gather(self.feed.start(), *loops)

    async def step_loop(self) -> None:
        """Train a run of steps of one job: each step's push also pulls the rows of the
        next batch in hand (one round trip a step); the run ends when none is, or the
        next belongs to another job. The gate is held for the whole run, so a job that
        allows one step at a time has exactly one between pull and push."""
        while not self.stopping.is_set():
            job = await self.feed.inbox.next_job()
            jm = await self.models.get(job)
            if jm is None:  # hand the batch back: the coordinator issues it again
                f = self.feed.take(job)
                self.feed.flush([f.work["step"]] if f else [])
                await asyncio.sleep(0.5)
                continue
            async with jm.gate:  # before taking a batch: a loop waiting here holds none
                f = None if self.stopping.is_set() else self.feed.take(job)  # (drain hands it back)
                if f is None:
                    continue
                pulled = None
                while f is not None:
                    self.busy += 1
                    try:
                        f, pulled = await self.train_step(jm, f, pulled)
                    except (BadMessage, DataFormatError) as e:  # counted; the lease lapses, the step is re-issued
                        self.counters["bad_messages"] += 1
                        log.warning("%s: step %s failed: %s", self.name, f.work["step"], e)
                        f = None
                    except (RemoteError, StepAbandoned) as e:  # the job ended, or a shard stayed away
                        self.counters["steps_abandoned"] += 1
                        log.info("%s: step %s dropped: %s", self.name, f.work["step"], e)
                        f = None
                    finally:
                        self.busy -= 1

    async def train_step(self, jm: JobModel, f: Fetched,
                         pulled: tuple | None) -> tuple[Fetched | None, tuple | None]:
        """One step, its rows pulled already or not; returns the next batch of the run and
        its rows (None, None: the run ends). A failed push, or next rows that come back
        wrong, put the next batch back."""
        work, batch = f.work, f.batch
        times = {"fetch": f.seconds, "pull": 0.0}
        if pulled is None:
            t0 = time.perf_counter()
            pulled = await self.shards.pull(jm, f)
            times["pull"] = time.perf_counter() - t0
            self.counters["separate_pulls"] += 1  # the others ride on the previous push
        rows, dense, admitted = pulled
        seen = None
        if admitted is not None:  # min_count > 1: ids not admitted read and train their field's rare row
            batch, rows, seen = self.shards.admit(jm, f, rows, admitted)
        uniq, inverse = batch.unique()
        owners = self.shards.partition(uniq)
        t1 = time.perf_counter()
        # No await from here to the copies below: another step loop shares the model.
        if jm.dense_size:
            set_dense(jm.model, dense)
        result = compute_grads(jm.model, batch, inverse, rows)
        dense_grad = (np.concatenate([g.reshape(-1) for g in result.dense_grads]).astype(np.float32)
                      if result.dense_grads else None)
        t2 = time.perf_counter()
        nxt = None if self.stopping.is_set() else self.feed.take(jm.job)
        next_ids = next_owners = next_occ = None
        if nxt is not None:
            next_ids, next_occ = self.shards.pull_ids(jm, nxt)
            next_owners = self.shards.partition(next_ids)
        try:
            acks = await self.shards.push(jm, work["step"], batch.num_rows, uniq, owners, result.row_grads,
                                          dense_grad, next_ids, next_owners, seen, next_occ,
                                          None if nxt is None else nxt.work["step"])
        except BaseException:
            if nxt is not None:
                self.feed.inbox.put_back(nxt)
            raise
        times.update(compute=t2 - t1, push=time.perf_counter() - t2)
        applied, next_rows = sum(bool(a["applied"]) for a in acks), None
        if nxt is not None:
            try:
                next_rows = self.shards.rows_of(jm, next_ids, next_owners, acks)
            except BadMessage as e:  # this step is applied and reported; the next one pulls on its own
                self.counters["bad_messages"] += 1
                log.warning("%s: rows for step %s came back wrong: %s", self.name, nxt.work["step"], e)
                self.feed.inbox.put_back(nxt)
                nxt = None
        self.counters["steps"] += 1
        self.counters["rows"] += batch.num_rows
        # The next step need not wait for the coordinator: the shards have the update.
        self.feed.report({"job": work["job"], "step": work["step"], "rows": batch.num_rows,
                          "loss_sum": result.loss_sum,
                          "stats": {"times": times, "applied": applied, "worker": self.name,
                                    "hist": [h.tolist() for h in result.score_hist]}})
        return nxt, next_rows


def _with_occ(arrays: dict, key: str, occ: np.ndarray | None, sel) -> dict:
    """`arrays` with the occurrences of the selected ids under `key`, when there are any."""
    if occ is not None:
        arrays[key] = occ[sel]
    return arrays


def _unpack_all(blobs: list[bytes | None]) -> list[SparseBatch | Exception | None]:
    """Each blob as a batch, the error for a corrupt one, None for a miss."""
    out = []
    for blob in blobs:
        try:
            out.append(None if blob is None else unpack_batch(blob))
        except (BadMessage, DataFormatError) as e:
            out.append(e)
    return out


def main(cfg: ClusterConfig, index: int) -> int:
    return run_service(Worker(cfg, index))
