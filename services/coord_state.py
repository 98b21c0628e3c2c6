"""The coordinator's records: a service it has heard from, a job it runs (with its ledger), and
the constants its parts share (services/coordinator.py, coord_jobs.py, coord_api.py)."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

from mariana.services.jobspec import JobSpec
from mariana.services.ledger import JobLedger
from mariana.sparse.parse import FIRST_BAD_KEPT

log = logging.getLogger(__name__)
TICK_SECONDS = 0.25
POINT_SECONDS = 1.0      # a history point of the running job this often
REDIS_STATS_SECONDS = 2.0  # /v1/status's Redis INFO is at most this old
ENDED = ("done", "failed", "cancelled")
# A job's counters in /metrics (coord_api), with their help texts: its ledger's, frozen when it ends.
JOB_COUNTERS = {"batches_reissued": "Batches of a job leased again after a lease ran out.",
                "cache_hits": "Steps of a job's epochs after the first whose batch came from the Redis "
                              "sample cache without a refill from the source (epoch 1 reads every batch as it is "
                              "cached).",
                "cache_misses": "Batches of a job a worker found missing from the sample cache.",
                "batches_replayed": "Steps of a job trained again for a shard restored from an "
                                    "older checkpoint."}
# The counter of each role's heartbeat status shown as its throughput: (counter, unit, scale).
RATES = {"worker": ("rows", "rows/s", 1.0), "ps": ("rows_applied", "rows/s", 1.0),
         "preprocess": ("batches", "batches/s", 1.0), "loader": ("bytes_sent", "MB/s", 1e-6)}
MAX_RESENDS = 5
MAX_RECONCILE_ROUNDS = 10
MAX_WARNINGS = 20        # a job's warnings kept (`JobRun.warn`)


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
    restarts: int = 0                  # registrations with a new boot time after the first
    host: str = ""                     # the host it runs on, as it names itself (its node name)
    place: str = ""                    # where its pid names it: its kernel's boot id and pid namespace
    stopped: bool = False              # it said Bye: down now, not heartbeat_seconds later

    def alive(self, within: float) -> bool:
        return not self.stopped and time.time() - self.last_seen <= within

    def heard(self, within: float) -> bool:
        """Heard from within `within` seconds, stopped since or not: a job's grace for a restart."""
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
        self.status, self.last_seen = status, now  # (`stopped` stays: a heartbeat sent before the Bye)


REFUSED = "the coordinator refused"  # in a stall's `why`: the service it waits for exited, told why


@dataclass
class Stall:
    """Something a running job waits for and cannot do without (a shard that does not answer,
    no live worker, Redis away): its phase says so while it lasts (`JobRun.waiting`), and the
    job fails when it lasts too long (services/coord_jobs.py, `watch_job`)."""

    who: str     # "ps-0", "any worker", "the sample cache's Redis at redis://..."
    why: str     # "it did not answer StartJob"
    since: float = field(default_factory=time.monotonic)

    @property
    def refused(self) -> bool:
        """It waits for a service the coordinator refused (`coord_jobs.silence`): that one ran,
        and exited told why; its config, not whether it runs, is what to fix."""
        return REFUSED in self.why

    def text(self) -> str:
        return f"waiting for {self.who}: {self.why}" + ("" if self.refused else " (is it running?)")


