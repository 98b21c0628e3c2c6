"""Batch retrain with a promotion gate: train on a window of the logs, score
the new model and the served one on a later window, promote only when the
new one is not worse (AUC within `retrain.auc_tolerance`; with `retrain.gate =
["auc", "logloss"]`, its logloss too, within `retrain.logloss_tolerance`).

Triggered by `mariana retrain --config FILE`, by POST /v1/retrain on a model
server (which runs that command with a copy of its config kept under
<model_dir>/.retrain/, so the retrain outlives the server), or by the systemd
timer in deploy/. One retrain per model directory at a time (a lock file). Every
decision is a JSON line in <model_dir>/decisions.jsonl: a candidate trained and
then not gated (the eval failed) is one too, verdict "failed", with why. A
promotion moves CURRENT (recorded in promotions.jsonl) and is announced on
Redis, so servers swap to it. After the decision is recorded, the model dir is tidied:
versions pruned to `retrain.keep_versions` (checkpoint.prune: CURRENT and its rollback
target always stay) and the files of finished runs under .retrain/ beyond the newest
`retrain.keep_runs` removed; a failure there is a warning, never a failed retrain.

A retrain with nothing new to learn (`nothing_new`: the served version was trained on
this very window with this recipe, unchanged since) trains nothing: verdict "skipped".

    {"time": ..., "verdict": "promoted" | "refused" | "failed" | "skipped", "reason": "...",
     "new_version": "v000004", "served_version": "v000003",
     "metrics": {"new": {"auc": ..., "logloss": ...}, "served": {...}},
     "auc_tolerance": 0.0, "train_data": [...], "eval_data": [...]}
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from mariana.featurizer.speech import is_speech_model
from mariana.services.runtime import model_events, procs
from mariana.services.runtime.config import to_toml
from mariana.services.runtime.tuning import unpin
from mariana.serving.config import ServeConfig
from mariana.serving.errors import ServeError
from mariana.sparse.errors import ConfigError, MarianaError, ModelDirError
from mariana.sparse.files import loads_json
from mariana.sparse.inputs import NoDataFiles, expand_data_paths
from mariana.sparse.parse import Reader, describe_bad
from mariana.sparse.settings import dotted_items, from_dict
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.config import JobConfig, load_config

log = logging.getLogger(__name__)
DECISIONS = checkpoint.DECISIONS
VERDICTS = ("promoted", "refused", "skipped", "failed")  # how a retrain ends (`outcome`)
LOCK = ".retrain.lock"
RUNS = ".retrain"  # status files and logs of retrains started over HTTP
_RUN = r"r\d{8}-\d{6}-[0-9a-f]{6}"  # a retrain run's id: its start time, then 6 hex digits
RUN_ID = re.compile(f"^{_RUN}$")


class RetrainBusy(MarianaError):
    """Another retrain of the same model directory is running."""


class RetrainFailed(MarianaError):
    """A retrain that ended with a "failed" decision, recorded: `decision` is it (what
    `retrain --json` prints before the error)."""

    def __init__(self, message: str, decision: dict):
        super().__init__(message)
        self.decision = decision


# ---- the retrain itself ---------------------------------------------------------------

def run_retrain(cfg: ServeConfig, status_file: str | None = None) -> dict:
    """Train, gate, maybe promote; returns the decision (also appended to decisions.jsonl)."""
    model_dir = cfg.serve.model_dir
    if not model_dir:
        raise ConfigError("serve.model_dir is not set: the retrain needs the model directory it publishes to")
    status = _Status(status_file)
    status.update(pid=os.getpid())
    try:
        with model_lock(model_dir):
            decision = _retrain(cfg, model_dir, status)
    except (Exception, KeyboardInterrupt) as e:  # a bug or a SIGTERM too: the status says why, not "training"
        status.update(state="failed", error=_why(e))
        raise
    status.update(state="done", decision=decision)
    return decision


def _retrain(cfg: ServeConfig, model_dir: str, status: "_Status") -> dict:
    from mariana.trainer.job import check_has_rows

    r = cfg.retrain
    train, evals = windows(cfg)
    served = _served_version(model_dir)
    if served and not (Path(model_dir) / "CURRENT").exists():
        log.warning("retrain %s: CURRENT is missing; gating against %s, the version it was moved to last "
                    "(promotions.jsonl), which the servers serve", model_dir, served)
    if served and is_speech_model(model_dir, served):
        raise ConfigError(f"{model_dir}: the version in service, {served}, is a speech model (mariana train "
                          "speech); retrain trains and gates click models")
    if served:
        check_served_loads(model_dir, served)
        check_unseen(model_dir, served, evals)
    config = job_config(cfg, served)
    same = (nothing_new(model_dir, served, train, config) or refused_before(model_dir, served, train, evals, config)
            if served and r.skip_unchanged else None)
    if same:
        return _finish(cfg, status, {"time": None, "verdict": "skipped", "reason": same, "new_version": None,
                                     "served_version": served, "train_data": train, "eval_data": evals})
    schema = config.data.resolve_schema()
    Reader(evals, schema).probe()  # before hours of training: a file of another format fails now
    check_has_rows(evals, schema, "eval window")
    log.info("retrain %s: training %s on %d file(s) (%s ... %s); served: %s", model_dir, config.model.kind,
             len(train), os.path.basename(train[0]), os.path.basename(train[-1]), served or "nothing")
    status.update(state="training", train_data=train, eval_data=evals, served_version=served)
    warm = f"{model_dir}:{served}" if r.warm_start and served else None
    if warm:
        log.info("retrain %s: warm start from the served version %s (%s mode)", model_dir, served, r.mode)
    try:
        record = _train_candidate(cfg, status, config, train, warm)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (a systemd stop): said, as a killed one's server says it
        why = str(e) or "Ctrl-C"
        job = status.data.get("job")
        _failed(cfg, status, f"the retrain was stopped while training ({why}); nothing was gated"
                + (f" (its cluster job {job} was cancelled, unless it was writing its version)" if job else ""), why)
        raise
    new = record["model_version"]
    status.update(state="evaluating", new_version=new)
    decision = {
        "time": None, "verdict": None, "reason": None, "new_version": new, "served_version": served,
        "auc_tolerance": r.auc_tolerance, "gate": list(r.gate),
        **({"logloss_tolerance": r.logloss_tolerance} if "logloss" in r.gate else {}),
        "train_data": train, "eval_data": evals,
        "train_rows": record["train_rows"], "train_seconds": record["train_seconds"], "warm_start": warm is not None,
    }
    try:
        decision.update(_judge(model_dir, new, served, evals, r))
    except (Exception, KeyboardInterrupt) as e:  # the candidate is saved: decisions.jsonl says why it stays
        decision.update(verdict="failed", reason=f"the candidate could not be gated: {_why(e)}")
        _finish(cfg, status, decision)
        if isinstance(e, MarianaError):
            raise RetrainFailed(f"retrain {model_dir}: {new} was trained but could not be gated: {e}; recorded as "
                                f"failed in {DECISIONS}{checkpoint.current_note(model_dir)}", decision) from None
        raise
    return _finish(cfg, status, decision)


def _train_candidate(cfg: ServeConfig, status: "_Status", config: JobConfig, train: list[str],
                     warm: str | None) -> dict:
    """The candidate's training, local or as a cluster job (never promoted): its record; a
    training that ends without one raises RetrainFailed, its "failed" decision recorded."""
    from mariana.trainer.job import run_local_job

    model_dir, r = cfg.serve.model_dir, cfg.retrain
    if r.mode == "cluster":
        from mariana.services.runtime.cluster_job import JobFailed, Unreachable, run_cluster_job
        from mariana.services.runtime.config import load_cluster_config

        def submitted(job: str, info: dict) -> None:  # a killed retrain's server cancels the job (`_abandoned`)
            status.update(job=job, **({"temporary_cluster": info["dir"]} if info.get("temporary") else {}))

        try:
            record = run_cluster_job(config, train, [], model_dir, load_cluster_config(r.cluster_config or None),
                                     promote=False, init_from=warm, on_submit=submitted)
        except Unreachable as e:
            job = status.data.get("job")
            if job is None:
                what = "no job was submitted"
            elif status.data.get("temporary_cluster"):
                what = f"its job {job} ended with the temporary cluster it started, stopped now"
            else:  # the job goes on without this retrain: what it writes is never gated
                what = f"the version its job {job} writes, if it does, is not gated and not served"
            raise _failed(cfg, status, f"the retrain lost its cluster ({e}); {what}", str(e)) from None
        except JobFailed as e:  # cancelled by another client, failed on the cluster
            raise _failed(cfg, status, f"its training job ended without a version: {e}", str(e)) from None
    else:
        try:
            record = run_local_job(config, train, [], model_dir, promote=False, init_from=warm)
        except (MarianaError, OSError) as e:  # the data, the disk, a diverged run: nothing was published
            # (an OSError: a training file removed mid-run, a full disk; it left no decision line, and
            # over HTTP the status said "FileNotFoundError: ..." as a bug's)
            why = str(e) if isinstance(e, MarianaError) else f"{e.filename or 'a file'}: {e.strerror or e}"
            raise _failed(cfg, status, f"training failed: {why}", f"retrain {model_dir}: {why}") from None
    return record


def _failed(cfg: ServeConfig, status: "_Status", reason: str, message: str) -> RetrainFailed:
    """A retrain whose training ended without a candidate: its "failed" decision recorded,
    and the error to raise."""
    d = status.data
    decision = _finish(cfg, status, {"time": None, "verdict": "failed", "new_version": None,
                                     "served_version": d.get("served_version"), "job": d.get("job"),
                                     "train_data": d.get("train_data"), "eval_data": d.get("eval_data"),
                                     "reason": reason})
    return RetrainFailed(message, decision)


def _finish(cfg: ServeConfig, status: "_Status", decision: dict) -> dict:
    """How every retrain that reached a decision ends: the decision recorded in
    decisions.jsonl and the status file, logged, a promotion announced on Redis (after it
    is recorded: a server that hears of it can read why), then the model dir tidied."""
    model_dir = cfg.serve.model_dir
    verdict, new = decision["verdict"], decision["new_version"]
    try:
        _record(model_dir, decision)
    except OSError as e:  # a full disk, a file of another owner: the verdict stands (CURRENT may have moved)
        unrecorded = f"{DECISIONS} could not record it ({e.strerror or e})"
    else:
        unrecorded = None
    status.update(decision=decision, **({"unrecorded": unrecorded} if unrecorded else {}))
    log.log(logging.ERROR if verdict == "failed" else logging.INFO, "retrain %s: %s%s (%s)", model_dir, verdict,
            f" {new}" if new else "", decision["reason"])
    if verdict == "promoted" and cfg.serve.redis_url:  # the servers swap to what CURRENT names, recorded or not
        model_events.publish(cfg.serve.redis_url, "promoted", model_dir, new, new, cfg.serve.channel)
    if unrecorded:  # the verdict stands and the retrain ended: said, never reported as failed
        log.error("retrain %s: %s%s, but %s%s", model_dir, verdict, f" {new}" if new else "", unrecorded,
                  checkpoint.current_note(model_dir))
    tidy(cfg, status.path)
    return decision


def tidy(cfg: ServeConfig, own_status: str | None) -> None:
    """After a decision: the versions pruned to `retrain.keep_versions` and the files of
    finished runs to `retrain.keep_runs` (0: that is not done). The decision is recorded and
    stands: whatever goes wrong here is a warning."""
    model_dir, r = cfg.serve.model_dir, cfg.retrain
    if r.keep_versions:
        try:
            result = checkpoint.prune(model_dir, r.keep_versions)
        except Exception as e:  # a bug too: the retrain did its work
            log.warning("retrain %s: the old versions were not pruned: %s", model_dir, _why(e))
        else:
            if result["removed"]:
                log.info("retrain %s: pruned %s (%s bytes freed); kept %s", model_dir,
                         ", ".join(x["name"] for x in result["removed"]), f"{result['bytes_freed']:,}",
                         ", ".join(k["version"] for k in result["kept"]))
            for why in result["errors"]:
                log.warning("retrain %s: prune: %s", model_dir, why)
    if r.keep_runs:
        try:
            gone = prune_runs(model_dir, r.keep_runs, own_status)
        except Exception as e:
            log.warning("retrain %s: the files of old runs in %s/ were not removed: %s", model_dir, RUNS, _why(e))
        else:
            if gone:
                log.info("retrain %s: removed the files of %d finished run(s) from %s/ (oldest %s)", model_dir,
                         len(gone), RUNS, gone[0])


RUN_FILE = re.compile(f"^({_RUN})\\.(json|log|toml|json\\.tmp)$")


def prune_runs(model_dir: str, keep: int, own_status: str | None = None) -> list[str]:
    """Remove the files under <model_dir>/.retrain/ (<id>.json, .log, .toml) of finished runs
    but the newest `keep` (ids sort by start time); returns the ids removed. Called by a
    retrain, holding the model dir's retrain lock: no other retrain runs or starts meanwhile
    (a server takes that lock before it starts one), so a run is done unless it is this one
    (`own_status`), or its status names a live pid and no end (kept all the same)."""
    runs = os.path.join(model_dir, RUNS)
    try:
        names = os.listdir(runs)
    except FileNotFoundError:
        return []
    files: dict[str, list[str]] = {}
    for name in names:
        m = RUN_FILE.match(name)
        if m:
            files.setdefault(m.group(1), []).append(name)
    own = os.path.abspath(own_status) if own_status else None
    done = [run for run in sorted(files) if not _may_run(os.path.join(runs, f"{run}.json"), own)]
    # this retrain's own run is one of the `keep` once it ends: 5 kept 6 finished runs' files
    room = max(0, keep - sum(1 for run in files if own == os.path.abspath(os.path.join(runs, f"{run}.json"))))
    gone = done[:max(0, len(done) - room)]
    for run in gone:
        for name in files[run]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(runs, name))
    return gone


def _may_run(status: str, own: str | None) -> bool:
    """Whether the run of this status file may still be running (see `prune_runs`)."""
    if own is not None and os.path.abspath(status) == own:
        return True
    try:
        data = loads_json(Path(status).read_text())
    except FileNotFoundError:  # files of a run that never wrote a status: it never started
        return False
    except ValueError:  # not JSON (a status is replaced whole, never half-written): no run keeps it
        return False
    except OSError:  # unreadable: it cannot be told, and is left alone
        return True
    if not isinstance(data, dict) or data.get("state") in ("done", "failed"):
        return False
    pid = data.get("pid")
    return isinstance(pid, int) and procs.running(pid)


def _judge(model_dir: str, new: str, served: str | None, evals: list[str], r) -> dict:
    """Score the candidate and the served version on the eval window, gate, and move
    CURRENT on a promotion: the decision's verdict, reason, metrics and bad row count."""
    from mariana.trainer.strategies.local import evaluate

    scores = {}
    scores["new"], parsed = evaluate(ModelBundle.load(model_dir, new, tables="auto"), evals)
    if served:
        try:
            scores["served"], parsed = evaluate(ModelBundle.load(model_dir, served, tables="auto"), evals)
        except ModelDirError:
            now = _served_version(model_dir)
            if now == served:
                raise
            # another train, promote or rollback moved CURRENT, and a prune then removed `served`
            return {"verdict": "refused", "reason": _moved(served, now, new), "metrics": {"new": _round(scores["new"])},
                    "eval_bad_rows": parsed["rows_bad"]}
    if parsed["rows_bad"]:
        log.warning("retrain %s: skipped %d malformed rows of the eval window (first: %s)", model_dir,
                    parsed["rows_bad"], describe_bad(parsed["first_bad"], 3))
    verdict, reason = gate(scores["new"], scores.get("served"), r.auc_tolerance, r.gate, r.logloss_tolerance)
    if verdict == "promoted":
        try:  # only over the version it was gated against: a promotion or rollback meanwhile stands
            checkpoint.set_current(model_dir, new, reason="retrain", expect=served)
        except checkpoint.CurrentMoved as e:
            verdict, reason = "refused", f"{reason}; but {_moved(served, e.found, new)}"
    return {"verdict": verdict, "reason": reason, "metrics": {k: _round(v) for k, v in scores.items()},
            "eval_bad_rows": parsed["rows_bad"]}


