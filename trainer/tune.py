"""`mariana tune`: search the hyper-parameters that matter under a wall-clock budget,
scored on the validation logloss, and publish the best model as a version.

Optuna does the search (TPE sampler, seeded) and the pruning: every trial trains
with `epochs = "auto"` (early stopping on the validation rows) and reports each
epoch's validation logloss, so a successive-halving pruner stops trials that are
behind the others at the same epoch. The first trial is the job's own config (the
defaults), so the tuned model is never worse on validation than the default one.
At the deadline the trial under way stops: in this process its last epoch is cut short
and scored, and it counts with its best epoch ("unfinished", never the best, when the
cut came inside its first epoch); a cluster trial's job is cancelled. The best trial's
model is kept in memory, scored on the test files and saved; the trials go to
`<model dir>/tune/<time>.json` and the version's manifest records the chosen config and
the search.

The search is one loop whatever trains a trial: a `TrialRunner` runs one config and
hands back its validation record. `LocalTrials` trains in this process
(`train_local`); services.cluster_tune submits each trial as a cluster job.
"""
from __future__ import annotations

import copy
import gc
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from mariana.sparse.errors import MarianaError
from mariana.sparse.files import why, write_atomically
from mariana.trainer.bundle import ModelBundle
from mariana.sparse.settings import from_dict
from mariana.trainer.config import AUTO, JobConfig, TrainConfig
from mariana.trainer.data import RowRange
from mariana.trainer.strategies.local import Validation, train_local

log = logging.getLogger(__name__)

KINDS = ("lr", "dnn", "any")
SEARCH = "optuna TPE sampler + successive halving pruner on the validation logloss per epoch"
TRIAL_MAX_EPOCHS = 30  # a trial's cap (early stopping ends most far sooner); train.max_epochs if higher


@dataclass
class Trial:
    number: int
    params: dict
    state: str = "running"          # complete | pruned | failed | budget | unfinished | interrupted
    value: float | None = None      # best validation logloss
    auc: float | None = None        # validation AUC at the best epoch
    epochs: int = 0                 # epochs run
    best_epoch: int = 0
    seconds: float = 0.0
    error: str = ""
    job: str = ""                   # cluster mode: the trial's job
    version: str = ""               # cluster mode: the version its job wrote (in the trials' scratch dir)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v != ""}  # the empty strings: not set


@dataclass
class TrialRun:
    """A trial's outcome as its runner reports it: the validation record (`valid_record`:
    each epoch's metrics, `best_epoch`, `stopped`) and what publishing the trial takes
    (`kept`; None when nothing can be published, e.g. a job cancelled at the deadline)."""
    valid: dict
    kept: object = None


class TrialRunner(Protocol):
    """How a trial trains: here (`LocalTrials`) or as a cluster job (services.cluster_tune)."""

    def run(self, trial: Trial, config: JobConfig, on_valid: Callable[[int, dict], None],
            deadline: float) -> TrialRun:
        """Train `config` with `epochs = "auto"`, calling `on_valid(epoch, metrics)` after each
        epoch's validation; when it raises (the pruner), stop the trial, free what it holds and
        let the exception through. `deadline`: a time.perf_counter() value. A MarianaError is a
        failed trial (the search goes on), a SearchFailed ends the search."""

    def discard(self, run: TrialRun) -> None:
        """A finished trial that is not, or no longer, the best: free what it keeps."""


