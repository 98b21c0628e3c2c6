"""`mariana tune --mode cluster`: trainer.tune's search, every trial a cluster job.

The search (the Optuna study, its space, the deadline, the bookkeeping) is trainer.tune's;
`ClusterTrials` runs one trial: POST /v1/jobs with the trial's config (`epochs = "auto"`;
the --valid-data files, or the coordinator holds out the tail of the training rows,
`train.valid_fraction`; `promote: false`; published into the scratch model dir
OUT/tune/<time>-<pid>-<host>-trials/), polls GET /v1/jobs/{id}/history for each epoch's validation
metrics and hands them to the pruner, and cancels the job (POST /v1/jobs/{id}/cancel)
when the pruner stops it or at the deadline (a job cancelled there publishes nothing).
A trial's version is deleted as soon as it is not the best so far; the best is copied
into OUT as a new version whose manifest adds `tune`, and the scratch dir goes when the
search ends (one a SIGKILL left is removed by the next search on its host). One cluster
serves the whole search: the one up, or one started for it.
"""
from __future__ import annotations

import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from mariana.services.assemble import check_request
from mariana.services.runtime.cluster_job import (JobFailed, Unreachable, _request, cancel_job, cluster_session,
                                                  submit, wait)
from mariana.services.runtime import procs
from mariana.services.runtime.config import ClusterConfig
from mariana.sparse.errors import MarianaError
from mariana.trainer import checkpoint
from mariana.trainer.config import JobConfig
from mariana.trainer.job import absolute_paths
from mariana.trainer.strategies.local import best_epoch, valid_record
from mariana.trainer.tune import (SEARCH, SearchFailed, SearchInterrupted, Trial, TrialRun, check_search, refit_plan,
                          refit_reserve, save_trials, saved_when_interrupted, summarize, trials_kept, trials_path,
                          tune)

log = logging.getLogger(__name__)
POLL_SECONDS = 0.25  # how late the pruner hears an epoch, and the deadline is noticed


@dataclass
class ClusterTrials:
    """Trials as jobs on the cluster `info` names (launcher.cluster_info). `body`: what every
    trial's job shares (files, `out` = the scratch dir, mode, promote false). A finished
    trial keeps its job's record."""
    info: dict
    body: dict
    source: str  # what the trials validate on (`trial_body`)

    def run(self, trial: Trial, config: JobConfig, on_valid: Callable[[int, dict], None],
            deadline: float) -> TrialRun:
        try:
            trial.job = submit(self.info, {**self.body, "config": config.to_dict()})
            return self.follow(trial, config, on_valid, deadline)
        except Unreachable as e:
            raise SearchFailed(str(e)) from None
        except BaseException:  # pruned, failed, interrupted: the job must not go on
            if trial.job:
                self.drop(trial.job)
            raise

    def follow(self, trial: Trial, config: JobConfig, on_valid: Callable[[int, dict], None],
               deadline: float) -> TrialRun:
        """Poll the job: each new epoch's validation metrics go to `on_valid`; its record
        once it is done; at the deadline it is cancelled (a trial without a model)."""
        seen, writing = 0, False  # writing: a cancel was refused (the job ends done), not asked again
        while True:
            summary = _request(self.info, "GET", f"/v1/jobs/{trial.job}")
            epochs = self.valid_epochs(trial.job)  # after the summary: a done job's are all there
            for e in epochs[seen:]:
                on_valid(e["epoch"], e)
            seen = len(epochs)
            if summary["state"] == "done":
                trial.version = summary["record"]["model_version"]
                return TrialRun(summary["record"]["valid"], summary["record"])
            if summary["state"] in ("failed", "cancelled"):
                raise JobFailed(f"job {trial.job} {summary['state']}: {summary['error']}")
            if not writing and time.perf_counter() >= deadline:
                state = self.cancel(trial.job)["state"]
                if state not in ("done", "writing"):
                    return TrialRun(self.cut(epochs, config), None)
                writing = state == "writing"  # its version is on its way: polled until done
            time.sleep(POLL_SECONDS)

    def valid_epochs(self, job: str) -> list[dict]:
        """The job's validated epochs as a `valid` record lists them ({epoch, logloss, auc, ...})."""
        history = _request(self.info, "GET", f"/v1/jobs/{job}/history?since={time.time():.3f}")  # no points
        return [{"epoch": s["epoch"], **s["valid"], "train_loss": s.get("loss")}
                for s in history["epochs"] if s.get("valid") and s["valid"].get("logloss") is not None]

    def cut(self, epochs: list[dict], config: JobConfig) -> dict:
        """The validation record of a job cancelled at the deadline."""
        best = best_epoch([e["logloss"] for e in epochs])
        return valid_record(self.source, epochs, best, "none (cancelled at the deadline)",
                            True, config.train.patience, config.train.max_epochs, stopped="time budget")

    def cancel(self, job: str) -> dict:
        return cancel_job(self.info, job)

    def drop(self, job: str) -> None:
        """Cancel a trial's job; one that got done first (or was writing its version: it is
        waited for) loses its version."""
        try:
            summary, until = self.cancel(job), time.monotonic() + 120.0
            while summary["state"] in ("writing", "running") and time.monotonic() < until:
                time.sleep(POLL_SECONDS)
                summary = _request(self.info, "GET", f"/v1/jobs/{job}")
        except MarianaError as e:
            log.warning("could not cancel job %s: %s", job, e)
            return
        if summary["state"] == "done":
            self.discard(TrialRun({}, summary["record"]))

    def discard(self, run: TrialRun) -> None:
        shutil.rmtree(os.path.join(run.kept["model_dir"], run.kept["model_version"]), ignore_errors=True)