def _moved(served: str | None, found: str | None, new: str) -> str:
    return (f"CURRENT moved from {served or 'nothing'} to {found or 'nothing'} during the retrain, and {new} was not "
            f"gated against {found or 'nothing'}")


def check_served_loads(model_dir: str, served: str) -> None:
    """ModelDirError, before any training, when the version in service cannot be loaded:
    the candidate could not be scored against it, and would be left trained for nothing."""
    try:
        ModelBundle.load(model_dir, served, tables="auto")
    except Exception as e:  # whatever stops the load stops the gate after the training
        raise ModelDirError(f"{model_dir}: the version in service, {served}, cannot be loaded, and a candidate "
                            f"could not be gated against it; nothing was trained: {_why(e)} (promote a version "
                            "that loads, see 'mariana model list', then retrain)") from None


def check_unseen(model_dir: str, served: str, evals: list[str]) -> None:
    """ConfigError, before any training, when the version in service (or a version it was
    warm-started from) was trained on a file of the eval window: scored on rows it learned
    from, it looks better than it is, and a better candidate is refused (a lifecycle test:
    AUC 0.817 against the served 0.846, where a true holdout gave 0.734 against 0.727)."""
    seen = learned_from(model_dir, served)
    for path in evals:
        version = seen.get(os.path.realpath(path))
        if version:
            what = served if version == served else f"{version}, which {served} was warm-started from,"
            raise ConfigError(f"retrain windows: {path} is in the eval window, but the version in service was "
                              f"trained on it ({what} learned from it): it would be scored on rows it has seen; "
                              "score on a later window (retrain.data's newest files, or retrain.eval_data)")