@dataclass
class JobRun:
    id: str
    request: dict                  # what was submitted (files, out, epochs, mode, ...)
    spec: JobSpec                  # what services need: config, schema, images, init_from
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
    writing: bool = False          # its version is being written: a cancel comes too late (`begin_writing`)
    stalls: dict[str, Stall] = field(default_factory=dict)  # what it waits for, by key ("ps-0", "worker", "redis")
    redis_checked: float = 0.0     # time.monotonic() of the coordinator's last PING for it (`watch_job`)
    peak_rss_mb: float = 0.0       # the largest RSS of one process of the cluster while it ran (`JobRunner.tick`)
    warnings: list[str] = field(default_factory=list)  # what services warned of about it (`warn`), for its submitter
    _turn: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def begin_writing(self) -> bool:
        """Called by the thread that writes the job's version, just before it does: False when
        the job was cancelled meanwhile (then nothing is written); True, and from now on a
        cancel is refused (`cancel`): a version written, and maybe served, ends its job done."""
        with self._turn:
            if self.state != "running":
                return False
            self.writing = True
            return True

    def cancel(self) -> str:
        """Cancel a queued or running job: "cancelled"; "writing" (refused: its version is
        being written) or "ended" (left as it is) otherwise."""
        with self._turn:
            if self.writing and self.state == "running":
                return "writing"
            if self.state not in ("queued", "running"):
                return "ended"
            self.state, self.ended, self.error = "cancelled", time.time(), "cancelled by request"
            return "cancelled"

    def warn(self, text, who: str) -> None:
        """`who`'s warning about this job (a shard's tables too big for its machine; None or not
        a string: nothing) in the job's summary, where `mariana train --mode cluster` and the web
        UI show it; the same text once (a restarted shard says it again), at most MAX_WARNINGS."""
        line = f"{who}: {text}"
        if isinstance(text, str) and line not in self.warnings and len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(line)

    def summary(self) -> dict:
        out = {"id": self.id, "state": self.state, "error": self.error, "submitted": self.submitted,
               "started": self.started, "ended": self.ended, "model": self.request.get("model"),
               "mode": self.request.get("mode"), "data": self.request.get("data"), "restarts": self.restarts,
               "phase": (self.waiting() or self.phase) if self.state == "running" else None,
               "warnings": list(self.warnings)}
        if self.final is not None:
            out.update(progress=self.final["progress"], cache=self.final["cache"])
        else:
            out.update(progress=self.ledger.progress(), cache=self.ledger.cache_stats())
        if self.record:
            out["record"] = self.record
        return out

    def waiting(self) -> str | None:
        """What the job waits for (its stalls, the longest first), or None."""
        return "; ".join(s.text() for s in sorted(self.stalls.values(), key=lambda s: s.since)) or None

    def epochs(self) -> list[dict]:
        return self.final["epochs"] if self.final is not None else self.ledger.epoch_summaries

    def to_saved(self) -> dict:
        """What the job store keeps of the job (the ledger is its journal)."""
        s = self.summary()
        return {"id": self.id, "request": self.request, "spec": self.spec.to_dict(), "state": self.state,
                "error": self.error, "submitted": self.submitted, "started": self.started, "ended": self.ended,
                "record": self.record, "restarts": self.restarts, "data_bytes": self.ledger.data_bytes,
                "warnings": self.warnings,
                "final": {"progress": s["progress"], "cache": s["cache"], "epochs": self.epochs(),
                          "counters": self.job_counters()}}

    def job_counters(self) -> dict[str, int]:
        """The counters /metrics shows of a job (JOB_COUNTERS): its ledger's while it runs,
        frozen in `final` when it ends ({} for a job that ended before they were kept)."""
        if self.final is not None:
            return dict(self.final.get("counters") or {})
        return {k: self.ledger.counters[k] for k in JOB_COUNTERS}

    @classmethod
    def from_saved(cls, d: dict) -> "JobRun":
        spec, request = JobSpec.from_dict(d["spec"]), d["request"]
        ledger = job_ledger(d["id"], request, spec, d.get("data_bytes", 0))
        run = cls(d["id"], request, spec, ledger, state=d["state"], error=d["error"], submitted=d["submitted"],
                  started=d["started"], ended=d["ended"], record=d.get("record") or {},
                  restarts=d.get("restarts", 0), warnings=list(d.get("warnings") or []))
        if run.state in ENDED:
            run.final = d["final"]
        return run


def job_ledger(job: str, request: dict, spec: JobSpec, data_bytes: int) -> JobLedger:
    """A job's empty ledger (a new job, or one a restarted coordinator replays its journal into)."""
    staleness = {"async": None, "bsp": 0, "ssp": request.get("staleness")}[request["mode"]]
    epochs = spec.config.train.epoch_limit  # "auto": at most max_epochs
    ramp = spec.config.train.ramp_steps  # a number once the submitter resolved it ("auto": an older spec)
    return JobLedger(job, epochs=epochs, staleness=staleness, data_bytes=data_bytes,
                     ramp=ramp if isinstance(ramp, int) else 0)


class JobStopped(Exception):
    """The job was cancelled or failed while the coordinator waited for it."""


def numbers(stats: dict) -> dict:
    """What the ledger reads of a Cached report's stats, for the journal: its numbers, and its
    first malformed rows (`first_bad`: at most FIRST_BAD_KEPT, each a line number, a reason and
    a file name, cut short), never anything else a peer put there."""
    out = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    bad = stats.get("first_bad")
    if isinstance(bad, list):
        out["first_bad"] = [{"line": b["line"], "reason": b["reason"][:300], "file": b["file"][:1000]}
                            for b in bad[:FIRST_BAD_KEPT] if isinstance(b, dict) and type(b.get("line")) is int
                            and isinstance(b.get("reason"), str) and isinstance(b.get("file"), str)]
    return out


def bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)