def run_cluster_tune(config: JobConfig, data: list[str], test_data: list[str], valid_data: list[str], out: str,
                     cluster: ClusterConfig, budget: float, kind: str = "lr", max_trials: int | None = None,
                     seed: int = 0, mode: str = "async", staleness: int | None = None,
                     asked: tuple[str, ...] = (), promote: bool = True, refit: bool = True) -> dict:
    """Search under `budget` seconds with every trial a job on the cluster up in `cluster`'s
    dir (or one started for the search), publish the best trial's version in `out`; the
    record of its job, adding `tune` and the trials (as trainer.job.run_tune_job's). With
    `refit` and the held-out tail, the best config is trained again on every row (one more
    job; see trainer.job.run_tune_job) and that version is the one published."""
    check_search(config, budget)
    t0 = time.perf_counter()
    config.train.epochs = "auto"  # every trial stops on its validation logloss
    path = trials_path(out)
    sweep_dead_scratch(out)
    scratch = f"{path.removesuffix('.json')}-{_host_tag()}-trials"
    body, config, source = trial_body(config, data, test_data, valid_data, scratch, mode, staleness)
    fraction = config.train.valid_fraction if refit and not body["valid_data"] else 0.0
    reserve = (lambda trial: refit_reserve(trial, fraction)) if fraction else None
    try:
        with cluster_session(cluster, asked) as info:
            log.info("tuning on %s for %gs, every trial a job on %s (validation: %s)", ",".join(body["data"]),
                     budget, info["http"], source)
            meta = {"budget_seconds": budget, "model": kind, "seed": seed, "search": SEARCH, "validation": source,
                    "first_trial": "the job's own config", "mode": f"cluster/{mode}"}
            try:
                result = tune(config, ClusterTrials(info, body, source), budget, kind, max_trials, seed,
                              reserve=reserve, started=t0)
            except SearchInterrupted as e:  # Ctrl-C: the trials so far are saved, nothing is published
                raise saved_when_interrupted(e, out, meta) from None
            meta["seconds"] = round(result.seconds, 2)
            kept = result.kept
            if fraction:
                with trials_kept(out, result, meta, path):
                    kept, meta["refit"] = refit_job(info, body, result, fraction, t0 + budget)
        summary = summarize(result, meta, path)
        record = publish_best(kept, out, promote, summary)
    finally:  # after the session: a cluster started for the search has stopped writing into it
        shutil.rmtree(body["out"], ignore_errors=True)
    try:
        save_trials(out, result, {**meta, "model_version": record["model_version"]}, path)
    except MarianaError as e:  # after the publish: the version stands, and the error says it is out
        raise MarianaError(f"{e}; the best trial's model was published all the same, as "
                           f"{record['model_dir']}/{record['model_version']}") from None
    return {**record, "tune": summary, "trials": [t.to_dict() for t in result.trials]}