def nothing_new(model_dir: str, served: str, train: list[str], config: JobConfig) -> str | None:
    """Why a retrain would learn nothing new, or None: the version in service was trained on
    these very files, in this order, with this recipe, and none of them has been written since
    that version was. A timer that retrains while no new log has come would otherwise add a
    copy of the served model each time (or, warm-started, train on the same rows again), and
    `keep_versions` would prune the versions a rollback needs to make room for the copies."""
    manifest = checkpoint.read_manifest(model_dir, served)
    if not _same_files((manifest.get("train") or {}).get("data"), train) \
            or not _made_by(model_dir, served, config, train, manifest):
        return None
    return (f"{served}, in service, was trained on these {len(train)} file(s) with this recipe, and none has "
            "changed since: nothing new to learn (retrain.skip_unchanged = false trains anyway)")


def refused_before(model_dir: str, served: str, train: list[str], evals: list[str], config: JobConfig) -> str | None:
    """Why a retrain would decide nothing new, or None: a candidate trained on these very
    windows with this recipe was refused against the version still in service (or promoted
    over it, then rolled back to it), and no file of either window has been written since it
    was made. A timer with no new logs added a refused copy each time (which took the newest
    slots that `keep_versions` keeps)."""
    for d in reversed(checkpoint.decisions(model_dir)):
        if d.get("verdict") == "skipped" or d.get("served_version") != served \
                or not _same_files(d.get("train_data"), train) or not _same_files(d.get("eval_data"), evals):
            continue
        candidate = d.get("new_version")
        if d.get("verdict") == "promoted" and isinstance(candidate, str) and _rolled_back(model_dir, candidate) \
                and _made_by(model_dir, candidate, config, train + evals):
            # the operator's rollback stands: a timer with no new logs promoted a copy of what was rolled back
            return (f"{candidate} was trained on this window with this recipe, promoted over {served} and rolled "
                    "back to it, and no file of either window has changed since: a copy would be promoted again "
                    "(retrain.skip_unchanged = false trains anyway)")
        if d.get("verdict") != "refused" or not isinstance(candidate, str) \
                or not _made_by(model_dir, candidate, config, train + evals):
            return None  # the newest decision on these windows against it is another one, or its candidate differs
        return (f"{candidate} was trained on this window with this recipe and refused against {served}, still in "
                f"service, and no file of either window has changed since: nothing new to decide "
                "(retrain.skip_unchanged = false trains anyway)")
    return None


