"""Local training: one process streams the data in blocks for N epochs,
updating in-process tables, then evaluates. Read top to bottom:

    for epoch (train.epochs of them, or until the validation logloss stops improving):
        for batch in stream(files):          # read, parsed, hashed, deduped on other threads
            local_step(bundle, batch)         # pull rows -> ps_step.compute_grads -> apply
            report progress (rows/s, loss) about once a second
        evaluate(bundle, validation rows)     # with --valid-data / train.valid_fraction
    epochs = "auto": put the best epoch's weights back
    evaluate(bundle, test files)
"""
from __future__ import annotations

import functools
import logging
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mariana.sparse.batch import SparseBatch
from mariana.sparse.errors import MarianaError
from mariana.sparse.host import available_cpus
from mariana.sparse.metrics import BinaryMetrics
from mariana.sparse.parse import describe_bad
from mariana.trainer.bundle import ModelBundle, Snapshot
from mariana.trainer.config import LOWER_RATES
from mariana.trainer.data import BatchStream, RowRange
from mariana.trainer.models.registry import uses_torch
from mariana.trainer.strategies.ps_step import StepResult, compute_grads

log = logging.getLogger(__name__)


@dataclass
class Progress:
    epoch: int
    epochs: int
    rows: int            # rows trained in this epoch so far
    rows_per_s: float
    loss: float          # mean logloss over the last report interval
    elapsed: float
    done: bool = False


@dataclass
class TrainResult:
    train_rows: int = 0                 # summed over epochs
    rows_per_epoch: list[int] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    train_loss: float | None = None     # mean logloss of the last epoch (of the best, when it was kept)
    parse: dict = field(default_factory=dict)
    valid: dict | None = None           # per-epoch validation metrics, the best epoch, why it stopped

    @property
    def rows_per_s(self) -> float:
        return self.train_rows / self.train_seconds if self.train_seconds > 0 else 0.0


@dataclass
class Validation:
    """Rows to score after every epoch: `paths` (all their rows, or `rows` of them)."""

    paths: list[str]
    rows: RowRange | None = None
    source: str = ""                    # what the record says they were


def local_step(bundle: ModelBundle, batch: SparseBatch) -> StepResult:
    """Pull the batch's rows from the in-process tables, compute, apply."""
    batch = bundle.admit(batch)  # hashing.min_count > 1: ids not admitted yet -> their field's rare id
    uniq, inverse = batch.unique()
    pulled = {name: t.gather(uniq) for name, t in bundle.tables.items()}
    result = compute_grads(bundle.model, batch, inverse, pulled)
    for name, grads in result.row_grads.items():
        bundle.optimizers[name].apply(bundle.tables[name], uniq, grads, unique=True, pulled=pulled[name])
    bundle.dense_opt.apply(result.dense_grads)
    bundle.steps += 1
    bundle.rows_trained += batch.num_rows
    return result