def refit_job(info: dict, body: dict, result, fraction: float, deadline: float) -> tuple[dict, dict]:
    """(the record of the version to publish, what was done): a job training the best
    trial's config on every row for its best epoch count (`trainer.tune.refit_plan`), or the
    trial's own version when that would not end by `deadline`."""
    config, done = refit_plan(result, fraction, deadline)
    if config is None:
        return result.kept, done
    job = submit(info, {**body, "config": config.to_dict()})
    log.info("tune: refit job %s submitted", job)
    record = wait(info, job, None)
    return record, {**done, "rows": record["train_rows"], "seconds": record["train_seconds"], "job": job}


def _host_tag() -> str:
    """This host's name as a file name can hold it (a scratch dir names the host and pid of
    its search, so another search can tell a dead one's)."""
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in platform.node())[:64] or "host"


def sweep_dead_scratch(out: str) -> None:
    """Remove the scratch dirs (`<time>-<pid>-<host>-trials`, their trial versions) of searches
    on this host whose process is gone: a search killed with SIGKILL left its for good (a DNN's
    trials are whole model versions). Another host's, or one of a live pid, is left alone."""
    tune_dir = os.path.join(os.path.abspath(out), "tune")
    try:
        names = os.listdir(tune_dir)
    except OSError:
        return
    tag = _host_tag()
    for name in names:
        parts = name.split("-", 2)  # <time>, <pid>, <host>-trials
        if len(parts) != 3 or parts[2] != f"{tag}-trials" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or procs.running(pid):
            continue
        shutil.rmtree(os.path.join(tune_dir, name), ignore_errors=True)
        log.info("removed %s: the scratch dir of a search (pid %d) that ended without removing it", name, pid)


def trial_body(config: JobConfig, data: list[str], test_data: list[str], valid_data: list[str], scratch: str,
               mode: str, staleness: int | None) -> tuple[dict, JobConfig, str]:
    """(what every trial's job shares: its config goes in per trial, the config with its
    "auto" values settled: the numbers the search starts from, what the trials validate on:
    the --valid-data files or the held-out tail the coordinator cuts, `train.valid_fraction`,
    0.1 when none was named), checked as the coordinator will check it: bad input fails
    before any process starts."""
    body = {"data": absolute_paths(data), "test_data": absolute_paths(test_data), "out": scratch,
            "valid_data": absolute_paths(valid_data), "mode": mode, "promote": False,
            **({"staleness": staleness} if staleness is not None else {})}
    request, spec = check_request({**body, "config": config.resolve_paths().to_dict()})
    source = request["holdout"]["source"] if request.get("holdout") else ",".join(body["valid_data"])
    return body, spec.config, source


def publish_best(record: dict, out: str, promote: bool, summary: dict) -> dict:
    """Copy the best trial's version into `out` (CURRENT moves to it unless `promote` is
    False), its manifest adding `tune`; its job's record, naming the new version."""
    manifest, weights, optim = checkpoint.load_version(record["model_dir"], record["model_version"],
                                                       with_optimizer=True)
    manifest = {k: v for k, v in manifest.items() if k not in ("format", "version")}
    version = checkpoint.save_version(out, {**manifest, "tune": summary}, weights, optim, make_current=promote,
                                      reason="trained")
    log.info("saved %s/%s: trial %d's model (job %s, %s/%s)", out, version, summary["best_trial"], record["job"],
             record["model_dir"], record["model_version"])
    return {**record, "model_dir": os.path.abspath(out), "model_version": version, "promoted": promote}