def _rolled_back(model_dir: str, version: str) -> bool:
    """Whether `mariana model rollback` moved CURRENT away from `version` (promotions.jsonl)."""
    return any(p.get("from") == version and p.get("reason") == "rollback" for p in checkpoint.promotions(model_dir))


def _same_files(recorded, paths: list[str]) -> bool:
    """Whether `recorded` (read from a manifest or a decision: any JSON) lists `paths`, in order."""
    return isinstance(recorded, list) and [os.path.realpath(p) for p in recorded if isinstance(p, str)] == \
        [os.path.realpath(p) for p in paths]


def _made_by(model_dir: str, version: str, config: JobConfig, paths: list[str], manifest: dict | None = None) -> bool:
    """Whether `version` (its `manifest`, when read already) was made with the recipe `config`,
    after every file of `paths` was last written (or put in place: its ctime). False when that
    cannot be told (pruned, unreadable, a recipe not read back)."""
    try:
        manifest = manifest if manifest is not None else checkpoint.read_manifest(model_dir, version)
        if not same_recipe(from_dict(JobConfig, manifest.get("config") or {}), config):
            return False
        made = os.stat(os.path.join(model_dir, version, checkpoint.MANIFEST)).st_mtime
        # ctime too: `cp -p`, `rsync -a` and `tar x` put back an older mtime on new contents (skipped)
        return all(max(st.st_mtime, st.st_ctime) < made for st in map(os.stat, paths))
    except (MarianaError, OSError, TypeError, ValueError):
        return False


def same_recipe(made: JobConfig, recipe: JobConfig) -> bool:
    """Whether a version whose manifest's config is `made` (every "auto" resolved) was made by
    `recipe`: equal but for the keys `recipe` leaves "auto", which the same data resolves alike.
    A retrain.job_config's "auto"s (init_bias, batch_size, ramp_steps) made every version look
    made by another recipe, and skip_unchanged never skipped.

    >>> recipe = from_dict(JobConfig, {"train": {"batch_size": "auto"}})
    >>> made, other = (from_dict(JobConfig, {"train": {"batch_size": 256, "epochs": e}}) for e in (1, 2))
    >>> same_recipe(made, recipe), same_recipe(other, recipe)
    (True, False)
    """
    a, b = dotted_items(made.to_dict()), dotted_items(recipe.to_dict())
    return a.keys() == b.keys() and all(value == "auto" or a[key] == value for key, value in b.items())


