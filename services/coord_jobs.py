"""How the coordinator runs a job (`JobRunner.run_job`, read top to bottom in
services/coordinator.py's docstring) and scores it after each epoch (`EpochValidation`)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time

from mariana.services import protocol
from mariana.services.assemble import (assemble_and_publish, check_model_side, check_request, data_bytes,
                                       job_validation, validate_exports, written_before)
from mariana.services.coord_state import (MAX_RECONCILE_ROUNDS, MAX_RESENDS, POINT_SECONDS, TICK_SECONDS, JobRun,
                                          REFUSED, JobStopped, Stall, job_ledger)
from mariana.services.jobspec import JobSpec
from mariana.services.creative_cache import creative_table, ensure_cached, featurize_creatives
from mariana.services.ledger import STAGES, ChunkInfo, next_refills, parse_step, reissue_leases_of
from mariana.services.protocol import Message
from mariana.services.runtime import failpoints, memwatch, model_events
from mariana.services.runtime.redis_url import redact
from mariana.services.runtime.tuning import release_freed_memory
from mariana.services.sample_cache import CacheRefused
from mariana.services.transport import PeerTimeout, RemoteError
from mariana.sparse.errors import MarianaError
from mariana.sparse.metrics import histogram_auc
from mariana.sparse.parse import describe_bad
from mariana.trainer.strategies.local import best_epoch, valid_record

log = logging.getLogger(__name__)
REDIS_PING_SECONDS = 2.0  # how often a running job's Redis is checked (`check_redis`)


def check_shards(run: JobRun, shards: int) -> None:
    """MarianaError for a job resumed by a coordinator whose config has another ps.count than
    the one the job started with: its tables are split that many ways, on those shards."""
    n = run.request.get("ps_count")
    if n is not None and n != shards:
        raise MarianaError(f"job {run.id} started with ps.count = {n}, and the coordinator restarted with "
                           f"ps.count = {shards}: the job's tables are split {n} ways, so it cannot go on; "
                           "submit it again")


class JobRunner:
    """Runs the coordinator's jobs one at a time: start the shards, stream the source, lease
    steps epoch by epoch, reconcile, validate, export and publish (`run_job`); the periodic
    tick and history points; a job's phase and failure. State stays on the coordinator."""

    def __init__(self, coord):
        self.coord = coord

    async def tick(self) -> None:
        last_point = 0.0
        while True:
            await asyncio.sleep(TICK_SECONDS)
            run = self.coord.active()
            if run is None:
                continue
            try:
                await self.tick_job(run)
                sample_rss(self.coord, run)
                if time.monotonic() - last_point >= POINT_SECONDS:
                    last_point = time.monotonic()
                    add_point(self.coord, run)
                    self.coord.book.save(run)
            except Exception:  # a bug here must not stop leases from lapsing for good
                log.exception("%s: job %s: periodic check failed", self.coord.name, run.id)

    async def tick_job(self, run: JobRun) -> None:
        await watch_job(self, run)
        for step, worker in run.ledger.expire_leases():
            log.warning("%s: job %s: lease of %s by %s lapsed; issuing it again", self.coord.name, run.id,
                        step, worker)
            self.coord.pulse()
        for c in run.ledger.chunks_overdue(self.coord.cfg.coordinator.chunk_seconds):
            if c.resends >= MAX_RESENDS:
                self.coord.book.journal(run, "lost", {"chunk": c.id})
                log.error("%s: job %s: chunk %s never cached after %d tries; lost", self.coord.name, run.id,
                          c.id, c.resends)
                await self.pump_refills(run)
                self.coord.pulse()
                continue
            log.warning("%s: job %s: chunk %s not cached after %.0fs; reading it again", self.coord.name,
                        run.id, c.id, self.coord.cfg.coordinator.chunk_seconds)
            await self.resend(run, c)

    async def run_job(self, run: JobRun) -> None:
        led = run.ledger
        run.baseline = self.coord.bad_message_counts()
        if run.state == "running":  # restored from the journal after a restart
            log.info("%s: job %s goes on at epoch %d (restart %d)", self.coord.name, run.id, led.epoch, run.restarts)
        else:
            run.state, run.started = "running", time.time()
            run.request["ps_count"] = len(self.coord.shards)  # its rows' split: a resumed job needs the same
            self.coord.book.journal(run, "start", {"t": run.started})
            self.coord.book.save(run)
            log.info("%s: job %s started: %s, %d epochs, mode %s, data %s%s%s", self.coord.name, run.id,
                     run.request["model"], led.epochs, run.request["mode"], ",".join(run.request["data"]),
                     f" (validation: {run.request['holdout']['source']})" if run.request.get("holdout") else "",
                     f", warm start from {run.request['init_from']}" if run.request.get("init_from") else "")
        try:
            check_shards(run, len(self.coord.shards))
            if led.published is not None:  # restarted after writing the version: only the end was left
                log.info("%s: job %s: %s/%s was published before the restart; ending the job", self.coord.name,
                         run.id, led.published.get("model_dir"), led.published.get("model_version"))
                await self.complete(run, dict(led.published))
                return
            if run.spec.config.images.creatives and run.spec.images is None:
                await prepare_images(self.coord, run)  # before any shard or preprocess reads the spec
            for i in range(len(self.coord.shards)):
                await self.start_shard(run, i)  # returns when the job failed waiting (watch_job)
            if not led.source_done and run.state == "running":
                await self.read_source(run)  # a loader that is reading it already goes on
            while led.epoch <= led.epochs:
                await self.until(run, led.epoch_complete)
                await self.reconcile(run)
                log.info("%s: job %s: epoch %d done: %d rows, %.2fs", self.coord.name, run.id, led.epoch,
                         led.rows_done[led.epoch], time.time() - led.epoch_started)
                epoch, valid = led.epoch, None
                if job_validation(run.request):  # the workers wait: the export is of this epoch alone
                    valid = await self.coord.validation.validate(run)
                    if self.coord.validation.stop_early(run, valid):
                        self.coord.book.journal(run, "stop", {"epochs": epoch})
                self.coord.book.journal(run, "epoch", {"t": time.time()})
                if valid is not None:
                    self.coord.book.journal(run, "valid", {"epoch": epoch, "metrics": valid})
                self.coord.pulse()
            await self.finish(run)
        except JobStopped:
            pass
        except (MarianaError, OSError) as e:
            self.fail(run, str(e))
        except asyncio.CancelledError:
            if not self.coord.stopping.is_set():
                self.fail(run, "the coordinator stopped")
            else:  # left running in the job store: it goes on when the coordinator starts again
                log.info("%s: job %s left running at epoch %d; it resumes when the coordinator starts",
                         self.coord.name, run.id, led.epoch)
            raise
        except Exception as e:  # a bug: the job fails visibly instead of staying "running"
            log.exception("%s: job %s: unexpected error", self.coord.name, run.id)
            self.fail(run, f"internal error: {type(e).__name__}: {e}")
        finally:
            if run.state != "done" and run.state != "running":
                await self.cleanup(run)

    async def until(self, run: JobRun, cond) -> None:
        while not cond():
            if run.state != "running":
                raise JobStopped()
            try:
                await asyncio.wait_for(self.coord.wake.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def start_shard(self, run: JobRun, i: int) -> None:
        delay = 0.2
        while run.state == "running":
            try:
                reply = await self.coord.shards[i].call("StartJob", job=run.id, spec=run.spec.to_dict(), timeout=10.0)
                run.warn(reply.get("warning"), f"ps-{i}")  # its tables too big for its memory
                unstall(run, f"ps-{i}")
                return
            except RemoteError as e:  # the shard is up and refuses the job: retrying will not help
                raise MarianaError(f"shard {i} cannot start the job: {e}") from None
            except PeerTimeout as e:
                log.warning("%s: job %s: shard %d not ready: %s", self.coord.name, run.id, i, e)
                stall(self.coord, run, f"ps-{i}", f"ps-{i}", "it did not answer StartJob")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def read_source(self, run: JobRun) -> None:
        """Tell the loader to read the job's files (but a held-out tail: `until`, where it starts)."""
        until = {"until": run.request["holdout"]["until"]} if run.request.get("holdout") else {}
        while not await self.coord.command("loader", "ReadSource", job=run.id, files=run.request["data"],
                                     block_bytes=run.spec.config.data.block_bytes, **until):
            if run.state != "running":
                raise JobStopped()
            await asyncio.sleep(0.2)  # the loader has not registered yet

    async def missing_steps(self, run: JobRun) -> tuple[set[str], list[dict]]:
        """(the steps done so far that some shard has not applied (restored from a checkpoint),
        each shard's rows applied by epoch), from one ShardStats round."""
        expected = run.ledger.expected_steps() - run.ledger.lost
        missing: set[str] = set()
        rows = []
        for i in range(len(self.coord.shards)):
            stats = await self.shard_call(run, i, "ShardStats")
            if "applied" not in stats.arrays:
                raise MarianaError(f"shard {i} answered ShardStats without its applied steps")
            missing |= expected - set(protocol.array_names(stats.arrays["applied"]))
            rows.append(stats["rows"])
        return missing, rows

    async def reconcile(self, run: JobRun) -> list[dict]:
        """Every shard must have applied every step so far; replay what one lacks. Returns each
        shard's rows applied by epoch once none lacks a step."""
        led = run.ledger
        for _ in range(MAX_RECONCILE_ROUNDS):
            missing, rows = await self.missing_steps(run)
            if not missing:
                return rows
            n = len(missing & led.done)
            self.coord.book.journal(run, "replay", {"steps": sorted(missing)})
            log.warning("%s: job %s: shards lack %d steps (restored from a checkpoint); replaying",
                        self.coord.name, run.id, n)
            self.coord.pulse()
            await self.until(run, led.epoch_complete)
        raise MarianaError(f"job {run.id}: shards still lack steps after {MAX_RECONCILE_ROUNDS} replays")

    async def shard_call(self, run: JobRun, i: int, type_: str, **fields) -> Message:
        """A request to shard i for this job, retried while the shard restarts."""
        delay = 0.2
        while True:
            if run.state != "running":
                raise JobStopped()
            try:
                reply = await self.coord.shards[i].call(type_, job=run.id, **fields, timeout=60.0)
            except (PeerTimeout, RemoteError) as e:
                log.warning("%s: job %s: shard %d: %s: %s", self.coord.name, run.id, i, type_, e)
                if isinstance(e, PeerTimeout):
                    stall(self.coord, run, f"ps-{i}", f"ps-{i}", f"it did not answer {type_}")
                elif e.code != "UnknownJob":
                    raise MarianaError(f"shard {i} refused {type_}: {e}") from None
                else:
                    await self.start_shard(run, i)  # it restarted: give it the job (it restores)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            unstall(run, f"ps-{i}")
            return reply

    async def finish(self, run: JobRun) -> None:
        led = run.ledger
        failpoints.reached("coordinator.epochs_done")  # tests: a shard restarted before the export
        for _ in range(MAX_RECONCILE_ROUNDS):
            applied = await self.reconcile(run)  # a shard restarted since the last epoch's end: its steps again
            self.set_phase(run, f"exporting the tables of {len(self.coord.shards)} shard(s)")
            done = sum(led.rows_done.values())
            if done and not any(int(n) for a in applied for n in a.values()):
                raise MarianaError(f"the shards hold none of the {done:,} rows this job applied (their state was "
                                   "dropped): nothing published")
            record = await written_before_restart(self.coord, run)
            if record is None:
                record = await sampled(self.coord, run, publish(self, run))  # None: a shard restarted meanwhile
                if record is None:
                    continue
                failpoints.reached("coordinator.version_written")  # tests: the window before the journal
            break
        else:
            raise MarianaError(f"job {run.id}: shards kept losing steps during the export "
                               f"({MAX_RECONCILE_ROUNDS} tries): nothing published")
        rows_applied = [min(int(a.get(str(e), 0)) for a in applied) for e in range(1, led.epochs + 1)]
        record.update({
            "rows_applied": sum(rows_applied),
            "rows_applied_per_epoch": rows_applied,
            "rows_in_data": led.counters["rows_in_data"],
            "rows_lost": sum(led.batch_rows.get(parse_step(s)[1], 0) for s in led.lost),
            "lines_lost": led.counters["lines_lost"],
            "batches_reissued": led.counters["batches_reissued"],
            "batches_replayed": led.counters["batches_replayed"],
            "row_count_mismatches": led.counters["row_count_mismatches"],
            **{k: led.counters[k] for k in ("cache_hits", "cache_misses", "ramped_steps")},
            "bad_messages": self.coord.bad_messages_since(run.baseline),
            "stage_seconds": {s: round(led.stage_seconds[s], 3) for s in STAGES},
            "mode": run.request["mode"], "staleness": led.staleness, "ramp_steps": led.ramp,
            "workers": self.coord.cfg.worker.count, "ps": self.coord.cfg.ps.count,
            "preprocess": self.coord.cfg.preprocess.count, "job": run.id,
        })
        if run.peak_rss_mb:  # else (a job shorter than a tick) the coordinator's own, as publish_version gave it
            record["peak_rss_mb"] = round(run.peak_rss_mb, 1)
        if run.state != "running":  # cancelled before its version was written (a cancel is refused after)
            raise JobStopped()
        # Journaled before the shards drop the job: a coordinator restarted from here on ends the
        # job with this record; it never exports again (from shards that hold nothing any more).
        try:
            self.coord.book.journal(run, "published", {"record": record})
        except (MarianaError, OSError) as e:  # the version is out, CURRENT moved: the job is done all the same
            log.error("%s: job %s: %s/%s is published, but the job store could not record it (%s): a coordinator "
                      "restarted before the job ends would export it again", self.coord.name, run.id,
                      record["model_dir"], record["model_version"], e)
        await self.complete(run, record)

    async def complete(self, run: JobRun, record: dict) -> None:
        """A published job's end: the shards and cached batches let go, the job done, servers told."""
        await self.cleanup(run)  # a job reported done holds nothing any more (shards, cached batches)
        run.record, run.state, run.ended = record, "done", time.time()
        self.coord.book.ended(run)
        log.info("%s: job %s done: %s/%s, %d rows applied of %d x %d epochs, auc %s", self.coord.name, run.id,
                 record["model_dir"], record["model_version"], record["rows_applied"],
                 record["rows_in_data"], run.ledger.epochs, record.get("auc"))
        if record.get("bad_rows"):  # as local mode warns (the manifest's train.parse names the first)
            log.warning("%s: job %s skipped %d malformed training rows per pass (first: %s)", self.coord.name,
                        run.id, record["bad_rows"], describe_bad(run.ledger.first_bad, 3))
        await announce(self.coord, record)

    async def cleanup(self, run: JobRun) -> None:
        timeout = 2.0 if self.coord.stopping.is_set() else 10.0  # shutting down: do not outwait the drain
        for i, shard in enumerate(self.coord.shards):
            try:
                await shard.call("EndJob", job=run.id, timeout=timeout)
            except (PeerTimeout, RemoteError) as e:
                log.warning("%s: job %s: EndJob on shard %d: %s", self.coord.name, run.id, i, e)
        try:
            await self.coord.cache.drop_job(run.id)
        except MarianaError as e:
            log.warning("%s: job %s: could not drop cached batches: %s", self.coord.name, run.id, e)
        self.coord.pulse()

    def set_phase(self, run: JobRun, text: str) -> None:
        """What the job does once its epochs are done (status, the web UI and the CLI show it);
        called from the publishing thread too (one attribute store)."""
        run.phase = text
        log.info("%s: job %s: %s", self.coord.name, run.id, text)

    def fail(self, run: JobRun, error: str) -> None:
        if run.state in ("done", "failed", "cancelled"):
            return
        run.state, run.error, run.ended = "failed", error, time.time()
        log.error("%s: job %s failed: %s", self.coord.name, run.id, error)
        self.coord.book.ended(run)
        self.coord.pulse()

    async def pump_refills(self, run: JobRun) -> None:
        """Read missed chunks again, a few at a time (two per preprocess instance). A chunk
        cached and then missing again and again in one epoch fails the job: its batches do not
        stay where the workers read (a loop at 0 rows, with a green status, before)."""
        for c in next_refills(run.ledger, 2 * self.coord.cfg.preprocess.count):
            if c.misses[1] > MAX_RESENDS:
                self.fail(run, f"chunk {c.id} was cached {c.misses[1]} times in epoch {c.misses[0]} and each time "
                               "a worker found its batches missing: preprocess and the workers do not use one Redis "
                               "(every host's redis.url must name the same server and database), or Redis drops "
                               "keys as it fills (its maxmemory-policy must be noeviction)")
                return
            await self.send_resend(run, c)

    async def resend(self, run: JobRun, c: ChunkInfo) -> None:
        run.ledger.chunk_resent(c)
        await self.send_resend(run, c)

    async def send_resend(self, run: JobRun, c: ChunkInfo) -> None:
        await self.coord.command("loader", "Resend", job=run.id, chunk=c.id, file=c.file, offset=c.offset,
                           length=c.length, first_line=c.first_line, lines=c.lines, files=run.request["data"])


def add_point(coord, run: JobRun) -> None:
    """A history point: rows, rows/s, and the loss and progressive AUC of the steps
    done since the previous point."""
    led, now = run.ledger, time.time()
    rows = sum(led.rows_done.values())
    loss = sum(led.loss_sum.values())
    hist = sum(led.hist.values()) if led.hist else None
    t0, rows0, loss0, hist0 = run.last_point or (run.started or now, 0, 0.0, None)
    if rows == rows0 and run.state == "running":
        return  # nothing new: no flat stretch of points while the job waits (the next one's rate spans it)
    run.last_point = (now, rows, loss, hist)
    d_hist = None if hist is None else hist - (0 if hist0 is None else hist0)
    d_rows = rows - rows0
    coord.store.add_point(run.id, {
        "t": round(now, 3), "epoch": min(led.epoch, led.epochs), "rows_total": rows,
        "rows_per_s": round(d_rows / max(now - t0, 1e-9), 1),
        "loss": (loss - loss0) / d_rows if d_rows > 0 else None,
        "auc": histogram_auc(d_hist[0], d_hist[1]) if d_hist is not None and d_rows > 0 else None})


def sample_rss(coord, run: JobRun) -> None:
    """The job's peak_rss_mb: the largest resident set of one process of the cluster while
    it ran, the coordinator's now and each service's last heartbeat (not the coordinator's
    own lifetime peak, VmHWM, which a job before this one may have set)."""
    within = coord.cfg.coordinator.heartbeat_seconds  # a service gone since: its last number is not of this job
    beats = [s.status.get("resident_memory_bytes") for s in coord.services.values()
             if s.role != "coordinator" and s.alive(within)]
    now = [memwatch.rss_bytes()] + [v for v in beats if isinstance(v, (int, float))]
    run.peak_rss_mb = max(run.peak_rss_mb, max(now) / (1 << 20))


async def sampled(coord, run: JobRun, work):
    """`work`'s result, the job's peak_rss_mb sampled every tick while it runs. The periodic
    tick samples only while steps go out, and the export and assembly that follow are when the
    coordinator holds the whole model: a job's record said 928 MB while the coordinator's
    resident set reached 3.6 GB (an LR at bits 28 over 4 shards)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            sample_rss(coord, run)
            done, _ = await asyncio.wait({task}, timeout=TICK_SECONDS)
            if done:
                return task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise


async def announce(coord, record: dict) -> None:
    """Tell model servers (Redis pub/sub) that a version was written."""
    promoted = record.get("promoted", True)
    await model_events.publish_async(coord.cache.redis, "trained" if promoted else "candidate",
                                     record["model_dir"], record["model_version"],
                                     record["model_version"] if promoted else None)


async def rejoined(runner: JobRunner, run: JobRun, role: str, name: str) -> None:
    """What a service that restarted mid-job lost goes out again now, not after a lease
    (coordinator.lease_seconds) or a chunk (chunk_seconds) times out: a worker's leased
    steps; and the chunks in flight, which a restarted loader or preprocess may have held
    (those that were not are cached twice, the same batches under the same keys)."""
    coord = runner.coord
    if role == "worker":
        n = reissue_leases_of(run.ledger, name)
        if n:
            log.info("%s: job %s: %s restarted; its %d leased steps issued again now", coord.name, run.id, name, n)
            coord.pulse()
    elif role in ("loader", "preprocess"):
        lost = run.ledger.chunks_overdue(0.0)
        if lost:
            log.info("%s: job %s: %s restarted; reading its %d chunks in flight again now", coord.name, run.id,
                     name, len(lost))
        for c in lost:
            await runner.resend(run, c)


# ---- what a running job waits for ------------------------------------------------------------
#
# A job that waits says so: each stall (a shard that does not answer, no live worker, loader or
# preprocess while the job needs one, Redis away) is its phase, which the client and `mariana
# status` show instead of "0 rows". A stall that lasts longer than cluster.start_seconds (Redis:
# redis.retry_seconds, as long as the services themselves wait for it) fails the job with that
# line: by then the service is not restarting (the supervisor brings one back in seconds), and
# waiting on would only hide it. Redis refusing the credentials fails the job at once.

def stall(coord, run: JobRun, key: str, who: str, why: str) -> None:
    """`run` waits for `who` (`key`: one stall per service, or "worker", "redis")."""
    held = run.stalls.get(key)
    why = why.rstrip(".")
    if held is None or held.why != why:
        run.stalls[key] = Stall(who, why, held.since if held else time.monotonic())
        log.warning("%s: job %s: %s", coord.name, run.id, run.stalls[key].text())


def unstall(run: JobRun, key: str, why: str | None = None) -> None:
    """`key` no longer holds the job up (only if the stall says `why`, when given)."""
    held = run.stalls.get(key)
    if held is not None and (why is None or held.why == why):
        del run.stalls[key]


def needed(cfg, led) -> list[tuple[str, str, list[str]]]:
    """(key, who, instances of which one must be alive) for what the job needs now: the loader and
    preprocess while the source is read (or chunks read again), workers while steps are out, the
    shards in both cases. Between epochs and after them a job needs none of them on a heartbeat
    (its own calls to the shards stall on their own)."""
    def some(role: str) -> tuple[str, str, list[str]]:
        n = cfg.count(role)
        return role, f"{role}-0" if n == 1 else f"any {role}", [f"{role}-{i}" for i in range(n)]

    reading = not led.source_done or bool(led.refill)
    training = bool(led.ready or led.leased) and not led.epoch_complete()
    out = [(f"ps-{i}", f"ps-{i}", [f"ps-{i}"]) for i in range(cfg.ps.count)] if reading or training else []
    if reading:
        out += [("loader-0", "loader-0", ["loader-0"]), some("preprocess")]
    if training:
        out.append(some("worker"))
    return out


async def watch_job(runner: JobRunner, run: JobRun) -> None:
    """The job's stalls from the services' heartbeats and a PING of Redis (every tick); the job
    fails when one has lasted too long (see above)."""
    coord, cfg = runner.coord, runner.coord.cfg
    quiet = 2 * cfg.coordinator.heartbeat_seconds  # twice what `mariana status` calls dead: no flicker
    silent = f"no heartbeat in {quiet:g}s"
    wanted = needed(cfg, run.ledger)
    if time.time() - coord.boot > quiet:  # a coordinator just (re)started has not heard from all yet
        for key, who, names in wanted:
            held = run.stalls.get(key)
            ours = held is not None and held.why.startswith(silent)  # a shard's unanswered request says more
            if any(n in coord.services and coord.services[n].heard(quiet) for n in names):  # a restart's grace
                if ours:
                    del run.stalls[key]
            elif held is None or ours:
                stall(coord, run, key, who, silence(coord, names, silent))
        for key in set(run.stalls) - {k for k, _, _ in wanted} - {"redis"}:
            if run.stalls[key].why.startswith(silent):
                del run.stalls[key]  # not needed any more
    try:
        await check_redis(coord, run, bool(wanted))
    except CacheRefused as e:
        runner.fail(run, str(e))
        return
    now = time.monotonic()
    for key, held in list(run.stalls.items()):
        bound, setting = ((cfg.redis.retry_seconds, "redis.retry_seconds") if key == "redis"
                          else (cfg.cluster.start_seconds, "cluster.start_seconds"))
        if now - held.since > bound:
            refused = "; ".join(f"{n}: {why}" for n, (_, why) in sorted(coord.refused.items()))
            runner.fail(run, f"gave up waiting for {held.who} after {bound:g}s ({setting}): {held.why}" + (
                "" if held.refused else f"; the coordinator refuses {refused}" if refused else
                "; is it running? (`mariana status`; start it and submit the job again)"))
            return


def silence(coord, names: list[str], silent: str) -> str:
    """Why none of `names` is heard from: `silent`, and the coordinator's refusal of those it
    refused (they exited: a restart with the same config is refused again)."""
    refused = [f"{n}: {coord.refused[n][1]}" for n in names if n in coord.refused]
    if refused:
        return f"{silent}; {REFUSED} " + "; ".join(refused)
    stopped = [n for n in names if n in coord.services and coord.services[n].stopped]
    return f"{silent}, {' and '.join(stopped)} said it stopped" if stopped else silent


async def check_redis(coord, run: JobRun, needed_now: bool) -> None:
    """A PING of the sample cache's Redis every couple of seconds while the job reads or writes
    batches: a stall while it does not answer; CacheRefused when it refuses the credentials."""
    if not needed_now:
        unstall(run, "redis")
        return
    if time.monotonic() - run.redis_checked < REDIS_PING_SECONDS:
        return
    run.redis_checked = time.monotonic()
    away = await coord.cache.ping()
    if away is None:
        unstall(run, "redis")
    else:
        stall(coord, run, "redis", f"the sample cache's Redis at {redact(coord.cfg.redis.url)}", away)


# ---- a job's image features (the featurizer stage) ----------------------------------------

async def prepare_images(coord, run: JobRun) -> None:
    """The featurizer stage's batch job: embed the creatives not cached in Redis yet,
    and name their cache in the spec that preprocess, workers and shards read."""
    cfg = run.spec.config.images
    log.info("%s: job %s: image features of %s", coord.name, run.id, cfg.creatives)
    info = await featurize_creatives(coord.cache, cfg, coord.counters)
    info.pop("ids")
    run.spec = dataclasses.replace(run.spec, images={"redis_key": info["redis_key"], "dim": info["dim"],
                                                     "field": cfg.field, "set": info["set"], "info": info})
    coord.book.save(run)


async def image_table(coord, run: JobRun):
    """The job's creatives that have cached features: the table its model version stores."""
    if run.spec.images is None:
        return None
    from mariana.trainer.images import load_creative_set

    img, cfg = run.spec.images, run.spec.config.images
    # Redis may have restarted
    await ensure_cached(coord.cache, cfg, img["redis_key"], img["set"], coord.counters)
    cset = await asyncio.to_thread(load_creative_set, cfg.creatives)
    return await creative_table(coord.cache, img["redis_key"], int(img["dim"]), cset.ids)


class EpochValidation:
    """After each epoch: score the model on the job's validation rows, stop early, and pick
    the export a job with `epochs = "auto"` publishes."""

    def __init__(self, coord):
        self.coord = coord

    async def validate(self, run: JobRun) -> dict:
        """Score the model as it stands after this epoch on the job's validation rows (its
        valid_data files, or the tail of its data it holds out); keep the shards' export of the
        best epoch so far (`epochs = "auto"` publishes it)."""
        led, valid = run.ledger, job_validation(run.request)
        names = valid.source if valid.rows else ", ".join(os.path.basename(p) for p in valid.paths)
        if self.coord.inputs.enabled:  # copies of the rows, fetched from the loader's host once
            if not self.coord.inputs.fetched(run.id):
                self.coord.job_runner.set_phase(run, f"fetching the validation rows ({names}) from the loader")
            valid = await self.coord.inputs.validation(run.id, run.request)
        self.coord.job_runner.set_phase(run, f"validating epoch {led.epoch} on {names}")
        call = self.coord.job_runner.shard_call
        exports = [(await call(run, i, "Export")).arrays for i in range(len(self.coord.shards))]
        images = await image_table(self.coord, run)
        metrics = await asyncio.to_thread(validate_exports, run.spec, exports, images, valid)
        run.phase = None
        best = run.best_export
        if run.state == "running" and metrics["logloss"] is not None and (best is None or metrics["logloss"] < best[1]):
            run.best_export = (led.epoch, metrics["logloss"], exports)
        log.info("%s: job %s: epoch %d: valid logloss %s, auc %s", self.coord.name, run.id, led.epoch,
                 metrics["logloss"], metrics["auc"])
        return metrics

    def stop_early(self, run: JobRun, valid: dict) -> bool:
        """`epochs = "auto"`: no better validation logloss for `train.patience` epochs."""
        train = run.spec.config.train
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
        train = run.spec.config.train
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


async def publish(runner: JobRunner, run: JobRun) -> dict | None:
    """Export the shards' tables (or the best epoch's, kept), assemble, evaluate, write a version;
    None when a shard lost steps during the export (restarted from a checkpoint): nothing written."""
    exports = [(await runner.shard_call(run, i, "Export")).arrays for i in range(len(runner.coord.shards))]
    if (await runner.missing_steps(run))[0]:
        log.warning("%s: job %s: a shard lost steps during the export (restarted); replaying them first",
                    runner.coord.name, run.id)
        return None
    failpoints.reached("coordinator.exported")  # tests: exported, nothing written (the shards keep the job)
    exports, valid = runner.coord.validation.kept_export(run, exports)
    run.best_export = None
    images = await image_table(runner.coord, run)
    train_seconds = time.time() - run.started
    tests = run.request["test_data"]
    if tests and runner.coord.inputs.enabled:
        runner.set_phase(run, f"fetching {', '.join(os.path.basename(p) for p in tests)} from the loader")
        tests = await runner.coord.inputs.test_paths(run.id, tests)

    def before_write() -> None:  # on the thread: a job cancelled while it was evaluated writes nothing
        if not run.begin_writing():
            raise JobStopped()

    return await asyncio.to_thread(assemble_and_publish, run.request, run.spec, exports, run.ledger,
                                   len(runner.coord.shards), train_seconds, images,
                                   lambda text: runner.set_phase(run, text), valid, tests, before_write)


async def written_before_restart(coord, run: JobRun) -> dict | None:
    """After a coordinator restart, the record of the version this job wrote before it
    (killed after writing, before journaling "published"): the job ends with that one
    instead of writing the same model again. None: no restart, or no version written."""
    if not run.restarts:
        return None
    record = await asyncio.to_thread(written_before, run.request, run.ledger, len(coord.shards), run.started)
    if record is not None:
        log.info("%s: job %s: %s/%s was written before the restart; ending the job with it", coord.name, run.id,
                 record["model_dir"], record["model_version"])
    return record


class JobJournal:
    """Jobs in the coordinator's job store: a new job, the journal of ledger changes written
    before they are acknowledged, a job saved and ended, and all of it read back at start."""

    def __init__(self, coord):
        self.coord = coord

    def restore(self) -> None:
        """Jobs from the job store: ended ones as they were, queued ones queued again, and a
        running one rebuilt from its journal, to go on where it was."""
        for saved in self.coord.store.load_jobs():
            try:
                run = JobRun.from_saved(saved)
            except (MarianaError, KeyError, TypeError, ValueError, AttributeError) as e:
                self.unreadable(saved, e)
                continue
            self.coord.jobs[run.id] = run
            if run.state == "running":
                run.restarts += 1
                events = 0
                try:
                    for kind, data in self.coord.store.events(run.id):
                        try:
                            run.ledger.apply(kind, data)
                        except (KeyError, TypeError, ValueError) as e:
                            if kind not in ("done", "sent"):  # a chunk, an epoch, a stop: the job cannot go on right
                                raise
                            log.warning("%s: job %s: journal event %s left out: %s", self.coord.name, run.id, kind, e)
                            continue  # a step done is done again; a chunk sent is read again
                        events += 1
                except (KeyError, TypeError, ValueError) as e:
                    del self.coord.jobs[run.id]
                    self.unreadable(saved, e, f"its journal does not replay (a {kind} event)")
                    continue
                led = run.ledger
                log.info("%s: job %s resumed from %d journal events: epoch %d/%d, %d steps done, source %s",
                         self.coord.name, run.id, events, led.epoch, led.epochs, len(led.done),
                         "read" if led.source_done else "being read")
                self.save(run)
            if run.state in ("queued", "running"):
                self.coord.queue.put_nowait(run.id)
        if self.coord.jobs:
            log.info("%s: %d jobs in %s", self.coord.name, len(self.coord.jobs), self.coord.store.path)

    def unreadable(self, saved, e: Exception, what: str = "its saved spec does not read") -> None:
        """A saved job this version cannot rebuild (its spec no longer passes a check added
        since, or a damaged row): left out of the job list, with a warning, never a coordinator
        that cannot start. One that was queued or running is saved as failed, saying why."""
        d = saved if isinstance(saved, dict) else {}
        job, state = d.get("id", "?"), d.get("state", "?")
        log.warning("%s: job %s (%s) in %s does not read under this version: %s; left out of the job list%s",
                    self.coord.name, job, state, self.coord.store.path, e,
                    "; marked failed" if state in ("queued", "running") else "")
        if state in ("queued", "running") and isinstance(d.get("submitted"), (int, float)):
            d.update(state="failed", ended=time.time(),
                     error=f"not resumed after a coordinator restart: {what}: {e}")
            self.coord.store.save_job(job, d, d["submitted"])

    def journal(self, run: JobRun, kind: str, data: dict):
        """A ledger change, recorded before it is acknowledged; returns what the ledger did
        (False: nothing new). Raises ValueError for a bad event, changing nothing."""
        changed = run.ledger.apply(kind, data)
        if changed is not False:
            self.coord.store.append(run.id, kind, data)
        return changed

    def save(self, run: JobRun) -> None:
        self.coord.store.save_job(run.id, run.to_saved(), run.submitted)

    def ended(self, run: JobRun) -> None:
        """A job reached done, failed or cancelled: freeze its numbers, keep its history,
        drop its journal."""
        add_point(self.coord, run)
        self.coord.inputs.forget(run.id)
        run.best_export = None  # a whole model (the shards' tables): a cancelled or failed job kept it for good
        run.final = run.to_saved()["final"]
        try:
            self.save(run)
            self.coord.store.drop_events(run.id)
        except (MarianaError, OSError) as e:  # a full disk: the job ended all the same, and status shows it
            log.error("%s: job %s %s, but the job store could not record its end (%s): a coordinator restarted "
                      "before it can may resume the job", self.coord.name, run.id, run.state, e)
        release_freed_memory()  # its model, test rows and tables: the coordinator idles between jobs

    def new_job(self, body: dict, checked: tuple[dict, dict, int] | None = None) -> JobRun:
        """A job from its body, checked here (`check_request`), or, with `checked` = (request,
        spec, data bytes) from the loader's `check_data`, only its model side checked here."""
        if checked is None:
            request, spec = check_request(body, self.coord.cfg.worker.count)
            size = data_bytes(request)
        else:
            request, spec = check_model_side(body, checked[0], JobSpec.from_dict(checked[1]))
            size = checked[2]
        job = time.strftime("j%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)
        return JobRun(job, request, spec, job_ledger(job, request, spec, size))