class SearchFailed(MarianaError):
    """No trial can run any more (e.g. the cluster is gone): the search ends with this error."""


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended the search: `result` holds the trials that ran (its `best`
    may be None); the caller saves them before it exits."""

    def __init__(self, message: str = "", result: "TuneResult | None" = None):
        super().__init__(message)
        self.result = result


@dataclass
class LocalTrials:
    """Trials trained in this process; a trial keeps (its ModelBundle, its TrainResult)."""
    schema: object
    train_paths: list[str]
    train_rows: RowRange | None
    valid: Validation

    def run(self, trial: Trial, config: JobConfig, on_valid: Callable[[int, dict], None],
            deadline: float) -> TrialRun:
        bundle = ModelBundle(config, self.schema)
        result = train_local(bundle, self.train_paths, rows=self.train_rows, valid=self.valid, on_valid=on_valid,
                             deadline=deadline, log_epochs=False)
        return TrialRun(result.valid, (bundle, result))

    def discard(self, run: TrialRun) -> None:
        pass  # the bundle goes with its last reference (tune collects after every trial)


@dataclass
class TuneResult:
    best: Trial | None              # None only in a SearchInterrupted's result
    kept: object                    # the best trial's TrialRun.kept (local: (ModelBundle, TrainResult))
    config: JobConfig
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0


def search_space(trial, kind: str, base: JobConfig) -> dict:
    """The dotted config keys a trial sets: the optimizer and its rates, L1/L2, batch size,
    the numeric transform and, for the DNN, the interaction, widths and embedding size.
    Every range and list of choices holds the base config's own value (the first trial)."""
    c, p = base, {}

    def pick(name: str, choices: list, current) -> object:
        return trial.suggest_categorical(name, sorted(set(choices) | {current}, key=str))

    def rate(name: str, low: float, high: float, current: float) -> float:
        return trial.suggest_float(name, min(low, current), max(high, current), log=True)

    model = c.model.kind if kind != "any" else trial.suggest_categorical("model.kind", ["lr", "dnn"])
    p["model.kind"] = model
    p["optim.linear"] = linear = trial.suggest_categorical("optim.linear", ["adagrad", "ftrl"])
    if linear == "adagrad":
        p["optim.lr"] = rate("optim.lr", 0.005, 0.5, c.optim.lr)
    else:
        p["optim.ftrl_alpha"] = rate("optim.ftrl_alpha", 0.005, 0.5, c.optim.ftrl_alpha)
        p["optim.ftrl_l1"] = rate("optim.ftrl_l1", 1e-3, 10.0, max(c.optim.ftrl_l1, 1e-3))
        p["optim.ftrl_l2"] = rate("optim.ftrl_l2", 1e-3, 30.0, max(c.optim.ftrl_l2, 1e-3))
    p["train.batch_size"] = pick("train.batch_size", [256, 1024, 4096], int(c.train.batch_size))
    if c.data.resolve_schema().numeric:
        p["hashing.numeric"] = pick("hashing.numeric", ["bucket", "both"], c.hashing.numeric)
        p["hashing.bucket_scale"] = pick("hashing.bucket_scale", [2.0, 4.0, 8.0], float(c.hashing.bucket_scale))
    if model == "dnn":
        p["model.interaction"] = pick("model.interaction", ["proj", "dot", "fm"], c.model.interaction)
        p["model.embed_dim"] = pick("model.embed_dim", [4, 8, 16], c.model.embed_dim)
        width = pick("model.width", [32, 64, 128], c.model.hidden[0])
        p["model.hidden"] = scaled_layers(c.model.hidden, width)
        p["optim.embed_lr"] = rate("optim.embed_lr", 0.01, 0.5, c.optim.embed_lr)
        p["optim.dense_lr"] = rate("optim.dense_lr", 0.002, 0.1, c.optim.dense_lr)
    return p


def scaled_layers(hidden: list[int], width: int) -> list[int]:
    """The job's hidden layers with the first `width` wide and the others scaled alike, so
    its own shape is searched (every trial was [width, width // 2]: the first trial turned
    a job's [48, 48, 16] into [48, 24]).

    >>> scaled_layers([48, 48, 16], 48), scaled_layers([48, 48, 16], 96), scaled_layers([64, 32], 32)
    ([48, 48, 16], [96, 96, 32], [32, 16])
    """
    return [width] + [max(1, round(h * width / hidden[0])) for h in hidden[1:]]


def default_params(base: JobConfig, kind: str) -> dict:
    """The first trial: the base config's own values in the search's terms."""
    c = base
    p = {"optim.linear": c.optim.linear, "train.batch_size": int(c.train.batch_size)}
    if kind == "any":
        p["model.kind"] = c.model.kind
    p.update({"optim.lr": c.optim.lr} if c.optim.linear == "adagrad" else
             {"optim.ftrl_alpha": c.optim.ftrl_alpha, "optim.ftrl_l1": max(c.optim.ftrl_l1, 1e-3),
              "optim.ftrl_l2": max(c.optim.ftrl_l2, 1e-3)})
    if c.data.resolve_schema().numeric:
        p.update({"hashing.numeric": c.hashing.numeric, "hashing.bucket_scale": float(c.hashing.bucket_scale)})
    if c.model.kind == "dnn":
        p.update({"model.interaction": c.model.interaction, "model.embed_dim": c.model.embed_dim,
                  "model.width": c.model.hidden[0], "optim.embed_lr": c.optim.embed_lr,
                  "optim.dense_lr": c.optim.dense_lr})
    return p