def learned_from(model_dir: str, version: str, most: int = 1000) -> dict[str, str]:
    """The real path of each file `version` learned from -> the version trained on it: its
    manifest's train.data, then its warm-start parents' (manifest "parent"), back to the first.
    A parent pruned since is known by what the manifest's parent says it learned ("learned":
    the files of it and its ancestors; a prune of an ancestor made the check pass)."""
    seen: dict[str, str] = {}
    for _ in range(most):
        try:
            manifest = checkpoint.read_manifest(model_dir, version)
        except MarianaError:  # a parent since deleted, and from before "learned" was kept: not known here
            break
        for path in (manifest.get("train") or {}).get("data") or []:
            if isinstance(path, str):
                seen.setdefault(os.path.realpath(path), version)
        parent = manifest.get("parent")
        if not (isinstance(parent, dict) and isinstance(parent.get("model_dir"), str)
                and isinstance(parent.get("version"), str)):
            break
        for path in parent.get("learned") if isinstance(parent.get("learned"), list) else []:
            if isinstance(path, str):  # (named by the nearest ancestor: it learned them, itself or through its own)
                seen.setdefault(os.path.realpath(path), parent["version"])
        model_dir, version = parent["model_dir"], parent["version"]
    return seen


def _record(model_dir: str, decision: dict) -> None:
    """The decision, timed now, as a line of decisions.jsonl."""
    decision["time"] = _now()
    with open(os.path.join(model_dir, DECISIONS), "a") as f:
        f.write(json.dumps(decision) + "\n")


def _why(e: BaseException) -> str:
    """An exception as one line: ours say it all; another one (a bug) is named by its type."""
    if isinstance(e, MarianaError):
        return str(e)
    if isinstance(e, KeyboardInterrupt):
        return f"interrupted ({e})" if str(e) else "interrupted"
    return f"{type(e).__name__}: {e}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def gate(new: dict, served: dict | None, tolerance: float, metrics: tuple[str, ...] | list[str] = ("auc",),
         logloss_tolerance: float = 0.0) -> tuple[str, str]:
    """('promoted' | 'refused', why), on the same later window: AUC (`tolerance` below the
    served one's at most) and, with "logloss" in `metrics`, the logloss (`logloss_tolerance`,
    a fraction, above the served one's at most: a model that ranks as well but whose pCTRs
    are off, which AUC cannot see, is refused).

    >>> gate({"auc": 0.70}, {"auc": 0.71}, 0.02)
    ('promoted', 'AUC 0.700000 >= served 0.710000 - tolerance 0.02')
    >>> gate({"auc": 0.60}, {"auc": 0.71}, 0.0)[0]
    'refused'
    >>> gate({"auc": 0.72, "logloss": 0.718}, {"auc": 0.71, "logloss": 0.483}, 0.0, ("auc", "logloss"))
    ('refused', 'logloss 0.718000 > served 0.483000 x (1 + tolerance 0)')
    """
    tolerances = {"auc": tolerance, "logloss": logloss_tolerance}
    checks = [_check(m, new, served, tolerances[m]) for m in GATE_CHECKS if m in metrics]
    refused = [why for verdict, why in checks if verdict == "refused"]
    if refused:
        return "refused", "; ".join(refused)
    return "promoted", "; ".join(why for _, why in checks)


# metric -> (its name in a reason, why it may be undefined, whether a candidate passes (new, served,
# tolerance), the rule as said when it passes, and when it does not)
GATE_CHECKS = {
    "auc": ("AUC", " (the window holds one class only)", lambda v, b, t: v >= b - t,
            "{v} >= served {b} - tolerance {t}", "{v} < served {b} - tolerance {t}"),
    "logloss": ("logloss", "", lambda v, b, t: v <= b * (1 + t),
                "{v} <= served {b} x (1 + tolerance {t})", "{v} > served {b} x (1 + tolerance {t})"),
}


def _check(metric: str, new: dict, served: dict | None, tolerance: float) -> tuple[str, str]:
    name, undefined, passes, said_ok, said_no = GATE_CHECKS[metric]
    value = new.get(metric)
    if value is None or not math.isfinite(value):
        return "refused", f"the new model's {name} on the eval window is undefined{undefined}"
    if served is None:
        return "promoted", f"nothing was served; {name} {value:.6f}"
    base = served.get(metric)
    if base is None or not math.isfinite(base):
        return "promoted", f"the served model's {name} on the eval window is undefined; new {name} {value:.6f}"
    ok = passes(value, base, tolerance)
    said = (said_ok if ok else said_no).format(v=f"{value:.6f}", b=f"{base:.6f}", t=f"{tolerance:g}")
    return ("promoted" if ok else "refused"), f"{name} {said}"


def windows(cfg: ServeConfig) -> tuple[list[str], list[str]]:
    """(files to train on, later files to score on): named outright, or the newest
    `eval_files` of `data` (sorted by name) and the `train_files` just before them.
    Every name is a file, a directory or a glob, as `--data` takes (sparse/inputs.py)."""
    r = cfg.retrain
    if r.train_data or r.eval_data:
        if not (r.train_data and r.eval_data):
            raise ConfigError("retrain.train_data and retrain.eval_data go together: name both windows")
        files = _expand("retrain.train_data", r.train_data), _expand("retrain.eval_data", r.eval_data)
    else:
        if not r.data:
            raise ConfigError("retrain.data is not set: a glob of the log files (or train_data and eval_data)")
        try:
            found = expand_data_paths([r.data])  # sorted by name
        except NoDataFiles:
            found = []
        need = r.train_files + r.eval_files
        if len(found) < need:
            raise ConfigError(f"retrain.data {r.data!r} matches {len(found)} file(s); a window of "
                              f"{r.train_files} to train on and {r.eval_files} to score on needs {need}")
        files = found[-need:-r.eval_files], found[-r.eval_files:]
    for p in files[0] + files[1]:
        if not os.path.isfile(p):
            raise ConfigError(f"retrain window: {p}: no such file")
    train, evals = [os.path.abspath(p) for p in files[0]], [os.path.abspath(p) for p in files[1]]
    both = sorted(set(map(os.path.realpath, train)) & set(map(os.path.realpath, evals)))
    if both:  # a model scored on rows it was trained on passes any gate
        raise ConfigError(f"retrain windows overlap: {both[0]} is in train_data and in eval_data; the eval window "
                          "must hold rows the candidate never saw (later ones)")
    return train, evals


