"""Glue between a cluster job and the trainer, without sockets: checking a
submitted job, and turning the shards' exports into one model version in the
same format as local mode (so evaluate, predict and serving need not know
how a model was trained).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

from mariana.featurizer.creatives import check_image_field
from mariana.services.jobspec import JobSpec
from mariana.services.ledger import parse_step
from mariana.sparse.errors import ConfigError, ModelDirError
from mariana.sparse.inputs import expand_data_paths, split_spec
from mariana.sparse.parse import Reader
from mariana.sparse.schema import Schema
from mariana.trainer import checkpoint
from mariana.trainer.bundle import INITS, ModelBundle, check_parent, parent_version
from mariana.sparse.settings import from_dict, shown
from mariana.trainer.config import JobConfig
from mariana.trainer.data import RowRange
from mariana.trainer.job import (TrainSummary, check_inputs, check_out_dir, check_trained, image_record,
                                 publish_version, resolve_auto, validation, written_record, written_version)
from mariana.trainer.strategies.local import Validation, evaluate

MODES = ("async", "ssp", "bsp")


def check_request(body: dict, workers: int = 1) -> tuple[dict, JobSpec]:
    """A submitted job -> (request, spec), or ConfigError/MarianaError/OSError naming what is wrong;
    `workers`: the cluster's worker processes (`check_data`).

    body: {"data": [paths], "test_data": [paths], "out": dir, "config": {job config},
           "valid_data": [paths] (scored after every epoch; or config.train.valid_fraction: the
                          last F of the data's lines, held out; epochs = "auto" holds out 0.1),
           "init_from": "dir[:vNNNNNN]" (a warm start from that version, default its CURRENT),
           (every path absolute: data, test_data, valid_data, out, init_from, config.images.*)
           "mode": "async" | "ssp" | "bsp", "staleness": k,
           "promote": true (default) | false (write the version without moving CURRENT)}

    Two halves, so that with `coordinator.data_via_loader` each runs where its files are:
    `check_data` (the data files: the loader's host) and `check_model_side` (the model
    directory, a warm start's parent, the creatives: the coordinator's).
    """
    request, spec = check_data(body, workers)
    return check_model_side(body, request, spec)


def check_data(body: dict, workers: int = 1) -> tuple[dict, JobSpec]:
    """The half of `check_request` that reads the data files: their existence and format, the
    held-out rows, the config's data-dependent numbers (`workers`: the cluster's worker
    processes, which a DNN's "auto" batch size divides: `resolve_auto`). The warm start is
    not applied yet."""
    if not isinstance(body, dict):
        raise ConfigError("the job must be a JSON object")
    unknown = set(body) - set(JOB_KEYS)
    if unknown:
        raise ConfigError(f"unknown job key {sorted(unknown)[0]!r} (known: {', '.join(JOB_KEYS)})")
    config = from_dict(JobConfig, body.get("config") or {}, "config")
    for key, path in config.paths().items():
        _absolute(f"config.{key}", path)
    data, tests, valid = _paths(body, "data"), _paths(body, "test_data"), _paths(body, "valid_data")
    if not data:
        raise ConfigError("data: name at least one training file")
    out = body.get("out")
    if out is None or out == "":
        raise ConfigError("out: the model directory to publish into is required")
    if not isinstance(out, str):  # it said "required" for an out of 5
        raise ConfigError(f"out: expected the model directory to publish into (a path as text), got {shown(out)}")
    _absolute("out", out)
    init = body.get("init_from")
    if init is not None:
        if not isinstance(init, str) or not init:
            raise ConfigError(f"init_from must be a model directory ('DIR' or 'DIR:vNNNNNN'), got {init!r}")
        _absolute("init_from", init)
    options = _run_options(body)
    schema = config.data.resolve_schema()
    if config.images.creatives:
        check_image_field(config.images.field, schema)
    check_inputs(data + tests + valid)
    Reader(data + tests + valid, schema).probe()
    train_rows, held = validation(config, schema, data, valid)  # local mode's split: the tail of the data
    resolve_auto(config, schema, data, train_rows.rows if train_rows else None, workers)  # numbers in the spec
    request = {"data": data, "test_data": tests, "valid_data": valid, "out": os.path.normpath(out), **options,
               "model": config.model.kind}
    if train_rows is not None:
        request["holdout"] = _holdout(data, train_rows, held)
    return request, JobSpec(config, schema)


def check_model_side(body: dict, request: dict, spec: JobSpec) -> tuple[dict, JobSpec]:
    """The half of `check_request` on the coordinator's host: the model directory is writable,
    a warm start's parent matches (its inits become the job's), the creatives exist."""
    check_out_dir(request["out"])
    parent = _parent(body.get("init_from"), spec.config, spec.schema)
    _check_images(spec.config)
    if parent is not None:
        request["init_from"] = f"{parent['model_dir']}:{parent['version']}"
        spec = dataclasses.replace(spec, init_from=parent)
    return request, spec


def data_bytes(request: dict) -> int:
    """What epoch 1's progress is measured against: the bytes the loader reads (0 for gzip,
    whose offsets count uncompressed bytes)."""
    if any(str(f).endswith(".gz") for f in request["data"]):
        return 0
    size = sum(os.path.getsize(f) for f in request["data"])
    if request.get("holdout"):  # the loader reads the lines before the held-out tail
        rows = request["holdout"]["rows"]
        size = size * rows["start"] // max(rows["stop"], 1)
    return size


JOB_KEYS = ("config", "data", "init_from", "mode", "out", "promote", "staleness", "test_data", "valid_data")


def _run_options(body: dict) -> dict:
    """{"mode", "staleness", "promote"} of a job, checked."""
    mode = body.get("mode", "async")
    if mode not in MODES:
        raise ConfigError(f"mode: unknown {mode!r} (use {', '.join(MODES)})")
    staleness = body.get("staleness", 2 if mode == "ssp" else 0)
    if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
        raise ConfigError(f"staleness must be an integer >= 0, got {staleness!r}")
    promote = body.get("promote", True)
    if not isinstance(promote, bool):
        raise ConfigError(f"promote must be true or false, got {promote!r}")
    return {"mode": mode, "staleness": staleness, "promote": promote}


def _parent(spec, config: JobConfig, schema) -> dict | None:
    """The version a warm start goes on from, checked against the job as local mode checks it
    (`trainer.bundle.check_parent`): {"model_dir", "version", "rows_trained", "steps"}, which
    every shard loads its slice of. New rows start as the parent's would: its inits are the job's."""
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"init_from must be a model directory ('DIR' or 'DIR:vNNNNNN'), got {spec!r}")
    _absolute("init_from", spec)
    if config.images.creatives:
        raise ConfigError("init_from: a warm start of a job with image features (images.creatives) runs in "
                          "local mode, which keeps the version's creative table")
    model_dir, version = parent_version(os.path.normpath(spec))
    manifest = checkpoint.read_manifest(model_dir, version)
    try:
        parent = from_dict(JobConfig, manifest["config"])
        parent_schema = Schema.from_dict(manifest["schema"])
    except KeyError as e:
        raise ModelDirError(f"{model_dir}/{version}: manifest lacks {e}") from None
    check_parent(spec, parent, parent_schema, config, schema, flag="init_from")
    checkpoint.check_optimizer_state(os.path.join(model_dir, version))  # before the shards read it
    for key in INITS:
        section, name = key.split(".")
        setattr(getattr(config, section), name, getattr(getattr(parent, section), name))
    return {"model_dir": model_dir, "version": version, "rows_trained": manifest.get("rows_trained", 0),
            "steps": manifest.get("steps", 0), "learned": checkpoint.learned_paths(manifest)}


def _holdout(data: list[str], train_rows: RowRange, valid: Validation) -> dict:
    """The request's record of a held-out tail: its rows (scored after every epoch), what the
    record calls them, and where the loader stops, the end of the training rows: [file index,
    lines of that file]."""
    path, lines = train_rows.end()
    return {"rows": dataclasses.asdict(valid.rows), "source": valid.source, "until": [data.index(path), lines]}


def _check_images(config: JobConfig) -> None:
    if config.images.creatives:
        from mariana.trainer.images import creatives_dir

        creatives_dir(config.images.creatives)  # ConfigError naming the dir when it is not one
        if config.images.featurizer and not os.path.isdir(config.images.featurizer):
            raise ConfigError(f"images.featurizer {config.images.featurizer}: no such directory")


def job_validation(request: dict) -> Validation | None:
    """The rows a job scores after every epoch: its held-out tail, its valid_data files, or none."""
    held = request.get("holdout")
    if held:
        return Validation(request["data"], RowRange(**held["rows"]), held["source"])
    if request.get("valid_data"):
        return Validation(request["valid_data"], source=",".join(request["valid_data"]))
    return None


def cluster_image_record(job: JobSpec, ledger, images) -> dict:
    """Local mode's record of the image features (trainer.job.image_record); training rows
    were looked up by preprocess once, in the pass over the source, and the table was
    fresh for the evaluation."""
    from mariana.trainer.images import features_sha

    info = {**job.images["info"], "model_creatives": len(images.ids), "features_sha256": features_sha(images.features)}
    train = {"lookups": int(ledger.counters["creative_lookups"]), "unknown": int(ledger.counters["creatives_unknown"])}
    return image_record(info, train, images.counts(), job.config.model.kind)


def _paths(body: dict, key: str) -> list[str]:
    value = body.get(key) or []
    if isinstance(value, str):
        value = split_spec(value)
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


def validate_exports(job: JobSpec, exports: list, images, valid: Validation) -> dict:
    """The validation metrics of the model the shards hold now (after an epoch)."""
    bundle = ModelBundle.from_shard_exports(job.config, job.schema, exports, images)
    metrics, _ = evaluate(bundle, valid.paths, valid.rows)
    return {"logloss": metrics.get("logloss"), "auc": metrics.get("auc"), "calibration": metrics.get("calibration"),
            "ne": metrics.get("ne"), "rows": metrics.get("count", 0)}


def train_summary(request: dict, ledger, num_shards: int, train_seconds: float,
                  valid: dict | None) -> TrainSummary:
    """What the record and the manifest say of a cluster job's training, from its ledger."""
    rows_per_epoch = [int(ledger.rows_done[e]) for e in range(1, ledger.epochs + 1)]
    last = kept_epoch(ledger, valid)
    train_loss = ledger.loss_sum[last] / rows_per_epoch[last - 1] if rows_per_epoch and rows_per_epoch[last - 1] \
        else None
    return TrainSummary(request["data"], rows_per_epoch, ledger.epoch_seconds, train_seconds,
                        sum(rows_per_epoch) / max(sum(ledger.epoch_seconds), 1e-9), train_loss,
                        ledger.counters["bad_rows"], valid,
                        run={"mode": "cluster/" + request["mode"], "shards": num_shards, "job": ledger.job,
                             "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             "parse": parse_summary(ledger)})


def kept_epoch(ledger, valid: dict | None) -> int:
    """The epoch whose weights the version holds: the best one when `--epochs auto` kept it
    (`valid`), else the last."""
    return valid["best_epoch"] if valid and valid["kept"] == "best" and valid["best_epoch"] else ledger.epochs


def parse_summary(ledger) -> dict:
    """A pass over the data as the preprocess instances parsed it: local mode's
    `ParseStats.to_dict()` (`clicks` None where a chunk came without its count)."""
    c = ledger.counters
    return {"rows_ok": c["rows_in_data"], "rows_bad": c["bad_rows"], "first_bad": list(ledger.first_bad),
            "clicks": None if c["chunks_without_clicks"] else c["clicks_in_data"]}


def written_before(request: dict, ledger, num_shards: int, started: float) -> dict | None:
    """The record of the version this job wrote before the coordinator restarted (killed
    after writing it, before journaling it), or None: then the job has written none."""
    found = written_version(request["out"], ledger.job, started)
    if found is None:
        return None
    version, manifest = found
    summary = train_summary(request, ledger, num_shards, 0.0, manifest.get("valid"))
    return written_record(request["out"], version, manifest, summary, request.get("promote", True))


def assemble_and_publish(request: dict, job: JobSpec, exports: list, ledger, num_shards: int,
                         train_seconds: float, images=None,
                         on_phase: Callable[[str], None] | None = None, valid: dict | None = None,
                         test_paths: list[str] | None = None, before_write: Callable[[], None] | None = None) -> dict:
    """Assemble, evaluate on the test files, save a version; the job's result record.
    `on_phase(text)` hears what it is doing (evaluating, publishing). A job whose
    training saw no rows, or whose loss is not finite, publishes nothing (MarianaError).
    `valid`: the per-epoch validation record (the exports are of its kept epoch); `test_paths`:
    local copies of the test files to score (data_via_loader), the record names the originals.
    `before_write()` runs right before the version is written, and raises to write nothing (a
    job cancelled while it was evaluated)."""
    phase = on_phase or (lambda text: None)
    summary = train_summary(request, ledger, num_shards, train_seconds, valid)
    check_trained(request["data"], sum(summary.rows_per_epoch), summary.loss, summary.run["parse"])
    bundle = ModelBundle.from_shard_exports(job.config, job.schema, exports, images)
    parent = job.init_from  # a warm start: counts go on from the parent's, as in local mode
    # what the weights learned from: up to the kept epoch (`--epochs auto` keeps the best), as local mode counts
    kept = kept_epoch(ledger, valid)
    bundle.rows_trained = sum(summary.rows_per_epoch[:kept]) + (parent["rows_trained"] if parent else 0)
    bundle.steps = sum(1 for step in ledger.done if parse_step(step)[0] <= kept) + (parent["steps"] if parent else 0)
    if parent:
        bundle.parent = {k: parent[k] for k in ("model_dir", "version", "rows_trained", "learned") if k in parent}
    tested = ({}, None)
    if request["test_data"]:
        phase(f"evaluating on {', '.join(os.path.basename(p) for p in request['test_data'])}")
        tested = evaluate(bundle, test_paths or request["test_data"])
    image_info = cluster_image_record(job, ledger, images) if images is not None else None
    phase(f"publishing a version in {request['out']}")
    if before_write is not None:
        before_write()
    return publish_version(bundle, request["out"], summary, request["test_data"], tested,
                           request.get("promote", True), images=image_info)