def trial_max_epochs(base: JobConfig) -> int:
    """The epochs a trial may run at most (early stopping ends most far sooner)."""
    return max(base.train.max_epochs, TRIAL_MAX_EPOCHS)


def apply_params(base: JobConfig, params: dict) -> JobConfig:
    """A copy of `base` with the dotted keys of `params` set (checked like any config)."""
    tree = copy.deepcopy(base.to_dict())
    for dotted, value in params.items():
        section, key = dotted.split(".", 1)
        tree[section][key] = value
    tree["train"].update(epochs=AUTO, max_epochs=trial_max_epochs(base))
    return from_dict(JobConfig, tree)


def refit_seconds(trial: Trial, fraction: float) -> float:
    """About how long training `trial`'s config on all the rows for its best epoch count
    takes: its seconds per epoch (validation included: an over-estimate) over 1 - the
    held-out fraction.

    >>> refit_seconds(Trial(0, {}, epochs=4, best_epoch=3, seconds=8.0), 0.2)
    7.5
    """
    return trial.seconds / max(trial.epochs, 1) * max(trial.best_epoch, 1) / (1.0 - fraction)


def refit_reserve(trial: Trial, fraction: float) -> float:
    """The seconds a search keeps free for the refit of `trial` (any finished one): its estimate
    and half as much again plus a second, for what a search does after its deadline (the
    last validation pass, the study's bookkeeping) before the refit starts. Half a second
    was not enough on a 2-core host whose other core took on a cluster mid-search: that work
    ran a few times slower than the trials before had measured."""
    return 1.5 * refit_seconds(trial, fraction) + 1.0


def refit_plan(result: "TuneResult", fraction: float, deadline: float) -> tuple[JobConfig | None, dict]:
    """(the best trial's config for training on every row: its best epoch count, nothing held
    out; what is done, for `tune.refit`), or (None, why not) when the refit would not end by
    `deadline` (a time.perf_counter() value). Local and cluster searches alike."""
    best = result.best
    estimate = refit_seconds(best, fraction)
    left = deadline - time.perf_counter()
    if estimate > left:
        log.info("tune: no refit (about %.1fs needed, %.1fs of the budget left): the best trial's model is kept",
                 estimate, left)
        return None, {"done": False, "why": f"about {estimate:.1f}s needed, not left in the budget"}
    tree = copy.deepcopy(result.config.to_dict())
    tree["train"].update(epochs=max(best.best_epoch, 1), valid_fraction=0.0)
    config = from_dict(JobConfig, tree)
    log.info("tune: refit of trial %d on every row (the held-out %g too) for %d epoch(s)", best.number, fraction,
             config.train.epochs)
    return config, {"done": True, "epochs": config.train.epochs}


def check_search(config: JobConfig, budget: float) -> None:
    """What a search refuses before any work, local or cluster."""
    if config.images.creatives:
        raise MarianaError("tune: jobs with image features (images.creatives) are trained with 'mariana train'")
    if not 0 < budget < math.inf:
        raise MarianaError(f"tune: --budget must be a finite number of seconds > 0, got {budget} "
                           "(--trials N bounds the search by count)")
    if config.train.epochs not in (TrainConfig.epochs, AUTO):  # the default is untouched; anything else was meant
        log.warning("tune: train.epochs = %r is not used: every trial stops on its validation logloss (epochs = "
                    "\"auto\"), after %d epochs at most", config.train.epochs, trial_max_epochs(config))


