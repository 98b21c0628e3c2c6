"""A whole local job: build a model, train, evaluate, save a version. The CLI
and later the coordinator call this; it prints nothing."""
from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from mariana.sparse.errors import MarianaError, ModelDirError
from mariana.sparse.metrics import rounded
from mariana.sparse.parse import PROBE_BYTES, Reader, describe_bad
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle, say_if_too_big, warm_start
from mariana.trainer.config import AUTO, LOWER_RATES, JobConfig, TrainConfig
from mariana.trainer.data import RowRange, estimate_rows
from mariana.trainer.paths import check_can_create_in, check_path_name
from mariana.trainer.strategies.local import Progress, TrainResult, Validation, evaluate, peak_rss_mb, train_local

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
    if not os.fspath(path):  # "" would be the working directory, its versions among whatever is there
        raise MarianaError("the model directory (--out) is empty: name one")
    check_path_name(path, "the model directory (--out)")
    if os.path.exists(path):
        if not os.path.isdir(path):  # the user's mistake, not the filesystem's: a MarianaError for the API too
            raise MarianaError(f"{path}: exists and is not a directory")
        _check_model_dir(path)
    check_can_create_in(path, "the model directory (--out)")


def _check_model_dir(path: str) -> None:
    """An existing --out is a model directory, or holds nothing a version would land among:
    versions written into a directory of data files would be read as data by the next
    `--data DIR`, and the files taken for the model's own."""
    if os.path.exists(os.path.join(path, "CURRENT")) or checkpoint.list_versions(path):
        return
    other = sorted(n for n in os.listdir(path) if not n.startswith(".") and n not in MODEL_DIR_FILES)
    if other:
        raise MarianaError(f"{path}: holds {len(other)} other files ({', '.join(other[:3])}"
                           f"{', ...' if len(other) > 3 else ''}) and no model: --out takes a model directory, "
                           "or a new or empty one")


MODEL_DIR_FILES = {checkpoint.PROMOTIONS, checkpoint.DECISIONS, checkpoint.HIGHEST, "tune"}  # its own, beside versions


def check_trained(train_paths: list[str], rows: int, loss: float | None, parse: dict | None = None) -> None:
    """Refuse to publish a model whose training saw no rows, rows of one label only (`parse`,
    a pass's `ParseStats.to_dict()`, when it counted the clicks), or whose loss is not a
    number: nothing is ever served from it (local, cluster and retrain jobs alike).

    >>> check_trained(["a.tsv"], 0, None)
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.MarianaError: no valid training rows in a.tsv: nothing to publish
    >>> check_trained(["a.tsv"], 9, 0.1, {"rows_ok": 9, "clicks": 0, "rows_bad": 3, "first_bad": [
    ...     {"file": "a.tsv", "line": 2, "reason": "label is not 0 or 1 ('-1')"}]})
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.MarianaError: every valid training row in a.tsv is a non-click (label 0; 3 malformed rows \
skipped, the first: a.tsv:2: label is not 0 or 1 ('-1')): a click model needs both, nothing to publish
    """
    names = ", ".join(os.path.basename(p) for p in train_paths) or "the training data"
    if rows <= 0:
        raise MarianaError(f"no valid training rows in {names}: nothing to publish")
    clicks = (parse or {}).get("clicks")
    if clicks is not None and parse["rows_ok"] and clicks in (0, parse["rows_ok"]):
        # labels -1/+1 (Vowpal Wabbit's) lose every click as malformed; a day's log may hold none
        what, label = ("non-click", 0) if clicks == 0 else ("click", 1)
        bad = parse.get("rows_bad", 0)
        first = describe_bad(parse.get("first_bad") or [], 1)
        skipped = f"; {bad} malformed rows skipped" + (f", the first: {first}" if first else "") if bad else ""
        raise MarianaError(f"every valid training row in {names} is a {what} (label {label}{skipped}): a click model "
                           "needs both, nothing to publish")
    if loss is None or not math.isfinite(loss):
        raise MarianaError(f"training on {names} diverged (train loss {loss}): nothing to publish; {LOWER_RATES}")


@dataclass
class JobInputs:
    """A local job's files, checked: absolute paths, the schema, the training rows and the
    validation rows (see `validation`)."""

    train: list[str]
    test: list[str]
    schema: object
    train_rows: RowRange | None
    valid: Validation | None


