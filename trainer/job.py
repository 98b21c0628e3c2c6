"""A whole local job: build a model, train, evaluate, save a version. The CLI
and later the coordinator call this; it prints nothing."""
from __future__ import annotations

import errno
import logging
import math
import os
from typing import Callable

from sparse.errors import MarianaError
from sparse.parse import Reader, describe_bad
from trainer.bundle import ModelBundle
from trainer.config import LOWER_RATES, JobConfig
from trainer.strategies.local import Progress, evaluate, peak_rss_mb, train_local

log = logging.getLogger(__name__)


def check_inputs(paths: list[str]) -> None:
    """Fail before any work when a data path is missing or not a file."""
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(errno.ENOENT, "no such file", p)
        if os.path.isdir(p):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a data file", p)


def check_out_dir(path: str) -> None:
    """The model directory must be a writable directory, or creatable."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", path)
        probe = path
    else:
        probe = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "not writable", probe)


def check_trained(train_paths: list[str], rows: int, loss: float | None) -> None:
    """Refuse to publish a model whose training saw no rows or whose loss is not a
    number: nothing is ever served from it (local, cluster and retrain jobs alike).

    >>> check_trained(["a.tsv"], 0, None)
    Traceback (most recent call last):
    ...
    sparse.errors.MarianaError: no valid training rows in a.tsv: nothing to publish
    """
    names = ", ".join(os.path.basename(p) for p in train_paths) or "the training data"
    if rows <= 0:
        raise MarianaError(f"no valid training rows in {names}: nothing to publish")
    if loss is None or not math.isfinite(loss):
        raise MarianaError(f"training on {names} diverged (train loss {loss}): nothing to publish; {LOWER_RATES}")


def run_local_job(config: JobConfig, train_paths: list[str], test_paths: list[str], out_dir: str,
                  on_progress: Callable[[Progress], None] | None = None, promote: bool = True) -> dict:
    """Train on `train_paths`, evaluate on `test_paths`, publish a version in `out_dir`
    (and move CURRENT to it unless `promote` is False: a candidate for a retrain gate).

    Returns the result record (metrics, throughput, the version written, `promoted`).
    Relative paths are taken from the working directory; the manifest records them
    absolute.
    """
    if not train_paths:
        raise MarianaError("no training files given")
    train_paths, test_paths = absolute_paths(train_paths), absolute_paths(test_paths)
    config.resolve_paths()
    schema = config.data.resolve_schema()
    check_inputs(train_paths + test_paths)
    Reader(train_paths + test_paths, schema).probe()  # a wrong format fails now, not after training
    check_out_dir(out_dir)
    images, image_info = None, None
    if config.images.creatives:
        from trainer.images import prepare_image_features

        images, image_info = prepare_image_features(config.images)
    bundle = ModelBundle(config, schema, images)
    log.info("training %s on %s (%d fields, %d dense, 2^%d ids)", config.model.kind,
             ",".join(train_paths), bundle.encoder.num_fields, bundle.encoder.dense_dim, config.hashing.bits)
    trained = train_local(bundle, train_paths, on_progress)
    if trained.parse["rows_bad"]:
        log.warning("skipped %d malformed training rows per pass (first: %s)", trained.parse["rows_bad"],
                    describe_bad(trained.parse["first_bad"], 3))
    check_trained(train_paths, trained.train_rows, trained.train_loss)
    train_lookups = images.counts() if images else None
    metrics, test_parse = ({}, None)
    if test_paths:
        metrics, test_parse = evaluate(bundle, test_paths)
    if images:
        after = images.counts()
        image_info = image_record(image_info, train_lookups,
                                  {k: after[k] - train_lookups[k] for k in after}, config.model.kind)
    record = {
        "auc": metrics.get("auc"),
        "logloss": metrics.get("logloss"),
        "calibration": metrics.get("calibration"),
        "ne": metrics.get("ne"),
        "test_rows": metrics.get("count", 0),
        "train_rows": trained.train_rows,
        "rows_per_epoch": trained.rows_per_epoch,
        "epochs": config.train.epochs,
        "epoch_seconds": trained.epoch_seconds,
        "train_seconds": round(trained.train_seconds, 3),
        "rows_per_s": round(trained.rows_per_s, 1),
        "train_loss": trained.train_loss,
        "bad_rows": trained.parse["rows_bad"] + (test_parse["rows_bad"] if test_parse else 0),
        "model": config.model.kind,
    }
    if image_info:
        record["images"] = image_info
    version = bundle.save(out_dir, make_current=promote, extra={
        **({"images": image_info} if image_info else {}),
        "metrics": {k: record[k] for k in ("auc", "logloss", "calibration", "ne", "test_rows")},
        "train": {"data": train_paths, "test_data": test_paths, "rows": trained.train_rows,
                  "seconds": record["train_seconds"], "parse": trained.parse, "test_parse": test_parse},
    })
    record.update(model_dir=os.path.abspath(out_dir), model_version=version, promoted=promote,
                  peak_rss_mb=round(peak_rss_mb(), 1))
    log.info("saved %s/%s (auc=%s, logloss=%s)", out_dir, version, _fmt(record["auc"]), _fmt(record["logloss"]))
    return record


MODES = {"lr": "mode 1: LR over hashed ids + image features as dense values",
         "dnn": "mode 2: sparse DNN with an image tower over frozen image features"}


def image_record(info: dict, train: dict, test: dict, kind: str) -> dict:
    """The featurizer used and the lookups of each phase ({"lookups", "unknown"} counts):
    rows whose creative id the table lacked got the fallback (zeros, flag 1) and are
    counted here. Local and cluster jobs record it alike."""
    if train["unknown"] or test["unknown"]:
        log.warning("image features: %d training and %d test rows named an unknown creative (fallback used)",
                    train["unknown"], test["unknown"])
    return {**info, "train_lookups": train["lookups"], "train_unknown_creative": train["unknown"],
            "test_lookups": test["lookups"], "test_unknown_creative": test["unknown"], "mode": MODES[kind]}


def absolute_paths(paths: list[str]) -> list[str]:
    """The paths made absolute against the working directory (what manifests record, and
    what a job sent to a coordinator must name)."""
    return [os.path.abspath(p) for p in paths]


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.5f}"