def tune(base: JobConfig, runner: TrialRunner, budget: float, kind: str = "lr", max_trials: int | None = None,
         seed: int = 0, on_trial: Callable[[Trial], None] | None = None,
         reserve: Callable[[Trial], float] | None = None, started: float | None = None) -> TuneResult:
    """Run trials through `runner` until `budget` seconds are spent (or `max_trials` are
    done); the best trial: the lowest validation logloss of a trial that kept a model.
    `reserve(trial)`: seconds to leave at the end of the budget for that trial's refit; trials
    stop the most any finished trial needs before it (any of them may turn out the best).
    `started`: the time.perf_counter() value the budget counts from (a job's own start, so
    its preparation is inside the budget); now by default. No trial starts with less time
    left than the quickest epoch so far took: it would stop before its first validation.

        result = tune(config, LocalTrials(schema, ["train.tsv"], None, Validation(["valid.tsv"])), 60.0)
        result.best.params  # {"optim.linear": "ftrl", "optim.ftrl_alpha": 0.05, ...}
    """
    import optuna  # imported here: every other command starts without it

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _return_freed_memory()
    if kind not in KINDS:
        raise MarianaError(f"tune: unknown model {kind!r} (use {', '.join(KINDS)})")
    if kind != "any":
        base = apply_params(base, {"model.kind": kind})
    t0 = time.perf_counter()
    deadline = (t0 if started is None else started) + budget
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3))
    study.enqueue_trial(default_params(base, kind), skip_if_exists=True)
    state: dict = {"best": None, "run": None, "config": None, "trials": []}

    def objective(ot) -> float:
        t, trial = time.perf_counter(), None
        try:
            trial = Trial(ot.number, search_space(ot, kind, base))
            state["trials"].append(trial)
            return run_trial(ot, trial, t)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: this trial ends the search; those before it are kept
            state["interrupted"] = True
            if trial is not None and trial.state == "running":
                _end(trial, "interrupted", t, on_trial)
            ot.study.stop()
            raise optuna.TrialPruned() from None  # no traceback from optuna's log of a failed trial

    def run_trial(ot, trial: Trial, t: float) -> float:
        try:
            config = apply_params(base, trial.params)
            run = runner.run(trial, config, _pruning(ot, trial), search_deadline())
        except optuna.TrialPruned:
            _end(trial, "pruned", t, on_trial)
            raise
        except SearchFailed:
            raise
        except MarianaError as e:  # a diverging config: a failed trial, the search goes on
            trial.error = str(e)
            _end(trial, "failed", t, on_trial)
            return math.inf
        _settle(trial, run.valid, cut_model=run.kept is not None)
        best = state["best"]
        if run.kept is not None and trial.value is not None and (best is None or trial.value < best.value):
            if state["run"] is not None:
                runner.discard(state["run"])
            state.update(best=trial, run=run, config=config)
        elif run.kept is not None:
            runner.discard(run)
        _end(trial, trial.state, t, on_trial)
        return trial.value if trial.value is not None else math.inf

    def search_deadline() -> float:
        finished = [t for t in state["trials"] if t.value is not None and t.state in ("complete", "budget")]
        return deadline - (max(map(reserve, finished)) if reserve and finished else 0.0)

    def out_of_time(study, _trial) -> None:
        gc.collect()  # the trial's bundle (a pruned one's is held by its traceback until now)
        left = search_deadline() - time.perf_counter()
        epochs = [t.seconds / t.epochs for t in state["trials"] if t.epochs]
        if left <= 0:
            study.stop()
        elif epochs and left < min(epochs):
            log.info("tune: search ends with %.1fs left, less than the quickest epoch so far (%.1fs)",
                     left, min(epochs))
            study.stop()

    try:
        study.optimize(objective, n_trials=max_trials, callbacks=[out_of_time], catch=())
    except KeyboardInterrupt:  # between two trials
        state["interrupted"] = True
    if state.get("interrupted"):
        kept = state["run"].kept if state["run"] is not None else None
        raise SearchInterrupted(result=TuneResult(state["best"], kept, state["config"], state["trials"],
                                                  time.perf_counter() - t0))
    if state["best"] is None:
        failed = [t for t in state["trials"] if t.state == "failed"]
        if failed and len(failed) == len(state["trials"]):  # it blamed the budget for trials that diverged
            raise MarianaError(f"tune: every trial failed ({len(failed)}); the first: {failed[0].error}")
        raise MarianaError(f"tune: no trial finished within the budget of {budget:g} s "
                           "(raise --budget or use fewer rows)")
    return TuneResult(state["best"], state["run"].kept, state["config"], state["trials"],
                      time.perf_counter() - t0)


def _pruning(ot, trial: Trial) -> Callable[[int, dict], None]:
    """A trial's `on_valid`: note the epoch (a pruned trial keeps its best), tell the
    pruner, raise optuna.TrialPruned when it says so."""
    import optuna

    def on_valid(epoch: int, metrics: dict) -> None:
        trial.epochs = epoch
        if trial.value is None or metrics["logloss"] < trial.value:
            trial.value, trial.auc, trial.best_epoch = metrics["logloss"], metrics["auc"], epoch
        ot.report(metrics["logloss"], epoch)
        if ot.should_prune():
            raise optuna.TrialPruned()
    return on_valid