def prepare_job(config: JobConfig, train_paths: list[str], test_paths: list[str], out_dir: str,
                valid_paths: list[str] | None = None) -> JobInputs:
    """Check every input before any work: the files exist and parse, the model directory
    is writable, the validation split is possible. Relative paths are taken from the
    working directory."""
    if not train_paths:
        raise MarianaError("no training files given")
    train_paths, test_paths = absolute_paths(train_paths), absolute_paths(test_paths)
    valid_paths = absolute_paths(valid_paths or [])
    config.resolve_paths()
    schema = config.data.resolve_schema()
    check_inputs(train_paths + test_paths + valid_paths)
    Reader(train_paths + test_paths + valid_paths, schema).probe()  # a wrong format fails now, not after training
    check_out_dir(out_dir)
    if test_paths:  # else, after training, a record of "n/a" metrics
        check_has_rows(test_paths, schema, "test")
    train_rows, valid = validation(config, schema, train_paths, valid_paths)
    resolve_auto(config, schema, train_paths, train_rows.rows if train_rows else None)
    return JobInputs(train_paths, test_paths, schema, train_rows, valid)


FEW_STEPS = 10  # an explicit batch size over auto's giving fewer steps an epoch than this is said
ESTIMATED_FILES = 16  # rows are estimated for that check only with this few files (a block read each)
# train.ramp_steps "auto" for a model with dense layers: a cluster job's steps out at once are
# 1 + isqrt(n / 12) after n steps (one until 12, two until 48, three until 108, ...). AdaGrad's first
# steps are its largest: taken from stale weights they broke the DNN's dense layers (docs/pipeline.md).
RAMP_STEPS = 12


def resolve_auto(config: JobConfig, schema, train_paths: list[str], rows: int | None = None,
                 workers: int = 1) -> None:
    """Settle the config's data-dependent defaults before training, in place: the numbers go
    into the manifest, and into a cluster job's spec so every service uses the same ones.
    `train.batch_size = "auto"`: `TrainConfig.auto_batch_size` of the training rows (`rows`,
    or estimated from the files); `model.init_bias = "auto"`: see `resolve_init_bias`.

    `workers`: a cluster job's worker processes. With W > 1 a model with dense layers gets
    the batch of rows / W: W workers step at once, so each step's rows were pulled before
    the other W - 1 steps' updates, and a batch W times smaller keeps the rows between a
    pull and its update what local mode's batch is. Measured (docs/benchmarks.md): the DNN
    on 1M generated rows, W = 2, AUC 0.815-0.825 at 4096 (0.784 once) against 0.829-0.837 at
    2048 (local 0.838); on Criteo Attribution no change beyond noise. LR's AUC does not move with its
    staleness, so its batch stays.

    `train.ramp_steps = "auto"`: RAMP_STEPS for a model with dense layers, 0 (no ramp) for LR:
    the steps a cluster job's workers take at once are limited at its start (services/ledger.py:
    `lease_cap`)."""
    if config.train.batch_size == AUTO:
        rows = rows if rows is not None else estimate_rows(train_paths, schema, config.data.block_bytes)
        share = rows // workers if workers > 1 and config.model.kind != "lr" else rows
        config.train.batch_size = TrainConfig.auto_batch_size(share)
        log.info("train.batch_size = %d: about %s training rows%s", config.train.batch_size, f"{rows:,}",
                 f" over {workers} workers" if share != rows else "")
    elif rows is not None or len(train_paths) <= ESTIMATED_FILES:
        # a batch the job names is kept; one of most of the rows takes a step or two an epoch
        rows = rows if rows is not None else estimate_rows(train_paths, schema, config.data.block_bytes)
        if rows and config.train.batch_size * FEW_STEPS > rows and config.train.batch_size > \
                TrainConfig.auto_batch_size(rows):
            log.warning("train.batch_size = %s makes %s an epoch of about %s training rows: the model moves "
                        "little from its start ('auto' would take %s)", f"{config.train.batch_size:,}",
                        "under one step" if config.train.batch_size > rows
                        else f"about {rows // config.train.batch_size} steps",
                        f"{rows:,}", f"{TrainConfig.auto_batch_size(rows):,}")
    if config.train.ramp_steps == AUTO:
        config.train.ramp_steps = 0 if config.model.kind == "lr" else RAMP_STEPS
    resolve_init_bias(config, schema, train_paths)