def _expand(key: str, specs: list[str]) -> list[str]:
    try:
        return expand_data_paths(specs)
    except NoDataFiles as e:
        raise ConfigError(f"{key}: {e}") from None


def job_config(cfg: ServeConfig, served: str | None) -> JobConfig:
    """The retrain's recipe: retrain.job_config, else that of the model in service."""
    if cfg.retrain.job_config:
        return load_config(cfg.retrain.job_config)
    if served is None:
        raise ConfigError("nothing is served yet, so there is no recipe to retrain: set retrain.job_config")
    return from_dict(JobConfig, checkpoint.read_manifest(cfg.serve.model_dir, served)["config"])


def _served_version(model_dir: str) -> str | None:
    """The version in service: CURRENT's; with CURRENT deleted, the one it was moved to last,
    which the servers go on serving (a candidate was promoted ungated, "nothing was served",
    over a version they served); None when nothing ever was."""
    try:
        return checkpoint.current_version(model_dir)
    except ModelDirError:
        if os.path.isdir(model_dir) and not (Path(model_dir) / "CURRENT").exists():
            return checkpoint.last_moved_to(model_dir)
        raise


def _round(metrics: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in metrics.items()
            if k in ("auc", "logloss", "calibration", "ne", "count")}


@contextmanager
def model_lock(model_dir: str):
    """Held while a retrain of `model_dir` runs (its pid written in the lock file);
    RetrainBusy when another process holds it. A retrain started over HTTP inherits the
    lock its server took before starting it (`LOCK_FD_ENV` names the descriptor)."""
    fd = _inherited_lock(model_dir)
    if fd is None:
        fd = take_lock(model_dir)
    try:
        write_pid(fd, os.getpid())
        yield
    finally:
        os.close(fd)  # closing drops the lock


LOCK_FD_ENV = "MARIANA_RETRAIN_LOCK_FD"


