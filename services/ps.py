"""Parameter-server shard: owns a hash partition of every table of a job plus
its optimizer state (`trainer.strategies.ps_shard.ParamShard`), answers
pulls, applies pushes at most once per step, checkpoints on a timer and on
SIGTERM, restores on start.

    PullRows{job, dense, step} + ids (+ occ)   -> Rows + {table: rows} (+ dense) (+ admitted)
    PushGrads{job, step, rows, next_dense, next_step} + ids, g.<table>, dense, next_ids
        (+ seen, seen_n, next_occ)
                                               -> Ack{applied} (+ the rows of next_ids, as Rows)

With hashing.min_count > 1 a pull carries each id's occurrences in the batch
(`occ`, uint32) and the answer says which ids are admitted (`admitted`, uint8);
a push carries the ids that were not and their occurrences (`seen`, `seen_n`),
which the shard counts once, with the step (trainer/strategies/ps_shard.py). A pull names
its step, so a step issued again after the shard applied it admits nothing new.
    StartJob{job, spec} / ShardStats / Export / EndJob   (from the coordinator)

A warm start's spec names the version it goes on from (`init_from`): the shard reads that
version from its model directory and starts from its slice of it, not from the init.

Checkpoints: <ps.state_dir>/shard-<i>/<job>/vNNNNNN (safetensors + JSON,
the applied step ids included, so a restored shard knows what to ignore and
the coordinator knows what to replay).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import time

import numpy as np

from mariana.services import protocol
from mariana.services.jobspec import JobSpec
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime.config import ClusterConfig
from mariana.services.runtime.lifecycle import Service, run_service
from mariana.services.transport import Server
from mariana.sparse.errors import MarianaError, ModelDirError
from mariana.trainer import checkpoint
from mariana.trainer.strategies.ps_shard import ParamShard

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 2


class UnknownJob(MarianaError):
    """No such job here yet (not started, or this shard restarted): StartJob brings it."""


class JobEnded(MarianaError):
    """The job has ended: a worker still holding one of its steps drops it."""


class ParamServer(Service):
    role = "ps"
    COUNTERS = Service.COUNTERS + ("pulls", "rows_pulled", "steps_applied", "rows_applied", "duplicate_pushes",
                                   "checkpoints", "checkpoint_failures", "restored_jobs")

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        super().__init__(cfg, index)
        self.jobs: dict[str, ParamShard] = {}
        self.dirty: set[str] = set()       # jobs changed since their last checkpoint
        self.ended: set[str] = set()
        self.state_dir = os.path.join(cfg.ps_state_dir, f"shard-{index}")
        self.server: Server | None = None
        self._writing = asyncio.Lock()

    async def start(self) -> None:
        self.server = Server(self.ctx, self.cfg.ps.endpoints[self.index], self.handle, self.counters,
                             max_bytes=self.cfg.cluster.max_message_bytes, name=self.name)
        self.connect_coordinator()
        await self.register()

    async def main(self) -> None:
        period = self.cfg.ps.checkpoint_seconds
        while True:
            await asyncio.sleep(period if period > 0 else 3600)
            if period > 0:
                await self.checkpoint_all()

    async def drain(self) -> None:
        await self.server.drain(timeout=5.0)

    async def close(self) -> None:
        await self.checkpoint_all()  # SIGTERM: persist what we own before exit
        if self.server:
            self.server.close()

    def status(self) -> dict:
        return {**self.counters, "jobs": len(self.jobs),
                "steps_held": sum(len(s.applied) for s in self.jobs.values())}

    # ---- requests -------------------------------------------------------------------

    def handle(self, peer: bytes, msg: Message):
        """Reply frames, answered at once; EndJob's coroutine runs as a task."""
        handler = getattr(self, f"on_{msg.type}", None)
        if handler is None:
            raise BadMessage("unexpected", f"a parameter server does not take {msg.type}")
        return handler(msg)

    def shard(self, msg: Message) -> ParamShard:
        shard = self.jobs.get(msg["job"])
        if shard is None:
            if msg["job"] in self.ended:
                raise JobEnded(f"job {msg['job']!r} has ended")
            raise UnknownJob(f"shard {self.index} has no job {msg['job']!r} (not started yet, or restarting)")
        return shard

    def on_StartJob(self, msg: Message) -> list:
        job = msg["job"]
        if job not in self.jobs:
            spec = JobSpec.from_dict(msg["spec"])  # BadMessage("spec", ...): answered with an Error
            new = functools.partial(ParamShard, spec.config, spec.schema, self.index, self.cfg.ps.count,
                                    spec.image_width, self.cfg.cluster.memory_max_bytes)
            # its checkpoint of the job (a restarted shard), else the job's start: the init or a warm start
            shard = self.restore(job, new) or self.warm_start(job, new(), spec.init_from)
            self.jobs[job] = shard
            self.ended.discard(job)
            log.info("%s: job %s: %s tables %s", self.name, job, spec.config.model.kind,
                     ", ".join(f"{n}[{t.num_rows}x{t.dim}]" for n, t in shard.tables.items()))
        shard = self.jobs[job]
        warning = {"warning": shard.memory_warning} if shard.memory_warning else {}
        return protocol.encode("Ok", msg.msg_id, steps=len(shard.applied), **warning)

    def warm_start(self, job: str, shard: ParamShard, parent: dict | None) -> ParamShard:
        """The job's new shard; with a warm start, from its slice of the version the job goes on
        from (`JobSpec.init_from`: {"model_dir", "version", ...}), read here (ModelDirError if it
        cannot be: the coordinator fails the job)."""
        if parent is None:
            return shard
        where = f"{parent['model_dir']}/{parent['version']}"
        try:
            _, weights, optim = checkpoint.load_version(parent["model_dir"], parent["version"], with_optimizer=True)
        except ModelDirError as e:
            if os.path.isdir(where):
                raise
            raise ModelDirError(f"{where}, the version this job warm-starts from, is no longer there: it was removed "
                                f"after the job was submitted (a prune?); submit the job again ({e})") from None
        try:
            shard.warm_start(weights, optim)
        except KeyError as e:
            raise ModelDirError(f"{where}: the version lacks {e}: it cannot warm-start this job") from None
        log.info("%s: job %s starts from %s: %s rows of its tables", self.name, job, where,
                 "/".join(str(len(t.touched_rows())) for t in shard.tables.values()))
        return shard

    def on_PullRows(self, msg: Message) -> list:
        shard = self.shard(msg)
        ids = _array(msg, "ids", np.int64, 1)
        occ = _array(msg, "occ", np.uint32, 1) if "occ" in msg.arrays else None
        step = _step_field(msg, "step")
        return protocol.encode("Rows", msg.msg_id, self.pull(shard, shard.local_rows(ids), msg["dense"], occ, step))

    def pull(self, shard: ParamShard, rows: np.ndarray, dense: bool,
             occ: np.ndarray | None = None, step: str | None = None) -> dict[str, np.ndarray]:
        """The answer to a pull of local `rows` (checked ids, `ParamShard.local_rows`) for
        `step`; with `occ` (min_count > 1), which of them are admitted."""
        if occ is None:
            out = shard.gather(rows)
        else:
            out, admitted = shard.gather_admitted(rows, occ, step)
            out["admitted"] = admitted.view(np.uint8)
        if dense:
            out["dense"] = shard.dense.copy()  # frames go out zero-copy: never the live array a push updates
        self.counters["pulls"] += 1
        self.counters["rows_pulled"] += len(rows)
        return out

    def on_PushGrads(self, msg: Message) -> list:
        """Apply a step; with `next_ids`, answer the pull of the worker's next step too
        (rows read after this update, as a PullRows right after it would)."""
        shard = self.shard(msg)
        if msg["rows"] < 1:
            raise BadMessage("rows", f"PushGrads.rows must be >= 1, got {msg['rows']}")
        ids = _array(msg, "ids", np.int64, 1)
        grads = {k[2:]: _array(msg, k, np.float32, 2) for k in msg.arrays if k.startswith("g.")}
        dense = _array(msg, "dense", np.float32, 1) if "dense" in msg.arrays else None
        seen = None
        if "seen" in msg.arrays or "seen_n" in msg.arrays:
            seen = (_array(msg, "seen", np.int64, 1), _array(msg, "seen_n", np.uint32, 1))
        next_rows = next_occ = None
        next_step = _step_field(msg, "next_step")
        if "next_ids" in msg.arrays:
            if not isinstance(msg.get("next_dense", False), bool):
                raise BadMessage("field", "PushGrads.next_dense must be a boolean")
            next_rows = shard.local_rows(_array(msg, "next_ids", np.int64, 1))  # refused before anything is applied
            if "next_occ" in msg.arrays:
                next_occ = _array(msg, "next_occ", np.uint32, 1)
                if next_occ.shape != next_rows.shape or shard.counts is None:
                    raise BadMessage("arrays", "PushGrads.next_occ must have one count per next id, "
                                     "in a job with hashing.min_count > 1")
        applied = shard.push(msg["step"], msg["rows"], ids, grads, dense, seen)
        if applied:
            self.dirty.add(msg["job"])
            self.counters["steps_applied"] += 1
            self.counters["rows_applied"] += msg["rows"]
        else:
            self.counters["duplicate_pushes"] += 1
            log.info("%s: step %s of job %s was applied before; ignored", self.name, msg["step"], msg["job"])
        rows = None if next_rows is None else self.pull(shard, next_rows, msg.get("next_dense") is True, next_occ,
                                                         next_step)
        return protocol.encode("Ack", msg.msg_id, rows, applied=applied)

    def on_ShardStats(self, msg: Message) -> list:
        """Rows per epoch, and the applied step ids as an array (a header would
        outgrow its limit on a long job)."""
        shard = self.shard(msg)
        return protocol.encode("Stats", msg.msg_id, {"applied": protocol.names_array(list(shard.applied))},
                               rows={str(e): n for e, n in shard.rows_by_epoch().items()}, shard=self.index)

    def on_Export(self, msg: Message) -> list:
        arrays, _ = self.shard(msg).snapshot()
        return protocol.encode("Exported", msg.msg_id, arrays, shard=self.index)

    async def on_EndJob(self, msg: Message) -> list:
        job = msg["job"]
        if self.jobs.pop(job, None) is not None:
            log.info("%s: job %s ended; state dropped", self.name, job)
        self.dirty.discard(job)
        self.ended.add(job)
        async with self._writing:  # not while a checkpoint of it is being written
            shutil.rmtree(self.job_dir(job), ignore_errors=True)
        return protocol.encode("Ok", msg.msg_id)

    # ---- checkpoints ---------------------------------------------------------------------

    def job_dir(self, job: str) -> str:
        return os.path.join(self.state_dir, job)

    async def checkpoint_all(self) -> None:
        async with self._writing:
            for job in sorted(self.dirty):
                shard = self.jobs.get(job)
                if shard is None:
                    continue
                arrays, manifest = shard.snapshot()  # consistent: taken between two pushes
                self.dirty.discard(job)
                t0 = time.perf_counter()
                try:
                    version = await asyncio.to_thread(self.write, job, arrays, manifest)
                except MarianaError as e:  # a full or read-only disk, tables gone NaN (a diverging job):
                    # keep serving, try again next time
                    self.dirty.add(job)
                    self.counters["checkpoint_failures"] += 1
                    log.error("%s: checkpoint of job %s failed (still serving; a restart now would replay "
                              "more steps): %s", self.name, job, e)
                    continue
                self.counters["checkpoints"] += 1
                log.info("%s: checkpoint %s/%s: %d steps applied (%.2fs)", self.name, job, version,
                         len(manifest["applied"]), time.perf_counter() - t0)

    def write(self, job: str, arrays: dict, manifest: dict) -> str:
        d = self.job_dir(job)
        version = checkpoint.save_version(d, manifest, arrays)
        for old in checkpoint.list_versions(d)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(os.path.join(d, old), ignore_errors=True)
        return version

    def restore(self, job: str, new) -> ParamShard | None:
        """The job's shard (`new()`) with its last checkpoint loaded; None when there is none or
        it cannot be read (the job starts again, and the coordinator replays its steps). Lazily,
        on StartJob: a checkpoint of a job no coordinator runs any more costs disk, not memory."""
        if not os.path.isdir(self.job_dir(job)):
            return None
        shard = new()
        try:
            manifest, arrays, _ = checkpoint.load_version(self.job_dir(job))
            shard.restore(arrays, manifest)
        except (MarianaError, KeyError) as e:
            log.warning("%s: cannot restore job %s from %s: %s; starting it again", self.name, job,
                        self.job_dir(job), e)
            return None
        self.counters["restored_jobs"] += 1
        log.info("%s: restored job %s from %s (%d steps applied)", self.name, job,
                 manifest.get("version"), len(shard.applied))
        return shard


def _array(msg: Message, name: str, dtype, ndim: int) -> np.ndarray:
    arr = msg.arrays.get(name)
    if arr is None:
        raise BadMessage("arrays", f"{msg.type} needs an array {name!r}")
    if arr.dtype != dtype or arr.ndim != ndim:
        raise BadMessage("arrays", f"{msg.type}.{name} must be {ndim}-d {np.dtype(dtype).name}, "
                         f"got {arr.ndim}-d {arr.dtype.name}")
    return arr


def _step_field(msg: Message, name: str) -> str | None:
    """The optional step id a pull is for (`step`, or `next_step` on a push): a shard that
    applied that step already admits nothing new for it (ParamShard.gather_admitted)."""
    step = msg.get(name)
    if step is not None and not isinstance(step, str):
        raise BadMessage("field", f"{msg.type}.{name} must be a step id (a string)")
    return step


def main(cfg: ClusterConfig, index: int) -> int:
    return run_service(ParamServer(cfg, index))