def resolve_init_bias(config: JobConfig, schema, train_paths: list[str]) -> None:
    """`model.init_bias = "auto"` -> the log-odds of the click rate in the first block of the
    first training file (smoothed: (clicks + 0.5) / (rows + 1)), in place. A model then starts
    at the data's base rate instead of at 50 %: on a 0.5 %-CTR log, a few thousand steps of
    AdaGrad on the bias alone would not get there."""
    if config.model.init_bias != AUTO:
        return
    task = next(Reader(train_paths[:1], schema, config.data.block_bytes).tasks(), None)
    labels = task.run()[0].labels if task is not None else None
    if labels is None or not len(labels):
        config.model.init_bias = 0.0
        return
    rate = (float(labels.sum()) + 0.5) / (len(labels) + 1.0)  # never 0 or 1: a finite log-odds
    config.model.init_bias = round(math.log(rate / (1.0 - rate)), 6)
    clicks = int(labels.sum())
    log.info("model.init_bias = %.4f: %d clicks in the first %d training rows (%.4f%%; smoothed %.4f%%)",
             config.model.init_bias, clicks, len(labels), 100 * clicks / len(labels), 100 * rate)


def run_local_job(config: JobConfig, train_paths: list[str], test_paths: list[str], out_dir: str,
                  on_progress: Callable[[Progress], None] | None = None, promote: bool = True,
                  valid_paths: list[str] | None = None, init_from: str | None = None) -> dict:
    """Train on `train_paths`, evaluate on `test_paths`, publish a version in `out_dir`
    (and move CURRENT to it unless `promote` is False: a candidate for a retrain gate).
    Validation rows (`valid_paths`, or `train.valid_fraction` of the training rows)
    are scored after every epoch (see `validation`). `init_from` ('DIR' or 'DIR:vNNNNNN')
    warm-starts from that version's weights and optimizer state (`trainer.bundle.warm_start`).

    Returns the result record (metrics, throughput, the version written, `promoted`).
    The manifest records every path absolute.
    """
    job = prepare_job(config, train_paths, test_paths, out_dir, valid_paths)
    images, image_info = None, None
    if config.images.creatives and not init_from:  # a warm start keeps its version's image table
        from mariana.trainer.images import prepare_image_features

        images, image_info = prepare_image_features(config.images)
    bundle = warm_start(config, job.schema, init_from) if init_from else ModelBundle(config, job.schema, images)
    say_if_too_big(bundle)
    log.info("training %s on %s (%d fields, %d dense, 2^%d ids)", config.model.kind,
             ",".join(job.train), bundle.encoder.num_fields, bundle.encoder.dense_dim, config.hashing.bits)
    trained = train_local(bundle, job.train, on_progress, rows=job.train_rows, valid=job.valid)
    train_lookups = images.counts() if images else None
    return publish(bundle, job, trained, out_dir, promote, images=images, image_info=image_info,
                   train_lookups=train_lookups)


def publish(bundle: ModelBundle, job: JobInputs, trained: TrainResult, out_dir: str, promote: bool = True,
            extra: dict | None = None, images=None, image_info: dict | None = None,
            train_lookups: dict | None = None) -> dict:
    """Refuse an untrained or diverged model, score it on the test files, save the version
    (manifest: metrics, data, validation, `extra`); the job's result record."""
    if trained.parse["rows_bad"]:
        log.warning("skipped %d malformed training rows per pass (first: %s)", trained.parse["rows_bad"],
                    describe_bad(trained.parse["first_bad"], 3))
    check_trained(job.train, trained.train_rows, trained.train_loss, trained.parse)
    tested = evaluate(bundle, job.test) if job.test else ({}, None)
    if tested[1] and tested[1]["rows_bad"]:
        log.warning("skipped %d malformed test rows (first: %s)", tested[1]["rows_bad"],
                    describe_bad(tested[1]["first_bad"], 3))
    if images:
        after = images.counts()
        image_info = image_record(image_info, train_lookups,
                                  {k: after[k] - train_lookups[k] for k in after}, bundle.config.model.kind)
    summary = TrainSummary(job.train, trained.rows_per_epoch, trained.epoch_seconds, trained.train_seconds,
                           trained.rows_per_s, trained.train_loss, trained.parse["rows_bad"], trained.valid,
                           run={"parse": trained.parse})
    record = publish_version(bundle, out_dir, summary, job.test, tested, promote, extra, image_info)
    log.info("saved %s/%s (auc=%s, logloss=%s)", out_dir, record["model_version"], _fmt(record["auc"]),
             _fmt(record["logloss"]))
    return record