def _numpy_quiet(train: Callable) -> Callable:
    """`train` with numpy's overflow and invalid-value warnings off: a run that diverges is
    found by its NaN loss and said in one line (TrainingDiverged), which came after eight
    lines of RuntimeWarning with their source lines."""
    @functools.wraps(train)
    def quiet(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return train(*args, **kwargs)
    return quiet


@_numpy_quiet
def train_local(bundle: ModelBundle, paths: list[str],
                on_progress: Callable[[Progress], None] | None = None,
                report_every: float = 1.0, rows: RowRange | None = None,
                valid: Validation | None = None,
                on_valid: Callable[[int, dict], None] | None = None,
                deadline: float | None = None, log_epochs: bool = True) -> TrainResult:
    """Train for `train.epochs` epochs on `paths` (or `rows` of them), scoring `valid`
    after each; `epochs = "auto"` stops when the validation logloss has not improved
    for `train.patience` epochs and puts the best epoch's weights back.

    `on_valid(epoch, metrics)` sees every epoch's validation metrics (a tuner's pruner
    may raise there); at `deadline` (a `time.perf_counter()` value, less the last
    validation pass's time) the epoch under way ends early and training stops after its
    validation. `log_epochs=False` logs each
    epoch's validation at DEBUG (a tuner's trials)."""
    cfg = bundle.config
    if uses_torch(bundle.model):  # LR's step is numpy's, single-threaded: no torch to set (or import)
        set_threads(cfg.train.threads or available_cpus())
    stream = BatchStream(paths, bundle.encoder, cfg.data.block_bytes, cfg.train.prefetch,
                         cfg.data.parse_threads, labeled=True, batch_rows=cfg.train.batch_size,
                         workers=cfg.data.parse_workers, rows=rows)
    result = TrainResult()
    tracker = EarlyStop(cfg.train.patience) if valid else None
    limit = cfg.train.epoch_limit
    t_start = time.perf_counter()
    valid_seconds = 0.0  # the last validation pass: training stops that long before the deadline
    for epoch in range(1, limit + 1):
        stop_at = None if deadline is None else deadline - valid_seconds
        rows_seen, loss, seconds = _epoch(bundle, stream, epoch, limit, on_progress, report_every, t_start,
                                          stop_at)
        out_of_time = stop_at is not None and time.perf_counter() >= stop_at
        result.rows_per_epoch.append(rows_seen)
        result.epoch_seconds.append(round(seconds, 3))
        result.train_rows += rows_seen
        result.train_loss = loss
        if tracker is not None:
            tracker.out_of_time = out_of_time  # a cut epoch: the budget stopped it, whatever patience says
            t_valid = time.perf_counter()
            metrics, parsed = evaluate(bundle, valid.paths, valid.rows)
            valid_seconds = time.perf_counter() - t_valid
            if epoch == 1:
                check_validation(valid.source, metrics, parsed)
            improved = tracker.add(epoch, metrics, loss, bundle)
            log.log(logging.INFO if log_epochs else logging.DEBUG, "epoch %d/%s: valid logloss %s, auc %s%s",
                    epoch, cfg.train.epochs, _fmt(metrics.get("logloss")), _fmt(metrics.get("auc")),
                    " (best so far)" if improved else "")
            if on_valid:
                on_valid(epoch, metrics)
            if cfg.train.auto and tracker.should_stop():
                break
        if out_of_time:
            break
    result.train_seconds = time.perf_counter() - t_start
    result.parse = stream.stats.to_dict()
    if tracker is not None:
        if cfg.train.auto:
            tracker.best_state.restore(bundle)
            result.train_loss = tracker.best_train_loss
        result.valid = tracker.record(valid, keep_best=cfg.train.auto, limit=limit)
    return result


def check_validation(source: str, metrics: dict, parsed: dict) -> None:
    """After the first validation pass: its malformed rows said (once: every pass skips the
    same), and none valid is an error now, not epochs of "n/a" and no best epoch to keep."""
    if parsed["rows_bad"]:
        log.warning("skipped %d malformed validation rows in %s (first: %s)", parsed["rows_bad"], source,
                    describe_bad(parsed["first_bad"], 3))
    if not metrics["count"]:
        raise MarianaError(f"no valid validation rows in {source} ({parsed['rows_bad']} malformed): nothing to "
                           "validate on; name other rows (--valid-data) or hold out a share of training's "
                           "(--valid-fraction)")


def _epoch(bundle: ModelBundle, stream: BatchStream, epoch: int, epochs: int,
           on_progress: Callable[[Progress], None] | None, report_every: float,
           t_start: float, deadline: float | None = None) -> tuple[int, float | None, float]:
    """One pass (or the part of it before `deadline`): (rows, mean train logloss, seconds)."""
    t_epoch = time.perf_counter()
    rows = 0
    loss_sum = window_loss = 0.0
    window_rows, last_report = 0, t_epoch
    for batch in stream:
        step = local_step(bundle, batch)
        if not math.isfinite(step.loss_sum):  # every later step would be NaN too: stop now
            raise MarianaError(f"training diverged in epoch {epoch} after {rows:,} rows (loss "
                               f"{step.loss_sum / max(step.num_rows, 1)}): nothing to publish; {LOWER_RATES}")
        rows += step.num_rows
        loss_sum += step.loss_sum
        window_loss += step.loss_sum
        window_rows += step.num_rows
        now = time.perf_counter()
        if on_progress and now - last_report >= report_every:
            on_progress(Progress(epoch, epochs, rows, rows / (now - t_epoch),
                                 window_loss / max(window_rows, 1), now - t_start))
            window_loss, window_rows, last_report = 0.0, 0, now
        if deadline is not None and now >= deadline:
            break
    seconds = time.perf_counter() - t_epoch
    loss = loss_sum / rows if rows else None
    if on_progress:
        on_progress(Progress(epoch, epochs, rows, rows / max(seconds, 1e-9), loss or 0.0,
                             time.perf_counter() - t_start, done=True))
    return rows, loss, seconds


class EarlyStop:
    """Per-epoch validation metrics and the best epoch (lowest logloss) with its state."""

    def __init__(self, patience: int):
        self.patience = patience
        self.epochs: list[dict] = []
        self.best_epoch = 0
        self.best_logloss = math.inf
        self.best_state: Snapshot | None = None
        self.best_train_loss: float | None = None
        self.out_of_time = False

    def add(self, epoch: int, metrics: dict, train_loss: float | None, bundle: ModelBundle) -> bool:
        logloss = metrics.get("logloss")
        self.epochs.append({"epoch": epoch, "logloss": logloss, "auc": metrics.get("auc"),
                            "calibration": metrics.get("calibration"), "ne": metrics.get("ne"),
                            "train_loss": train_loss, "rows": metrics.get("count", 0)})
        if logloss is None or not logloss < self.best_logloss:
            return False
        self.best_epoch, self.best_logloss, self.best_train_loss = epoch, logloss, train_loss
        self.best_state = Snapshot(bundle)
        return True

    def should_stop(self) -> bool:
        return self.best_state is not None and len(self.epochs) - self.best_epoch >= self.patience

    def record(self, valid: Validation, keep_best: bool, limit: int) -> dict:
        stopped = "time budget" if self.out_of_time else None
        return valid_record(valid.source, self.epochs, self.best_epoch, "best" if keep_best else "last",
                            keep_best, self.patience, limit, stopped)


def best_epoch(losses: list[float | None]) -> int:
    """The 1-based epoch of the lowest validation logloss (0: none scored)."""
    scored = [(loss, e) for e, loss in enumerate(losses, 1) if loss is not None]
    return min(scored)[1] if scored else 0


def valid_record(source: str, epochs: list[dict], best: int, kept: str, auto: bool, patience: int, limit: int,
                 stopped: str | None = None) -> dict:
    """The `valid` entry of a job's record and manifest (local and cluster jobs alike):
    each epoch's validation metrics, the best epoch, what was kept and why training stopped."""
    since = len(epochs) - best
    if stopped is None:
        stopped = ("epochs" if not auto else f"no better valid logloss for {since} epoch(s)"
                   if best and since >= patience else f"max_epochs ({limit})")
    return {"source": source, "rows": epochs[-1].get("rows", 0) if epochs else 0, "epochs": epochs,
            "best_epoch": best, "kept": kept, "stopped": stopped}


def evaluate(bundle: ModelBundle, paths: list[str], rows: RowRange | None = None) -> tuple[dict, dict]:
    """(metrics of the model on labeled files (or `rows` of them), parse counts)."""
    metrics = BinaryMetrics()
    data = bundle.config.data
    stream = BatchStream(paths, bundle.encoder, data.block_bytes, bundle.config.train.prefetch,
                         data.parse_threads, labeled=True, workers=data.parse_workers, rows=rows)
    for block in stream:
        for batch in block.split(8192):
            metrics.update(batch.labels, bundle.predict(batch))
    return metrics.result(), stream.stats.to_dict()


def set_threads(n: int) -> None:
    """torch's intra-op threads (imports torch)."""
    import torch

    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def peak_rss_mb() -> float:
    """This process's peak resident set in MB: Linux's VmHWM, which starts afresh with the
    program; ru_maxrss where there is none. (On Linux ru_maxrss carries the parent's peak
    across fork and exec: a `mariana train` started by a 600 MB process said 600 MB.)"""
    hwm = proc_status("VmHWM")
    return hwm / (1 << 20) if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def proc_status(field: str) -> int | None:
    """A size field of /proc/self/status ("VmHWM", "VmRSS") in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.5f}"
