"""Local training: one process streams the data in blocks for N epochs,
updating in-process tables, then evaluates. Read top to bottom:

    for epoch:
        for batch in stream(files):          # read, parsed, hashed, deduped on other threads
            local_step(bundle, batch)         # pull rows -> ps_step.compute_grads -> apply
            report progress (rows/s, loss) about once a second
    evaluate(bundle, test files)
"""
from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from sparse.batch import SparseBatch
from sparse.errors import MarianaError
from sparse.metrics import BinaryMetrics
from trainer.bundle import ModelBundle
from trainer.config import LOWER_RATES
from trainer.data import BatchStream
from trainer.models.base import unique_ids
from trainer.strategies.ps_step import StepResult, compute_grads


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
    train_loss: float | None = None     # mean logloss of the last epoch
    parse: dict = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        return self.train_rows / self.train_seconds if self.train_seconds > 0 else 0.0


def local_step(bundle: ModelBundle, batch: SparseBatch) -> StepResult:
    """Pull the batch's rows from the in-process tables, compute, apply."""
    uniq, inverse = unique_ids(batch)
    pulled = {name: t.gather(uniq) for name, t in bundle.tables.items()}
    result = compute_grads(bundle.model, batch, inverse, pulled)
    for name, grads in result.row_grads.items():
        bundle.optimizers[name].apply(bundle.tables[name], uniq, grads, unique=True)
    bundle.dense_opt.apply(result.dense_grads)
    bundle.steps += 1
    bundle.rows_trained += batch.num_rows
    return result


def train_local(bundle: ModelBundle, paths: list[str],
                on_progress: Callable[[Progress], None] | None = None,
                report_every: float = 1.0) -> TrainResult:
    cfg = bundle.config
    set_threads(cfg.train.threads or (1 if cfg.model.kind == "lr" else os.cpu_count() or 1))
    stream = BatchStream(paths, bundle.encoder, cfg.data.block_bytes, cfg.train.prefetch,
                         cfg.data.parse_threads, labeled=True, batch_rows=cfg.train.batch_size,
                         workers=cfg.data.parse_workers)
    result = TrainResult()
    t_start = time.perf_counter()
    for epoch in range(1, cfg.train.epochs + 1):
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
                on_progress(Progress(epoch, cfg.train.epochs, rows, rows / (now - t_epoch),
                                     window_loss / max(window_rows, 1), now - t_start))
                window_loss, window_rows, last_report = 0.0, 0, now
        seconds = time.perf_counter() - t_epoch
        result.rows_per_epoch.append(rows)
        result.epoch_seconds.append(round(seconds, 3))
        result.train_rows += rows
        result.train_loss = loss_sum / rows if rows else None
        if on_progress:
            on_progress(Progress(epoch, cfg.train.epochs, rows, rows / max(seconds, 1e-9),
                                 result.train_loss or 0.0, time.perf_counter() - t_start, done=True))
    result.train_seconds = time.perf_counter() - t_start
    result.parse = stream.stats.to_dict()
    return result


def evaluate(bundle: ModelBundle, paths: list[str]) -> tuple[dict, dict]:
    """(metrics of the model on labeled files, parse counts)."""
    metrics = BinaryMetrics()
    data = bundle.config.data
    stream = BatchStream(paths, bundle.encoder, data.block_bytes, bundle.config.train.prefetch,
                         data.parse_threads, labeled=True, workers=data.parse_workers)
    for block in stream:
        for batch in block.split(8192):
            metrics.update(batch.labels, bundle.predict(batch))
    return metrics.result(), stream.stats.to_dict()


def set_threads(n: int) -> None:
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