@dataclass
class TrainSummary:
    """What a job's result record and its version's manifest say of its training, however
    it ran (local: `train_local`'s `TrainResult`; cluster: the coordinator's ledger)."""

    data: list[str]              # the training files
    rows_per_epoch: list[int]
    epoch_seconds: list[float]
    seconds: float               # all of training, wall clock
    rows_per_s: float
    loss: float | None           # mean logloss of the last epoch (of the best, when it was kept)
    bad_rows: int                # malformed training rows skipped
    valid: dict | None = None    # per-epoch validation metrics, the best epoch, why it stopped
    run: dict = field(default_factory=dict)  # how it ran, added to the manifest's "train" record


METRICS = ("auc", "logloss", "calibration", "ne", "test_rows", "ece")  # the manifest's "metrics"


def publish_version(bundle: ModelBundle, out_dir: str, trained: TrainSummary, test: list[str],
                    tested: tuple[dict, dict | None], promote: bool = True, extra: dict | None = None,
                    images: dict | None = None) -> dict:
    """Save `bundle` as a version in `out_dir` (CURRENT moves to it if `promote`); the job's
    result record, whose numbers the manifest records too. `tested`: (metrics, parse stats)
    of `evaluate` on the `test` files, ({}, None) without any; `images`: the image features
    record (`image_record`); `extra`: more for the manifest. Local and cluster jobs alike."""
    record = result_record(bundle.config.model.kind, trained, tested, images)
    version = bundle.save(out_dir, make_current=promote, extra={
        **({"images": images} if images else {}),
        **({"valid": trained.valid} if trained.valid else {}),
        **(extra or {}),
        "metrics": {k: record[k] for k in METRICS},
        "reliability": record["reliability"],  # beside metrics: /v1/models lists every version's metrics
        "train": {"data": trained.data, "test_data": test, "rows": record["train_rows"],
                  "seconds": record["train_seconds"], **trained.run, "test_parse": tested[1]},
    })
    record.update(model_dir=os.path.abspath(out_dir), model_version=version, promoted=promote,
                  peak_rss_mb=round(peak_rss_mb(), 1))
    say_if_worse(record)
    return record


def say_if_worse(record: dict) -> None:
    """Log `worse_than_it_could_be` of a published version's record, one warning each."""
    for line in worse_than_it_could_be(record):
        log.warning("%s: %s", record.get("model_version"), line)


def worse_than_it_could_be(record: dict) -> list[str]:
    """What a published version's numbers say against it: a test NE of 1 or more (no better than
    the test rows' click rate alone), and a last epoch kept whose validation logloss was worse
    than an earlier one's (`--epochs auto` keeps the best). Said, not refused: it is published.

    >>> worse_than_it_could_be({"ne": 1.05, "valid": {"kept": "last", "best_epoch": 1,
    ...                         "epochs": [{"logloss": 0.46}, {"logloss": 0.49}]}})  # doctest: +NORMALIZE_WHITESPACE
    ['test NE 1.0500: it scores the test rows no better than their click rate alone would',
     'validation logloss 0.49 in the last epoch (2), the one kept, against 0.46 in epoch 1: over-fitted? --epochs
     auto keeps the best epoch']
    >>> worse_than_it_could_be({"ne": 0.9})
    []
    """
    out, ne, valid = [], record.get("ne"), record.get("valid") or {}
    if isinstance(ne, (int, float)) and ne >= 1.0:
        out.append(f"test NE {ne:.4f}: it scores the test rows no better than their click rate alone would")
    epochs, best = valid.get("epochs") or [], valid.get("best_epoch") or 0
    if valid.get("kept") == "last" and 0 < best < len(epochs):
        last, low = epochs[-1].get("logloss"), epochs[best - 1].get("logloss")
        if isinstance(last, float) and isinstance(low, float) and last > low:
            out.append(f"validation logloss {last:.4g} in the last epoch ({len(epochs)}), the one kept, against "
                       f"{low:.4g} in epoch {best}: over-fitted? --epochs auto keeps the best epoch")
    return out