def _settle(trial: Trial, valid: dict, cut_model: bool = True) -> None:
    """A finished trial's numbers from its validation record (the same as on_valid's). One
    the budget stopped inside its first epoch with a model of that part epoch (`cut_model`:
    local mode, whose last epoch ends early at the deadline) is "unfinished", with no value:
    a model of a few batches (256 rows of a budget of 0.01 s) was published and promoted
    over a good one as the best of the search. (A cluster trial cut at the deadline keeps
    no model, and its epochs are whole ones.)"""
    best = valid["epochs"][valid["best_epoch"] - 1] if valid["best_epoch"] else {}
    trial.value, trial.auc = best.get("logloss"), best.get("auc")
    trial.epochs, trial.best_epoch = len(valid["epochs"]), valid["best_epoch"]
    trial.state = "budget" if valid["stopped"] == "time budget" else "complete"
    if trial.state == "budget" and trial.epochs <= 1 and cut_model:
        trial.state, trial.value, trial.error = "unfinished", None, "the budget ended its first epoch"


def _end(trial: Trial, state: str, started: float, on_trial: Callable[[Trial], None] | None) -> None:
    trial.state, trial.seconds = state, round(time.perf_counter() - started, 2)
    _report(trial, on_trial)


def _return_freed_memory() -> None:
    """Keep large arrays in their own mappings (glibc): a trial's 2^bits-row tables are then
    returned to the OS when it ends, and the next trial's zeroed tables cost only the pages
    they touch. Otherwise glibc raises its mmap threshold after the first free, serves the
    next trial's tables from the heap and must write every page of them (a DNN search on
    2,010 rows passed 8 GiB)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, and no longer dynamic
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _report(trial: Trial, on_trial: Callable[[Trial], None] | None) -> None:
    log.info("trial %d %s: valid logloss %s after %d epoch(s), %.1fs%s", trial.number, trial.state,
             "n/a" if trial.value is None else f"{trial.value:.5f}", trial.epochs, trial.seconds,
             f" (job {trial.job})" if trial.job else "")
    if on_trial:
        on_trial(trial)


def saved_when_interrupted(e: SearchInterrupted, model_dir: str, meta: dict) -> SearchInterrupted:
    """The trials of an interrupted search saved (`save_trials`): the error to raise, saying
    where they are and that nothing was published."""
    result = e.result
    if result is None or not result.trials:
        return SearchInterrupted("no trial had run; nothing published")
    path = save_trials(model_dir, result, {**meta, "interrupted": True})
    finished = sum(t.state in ("complete", "budget") for t in result.trials)
    best = f"; the best so far: trial {result.best.number}" if result.best else ""
    return SearchInterrupted(f"{len(result.trials)} trials ({finished} finished) saved in {path}{best}; "
                             "nothing published")


@contextmanager
def trials_kept(model_dir: str, result: TuneResult, meta: dict, path: str | None = None) -> Iterator[str]:
    """The search's trials saved (`save_trials`, at `path`) before the work that follows the
    search (the refit), which may take long: interrupted or failed there, the trials stay,
    and the error says where they are (they were lost with the refit's Ctrl-C)."""
    path = save_trials(model_dir, result, meta, path)
    kept = f"the search's {len(result.trials)} trials are saved in {path}; nothing published"
    try:
        yield path
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM
        raise SearchInterrupted(f"{str(e) + ' ' if str(e) else ''}during the refit of trial {result.best.number}: "
                                f"{kept}") from None
    except MarianaError as e:
        raise MarianaError(f"the refit of trial {result.best.number} failed: {e}; {kept}") from None


def summarize(result: TuneResult, meta: dict, trials_file: str) -> dict:
    """The `tune` entry of the record and the version's manifest."""
    return {**meta, "trials": len(result.trials), "best_trial": result.best.number,
            "best_params": result.best.params, "trials_file": trials_file}


def trials_path(model_dir: str) -> str:
    """<model_dir>/tune/<time>-<pid>.json: where a search's trials go (two searches into
    one dir in the same second wrote one file)."""
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.json"
    return os.path.join(os.path.abspath(model_dir), "tune", name)


def save_trials(model_dir: str, result: TuneResult, meta: dict, path: str | None = None) -> str:
    """The trials as JSON in `path` (default: `trials_path(model_dir)`); returns the path."""
    path = path or trials_path(model_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise MarianaError(f"{os.path.dirname(path)}: cannot create it for the trials: {why(e)}") from None
    body = {**meta, "best_trial": result.best.number if result.best else None,
            "trials": [t.to_dict() for t in result.trials]}
    return write_atomically(path, lambda f: json.dump(body, f, indent=1, allow_nan=False))