def write_pid(fd: int, pid: int, starting: bool = False) -> None:
    """`pid` as the lock file's whole content ("<pid> starting": a server process about to
    start the retrain, which a 409 must not name as the retrain). At offset 0 whatever the
    descriptor's offset: an inherited descriptor shares its server's, past the pid the server
    wrote, and a plain write there would leave NUL bytes before the digits (an unreadable pid:
    a 409 naming none)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}{' starting' if starting else ''}\n".encode(), 0)


def take_lock(model_dir: str) -> int:
    """The locked descriptor of `model_dir`'s retrain lock; RetrainBusy when it is held, and
    ModelDirError for a model dir that is not there (a mistyped one was made, and trained
    into with "nothing was served"; a file's name said "file exists")."""
    if not os.path.isdir(model_dir):
        raise ModelDirError(f"{model_dir}: " + ("not a directory" if os.path.exists(model_dir) else
                                                "no such model directory (for a first retrain into a new one, "
                                                "make it: mkdir)"))
    fd = os.open(os.path.join(model_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid, starting = _lock_holder(model_dir)
        raise RetrainBusy(f"a retrain of {model_dir} is running already" + (
            f" (pid {pid})" if pid and not starting else
            f" (starting: the server process pid {pid} is starting it)" if pid else " (starting)")) from None
    return fd


def _inherited_lock(model_dir: str) -> int | None:
    """The lock descriptor a server handed this process, if it is `model_dir`'s lock."""
    value = os.environ.pop(LOCK_FD_ENV, None)
    try:
        fd = int(value) if value else -1
        held, ours = os.fstat(fd), os.stat(os.path.join(model_dir, LOCK))
    except (ValueError, OSError):
        return None
    if (held.st_dev, held.st_ino) != (ours.st_dev, ours.st_ino):
        return None
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours already (the same open file): a no-op
    return fd


def running_retrain(model_dir: str) -> int | None:
    """The pid of the retrain holding the lock (or of the server process starting it), found
    without taking it (taking it, even for a moment, could make a retrain starting then fail)."""
    return _lock_holder(model_dir)[0]


def _lock_holder(model_dir: str) -> tuple[int | None, bool]:
    """(running_retrain's pid, whether that is a server process starting the retrain)."""
    try:
        pid, _, mark = Path(model_dir, LOCK).read_text().strip().partition(" ")
        pid = int(pid or 0)
    except (OSError, ValueError):
        return None, False
    # running, not a zombie: a finished retrain started by one of the server's worker processes
    # stays a zombie until that worker reaps it, and taken for alive it would refuse every
    # retrain asked of the other workers (409)
    return (pid, mark == "starting") if pid and procs.running(pid) else (None, False)


class _Status:
    """The JSON file a retrain started over HTTP keeps up to date (None: no file)."""

    def __init__(self, path: str | None):
        self.path = path
        self.data: dict = {}
        if path and os.path.exists(path):
            try:
                self.data = loads_json(Path(path).read_text())
            except ValueError:
                self.data = {}

    def update(self, **fields) -> None:
        self.data.update(fields, updated=_now())  # kept without a file too: the retrain reads its job back
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        try:
            Path(tmp).write_text(json.dumps(self.data))
            os.replace(tmp, self.path)
        except OSError:  # a full or read-only filesystem: no half-written temp file left behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# ---- started over HTTP ----------------------------------------------------------------

class RetrainRunner:
    """POST /v1/retrain: `mariana retrain --config FILE` as a child process; its status
    file under <model_dir>/.retrain/ can be read by every worker of the server. The worker
    that started a retrain says how it ended (`on_end(verdict)`, a log line) when it reaps it."""

    def __init__(self, cfg: ServeConfig, config_path: str | None, on_end=None):
        self.cfg, self.config_path, self.on_end = cfg, config_path, on_end
        self.children: dict[str, subprocess.Popen] = {}

    def start(self) -> dict:
        model_dir, r = self.cfg.serve.model_dir, self.cfg.retrain
        if not self.config_path or not (r.data or r.train_data):
            raise ServeError(403, "retrain is not configured on this server: start it with --config FILE "
                             "holding a [retrain] section (data, or train_data and eval_data)")
        try:  # taken here, before the child starts, and handed to it: two quick POSTs, from one
            lock = take_lock(model_dir)  # worker or two, cannot both be told 202
        except RetrainBusy as e:
            raise ServeError(409, str(e)) from None
        except OSError as e:  # a read-only or unwritable model dir
            raise _cannot_start(model_dir, e) from None
        run = time.strftime("r%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)
        runs = os.path.join(model_dir, RUNS)
        try:
            child = self._spawn(run, runs, lock)
        except OSError as e:  # a full filesystem, no process to be had, ...: nothing of this run stays
            for leftover in (f"{run}.json", f"{run}.log", f"{run}.toml"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(runs, leftover))
            raise _cannot_start(model_dir, e) from None
        finally:
            os.close(lock)  # the child's copy holds the lock now (or, if it did not start, nobody)
        unpin(child.pid)  # a pinned worker's child would inherit its one CPU
        self.children[run] = child
        log.info("retrain %s started for %s (pid %d, log: %s/%s.log)", run, model_dir, child.pid, runs, run)
        return {"id": run, "state": "starting", "status_url": f"/v1/retrain/{run}"}

    def _spawn(self, run: str, runs: str, lock: int) -> subprocess.Popen:
        """`mariana retrain` for `run`, holding `lock`, its config, status and log under `runs`."""
        write_pid(lock, os.getpid(), starting=True)  # until the child's: the lock names a live holder
        os.makedirs(runs, exist_ok=True)
        config = os.path.join(runs, f"{run}.toml")
        self._write_config(config)
        status = os.path.join(runs, f"{run}.json")
        _Status(status).update(id=run, state="starting", started=_now(), config=config)
        # The config is resolved (the environment applied): the server's MARIANA_SERVE__* and
        # MARIANA_RETRAIN__* are not applied to it again, to override what the server runs with.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MARIANA_SERVE__", "MARIANA_RETRAIN__"))}
        with open(os.path.join(runs, f"{run}.log"), "ab") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "mariana", "retrain", "--config", config, "--status-file", status],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                pass_fds=(lock,), env=env | {LOCK_FD_ENV: str(lock)})
        # Its pid at once, in the lock and the status: a status asked before its Python is up finds
        # it, and one asked after it died without a word says so. (The child's first write, a second
        # later, holds the same pid.) Not written (a full disk), the child writes it itself.
        with contextlib.suppress(OSError):
            write_pid(lock, child.pid)
        with contextlib.suppress(OSError):
            _Status(status).update(pid=child.pid)
        return child

    def _write_config(self, path: str) -> None:
        """The child's config, beside its status and log: the server's own (<run dir>/serve.toml)
        goes when the server stops, and a retrain goes on after that. Without the admin token,
        which the retrain does not use; 0600 all the same (a Redis URL may hold a password)."""
        cfg = dataclasses.replace(self.cfg, serve=dataclasses.replace(self.cfg.serve, token=""))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(to_toml(cfg))

    def status(self, run: str) -> dict:
        """(Not reaped here: `reap` may cancel a cluster job over HTTP, off the event loop.)"""
        return self._read(run)

    def _read(self, run: str) -> dict:
        path = os.path.join(self.cfg.serve.model_dir, RUNS, f"{run}.json")
        if not RUN_ID.match(run) or not os.path.exists(path):
            raise ServeError(404, f"no retrain {run!r}")
        try:
            data = loads_json(Path(path).read_text())
        except ValueError:  # written whole (os.replace) by the retrain: damaged since, or by hand
            data = None
        except OSError as e:
            raise ServeError(503, f"cannot read the status of retrain {run}: {path}: "
                                  f"{(e.strerror or str(e)).lower()}; try again later") from None
        if not isinstance(data, dict):  # '[1, 2]' was a 500 (an AttributeError)
            return {"id": run, "state": "unknown",
                    "error": f"its status file {path} holds no status object (damaged); see {path[:-5]}.log"}
        if data.get("state") not in ("done", "failed"):
            gone = self._gone(run, data.get("pid"))
            if gone:
                data.update(state="failed", error=gone, killed=True)  # (not a failure it recorded itself)
        return data

    def _gone(self, run: str, pid) -> str | None:
        """Why the process of an unfinished retrain is known to be gone, or None while it may run."""
        where = f"see {os.path.join(self.cfg.serve.model_dir, RUNS, run)}.log"
        if isinstance(pid, int):
            return None if procs.running(pid) else f"the retrain process (pid {pid}) ended without a decision; {where}"
        # No pid yet: from before its status was written until its pid is, the server that starts
        # it holds the lock and names itself in it. Nobody alive named there: it will never run.
        if running_retrain(self.cfg.serve.model_dir) is not None:
            return None
        return f"the retrain process ended before it recorded its pid (its server stopped as it started it?); {where}"

    def reap(self) -> None:
        """Forget the children that ended, saying how each did (its status file has the verdict)."""
        for run, child in list(self.children.items()):
            if child.poll() is None:
                continue
            del self.children[run]
            try:
                data = self._read(run)
                verdict, reason = outcome(data)
            except ServeError as e:
                data, verdict, reason = {}, "failed", e.message
            if data.get("killed"):
                verdict, reason = self._abandoned(run, data, reason)
            say = log.info if verdict in ("promoted", "refused", "skipped") else log.warning
            say("retrain %s of %s ended: %s (%s)", run, self.cfg.serve.model_dir, verdict, reason)
            if self.on_end is not None:
                self.on_end(verdict)

    def _abandoned(self, run: str, data: dict, error: str) -> tuple[str, str]:
        """A retrain of ours that was killed (it ended without a status of its own end, `data`):
        a "failed" decision recorded, as every retrain's end is (mariana_serve_retrains_total
        counted one that decisions.jsonl never named), and its status file saying so. A cluster
        job it left is cancelled (its temporary cluster stopped), since nothing would gate what it
        writes. A retrain whose job failed or was cancelled ended by itself and recorded so. One
        killed after its promotion moved CURRENT, before its line, is recorded as promoted.
        (verdict, reason) of its end, `error` the reason its status gave."""
        job, model_dir = data.get("job"), self.cfg.serve.model_dir
        if data.get("decision"):
            return "failed", error
        what = None
        if job and data.get("temporary_cluster"):
            what = _stop_temporary(data["temporary_cluster"], job)
        elif job:
            what = _cancel(self.cfg, job)
        new, verdict = data.get("new_version"), "failed"
        reason = "the retrain process ended without a decision" + (f"; {what}" if what else "")
        with contextlib.suppress(MarianaError):
            if new and new != data.get("served_version") and _served_version(model_dir) == new:
                # killed between its move of CURRENT and its line: the promotion stands, said as one
                verdict, reason = "promoted", (f"the retrain process ended after it moved CURRENT to {new}, before it "
                                               "recorded the gate's reason; CURRENT names it")
        decision = {"time": None, "verdict": verdict, "new_version": new, "job": job,
                    "served_version": data.get("served_version"), "train_data": data.get("train_data"),
                    "eval_data": data.get("eval_data"), "reason": reason}
        try:
            _record(model_dir, decision)
            _Status(os.path.join(model_dir, RUNS, f"{run}.json")).update(
                state="failed" if verdict == "failed" else "done", error=data.get("error"), killed=True,
                decision=decision)
        except OSError as e:
            log.warning("retrain %s: cannot record its end in %s: %s", run, DECISIONS, e)
        return verdict, (error + (f"; {what}" if what else "") if verdict == "failed" else f"{new}: {reason}")

    def close(self) -> None:
        """At the worker's stop: the retrains still running go on without it; each one said once."""
        self.reap()
        for run, child in self.children.items():
            log.info("retrain %s (pid %d) goes on after this server stops: GET /v1/retrain/%s or %s/%s will "
                     "tell its verdict", run, child.pid, run, self.cfg.serve.model_dir, DECISIONS)


def _cancel(cfg: ServeConfig, job: str) -> str:
    """A killed retrain's job on the configured cluster cancelled: what to say of it."""
    from mariana.services.runtime.cluster_job import cancel_in
    from mariana.services.runtime.config import load_cluster_config

    try:
        state = cancel_in(load_cluster_config(cfg.retrain.cluster_config or None), job)
    except (MarianaError, OSError) as e:
        return f"its cluster job {job} could not be cancelled ({e}): the version it writes is not gated"
    return f"its cluster job {job} cancelled" if state == "cancelled" else \
        f"its cluster job {job} {state}: its version, if any, is not gated"


def _stop_temporary(cluster_dir: str, job: str) -> str:
    """A killed retrain's temporary cluster stopped (its supervisor stops it when the retrain's
    process is gone; this makes sure): what to say of it."""
    from mariana.services.runtime.cluster_job import stop_temporary

    try:
        stop_temporary(cluster_dir)
    except (MarianaError, OSError) as e:
        return f"its cluster job {job} ran on a temporary cluster in {cluster_dir} that could not be stopped ({e})"
    return f"its cluster job {job} ended with the temporary cluster it ran on ({cluster_dir}), stopped"


def outcome(status: dict) -> tuple[str, str]:
    """(verdict, reason) of a retrain's status: promoted or refused with the gate's reason,
    skipped with why, or failed with the error.

    >>> outcome({"state": "done", "decision": {"verdict": "refused", "new_version": "v2", "reason": "AUC"}})
    ('refused', 'v2: AUC')
    >>> outcome({"state": "done", "decision": {"verdict": "skipped", "new_version": None, "reason": "nothing new"}})
    ('skipped', 'nothing new')
    >>> outcome({"state": "failed", "error": "no window"})
    ('failed', 'no window')
    """
    decision = status.get("decision") or {}
    if status.get("state") == "done" and decision.get("verdict") == "skipped":
        return "skipped", str(decision.get("reason"))
    if status.get("state") == "done" and decision.get("verdict") in ("promoted", "refused"):
        return decision["verdict"], f"{decision.get('new_version')}: {decision.get('reason')}"
    return "failed", status.get("error") or f"it ended in state {status.get('state')!r}"


def _cannot_start(model_dir: str, e: OSError) -> ServeError:
    """503: the server cannot start a retrain now (an operator can mend it), naming the
    file and the OS's reason, and what to do."""
    where = f"{e.filename}: " if e.filename else ""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
        todo = ("the retrain writes its lock, status, log and new version there: make the directory writable, "
                "with free space, and try again")
    else:
        todo = "try again later"
    return ServeError(503, f"cannot start a retrain of {model_dir}: {where}{(e.strerror or str(e)).lower()}; {todo}")