def result_record(kind: str, trained: TrainSummary, tested: tuple[dict, dict | None],
                  images: dict | None = None) -> dict:
    """A job's result record but where it was written (`publish_version` adds that)."""
    metrics, test_parse = tested
    record = {
        "auc": metrics.get("auc"),
        "logloss": metrics.get("logloss"),
        "calibration": metrics.get("calibration"),
        "ne": metrics.get("ne"),
        "test_rows": metrics.get("count", 0),
        "ece": metrics.get("ece"),
        # predicted vs observed CTR by bucket (None: no test data); 4 significant digits, for
        # the job store and /v1/status send every job's record again and again
        "reliability": rounded(metrics["reliability"]) if metrics else None,
        "train_rows": sum(trained.rows_per_epoch),
        "rows_per_epoch": trained.rows_per_epoch,
        "epochs": len(trained.rows_per_epoch),
        "epoch_seconds": trained.epoch_seconds,
        "train_seconds": round(trained.seconds, 3),
        "rows_per_s": round(trained.rows_per_s, 1),
        "train_loss": trained.loss,
        "bad_rows": trained.bad_rows,  # a pass's malformed training rows
        "test_bad_rows": test_parse["rows_bad"] if test_parse else 0,
        "model": kind,
    }
    if trained.valid:
        record["valid"] = trained.valid
    if trained.bad_rows:  # the first malformed rows, as the manifest's train.parse names them
        record["first_bad"] = list((trained.run.get("parse") or {}).get("first_bad") or [])[:3]
    if images:
        record["images"] = images
    return record


