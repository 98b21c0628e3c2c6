"""Glue between a cluster job and the trainer, without sockets: checking a
submitted job, and turning the shards' exports into one model version in the
same format as local mode (so evaluate, predict and serving need not know
how a model was trained).
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch

from sparse.errors import ConfigError
from sparse.metrics import rounded
from sparse.inputs import expand_data_paths
from sparse.parse import Reader
from trainer.bundle import ModelBundle
from trainer.config import JobConfig, from_dict
from trainer.job import check_inputs, check_out_dir, check_trained, resolve_auto
from trainer.strategies.local import evaluate, peak_rss_mb

MODES = ("async", "ssp", "bsp")


def check_request(body: dict) -> tuple[dict, dict]:
    """A submitted job -> (request, spec), or ConfigError/OSError naming what is wrong.

    body: {"data": [paths], "test_data": [paths], "out": dir, "config": {job config},
           "valid_data": [paths] (scored after every epoch; needed by epochs = "auto"),
           (every path absolute: data, test_data, valid_data, out, config.images.*)
           "mode": "async" | "ssp" | "bsp", "staleness": k,
           "promote": true (default) | false (write the version without moving CURRENT)}
    """
    if not isinstance(body, dict):
        raise ConfigError("the job must be a JSON object")
    unknown = set(body) - {"data", "test_data", "valid_data", "out", "config", "mode", "staleness", "promote"}
    if unknown:
        raise ConfigError(f"unknown job key {sorted(unknown)[0]!r} "
                          "(known: config, data, mode, out, promote, staleness, test_data, valid_data)")
    config = from_dict(JobConfig, body.get("config") or {}, "config")
    if config.train.valid_fraction:
        raise ConfigError("config.train.valid_fraction: a cluster job validates on files of their own "
                          "(valid_data); holding out the tail of the training rows runs in local mode")
    for key, path in config.paths().items():
        _absolute(f"config.{key}", path)
    data, tests, valid = _paths(body, "data"), _paths(body, "test_data"), _paths(body, "valid_data")
    if not data:
        raise ConfigError("data: name at least one training file")
    if config.train.auto and not valid:
        raise ConfigError("config.train.epochs = 'auto' stops on the validation logloss: name valid_data")
    out = body.get("out")
    if not isinstance(out, str) or not out:
        raise ConfigError("out: the model directory to publish into is required")
    _absolute("out", out)
    mode = body.get("mode", "async")
    if mode not in MODES:
        raise ConfigError(f"mode: unknown {mode!r} (use {', '.join(MODES)})")
    staleness = body.get("staleness", 2 if mode == "ssp" else 0)
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ConfigError(f"staleness must be an integer >= 0, got {staleness!r}")
    promote = body.get("promote", True)
    if not isinstance(promote, bool):
        raise ConfigError(f"promote must be true or false, got {promote!r}")
    schema = config.data.resolve_schema()
    check_inputs(data + tests + valid)
    Reader(data + tests + valid, schema).probe()
    resolve_auto(config, schema, data)  # numbers in the spec: every service uses the same ones
    check_out_dir(out)
    if config.images.creatives:
        from trainer.images import creatives_dir

        creatives_dir(config.images.creatives)  # ConfigError naming the dir when it is not one
        if config.images.featurizer and not os.path.isdir(config.images.featurizer):
            raise ConfigError(f"images.featurizer {config.images.featurizer}: no such directory")
    request = {"data": data, "test_data": tests, "valid_data": valid, "out": os.path.normpath(out), "mode": mode,
               "staleness": staleness, "model": config.model.kind, "promote": promote}
    return request, {"config": config.to_dict(), "schema": schema.to_dict()}


def cluster_image_record(spec: dict, ledger, images) -> dict:
    """Local mode's record of the image features (trainer.job.image_record); training rows
    were looked up by preprocess once, in the pass over the source, and the table was
    fresh for the evaluation."""
    from trainer.images import features_sha
    from trainer.job import image_record

    info = {**spec["images"]["info"], "model_creatives": len(images.ids), "features_sha256": features_sha(images.features)}
    train = {"lookups": int(ledger.counters["creative_lookups"]), "unknown": int(ledger.counters["creatives_unknown"])}
    return image_record(info, train, images.counts(), spec["config"]["model"]["kind"])


def _paths(body: dict, key: str) -> list[str]:
    value = body.get(key) or []
    if isinstance(value, str):
        value = [p for p in value.split(",") if p]
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError(f"{key}: expected a list of file paths")
    for p in value:
        _absolute(key, p)
    return expand_data_paths([os.path.normpath(p) for p in value])  # directories and globs, as the CLI takes


def _absolute(key: str, path: str) -> None:
    """The coordinator runs in a directory of its own (or on another host): a relative
    path would name a file there, not the submitter's. `mariana train` sends absolute ones."""
    if not os.path.isabs(path):
        raise ConfigError(f"{key}: {path!r} is a relative path; a job names files by absolute paths "
                          "(the coordinator does not know the submitter's working directory)")


