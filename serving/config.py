"""The serving config: one TOML file for `mariana serve` and `mariana retrain`.

    [serve]
    model_dir = "/var/lib/mariana/models/ctr"
    host = "127.0.0.1"            # loopback by default
    port = 8080
    workers = 0                   # processes sharing the port; 0: one per CPU it may use
    pin_workers = true            # with 2+ workers, each on a CPU of its own (round robin)
    redis_url = "redis://127.0.0.1:6379/0"   # new versions announced here ("" : poll only)
    token = "..."                 # bearer token of POST /v1/retrain ("" : the endpoint is off)

    [retrain]
    data = "/var/lib/mariana/logs/*.tsv"  # files sorted by name are the time order
    train_files = 3               # the window trained on ...
    eval_files = 1                # ... and the later window both models are scored on
    auc_tolerance = 0.0           # promote when new AUC >= served AUC - tolerance
    keep_versions = 7             # after each decision: CURRENT, its rollback target and the newest 7 stay

Loaded like every config here: defaults <- TOML <- `MARIANA_SERVE__PORT`-style
environment <- flags. Unknown keys and wrong types are errors naming the key.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from mariana.services.runtime.auth import check_token
from mariana.services.runtime.model_events import CHANNEL
from mariana.services.runtime.redis_url import check_redis_url
from mariana.sparse.errors import ConfigError
from mariana.sparse.host import available_cpus
from mariana.sparse.settings import load_settings
from mariana.sparse.table import TABLE_FORMS


@dataclass
class ServeSection:
    model_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 0                    # processes sharing the port (SO_REUSEPORT); 0: one per CPU it may
                                        # use (sparse/host.py: affinity, cgroup quota)
    pin_workers: bool = True            # with 2+ workers, worker i runs on one CPU (the i-th the server may
                                        # use, round robin): its caches stay warm (-21% CPU per request)
    max_body_bytes: int = 8 << 20       # a larger body is answered 413
    max_instances: int = 10_000         # instances per request; more is answered 413
    batch_requests: int = 64            # requests answered by one model call at most (micro-batching)
    inline_bytes: int = 16384           # a batch of bodies this small is answered on the event loop (<~3 ms);
                                        # bigger ones on the model thread (0: always the thread)
    watch_seconds: float = 2.0          # how often CURRENT is read again (the fallback to pub/sub)
    redis_url: str = ""                 # where new versions are announced; "" : poll only
    channel: str = CHANNEL
    token: str = ""                     # bearer token of the admin endpoints; "" : they are off
    drain_seconds: float = 10.0         # on SIGTERM, requests in flight get this long to finish
    keepalive_seconds: float = 75.0     # a connection with no request in flight (or one never sent, or sent
                                        # only in part: its headers) is closed after this long
    body_seconds: float = 60.0          # a request body not all received in this long is answered 408, closed
    tables: str = "auto"                # a version's tables in memory: "frozen", as many bytes as rows saved
                                        # (~0.2 us more CPU an id); "dense", 2^hashing.bits rows; "auto": frozen
                                        # when that is under half the bytes and dense would be >= 64 MiB
    creatives_seconds: float = 5.0      # image models: how often creatives featurized since training are read
                                        # from redis_url's creative cache into the table (0: never)

    def __post_init__(self) -> None:
        check_token(self.token, "serve.token")
        for key in ("max_body_bytes", "max_instances", "batch_requests"):
            if getattr(self, key) < 1:
                raise ConfigError(f"serve.{key} must be >= 1, got {getattr(self, key)}")
        if self.inline_bytes < 0:
            raise ConfigError(f"serve.inline_bytes must be >= 0, got {self.inline_bytes}")
        if self.workers < 0:
            raise ConfigError(f"serve.workers must be >= 0 (0: one per CPU it may use), got {self.workers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"serve.port must be in 0..65535, got {self.port}")
        if self.watch_seconds <= 0:
            raise ConfigError(f"serve.watch_seconds must be > 0, got {self.watch_seconds}")
        for key in ("keepalive_seconds", "body_seconds"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"serve.{key} must be > 0, got {getattr(self, key)}")
        if self.creatives_seconds < 0:
            raise ConfigError(f"serve.creatives_seconds must be >= 0 (0: never), got {self.creatives_seconds}")
        if self.tables not in TABLE_FORMS:
            raise ConfigError(f"serve.tables must be one of {', '.join(TABLE_FORMS)}, got {self.tables!r}")
        check_redis_url(self.redis_url, "serve.redis_url")  # else the watcher's tasks would die on it, unseen

    @property
    def worker_count(self) -> int:
        return self.workers or available_cpus()


@dataclass
class RetrainSection:
    data: str = ""                      # glob of the log files; sorted by name = time order
    train_files: int = 1                # the newest files but `eval_files` are trained on (this many)
    eval_files: int = 1                 # the newest files score both models
    train_data: list[str] = field(default_factory=list)  # or name the windows outright
    eval_data: list[str] = field(default_factory=list)
    auc_tolerance: float = 0.0          # the new model may be this much below the served one's AUC
    gate: list[str] = field(default_factory=lambda: ["auc"])  # what the new model must not be worse on:
                                        # "auc", and/or "logloss" (calibration counts there: pCTRs that bid)
    logloss_tolerance: float = 0.0      # "logloss" in gate: the new logloss may be this fraction above the served
    job_config: str = ""                # a job TOML; default: the served model's own config
    mode: str = "local"                 # or "cluster": train on the cluster that is up
    cluster_config: str = ""            # cluster mode: its TOML (default: the built-in defaults)
    warm_start: bool = False            # go on from the served version's weights (daily incremental training)
    skip_unchanged: bool = True         # no training when the served version learned this very window, with
                                        # this recipe, and no file of it changed since (decision "skipped")
    keep_versions: int = 0              # after each decision, versions pruned to CURRENT, its rollback target and
                                        # the newest this many (`mariana model prune --keep N`); 0: keep every one
    keep_runs: int = 20                 # <model_dir>/.retrain/ files of finished retrains started over HTTP kept
                                        # (the newest); 0: keep every one

    def __post_init__(self) -> None:
        if self.mode not in ("local", "cluster"):
            raise ConfigError(f"retrain.mode must be 'local' or 'cluster', got {self.mode!r}")
        if self.train_files < 1 or self.eval_files < 1:
            raise ConfigError("retrain.train_files and retrain.eval_files must be >= 1")
        for key in ("keep_versions", "keep_runs"):
            if getattr(self, key) < 0:
                raise ConfigError(f"retrain.{key} must be >= 0 (0: keep every one), got {getattr(self, key)}")
        if not 0 <= self.auc_tolerance < 1:  # an AUC lies in [0, 1]: a tolerance of 1 or more gates nothing
            raise ConfigError(f"retrain.auc_tolerance must be in [0, 1), got {self.auc_tolerance}")
        if not self.gate or not set(self.gate) <= set(GATE_METRICS):
            raise ConfigError(f"retrain.gate must name one or both of {list(GATE_METRICS)}, got {self.gate}")
        if not 0 <= self.logloss_tolerance < 1:
            raise ConfigError(f"retrain.logloss_tolerance must be in [0, 1) (0.01: 1% above the served model's "
                              f"logloss), got {self.logloss_tolerance}")


GATE_METRICS = ("auc", "logloss")  # what retrain.gate may hold


def ready_path(run_dir: str, index: int | str) -> str:
    """<run>/worker-<index>.ready: there while worker `index` listens (/readyz counts them; the
    supervisor removes a dead worker's, and /metrics then leaves out its gauges)."""
    return os.path.join(run_dir, f"worker-{index}.ready")


def snapshot_path(run_dir: str, index: int | str) -> str:
    """<run>/metrics-<index>.json: worker `index`'s metrics, which every worker's /metrics adds up."""
    return os.path.join(run_dir, f"metrics-{index}.json")


def snapshot_worker(path: str) -> str:
    """The worker index a snapshot_path names.

    >>> snapshot_worker(snapshot_path("/run/x", 3))
    '3'
    """
    return os.path.basename(path)[len("metrics-"):-len(".json")]


def worker_files(run_dir: str) -> list[str]:
    """Every worker's ready and snapshot files in the run dir (none once no worker is left)."""
    return glob.glob(ready_path(run_dir, "*")) + glob.glob(snapshot_path(run_dir, "*"))


def check_retrain_files(cfg: "ServeConfig") -> None:
    """ConfigError unless the config files the [retrain] section names exist and load (valid
    TOML, known keys, values of the right types): checked when a server starts, not when its
    first retrain (the nightly timer's) fails on a typo."""
    from mariana.services.runtime.config import load_cluster_config
    from mariana.trainer.config import load_config

    r = cfg.retrain
    for key, path, load in (("retrain.job_config", r.job_config, load_config),
                            ("retrain.cluster_config", r.cluster_config, load_cluster_config)):
        if not path:
            continue
        if not os.path.isfile(path):
            raise ConfigError(f"{key}: {path}: " + ("is not a file" if os.path.exists(path) else "no such file"))
        try:
            load(path)
        except ConfigError as e:
            where = "" if str(e).startswith(path) else f"{path}: "  # a TOML error names its file already
            raise ConfigError(f"{key}: {where}{e}") from None


@dataclass
class ServeConfig:
    serve: ServeSection = field(default_factory=ServeSection)
    retrain: RetrainSection = field(default_factory=RetrainSection)


def load_serve_config(path: str | None = None, overrides: dict | None = None,
                      env: dict | None = None) -> ServeConfig:
    cfg = load_settings(ServeConfig, path, env, {k: v for k, v in (overrides or {}).items() if v is not None})
    if path:
        base = os.path.dirname(os.path.abspath(path))  # relative paths in the file are relative to it
        cfg.serve.model_dir = _relative_to(base, cfg.serve.model_dir)
        r = cfg.retrain
        r.job_config, r.cluster_config, r.data = (_relative_to(base, p) for p in (r.job_config, r.cluster_config,
                                                                                  r.data))
        r.train_data = [_relative_to(base, p) for p in r.train_data]
        r.eval_data = [_relative_to(base, p) for p in r.eval_data]
    return cfg


def _relative_to(base: str, path: str) -> str:
    return os.path.join(base, path) if path and not os.path.isabs(path) else path