def written_version(out_dir: str, job: str, since: float) -> tuple[str, dict] | None:
    """(version, manifest) of the version of `out_dir` that cluster job `job` wrote (its
    manifest's train.job), looking back from the newest to those created before `since`
    (unix time, the job's start); None when it wrote none. A coordinator killed after
    writing a version and before journaling it asks this at restart, and ends the job with
    that version instead of writing the same model again."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
    for version in reversed(checkpoint.list_versions(out_dir)):
        try:
            manifest = checkpoint.read_manifest(out_dir, version)
        except ModelDirError:
            continue  # not this job's: a version it wrote is whole (written aside, then renamed)
        if manifest.get("train", {}).get("job") == job:
            return version, manifest
        if str(manifest.get("created_at", "")) < started:
            return None
    return None


def written_record(out_dir: str, version: str, manifest: dict, trained: TrainSummary, promote: bool) -> dict:
    """`publish_version`'s record of a version written before a restart (`written_version`),
    from its manifest and the job's `trained`. CURRENT moves to it now if `promote` and it
    never did (the writer was killed between the two): promotions.jsonl has no move to it."""
    metrics = manifest.get("metrics") or {}
    tested = ({**metrics, "count": metrics["test_rows"], "reliability": manifest.get("reliability")}
              if metrics.get("test_rows") else {}, manifest["train"].get("test_parse"))
    trained = dataclasses.replace(trained, seconds=float(manifest["train"].get("seconds", trained.seconds)))
    record = result_record(manifest["model"]["kind"], trained, tested, manifest.get("images"))
    if promote and not any(p["to"] == version for p in checkpoint.promotions(out_dir)):
        checkpoint.set_current(out_dir, version, "trained")
    record.update(model_dir=os.path.abspath(out_dir), model_version=version, promoted=promote,
                  peak_rss_mb=round(peak_rss_mb(), 1))
    say_if_worse(record)
    return record


def run_tune_job(config: JobConfig, train_paths: list[str], test_paths: list[str], out_dir: str,
                 budget: float, kind: str = "lr", valid_paths: list[str] | None = None,
                 max_trials: int | None = None, seed: int = 0, promote: bool = True, refit: bool = True) -> dict:
    """`mariana tune`: search under `budget` seconds (trainer.tune), publish the best
    trial's model; the record adds the trials and the chosen config. With `refit` and a
    held-out tail (no `valid_paths`), the search leaves time to train the best config on
    every row, the tail included, for its best epoch count, and publishes that model (as
    a grid search's refit does; for a log the tail is its newest rows)."""
    from mariana.trainer.tune import (SEARCH, LocalTrials, SearchInterrupted, check_search, refit_reserve,
                                      save_trials, saved_when_interrupted, summarize, trials_kept, tune)

    check_search(config, budget)
    t0 = time.perf_counter()
    config.train.epochs = "auto"  # every trial stops on its validation logloss
    job = prepare_job(config, train_paths, test_paths, out_dir, valid_paths)
    fraction = config.train.valid_fraction if job.train_rows is not None and refit else 0.0
    log.info("tuning on %s for %gs (validation: %s)", ",".join(job.train), budget, job.valid.source)
    runner = LocalTrials(job.schema, job.train, job.train_rows, job.valid)
    reserve = (lambda trial: refit_reserve(trial, fraction)) if fraction else None
    meta = {"budget_seconds": budget, "model": kind, "seed": seed, "search": SEARCH,
            "validation": job.valid.source, "first_trial": "the job's own config"}
    try:
        result = tune(config, runner, budget, kind, max_trials, seed, reserve=reserve, started=t0)
    except SearchInterrupted as e:  # Ctrl-C: the trials so far are saved, nothing is published
        raise saved_when_interrupted(e, out_dir, meta) from None
    bundle, trained = result.kept
    meta["seconds"] = round(result.seconds, 2)
    trials_file = None
    if fraction:
        with trials_kept(out_dir, result, meta) as trials_file:
            bundle, trained, meta["refit"] = refit_best(result, job, fraction, t0 + budget)
    trials_file = save_trials(out_dir, result, meta, trials_file)
    summary = summarize(result, meta, trials_file)
    record = publish(bundle, job, trained, out_dir, promote, extra={"tune": summary})
    record["tune"] = summary
    record["trials"] = [t.to_dict() for t in result.trials]
    return record


def refit_best(result, job: JobInputs, fraction: float,
               deadline: float) -> tuple[ModelBundle, TrainResult, dict]:
    """(bundle, training, what was done) of the best trial's config trained on every row for
    its best epoch count (`trainer.tune.refit_plan`); the trial's own model when that would
    not end by `deadline`."""
    from mariana.trainer.tune import refit_plan

    config, done = refit_plan(result, fraction, deadline)
    if config is None:
        return *result.kept, done
    refit = ModelBundle(config, job.schema)
    trained = train_local(refit, job.train, log_epochs=False)
    return refit, trained, {**done, "rows": trained.train_rows, "seconds": round(trained.train_seconds, 2)}


def check_has_rows(paths: list[str], schema, what: str) -> None:
    """MarianaError when `paths` hold no valid labeled row, found by parsing blocks until
    one has one (a block, for data that has rows). Before training: after it, every epoch's
    validation would say "n/a", and a tune's every trial would fail.

    >>> import tempfile; from mariana.sparse.schema import criteo
    >>> d = tempfile.mkdtemp(); open(f"{d}/v.tsv", "w").close()
    >>> check_has_rows([f"{d}/v.tsv"], criteo(), "validation")
    Traceback (most recent call last):
    mariana.sparse.errors.MarianaError: no valid validation rows in .../v.tsv (0 malformed): nothing to score a model on
    """
    bad = 0
    for task in Reader(paths, schema, PROBE_BYTES, labeled=True).tasks():  # the probe's size: a few ms
        _, stats = task.run()
        if stats.rows_ok:
            return
        bad += stats.rows_bad
    raise MarianaError(f"no valid {what} rows in {','.join(paths)} ({bad} malformed): nothing to score a model on")


DEFAULT_VALID_FRACTION = 0.1  # epochs = "auto" with no validation rows named


def validation(config: JobConfig, schema, train_paths: list[str],
               valid_paths: list[str]) -> tuple[RowRange | None, Validation | None]:
    """(the training rows, the validation rows) of a job: `valid_paths`, or the last
    `train.valid_fraction` of the training files' lines (held out of training), or
    none. `epochs = "auto"` with neither holds out the last 10 %."""
    fraction = config.train.valid_fraction
    if valid_paths and fraction:
        raise MarianaError("give validation rows one way: --valid-data or train.valid_fraction, not both")
    if valid_paths:
        trained = {os.path.realpath(p): p for p in train_paths}
        both = [p for p in valid_paths if os.path.realpath(p) in trained]
        if both:  # scored on rows it trained on, early stopping never stopped and tune picked what memorised them
            also = trained[os.path.realpath(both[0])]
            raise MarianaError(f"--valid-data {both[0]} is a training file too (as {also}): validation rows must be "
                               "rows the model does not train on")
        check_has_rows(valid_paths, schema, "validation")
        return None, Validation(valid_paths, source=",".join(valid_paths))
    if not fraction and config.train.auto:
        fraction = config.train.valid_fraction = DEFAULT_VALID_FRACTION
        log.info("epochs = auto: holding out the last %d%% of the training rows for validation", fraction * 100)
    if not fraction:
        return None, None
    train_rows, valid_rows = RowRange.of_files(train_paths, fraction, schema.header)
    if not train_rows.rows or not valid_rows.rows:
        raise MarianaError(f"train.valid_fraction {fraction} of {train_rows.rows + valid_rows.rows} lines leaves "
                           "no rows to train or none to validate on")
    return train_rows, Validation(train_paths, valid_rows,
                                  source=f"the last {fraction:g} of the training rows ({valid_rows.rows:,} lines)")


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
