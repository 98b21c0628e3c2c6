"""The coordinator's batch ledger of one job, without sockets.

Units: a *chunk* (`f<file>o<offset>`) is a span of source lines the loader
sent; preprocess turns it into batches `<chunk>:<k>` in the sample cache.
A *step* is one batch in one epoch, `e<epoch>/<chunk>:<k>`; shards apply a
step at most once, so issuing a step again is always safe.

    ready   steps waiting for a worker (re-issued and replayed ones go first)
    leased  step -> (worker, deadline); lapsed leases return to ready
    done    steps a worker reported done
    refill  chunk -> steps waiting for it to be cached again (a cache miss);
            such chunks are read again a few at a time (`next_refills`), so a
            miss storm (a restarted Redis) does not swamp preprocess

An epoch is complete when the source is fully cached (epoch 1) and every
step of it is done; then the coordinator asks every shard which steps it has
applied and replays the missing ones (a shard restored from an older
checkpoint) before the next epoch starts.

Every change that must outlive the coordinator goes through `apply(kind, data)`,
which the coordinator also writes to its journal (services/jobstore.py) before
acknowledging it; replaying the journal rebuilds the ledger after a restart.
Leases and cache misses are not journaled: a restored ledger has every step
that is not done back in `ready`, and issuing a step again is always safe.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from mariana.sparse.metrics import HIST_BINS, histogram_auc
from mariana.sparse.parse import FIRST_BAD_KEPT

log = logging.getLogger(__name__)

MAX_OUT = 1_000_000  # lease_cap when it sets no limit
STAGES = ("read", "parse", "image", "hash", "cache", "fetch", "pull", "compute", "push")


def _count_parse(ledger: "JobLedger", counts: dict[str, int], first_bad: list) -> None:
    """A chunk's parse counted once, as local mode's `ParseStats` counts a pass: rows, clicks
    (none: a preprocess of before they were counted, and the job's count is unknown), the
    first malformed rows."""
    ledger.counters["rows_in_data"] += counts.get("rows_ok", 0)
    ledger.counters["bad_rows"] += counts.get("rows_bad", 0)
    if "clicks" not in counts:
        ledger.counters["chunks_without_clicks"] += 1
    else:
        ledger.counters["clicks_in_data"] += counts["clicks"]
    ledger.first_bad.extend(list(first_bad)[:max(0, FIRST_BAD_KEPT - len(ledger.first_bad))])


def chunk_event(c: ChunkInfo, seconds: float) -> dict:
    """The journal's "sent" event of a chunk the loader sent."""
    return {"chunk": {k: v for k, v in asdict(c).items()
                      if k in ("id", "file", "offset", "length", "first_line", "lines")}, "seconds": seconds}


def _issued(ledger: "JobLedger", step: str) -> tuple[int, str] | None:
    """(epoch, batch) of a step reported done; None for one of an epoch that early stopping
    dropped (leased before it stopped: its lease let go, counted, not trained); ValueError for
    one never issued (made up by its sender: a Done of 10**9 rows was counted)."""
    epoch, name = parse_step(step)
    if name not in ledger.batch_rows or epoch < 1:
        raise ValueError(f"{step} is no step of job {ledger.job}")
    if epoch > ledger.epochs:
        ledger.leased.pop(step, None)
        ledger.counters["dropped_epoch_steps"] += 1
        return None
    return epoch, name


def step_id(epoch: int, batch: str) -> str:
    return f"e{epoch}/{batch}"


def parse_step(step: str) -> tuple[int, str]:
    """'e2/f0o0:3' -> (2, 'f0o0:3')."""
    head, _, batch = step.partition("/")
    if not head.startswith("e") or not head[1:].isdigit() or not batch:
        raise ValueError(f"not a step id: {step!r}")
    return int(head[1:]), batch


@dataclass
class ChunkInfo:
    id: str
    file: int
    offset: int
    length: int
    first_line: int
    lines: int
    state: str = "sent"          # sent -> cached; cached -> refill (a miss) -> resent -> cached; lost
    sent_at: float = 0.0
    batches: list[tuple[int, int]] = field(default_factory=list)  # (k, rows)
    resends: int = 0
    misses: tuple[int, int] = (0, 0)  # (epoch, times it was found missing after being cached in that epoch)


@dataclass
class Lease:
    worker: str
    deadline: float


class LedgerReport:
    """What a `JobLedger` reports of its job (status, /metrics, epoch summaries): read
    from its state, changing nothing."""

    def train_auc(self, epoch: int) -> float | None:
        """Progressive AUC of an epoch: every prediction made before its step's update."""
        h = self.hist.get(epoch)
        return None if h is None else histogram_auc(h[0], h[1])

    def fraction(self) -> float:
        """How much of the job is done, 0..1; during epoch 1 an estimate from the bytes cached."""
        if self.epoch > self.epochs:
            return 1.0
        total = self.counters["rows_in_data"]
        if not self.source_done and total:
            seen = sum(c.length for c in self.chunks.values() if c.batches and c.length > 0)
            if seen and self.data_bytes > seen:
                total = total * self.data_bytes / seen
        part = min(1.0, self.rows_done[self.epoch] / total) if total else 0.0
        return round((self.epoch - 1 + part) / self.epochs, 4)

    def progress(self) -> dict:
        e = min(self.epoch, self.epochs)
        finished = self.epoch > self.epochs
        seconds = self.epoch_seconds[-1] if finished and self.epoch_seconds else time.time() - self.epoch_started
        rows = self.rows_done[e]
        return {"epoch": e, "epochs": self.epochs, "rows": rows, "rows_per_s": round(rows / max(seconds, 1e-9), 1),
                "loss": self.loss_sum[e] / rows if rows else None,
                # the queue keeps steps done or out meanwhile (a lease skips them; a journal replayed at a restart
                # leaves every one): a done job said 476 ready of its 238 batches (~1 ms a poll at 20k steps)
                "ready": sum(1 for s in self.ready if s not in self.done and s not in self.leased),
                "leased": len(self.leased), "chunks": len(self.chunks), "batches": len(self.batches),
                "source_done": self.source_done, "fraction": self.fraction(),
                "rows_total": sum(self.rows_done.values())}

    def cache_stats(self) -> dict:
        hits, misses = self.counters["cache_hits"], self.counters["cache_misses"]
        return {"hits": hits, "misses": misses, "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}


@dataclass
class JobLedger(LedgerReport):
    job: str
    epochs: int
    staleness: int | None = None    # None: asynchronous; 0: BSP; k: bounded staleness
    ramp: int = 0                   # train.ramp_steps: steps out at once limited by lease_cap; 0: no limit
    epoch: int = 1
    chunks: dict[str, ChunkInfo] = field(default_factory=dict)
    batches: list[str] = field(default_factory=list)      # batch names in source order
    batch_rows: dict[str, int] = field(default_factory=dict)
    source_done: bool = False
    ready: deque = field(default_factory=deque)
    leased: dict[str, Lease] = field(default_factory=dict)
    done: set = field(default_factory=set)
    refill: dict[str, list[str]] = field(default_factory=dict)
    refill_queue: deque = field(default_factory=deque)    # chunks to read again, in miss order
    lost: set = field(default_factory=set)                # steps that could not be produced
    missed_steps: set = field(default_factory=set)        # steps whose batch had to be read again
    replayed: set = field(default_factory=set)            # steps out again for a shard: loss counted already
    rows_done: Counter = field(default_factory=Counter)   # epoch -> rows reported done
    loss_sum: Counter = field(default_factory=Counter)    # epoch -> summed logloss
    worker_done: Counter = field(default_factory=Counter)  # worker -> steps done first by it
    counters: Counter = field(default_factory=Counter)
    stage_seconds: Counter = field(default_factory=Counter)
    epoch_started: float = field(default_factory=time.time)   # wall clock: it outlives a restart
    epoch_seconds: list[float] = field(default_factory=list)
    epoch_summaries: list[dict] = field(default_factory=list)  # {epoch, seconds, rows, loss, auc} per finished one
    hist: dict = field(default_factory=dict)               # epoch -> (2, bins) positives/negatives per logit bin
    first_bad: list = field(default_factory=list)          # the first malformed rows of the data, as parsed
    data_bytes: int = 0                                    # size of the sources (0: unknown): progress in epoch 1
    published: dict | None = None                          # the record of the version written (then: only the end)

    # ---- the journal ---------------------------------------------------------------------

    def apply(self, kind: str, d: dict):
        """One journaled change; the coordinator records `(kind, d)` when this returns
        anything but False. Raises ValueError (changing nothing) for a bad event."""
        if kind == "start":
            self.epoch_started = float(d["t"])
        elif kind == "sent":
            return self.chunk_sent(ChunkInfo(**d["chunk"]), float(d.get("seconds", 0.0)))
        elif kind == "cached":
            return self.chunk_cached(d["chunk"], d["batches"], d["stats"])
        elif kind == "lost":
            self.chunk_lost(d["chunk"])
        elif kind == "source_done":
            self.source_done = True
        elif kind == "done":
            return self.step_done(d["step"], d["worker"], d["rows"], d["loss_sum"], d.get("times") or {},
                                  d.get("hist"))
        elif kind == "replay":
            return self.replay(set(d["steps"])) > 0
        elif kind == "epoch":
            self.next_epoch(float(d["t"]))
        elif kind == "valid":
            self.epoch_valid(int(d["epoch"]), d["metrics"])
        elif kind == "stop":
            self.stop_after(int(d["epochs"]))
        elif kind == "published":
            if not isinstance(d.get("record"), dict):
                raise ValueError("a published event without its record")
            self.published = dict(d["record"])
        else:
            raise ValueError(f"unknown journal event {kind!r}")
        return True

    # ---- chunks (epoch 1, and refills) -------------------------------------------------

    def chunk_sent(self, c: ChunkInfo, seconds: float = 0.0) -> bool:
        """Record a chunk the loader sent; False when it is known already."""
        if c.id in self.chunks:
            return False
        c.sent_at = time.monotonic()
        self.chunks[c.id] = c
        self.stage_seconds["read"] += seconds
        return True

    def chunk_cached(self, chunk: str, batches: list[tuple[int, int]], stats: dict) -> bool:
        """Record a cached chunk; False for a chunk cached before (a duplicate), or
        one first cached after epoch 1 gave up on it. Raises ValueError, changing
        nothing, for stats that are not numbers."""
        seconds = {stage: float(stats.get(f"{stage}_s", 0.0)) for stage in ("parse", "image", "hash", "cache")}
        counts = {k: int(stats[k]) for k in ("rows_ok", "rows_bad", "clicks") if k in stats}
        image_rows, image_unknown = int(stats.get("image_rows", 0)), int(stats.get("image_unknown", 0))
        batches = [(int(k), int(rows)) for k, rows in batches]
        c = self.chunks.get(chunk)
        if c is None:  # cached before its ChunkSent arrived (a restarted coordinator): accept it
            c = self.chunks[chunk] = ChunkInfo(chunk, -1, -1, 0, 0, 0)
        first_time = c.state in ("sent", "lost") and not c.batches
        if c.state == "cached" or (first_time and self.epoch > 1):
            self.counters["duplicate_chunks"] += 1
            return False
        if first_time and c.state == "lost":
            self.counters["lines_lost"] -= c.lines  # late, but still in epoch 1: not lost after all
        c.batches = batches
        for stage, s in seconds.items():
            self.stage_seconds[stage] += s
        if first_time:
            _count_parse(self, counts, stats.get("first_bad") or [])
            self.counters["creative_lookups"] += image_rows
            self.counters["creatives_unknown"] += image_unknown
            for k, rows in c.batches:
                name = f"{chunk}:{k}"
                self.batches.append(name)
                self.batch_rows[name] = rows
                self.ready.append(step_id(1, name))
        c.state = "cached"
        for step in self.refill.pop(chunk, []):
            self.ready.appendleft(step)
        return True

    def chunks_overdue(self, older_than: float) -> list[ChunkInfo]:  # 0: every chunk in flight
        now = time.monotonic()
        return [c for c in self.chunks.values()
                if c.state in ("sent", "resent") and now - c.sent_at >= older_than and c.file >= 0]

    def chunk_resent(self, c: ChunkInfo) -> None:
        c.sent_at = time.monotonic()
        c.resends += 1

    def chunk_lost(self, chunk: str) -> None:
        """A chunk that cannot be read again: its steps waiting for it are lost."""
        c = self.chunks.get(chunk)
        if c is None:
            return
        c.state = "lost"
        for step in self.refill.pop(chunk, []):
            self.lost.add(step)
        if not c.batches:
            self.counters["lines_lost"] += c.lines

    # ---- leases ------------------------------------------------------------------------------

    def may_lease(self, worker: str, active: set[str]) -> bool:
        """At most `lease_cap` steps out at once; bounded staleness: a worker may not run more
        than `staleness` steps ahead of the slowest active worker (0: a barrier per step, BSP)."""
        if len(self.leased) >= lease_cap(self, len(active | {worker})):
            return False
        if self.staleness is None:
            return True
        held = sum(1 for lease in self.leased.values() if lease.worker == worker)
        floor = min((self.worker_done[w] for w in active | {worker}), default=0)
        return self.worker_done[worker] + held - floor <= self.staleness

    def lease(self, worker: str, seconds: float, workers: int = 1) -> str | None:
        """The next step for `worker`, leased for `seconds`; one leased while `lease_cap` limits
        `workers` workers is counted (`ramped_steps`)."""
        capped = lease_cap(self, workers) < MAX_OUT
        while self.ready:
            step = self.ready.popleft()
            if step in self.done or step in self.leased:
                continue  # done late by a worker whose lease had lapsed, or already out again
            self.leased[step] = Lease(worker, time.monotonic() + seconds)
            self.counters["ramped_steps"] += capped
            return step
        return None

    def release(self, steps: list[str], worker: str) -> int:
        """Steps a worker hands back untrained (it is stopping): first in line again,
        without waiting for their leases to lapse. Returns how many it still held."""
        back = [s for s in steps if (lease := self.leased.get(s)) is not None and lease.worker == worker]
        for step in reversed(back):
            del self.leased[step]
            self.ready.appendleft(step)
        return len(back)

    def expire_leases(self) -> list[tuple[str, str]]:
        """(step, worker) of lapsed leases, now back at the head of the queue."""
        now = time.monotonic()
        lapsed = [(s, lease.worker) for s, lease in self.leased.items() if lease.deadline < now]
        for step, _ in lapsed:
            del self.leased[step]
            self.ready.appendleft(step)
            self.counters["batches_reissued"] += 1
        return lapsed

    def missed(self, step: str) -> str:
        """A worker found the step's batch missing from the cache: wait for its
        chunk to be read again. Returns the chunk (to re-send when new)."""
        self.leased.pop(step, None)
        self.counters["cache_misses"] += 1
        self.missed_steps.add(step)
        chunk = parse_step(step)[1].rsplit(":", 1)[0]
        c = self.chunks.get(chunk)
        if c is not None and c.state == "lost":  # it could not be read again before: do not wait
            self.lost.add(step)
            return ""
        self.refill.setdefault(chunk, []).append(step)
        if c is not None and c.state == "cached":
            c.state, c.misses = "refill", (self.epoch, c.misses[1] + 1 if c.misses[0] == self.epoch else 1)
            self.refill_queue.append(chunk)
            return chunk
        return ""

    def step_done(self, step: str, worker: str, rows: int, loss_sum: float, times: dict,
                  hist: list | None = None) -> bool:
        """Record a step done; False for a duplicate. `hist`: [positives, negatives] per logit bin (the AUC)."""
        if step in self.done:
            self.counters["duplicate_done"] += 1
            return False
        if (found := _issued(self, step)) is None:
            return False
        epoch, name = found
        if self.batch_rows[name] != rows:  # exactly-once counts rows as the chunk's parse gave them
            self.counters["row_count_mismatches"] += 1
            log.warning("job %s: step %s done with %d rows, its batch had %d when first cached", self.job, step,
                        rows, self.batch_rows[name])
        h = _hist(hist)
        seconds = stage_seconds_of(times)
        self.leased.pop(step, None)
        self.done.add(step)
        self.lost.discard(step)
        self.rows_done[epoch] += rows  # (a replay took its rows off; its loss and AUC counts stayed)
        self.worker_done[worker] += 1
        if step not in self.replayed:
            self.loss_sum[epoch] += loss_sum
            if h is not None:
                self.hist[epoch] = self.hist.get(epoch, 0) + h
        self.replayed.discard(step)
        for stage, s in seconds.items():
            self.stage_seconds[stage] += s
        if epoch >= 2 and step not in self.missed_steps:
            self.counters["cache_hits"] += 1
        return True

    # ---- epochs ------------------------------------------------------------------------------

    def epoch_steps(self, epoch: int) -> list[str]:
        return [step_id(epoch, b) for b in self.batches]

    def epoch_complete(self) -> bool:
        if self.epoch == 1 and not (self.source_done and all(
                c.state in ("cached", "lost") for c in self.chunks.values())):
            return False
        while self.ready and self.ready[0] in self.done:  # done late, after its lease lapsed
            self.ready.popleft()
        if self.leased or self.refill or any(s not in self.done for s in self.ready):
            return False
        # past the last epoch (steps replayed before the export): that last epoch's steps
        return all(s in self.done or s in self.lost for s in self.epoch_steps(min(self.epoch, self.epochs)))

    def replay(self, missing: set[str]) -> int:
        """Steps a shard lacks (restored from an older checkpoint) go out again."""
        steps = sorted(missing & self.done)
        for step in steps:
            self.done.discard(step)
            epoch, _ = parse_step(step)
            self.rows_done[epoch] -= self.batch_rows.get(parse_step(step)[1], 0)
            self.replayed.add(step)
            self.ready.appendleft(step)
        self.counters["batches_replayed"] += len(steps)
        return len(steps)

    def next_epoch(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        seconds = round(now - self.epoch_started, 3)
        self.epoch_seconds.append(seconds)
        rows = self.rows_done[self.epoch]
        self.epoch_summaries.append({"epoch": self.epoch, "seconds": seconds, "rows": rows,
                                     "loss": self.loss_sum[self.epoch] / rows if rows else None,
                                     "auc": self.train_auc(self.epoch)})
        self.epoch += 1
        self.epoch_started = now
        if self.epoch <= self.epochs:
            lost_chunks = {c.id for c in self.chunks.values() if c.state == "lost"}
            for step in self.epoch_steps(self.epoch):
                chunk = parse_step(step)[1].rsplit(":", 1)[0]
                (self.lost.add if chunk in lost_chunks else self.ready.append)(step)

    def epoch_valid(self, epoch: int, metrics: dict) -> None:
        """An epoch's validation metrics ({"logloss", "auc", ...}), kept with its summary."""
        if not 1 <= epoch <= len(self.epoch_summaries):
            raise ValueError(f"validation of epoch {epoch}, which has not finished")
        self.epoch_summaries[epoch - 1]["valid"] = dict(metrics)

    def stop_after(self, epochs: int) -> None:
        """Early stopping: the job ends after `epochs` epochs (the one under way)."""
        if not 1 <= epochs <= self.epochs:
            raise ValueError(f"stop after {epochs} epochs of {self.epochs}")
        self.epochs = epochs
        if self.epoch > epochs:  # steps of an epoch that will not run
            dropped = set(self.epoch_steps(self.epoch))
            self.ready = deque(s for s in self.ready if s not in dropped)
            self.lost -= dropped

    def replaying(self) -> bool:
        """Past its last epoch with steps out again (a shard restored after it lacks them)."""
        return self.epoch > self.epochs and bool(self.leased or self.refill or set(self.ready) - self.done)

    def expected_steps(self) -> set[str]:
        """Every step of the epochs so far."""
        return {step_id(e, b) for e in range(1, min(self.epoch, self.epochs) + 1) for b in self.batches}


def lease_cap(led: JobLedger, workers: int) -> int:
    """How many steps may be out at once with `workers` workers: 1 + isqrt(n / ramp) while
    that is under `workers`, n the job's steps done (ever: a replay does not start it again); else
    no limit (`ramp_cap`). W workers' steps are each taken from weights that miss up to W - 1
    others' updates, and AdaGrad's steps are largest at the start: there stale ones broke the
    DNN's dense layers (docs/pipeline.md).

    >>> led = JobLedger("j", epochs=1, ramp=12)
    >>> lease_cap(led, 4), lease_cap(led, 1)  # no step done yet: one at a time; a lone worker: no limit
    (1, 1000000)
    """
    if not led.ramp or workers < 2:
        return MAX_OUT
    return ramp_cap(led.ramp, workers, sum(led.worker_done.values()))


def next_refills(led: JobLedger, in_flight_limit: int) -> list[ChunkInfo]:
    """Chunks to read again now: at most `in_flight_limit` being re-read at once."""
    if not led.refill_queue:
        return []
    in_flight = sum(1 for c in led.chunks.values() if c.state == "resent")
    out = []
    while led.refill_queue and in_flight < in_flight_limit:
        c = led.chunks[led.refill_queue.popleft()]
        if c.state != "refill":
            continue
        c.state = "resent"
        led.chunk_resent(c)
        out.append(c)
        in_flight += 1
    return out


def ramp_cap(ramp: int, workers: int, n: int) -> int:
    """Steps out at once after `n` steps of a job (`lease_cap`): 1 + isqrt(n / ramp)
    while that is under `workers`, else MAX_OUT (no limit).

    >>> [ramp_cap(12, 4, n) for n in (0, 11, 12, 47, 48, 107, 108)]
    [1, 1, 2, 2, 3, 3, 1000000]
    """
    cap = 1 + math.isqrt(n // ramp)
    return cap if cap < workers else MAX_OUT


def stage_seconds_of(times) -> dict[str, float]:
    """A worker's stage times as {stage: seconds} (other keys dropped); ValueError for
    anything else, before the ledger changes."""
    if not isinstance(times, dict):
        raise ValueError("stats.times must be a map of stage -> seconds")
    try:
        out = {stage: float(s) for stage, s in times.items() if stage in STAGES and not isinstance(s, bytes)}
    except (TypeError, ValueError):
        raise ValueError("stats.times must map stages to numbers of seconds") from None
    if len(out) != sum(1 for stage in times if stage in STAGES):
        raise ValueError("stats.times must map stages to numbers of seconds")
    return out


def _hist(hist) -> np.ndarray | None:
    """A worker's [positives, negatives] per bin as a (2, HIST_BINS) array; None when absent.
    Raises ValueError for anything else."""
    if hist is None:
        return None
    try:
        h = np.asarray(hist, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("stats.hist must be two lists of counts") from None
    if h.shape != (2, HIST_BINS) or (h < 0).any():
        raise ValueError(f"stats.hist must be 2 x {HIST_BINS} non-negative counts, got shape {h.shape}")
    return h


def reissue_leases_of(led: JobLedger, worker: str) -> int:
    """A worker that restarted holds nothing it leased before: its steps go first in line
    again now, not when their leases lapse (counted as re-issued). Returns how many."""
    steps = [s for s, lease in led.leased.items() if lease.worker == worker]
    led.counters["batches_reissued"] += len(steps)
    return led.release(steps, worker)