def assemble(spec: dict, exports: list[dict[str, np.ndarray]], images=None) -> ModelBundle:
    """One bundle from every shard's export (tables by global id; dense from shard 0);
    `images`: the creative features table of a job with image features."""
    from sparse.schema import Schema

    bundle = ModelBundle(from_dict(JobConfig, spec["config"]), Schema.from_dict(spec["schema"]), images)
    for arrays in exports:
        for name, table in bundle.tables.items():
            state = {k.rsplit(".", 1)[1]: v for k, v in arrays.items()
                     if k.startswith(f"table.{name}.") and k.rsplit(".", 1)[1] not in ("rows", "weights")}
            table.load_rows(arrays[f"table.{name}.rows"], arrays[f"table.{name}.weights"], state)
        bundle.load_counts(arrays)  # min_count > 1: the ids each shard counted but did not admit
    dense = exports[0]["dense"]
    params = list(bundle.model.parameters())
    if params:
        torch.nn.utils.vector_to_parameters(torch.from_numpy(np.array(dense)), params)
        offset = 0
        for p, state in zip(params, bundle.dense_opt.state):
            n = p.numel()
            for key, arr in state.items():
                if f"dense.{key}" in exports[0]:
                    arr[...] = exports[0][f"dense.{key}"][offset:offset + n].reshape(arr.shape)
            offset += n
    return bundle


def validate_exports(spec: dict, exports: list, images, paths: list[str]) -> dict:
    """The validation metrics of the model the shards hold now (after an epoch)."""
    metrics, _ = evaluate(assemble(spec, exports, images), paths)
    return {"logloss": metrics.get("logloss"), "auc": metrics.get("auc"), "calibration": metrics.get("calibration"),
            "ne": metrics.get("ne"), "rows": metrics.get("count", 0)}


def assemble_and_publish(request: dict, spec: dict, exports: list, ledger, num_shards: int,
                         train_seconds: float, images=None,
                         on_phase: Callable[[str], None] | None = None, valid: dict | None = None) -> dict:
    """Assemble, evaluate on the test files, save a version; the job's result record.
    `on_phase(text)` hears what it is doing (evaluating, publishing). A job whose
    training saw no rows, or whose loss is not finite, publishes nothing (MarianaError).
    `valid`: the per-epoch validation record (the exports are of its kept epoch)."""
    phase = on_phase or (lambda text: None)
    rows_per_epoch = [int(ledger.rows_done[e]) for e in range(1, ledger.epochs + 1)]
    last = valid["best_epoch"] if valid and valid["kept"] == "best" and valid["best_epoch"] else ledger.epochs
    train_loss = ledger.loss_sum[last] / rows_per_epoch[last - 1] if rows_per_epoch and rows_per_epoch[last - 1] \
        else None
    check_trained(request["data"], sum(rows_per_epoch), train_loss)
    bundle = assemble(spec, exports, images)
    bundle.rows_trained = sum(rows_per_epoch)
    bundle.steps = len(ledger.done)
    metrics, test_parse = ({}, None)
    if request["test_data"]:
        phase(f"evaluating on {', '.join(os.path.basename(p) for p in request['test_data'])}")
        metrics, test_parse = evaluate(bundle, request["test_data"])
    record = {
        "auc": metrics.get("auc"), "logloss": metrics.get("logloss"),
        "calibration": metrics.get("calibration"), "ne": metrics.get("ne"),
        "test_rows": metrics.get("count", 0), "ece": metrics.get("ece"),
        # predicted vs observed CTR by bucket (None: no test data); 4 significant digits, for
        # the job store and /v1/status send every job's record again and again
        "reliability": rounded(metrics["reliability"]) if metrics else None,
        "train_rows": sum(rows_per_epoch), "rows_per_epoch": rows_per_epoch, "epochs": ledger.epochs,
        "epoch_seconds": ledger.epoch_seconds, "train_seconds": round(train_seconds, 3),
        "rows_per_s": round(sum(rows_per_epoch) / max(sum(ledger.epoch_seconds), 1e-9), 1),
        "train_loss": train_loss,
        "bad_rows": ledger.counters["bad_rows"] + (test_parse["rows_bad"] if test_parse else 0),
        "model": request["model"],
    }
    if valid:
        record["valid"] = valid
    if images is not None:
        record["images"] = cluster_image_record(spec, ledger, images)
    phase(f"publishing a version in {request['out']}")
    version = bundle.save(request["out"], make_current=request.get("promote", True), extra={
        **({"images": record["images"]} if images is not None else {}),
        **({"valid": valid} if valid else {}),
        "metrics": {k: record[k] for k in ("auc", "logloss", "calibration", "ne", "test_rows", "ece")},
        "reliability": record["reliability"],  # beside metrics: /v1/models lists every version's metrics
        "train": {"data": request["data"], "test_data": request["test_data"], "rows": record["train_rows"],
                  "seconds": record["train_seconds"], "mode": "cluster/" + request["mode"],
                  "shards": num_shards, "job": ledger.job, "test_parse": test_parse,
                  "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    })
    record.update(model_dir=request["out"], model_version=version, promoted=request.get("promote", True),
                  peak_rss_mb=round(peak_rss_mb(), 1))
    return record
