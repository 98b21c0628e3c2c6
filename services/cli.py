"""The `mariana` command line: the pipeline's commands. The installed `mariana`
script is `mariana.cli:main`, which adds serving's serve, model and retrain (services/
never imports serving/); `python -m mariana.services.cli` is what the launcher runs.

    mariana gen criteo|criteo-drift --rows N --seed S --out FILE
    mariana gen ads-with-images --rows N --seed S --images MNIST_DIR --out DIR
    mariana train --data DATA[,DATA...] [--test-data DATA] --model {lr,dnn} --out MODEL_DIR [--json]
                  [--epochs N|auto] [--valid-data DATA | --valid-fraction F] [--init-from MODEL_DIR[:VERSION]]
                  [--notify REDIS_URL] [--images CREATIVES_DIR [--featurizer DIR]]
                  [--mode cluster [--workers W] [--ps S] [--preprocess P] [--sync async|ssp|bsp]]
    mariana tune --data DATA [--valid-data DATA] [--test-data DATA] --budget SECONDS --out MODEL_DIR
                 [--mode cluster [--workers W] [--ps S] [--preprocess P] [--sync ...]]
    mariana train speech [--data FSDD] [--split S] [--nproc N] [--exchange E] --out MODEL_DIR (services/speech_cli.py)
    mariana evaluate --model MODEL_DIR --data DATA [--json] [--plot FILE.png]
    mariana featurizer train --data MNIST_DIR --out DIR
    mariana featurize --model FEATURIZER_DIR --images FILE --out FILE.npy
    mariana featurize-creatives --images CREATIVES_DIR [--featurizer DIR] [--redis-url URL]
    mariana predict --model MODEL_DIR --data FILE
    mariana up [--config FILE] [--dir DIR] [--workers W] [--ps S] [--preprocess P]
    mariana down [--dir DIR] [--timeout SECONDS]
    mariana status [--dir DIR] [--json]
    mariana run {coordinator,loader,preprocess,worker,ps} --config FILE [--index N]
    mariana deploy install [--prefix DIR] [--dry-run] [--mariana PATH] [--redis-server PATH]

DATA is a file (text, gzip or Parquet), a directory or a glob (sparse/inputs.py).
User errors (a bad path, an unknown format, a file of the wrong format, a bad
config key) print one line `mariana: error: ...` and exit with code 2.
`mariana status` exits 1 when no cluster is up or its coordinator does not answer.
"""
from __future__ import annotations

import argparse
import http.client as http_client
import json
import math
import logging
import os
import signal
import sys
import threading
import time
import urllib.parse

from mariana.services import images_cli
from mariana.services.cli_parser import Parser
from mariana.services.runtime import report
from mariana.services.runtime.tuning import exiting, freeze_imports, tune_process
from mariana.sparse.errors import MarianaError
from mariana.sparse.schema import FORMATS  # light: no numpy before tune_process() sets its thread count
from mariana.sparse.settings import seed_arg

log = logging.getLogger("mariana")
EXIT_USAGE = 2
# services.runtime.config.ROLES, written out: importing it loads numpy, and `mariana --help` need not.
ROLES = ("coordinator", "loader", "preprocess", "worker", "ps")


# ---- commands -------------------------------------------------------------------

def cmd_gen(args: argparse.Namespace) -> int:
    from mariana.sparse.synth import generate_criteo

    if args.rows < 0:
        raise MarianaError("--rows must be >= 0")
    t0 = [time.perf_counter()]

    def progress(done: int, seconds: float) -> None:
        if time.perf_counter() - t0[0] >= 2.0 or done == args.rows:
            t0[0] = time.perf_counter()
            log.info("gen: %s rows, %s rows/s", f"{done:,}", f"{done / max(seconds, 1e-9):,.0f}")

    if args.kind == "criteo-drift":
        from mariana.sparse.synth_drift import generate_drift

        seeds = {"seed": args.seed} | ({} if args.model_seed is None else {"model_seed": args.model_seed})
        result = generate_drift(args.out, args.rows, progress=progress, **seeds)
    else:
        result = generate_criteo(args.out, args.rows, seed=args.seed, model_seed=args.model_seed, progress=progress)
    print(json.dumps(result))
    return 0


def _parses_data() -> None:
    """For a command that parses data files: pyarrow's pandas check answered without pandas."""
    from mariana.sparse.parse import preload

    preload()


def cmd_train(args: argparse.Namespace) -> int:
    _parses_data()
    freeze_imports()
    config = _job_config(args)
    if args.featurizer and not args.images:
        raise MarianaError("--featurizer goes with --images")
    if args.notify:  # before the training, not after it
        from mariana.services.runtime.redis_url import check_redis_url

        check_redis_url(args.notify, "--notify")
    if args.mode == "cluster":
        record = _train_cluster(args, config)
    else:
        from mariana.trainer.job import run_local_job

        _refuse_cluster_flags(args)
        record = run_local_job(config, _paths(args.data), _paths(args.test_data), args.out,
                               on_progress=_progress_logger(), valid_paths=_paths(args.valid_data),
                               init_from=args.init_from)
    if args.notify:
        from mariana.services.runtime import model_events

        model_events.publish(args.notify, "trained", record["model_dir"], record["model_version"],
                             record["model_version"])
    report.print_record(record, args.json)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    _parses_data()
    config = _job_config(args)
    if args.trials is not None and args.trials < 1:
        raise MarianaError(f"--trials must be >= 1, got {args.trials}")
    if args.mode == "cluster":
        record = _tune_cluster(args, config)
    else:
        from mariana.trainer.job import run_tune_job

        _refuse_cluster_flags(args)
        record = run_tune_job(config, _paths(args.data), _paths(args.test_data), args.out, args.budget,
                              args.model or config.model.kind, _paths(args.valid_data), args.trials, args.seed,
                              refit=not args.no_refit)
    if not args.json:
        trials = record.pop("trials")
        shown = sorted(trials, key=lambda t: (t["value"] is None, t["value"] or 0.0))[:TRIALS_SHOWN]
        print(f"the {len(shown)} best of {len(trials)} trials, by validation logloss:")
        report.print_table(("trial", "state", "valid logloss", "valid auc", "epochs", "best", "seconds", "parameters"),
                           [(t["number"], t["state"], None if t["value"] is None else f"{t['value']:.6f}",
                             report.num(t["auc"]), t["epochs"], t["best_epoch"],
                             f"{t['seconds']:.1f}", _params(t["params"])) for t in shown])
        if len(trials) > len(shown):
            print(f"(every trial: {record['tune']['trials_file']})")
        print()
    report.print_record(record, args.json)
    return 0


TRIALS_SHOWN = 15  # `tune` prints the best trials; the trials file keeps them all


def _tune_cluster(args: argparse.Namespace, config) -> dict:
    from mariana.services.cluster_tune import run_cluster_tune

    cluster, sync, asked = _cluster_settings(args)
    return run_cluster_tune(config, _paths(args.data), _paths(args.test_data), _paths(args.valid_data), args.out,
                            cluster, args.budget, args.model or config.model.kind, args.trials, args.seed, mode=sync,
                            staleness=args.staleness, asked=asked, refit=not args.no_refit)


def _cluster_settings(args: argparse.Namespace) -> tuple:
    """(the cluster config, the sync mode, the roles whose counts were asked) of --mode
    cluster's flags: --workers, --ps, --preprocess, --sync, --staleness, --cluster-config."""
    from mariana.services.runtime.config import load_cluster_config

    overrides = {key: getattr(args, flag) for flag, key in
                 (("workers", "worker.count"), ("ps", "ps.count"), ("preprocess", "preprocess.count"))
                 if getattr(args, flag) is not None}
    cluster = load_cluster_config(args.cluster_config, overrides=overrides)
    sync = args.sync or ("ssp" if args.staleness is not None else "async")
    if args.staleness is not None and sync != "ssp":
        raise MarianaError(f"--staleness goes with --sync ssp, not --sync {sync}")
    return cluster, sync, tuple(key.split(".")[0] for key in overrides)


def _refuse_cluster_flags(args: argparse.Namespace) -> None:
    for flag in ("workers", "ps", "preprocess", "sync", "staleness", "cluster_config"):
        if getattr(args, flag) is not None:
            raise MarianaError(f"--{flag.replace('_', '-')} needs --mode cluster")


def _params(params: dict) -> str:
    """{'optim.lr': 0.0123456, 'train.batch_size': 256} -> 'lr=0.0123 batch_size=256'."""
    return " ".join(f"{k.split('.', 1)[1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.', 1)[1]}={v}"
                    for k, v in params.items())


def _train_cluster(args: argparse.Namespace, config) -> dict:
    from mariana.services.runtime.cluster_job import run_cluster_job

    cluster, sync, asked = _cluster_settings(args)
    return run_cluster_job(config, _paths(args.data), _paths(args.test_data), args.out, cluster,
                           mode=sync, staleness=args.staleness, on_progress=_cluster_progress(), asked=asked,
                           valid_data=_paths(args.valid_data), init_from=args.init_from)


def _cluster_progress():
    """A cluster job's progress line about once a second; after its epochs, what it does
    instead (when that changes, and every 10 s while it lasts)."""
    said = {"phase": None, "at": 0.0}

    def report(p: dict) -> None:
        if p.get("phase"):
            if p["phase"] != said["phase"] or time.monotonic() - said["at"] >= 10.0:
                log.info("job: %s", p["phase"])
                said.update(phase=p["phase"], at=time.monotonic())
            return
        loss = "n/a" if p.get("loss") is None else f"{p['loss']:.5f}"
        log.info("epoch %d/%d: %s rows, %s rows/s, loss %s (%d batches ready, %d leased)", p["epoch"],
                 p["epochs"], f"{p['rows']:,}", f"{p['rows_per_s']:,.0f}", loss, p["ready"], p["leased"])
    return report


def cmd_evaluate(args: argparse.Namespace) -> int:
    from mariana.services.runtime import reliability
    from mariana.sparse.parse import describe_bad
    from mariana.trainer.strategies.local import evaluate

    model = _model_arg(args)
    if _speech_model(*model):  # the named version's kind (CURRENT's: a DIR:vN of the other kind failed)
        from mariana.services import speech_cli
        return speech_cli.cmd_evaluate(args)
    if args.split:
        raise MarianaError(f"--split is for speech models; {args.model} holds a click model")
    if args.plot:
        reliability.check_plot_path(args.plot)  # before the work, not after it
    _parses_data()
    bundle, paths = _model_and_data(args, model)
    t0 = time.perf_counter()
    metrics, parse = evaluate(bundle, paths)
    if not metrics["count"]:
        bad = f" ({parse['rows_bad']} malformed: {describe_bad(parse['first_bad'], 3)})" if parse["rows_bad"] else ""
        raise MarianaError(f"no valid rows in {', '.join(os.path.basename(p) for p in paths)}{bad}: "
                           "nothing to evaluate")
    if parse["rows_bad"]:
        log.warning("skipped %d malformed rows (%s)", parse["rows_bad"], describe_bad(parse["first_bad"]))
    record = {"auc": metrics["auc"], "logloss": metrics["logloss"], "calibration": metrics["calibration"],
              "ne": metrics["ne"], "ece": metrics["ece"], "rows": metrics["count"], "bad_rows": parse["rows_bad"],
              "seconds": round(time.perf_counter() - t0, 3),
              "model_dir": os.path.abspath(model[0]),  # DIR of DIR:vNNNNNN
              "model_version": bundle.manifest.get("version")}
    table = metrics["reliability"]
    if args.plot:
        reliability.plot(table, args.plot, f"{os.path.basename(record['model_dir'])} {record['model_version']}: "
                                           f"{record['rows']:,} rows, ECE {record['ece']:.4g}")
        record["plot"] = os.path.abspath(args.plot)
    report.print_record({**record, "reliability": table}, args.json)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """One pCTR per input row, in order; a row that cannot be read prints `nan` (with
    --skip-bad: nothing), so line N of the output belongs to data row N of the input."""
    import numpy as np

    from mariana.sparse.parse import describe_bad
    from mariana.trainer.data import BatchStream

    model = _model_arg(args)
    if _speech_model(*model):  # the named version's kind (CURRENT's: a DIR:vN of the other kind failed)
        from mariana.services import speech_cli
        return speech_cli.cmd_predict(args)
    _parses_data()
    bundle, paths = _model_and_data(args, model)
    stream = BatchStream(paths, bundle.encoder, bundle.config.data.block_bytes, labeled=None, slots=True)
    out = sys.stdout
    for batch, (lines, slots) in stream:
        probs = bundle.predict(batch) if batch is not None else np.empty(0)
        if not args.skip_bad:  # a nan where a row could not be read
            probs, valid = np.full(lines, np.nan), probs
            probs[slots] = valid
        if len(probs):
            out.write("\n".join("null" if args.json and p != p else f"{p:.9g}" for p in probs.tolist()))
            out.write("\n")
    out.flush()
    if stream.stats.rows_bad:
        what = "skipped" if args.skip_bad else "printed as nan"
        print(f"mariana: {stream.stats.rows_bad} malformed rows {what} "
              f"({describe_bad(stream.stats.to_dict()['first_bad'])})", file=sys.stderr)
    return 0


def _model_arg(args: argparse.Namespace) -> tuple[str, str | None]:
    """--model (DIR or DIR:vNNNNNN) as (DIR, version or None), read once for the whole command."""
    from mariana.trainer.bundle import parse_init_from

    return parse_init_from(args.model, "--model")


def _speech_model(model_dir: str, version: str | None) -> bool:
    """Whether --model's version (CURRENT's when none is named) is a speech model."""
    from mariana.featurizer.speech import is_speech_model

    return is_speech_model(model_dir, version)


def cmd_run(args: argparse.Namespace) -> int:
    import importlib

    from mariana.services.runtime.config import load_cluster_config

    cfg = load_cluster_config(args.config)
    count = cfg.count(args.role)
    if not 0 <= args.index < count:
        raise MarianaError(f"--index {args.index}: {args.config} has {count} {args.role} instance(s), "
                           f"so --index must be in 0..{count - 1}")
    cfg.require_endpoints()
    from mariana.services.transport import use_curve

    use_curve(cfg.cluster.curve_key)  # every socket of this service, bound or connected
    exposed = cfg.exposed_endpoints()
    if exposed and not cfg.cluster.curve_key:
        log.warning("%s-%d: ZeroMQ endpoints off loopback (%s) with no cluster.curve_key: any peer that reaches "
                    "them is heard (docs/operations.md, \"Several hosts\")", args.role, args.index, ", ".join(exposed))
    return importlib.import_module(f"mariana.services.{args.role}").main(cfg, args.index)


def cmd_up(args: argparse.Namespace) -> int:
    from mariana.services.launcher import up
    from mariana.services.runtime.config import load_cluster_config

    flags = (("dir", "cluster.dir"), ("workers", "worker.count"), ("ps", "ps.count"),
             ("preprocess", "preprocess.count"))
    overrides = {key: getattr(args, flag) for flag, key in flags if getattr(args, flag) is not None}
    info = up(load_cluster_config(args.config, overrides=overrides))
    log.info("web UI of jobs, services and models: %s/ui/ (until `mariana down`)", info["http"])
    _warn_redis_down(info["http"])
    print(json.dumps({"dir": info["dir"], "http": info["http"], "ui": info["http"] + "/ui/", "pids": info["pids"],
                      "supervisor": info["supervisor"]}))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from mariana.services.launcher import down

    print(json.dumps(down(_cluster_dir(args), timeout=args.timeout)))
    return 0


def cmd_supervise(args: argparse.Namespace) -> int:
    from mariana.services.supervisor import Supervisor

    return Supervisor(os.path.abspath(args.dir)).run()


def cmd_status(args: argparse.Namespace) -> int:
    from mariana.services.launcher import ClusterNotUp, remote_status, status

    url = args.url
    if url:
        _check_url(url, "--url")
    if not url:
        try:
            st = status(_cluster_dir(args))
        except ClusterNotUp as e:
            url = _deployed_url(args)  # a config that names its coordinator's fixed port (deployed by hand)
            if not url:
                said = f"{e} (or name a coordinator with --url)"
                if args.json:  # a document, as for a coordinator that does not answer (stdout was empty)
                    print(json.dumps({"dir": None, "http": None, "processes": {}, "coordinator": None, "models": [],
                                      "error": said}))
                print(f"mariana: {said}", file=sys.stderr)
                return 1
    if url:  # a cluster this shell did not start (systemd, another machine)
        url = url.rstrip("/").removesuffix("/ui")  # the web UI's address, as the browser shows it: its coordinator
        st = {"dir": None, "http": url, "started_at": None, "processes": {}, **remote_status(url)}
    if args.json:
        print(json.dumps(st))
    else:
        _print_status(st)
    return 0 if st["error"] is None else 1


def _warn_redis_down(http: str) -> None:
    """A warning when the cluster just started cannot reach its Redis (an external one: redis.embedded
    off). `up` said the cluster was up, and `status` showed every service alive, with no word."""
    from mariana.services.launcher import fetch_status

    try:
        redis = fetch_status(http).get("redis")
    except (OSError, ValueError, http_client.HTTPException):
        return
    if isinstance(redis, dict) and redis.get("up") is False:
        log.warning("the cluster is up, but its Redis %s", _redis_trouble(redis))


def _redis_trouble(redis: dict) -> str:
    """What /v1/status's `redis` says is wrong: it refuses (a wrong db, credentials, an ACL: jobs
    fail at once) or does not answer (jobs wait for it, up to redis.retry_seconds)."""
    if redis.get("refused"):
        return f"{redis.get('error')}: jobs fail until redis.url (or the Redis's ACL) is fixed"
    return f"does not answer ({redis.get('error')}): jobs wait for it (redis.url)"


def _check_url(url: str, flag: str) -> None:
    """MarianaError unless `url` is an http(s) address with a valid port (a bare host:port was
    taken for a coordinator that did not answer, exit 1)."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port
    except ValueError:
        raise MarianaError(f"{flag} {url!r}: the port is not in 0..65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MarianaError(f"{flag} {url!r}: give the coordinator's address with its scheme, e.g. "
                           f"http://{url if '://' not in url else '127.0.0.1:5701'}")


def cmd_deploy(args: argparse.Namespace) -> int:
    from mariana.services.deploy import install

    print(install(args.prefix, dry_run=args.dry_run, mariana=args.mariana, redis_server=args.redis_server))
    return 0


# ---- helpers ----------------------------------------------------------------------

def seconds_arg(text: str) -> float:
    """A number of seconds > 0 (`down --timeout nan` killed every process at once, undrained).

    >>> seconds_arg("2.5")
    2.5
    >>> seconds_arg("nan")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected a number of seconds > 0, got 'nan'
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def epochs_arg(text: str) -> int | str:
    """--epochs: a number of passes or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of passes or 'auto', got {text!r}") from None


def _paths(spec: str | None) -> list[str]:
    """The files a comma-separated `--data`/`--test-data` names (a comma in a file's name
    stays in it): files, directories (their files, by name) and globs (sorted), expanded
    here, before any work or a cluster job's submission (sparse/inputs.py); an item that
    names no file is an error naming it."""
    from mariana.sparse.inputs import expand_data_paths, split_spec

    return expand_data_paths(split_spec(spec or ""))


def _job_config(args: argparse.Namespace):
    from mariana.sparse.settings import parse_set_option
    from mariana.trainer.config import load_config

    overrides = dict(parse_set_option(item) for item in args.set or [])
    for flag, key in (("model", "model.kind"), ("epochs", "train.epochs"), ("format", "data.format"),
                      ("valid_fraction", "train.valid_fraction"), ("patience", "train.patience"),
                      ("batch_size", "train.batch_size"), ("bits", "hashing.bits"),
                      ("images", "images.creatives"), ("featurizer", "images.featurizer")):
        value = getattr(args, flag, None)
        if flag == "model" and value == "any":  # tune's: the kind is searched, the config's is the first trial's
            continue
        if value is not None:
            if key in overrides and overrides[key] != value:  # one of the two would be dropped in silence
                raise MarianaError(f"--{flag.replace('_', '-')} {value} and --set {key}={overrides[key]} disagree: "
                                   "give one")
            overrides[key] = value
    config = load_config(args.config, overrides=overrides)
    if getattr(args, "patience", None) is not None and args.command == "train" and not config.train.auto:
        raise MarianaError("--patience is for --epochs auto (it stops training on the validation logloss)")
    return config


def _model_and_data(args: argparse.Namespace, model: tuple[str, str | None]):
    """(the version `model` (`_model_arg`) names: DIR's CURRENT, or DIR:vNNNNNN; the --data
    paths), checked before any work. A version CURRENT does not name (a refused retrain
    candidate) can be scored."""
    from mariana.sparse.parse import Reader
    from mariana.trainer import checkpoint
    from mariana.trainer.bundle import ModelBundle
    from mariana.trainer.job import check_inputs

    paths = _paths(args.data)
    if not paths:
        raise MarianaError("--data names no files")
    check_inputs(paths)
    model_dir, version = model
    if version:
        checkpoint.require_version(model_dir, version)
    bundle = ModelBundle.load(model_dir, version, tables="auto")  # reads only: frozen tables when they pay
    if args.format and args.format != bundle.config.data.format:
        raise MarianaError(f"{args.model}: the model reads {bundle.config.data.format} rows; "
                           f"--format {args.format} does not match")
    Reader(paths, bundle.schema, labeled=None if args.command == "predict" else True).probe()
    freeze_imports()
    return bundle, paths


def _progress_logger():
    def report(p) -> None:
        what = "done" if p.done else "progress"
        log.info("epoch %d/%d %s: %s rows, %s rows/s, loss %.5f", p.epoch, p.epochs, what,
                 f"{p.rows:,}", f"{p.rows_per_s:,.0f}", p.loss)
    return report


def _deployed_url(args: argparse.Namespace) -> str | None:
    """The coordinator's HTTP address a --config names by a fixed port (no --dir given)."""
    from mariana.services.launcher import http_url
    from mariana.services.runtime.config import load_cluster_config

    if args.dir or not args.config:
        return None
    cfg = load_cluster_config(args.config)
    return http_url(cfg) if cfg.coordinator.http_port else None


def _cluster_dir(args: argparse.Namespace) -> str:
    from mariana.services.runtime.config import load_cluster_config

    return args.dir or load_cluster_config(args.config).cluster.path


def _print_status(st: dict) -> None:
    """What the web UI shows, as tables: services, jobs, model versions and retrain verdicts."""
    coord = st["coordinator"] or {}
    where = f"cluster {st['dir']}  " if st["dir"] else "cluster "
    print(where + st["http"] + (f"  up {_ago(st['started_at'])}" if st["started_at"] else ""))
    if st["error"]:
        print(f"  {st['error']}")
    else:
        print(f"web UI: {st['http']}/ui/")
    print()
    sup = st.get("supervisor")
    if sup:
        print(f"supervisor: pid {sup['pid']}" + ("" if sup["running"] else " (exited: nothing is restarted)"))
    redis = coord.get("redis")
    if isinstance(redis, dict) and redis.get("up") is False:  # an external one: not among the processes below
        print(f"redis: {_redis_trouble(redis)}")
    report.print_table(("SERVICE", "ROLE", "INDEX", "ALIVE", "HOST", "PID", "RESTARTS", "LAST SEEN",
                        "THROUGHPUT"),
                       _service_rows(st, coord))
    for name, why in (coord.get("refused") or {}).items():  # its config differs from the coordinator's, ...
        print(f"refused {name}: {why}")
    jobs = coord.get("jobs") or []
    if jobs:
        print()
        report.print_table(("JOB", "STATE", "MODEL", "EPOCH", "DONE", "ROWS", "ROWS/S", "LOSS", "CACHE HITS", "ERROR"),
                           [_job_row(j) for j in jobs[:STATUS_JOBS]])
        if len(jobs) > STATUS_JOBS:
            print(f"  ... and {len(jobs) - STATUS_JOBS} older (--json lists them all)")
        for j in jobs[:STATUS_JOBS]:  # what services warned of (a shard's tables too big for its memory)
            for text in j.get("warnings") or []:
                print(f"  job {j.get('id')}: warning: {text}")
    if st.get("models_error"):
        print(f"\nmodels: unreadable ({st['models_error']})")
    for m in st.get("models") or []:
        print()
        report.print_versions(m["dir"], m.get("current"), [
            {**v, "auc": (v.get("metrics") or {}).get("auc"), "logloss": (v.get("metrics") or {}).get("logloss")}
            for v in m["versions"]], most=10, total=m.get("versions_total"))
        for d in m.get("decisions", [])[:5]:
            print(f"  retrain {d.get('time')}: {d.get('verdict')} {d.get('new_version') or d.get('served_version')} "
                  f"({d.get('reason')})")


STATUS_JOBS = 20  # the newest jobs `status` lists (the coordinator keeps every job)


def _job_row(j: dict) -> tuple:
    """ROWS: over every epoch; ROWS/S: an ended job's own (its record), a running one's epoch so
    far (an ended job showed its last epoch's rows and pace: 2.7x its own for 2 epochs)."""
    p, cache, record = j.get("progress") or {}, j.get("cache") or {}, j.get("record") or {}
    frac, hits = p.get("fraction"), cache.get("hit_rate")
    state = j.get("state") + (f" ({j['restarts']} restarts)" if j.get("restarts") else "")
    rate = record["rows_per_s"] if j.get("state") != "running" and "rows_per_s" in record else p.get("rows_per_s")
    return (j.get("id"), state + (f": {j['phase']}" if j.get("phase") else ""),
            j.get("model"), f"{p.get('epoch')}/{p.get('epochs')}", None if frac is None else f"{100 * frac:.0f}%",
            report.count(p.get("rows_total", p.get("rows"))), report.count(rate), report.num(p.get("loss")),
            None if hits is None else f"{100 * hits:.1f}%", (j.get("error") or "")[:60] or None)


def _service_rows(st: dict, coord: dict) -> list[tuple]:
    """One row per process started by `up` or registered with the coordinator (a service
    started elsewhere shows the pid and host it registered with)."""
    procs, services = st["processes"], coord.get("services") or {}
    rows = []
    for name in list(procs) + [n for n in services if n not in procs]:
        p, s = procs.get(name, {}), services.get(name, {})
        # a process `up` started that has exited is not alive, whatever the coordinator last heard
        down = "stopped" if s.get("stopped") else "no"  # "stopped": it said so (Bye)
        alive = down if p and not p["running"] else "-" if not s else "yes" if s.get("alive") else down
        pid = f"{p['pid']}{'' if p['running'] else ' (exited)'}" if p else s.get("pid") or "-"
        seen = _ago(s["last_seen"]) + " ago" if s.get("last_seen") else "-"
        rate = s.get("rate") or {}
        speed = f"{rate['value']:,.1f} {rate['unit']}" if rate.get("unit") else None
        restarts = p.get("restarts", s.get("restarts"))
        rows.append((name, p.get("role") or s.get("role"), p.get("index", s.get("index")), alive,
                     s.get("host") or "-", pid, restarts, seen, speed))
    return rows


def _ago(unix_time: float) -> str:
    s = max(0.0, time.time() - unix_time)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{s / 3600:.1f}h"


# ---- parser --------------------------------------------------------------------------

def _cluster_flags(p: argparse.ArgumentParser, mode_help: str) -> None:
    """--mode and the flags of --mode cluster (read back by `_cluster_settings`)."""
    p.add_argument("--mode", choices=("local", "cluster"), default="local", help=mode_help)
    p.add_argument("--workers", type=int, help="cluster: worker processes")
    p.add_argument("--ps", type=int, help="cluster: parameter-server shards")
    p.add_argument("--preprocess", type=int, help="cluster: preprocess processes")
    p.add_argument("--sync", choices=("async", "ssp", "bsp"),
                   help="cluster: asynchronous SGD (default), bounded staleness, or a barrier per step")
    p.add_argument("--staleness", type=int, help="cluster, --sync ssp: steps a worker may run ahead (default 2)")
    p.add_argument("--cluster-config", help="cluster: TOML cluster config (its cluster.dir says where one is up)")


def build_parser() -> argparse.ArgumentParser:
    from mariana.services import __version__

    p = Parser(prog="mariana", description="CTR training and serving platform")
    p.add_argument("--version", action="version", version=f"mariana {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("gen", help="generate synthetic data with a planted click model")
    gsub = g.add_subparsers(dest="kind", required=True, metavar="KIND")
    gc = gsub.add_parser("criteo", help="Criteo-format TSV (docs/synthetic-data.md)")
    gc.add_argument("--rows", type=int, required=True, help="rows to write")
    gc.add_argument("--seed", type=seed_arg, default=0, help="seed of the rows")
    gc.add_argument("--model-seed", type=seed_arg, default=20140621, help="seed of the planted click model")
    gc.add_argument("--out", required=True, help="output file (.gz to compress)")
    gc.set_defaults(func=cmd_gen)
    gd = gsub.add_parser("criteo-drift", help="Criteo-format TSV in time order whose click model drifts "
                                              "(docs/synthetic-data.md)")
    gd.add_argument("--rows", type=int, required=True, help="rows to write (time order: split by position)")
    gd.add_argument("--seed", type=seed_arg, default=0, help="seed of the rows")
    gd.add_argument("--model-seed", type=seed_arg, help="seed of the planted click model (default: the generator's)")
    gd.add_argument("--out", required=True, help="output file (.gz to compress)")
    gd.set_defaults(func=cmd_gen)
    images_cli.add_gen_ads(gsub)

    t = sub.add_parser("train", help="train a click model locally and publish a version (`train speech`: the "
                                     "speech DNN)", epilog="modes: " + "; ".join(f"train {m}: {h}" for m, (h, _)
                                                                              in TRAIN_MODES.items()))
    t.add_argument("--data", required=True, help="training data: files, directories or globs, comma-separated")
    t.add_argument("--test-data", help="file(s) to evaluate on after training")
    t.add_argument("--model", choices=("lr", "dnn"), help="model kind (default: lr, or the config's)")
    t.add_argument("--epochs", type=epochs_arg, help="passes over the data, or 'auto': until the validation "
                   "logloss stops improving, keeping the best epoch (default 1, or the config's train.epochs)")
    t.add_argument("--valid-data", help="file(s) scored after every epoch (validation: early stopping, tuning)")
    t.add_argument("--valid-fraction", type=float, help="hold out the last F of the training rows (file order: "
                   "time order for a log) for validation (train.valid_fraction; --epochs auto takes 0.1 when none "
                   "is given)")
    t.add_argument("--init-from", metavar="MODEL_DIR[:VERSION]", help="warm start: go on from that version's "
                   "weights and optimizer state (default version: its CURRENT); the hashing and model must match")
    t.add_argument("--patience", type=int, help="--epochs auto: stop after this many epochs without a better "
                   "validation logloss (train.patience, default 1)")
    t.add_argument("--batch-size", type=int,
                   help="rows per training step (default: auto, rows/200 as a power of two in 256..4096)")
    t.add_argument("--bits", type=int, help="hash bits: the tables have 2^bits rows")
    t.add_argument("--format", choices=FORMATS, help="the data's format (default criteo; csv needs [data.schema] "
                   "in --config)")
    t.add_argument("--config", help="TOML job config ([data], [hashing], [model], [optim], [train])")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.epochs=2")
    t.add_argument("--out", required=True, help="model directory (a new version is added)")
    t.add_argument("--json", action="store_true", help="print the result as one JSON line")
    _cluster_flags(t, "local: one process; cluster: the ZeroMQ pipeline (the cluster that is up, or one "
                      "started for this job)")
    t.add_argument("--notify", metavar="REDIS_URL",
                   help="announce the new version on this Redis (model servers subscribed to it load it)")
    t.add_argument("--images", metavar="DIR", help="creatives of 'gen ads-with-images' (its OUT dir): add each "
                   "row's creative image features (lr: mode 1, dnn: mode 2 with an image tower)")
    t.add_argument("--featurizer", metavar="DIR", help="with --images: the frozen featurizer to use "
                   "(default: DIR/creatives/featurizer, trained there on first use)")
    t.set_defaults(func=cmd_train)

    tu = sub.add_parser("tune", help="search hyper-parameters under a time budget (validation logloss) and "
                        "publish the best model as a version")
    tu.add_argument("--data", required=True, help="training data: files, directories or globs, comma-separated")
    tu.add_argument("--valid-data", help="file(s) that score each trial (default: the last --valid-fraction of "
                    "the training rows)")
    tu.add_argument("--valid-fraction", type=float, help="hold out the last F of the training rows for "
                    "validation (default 0.1 when no --valid-data)")
    tu.add_argument("--test-data", help="file(s) the best model is scored on (never used to choose)")
    tu.add_argument("--budget", type=float, required=True, help="seconds of wall time for the search, from the "
                    "command's start; the trial under way at the deadline stops there, its last epoch cut short "
                    "(one cut inside its first epoch is unfinished, never the best)")
    tu.add_argument("--trials", type=int, help="stop after this many trials (default: only the budget)")
    tu.add_argument("--model", choices=("lr", "dnn", "any"),
                    help="model kind to tune (any: the kind is searched too; default: model.kind of --config or "
                    "--set, else lr)")
    tu.add_argument("--seed", type=seed_arg, default=0, help="seed of the search")
    tu.add_argument("--no-refit", action="store_true", help="publish the best trial's model as it is (default, "
                    "when validating on the held-out tail: leave time in the budget to train the best config on "
                    "every row, the tail included, for its best epoch count, and publish that)")
    tu.add_argument("--format", choices=FORMATS, help="the data's format (default criteo)")
    tu.add_argument("--bits", type=int, help="hash bits: the tables have 2^bits rows")
    tu.add_argument("--config", help="TOML job config: the first trial and what the search does not change")
    tu.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    tu.add_argument("--patience", type=int, help="epochs without a better validation logloss before a trial "
                    "stops (train.patience, default 1)")
    tu.add_argument("--out", required=True, help="model directory (the best model is a new version; the trials "
                    "go to OUT/tune/)")
    tu.add_argument("--json", action="store_true", help="print the result as one JSON line")
    _cluster_flags(tu, "local: trials train in this process; cluster: every trial is a job on the cluster that "
                       "is up, or on one started for the search")
    tu.set_defaults(func=cmd_tune)

    e = sub.add_parser("evaluate", help="metrics of a model on labeled data")
    e.add_argument("--model", required=True, help="model directory (its CURRENT version), or DIR:vNNNNNN")
    e.add_argument("--data", required=True, help="labeled rows: files, directories or globs, comma-separated")
    e.add_argument("--format", choices=FORMATS, help="the rows' format (default: the model's; must match it)")
    e.add_argument("--json", action="store_true", help="print the metrics as one JSON line")
    e.add_argument("--split", help="a speech model: whose recordings to score (official | speaker:NAME; default: "
                   "the split it was trained with)")
    e.add_argument("--plot", metavar="FILE.png", help="also write a reliability plot (predicted vs observed "
                   "CTR by bucket, with 95%% intervals and the rows per bucket); .svg and .pdf work too")
    e.set_defaults(func=cmd_evaluate)

    pr = sub.add_parser("predict", help="print one pCTR per input row (nan for a row that cannot be read)")
    pr.add_argument("--model", required=True, help="model directory (its CURRENT version), or DIR:vNNNNNN")
    pr.add_argument("--data", required=True,
                    help="labeled or unlabeled rows: files, directories or globs, comma-separated")
    pr.add_argument("--format", choices=FORMATS, help="the rows' format (default: the model's; must match it)")
    pr.add_argument("--skip-bad", action="store_true",
                    help="print nothing for a malformed row (default: nan, so output line N is input row N)")
    pr.add_argument("--json", action="store_true", help="JSON lines: a number per row (null for nan); for a "
                    "speech model, an object per wav file (file, digit, posteriors, or error)")
    pr.set_defaults(func=cmd_predict)
    images_cli.add_commands(sub)
    _add_cluster_commands(sub)
    return p


def _add_cluster_commands(sub) -> None:
    u = sub.add_parser("up", help="start a local cluster: redis and every service as its own process")
    u.add_argument("--config", help="TOML cluster config (default: built-in defaults, free ports)")
    u.add_argument("--dir", help="cluster directory: config, pids, logs (default: the config's cluster.dir)")
    u.add_argument("--workers", type=int, help="worker.count")
    u.add_argument("--ps", type=int, help="ps.count: parameter-server shards")
    u.add_argument("--preprocess", type=int, help="preprocess.count")
    u.set_defaults(func=cmd_up)

    d = sub.add_parser("down", help="stop the local cluster (SIGTERM, then SIGKILL after --timeout)")
    d.add_argument("--dir", help="cluster directory (default: the config's cluster.dir)")
    d.add_argument("--config", help="cluster config whose cluster.dir to use")
    d.add_argument("--timeout", type=seconds_arg, default=60.0, help="seconds each stage may take to exit")
    d.set_defaults(func=cmd_down)

    s = sub.add_parser("status", help="services and jobs of the local cluster")
    s.add_argument("--dir", help="cluster directory (default: the config's cluster.dir)")
    s.add_argument("--config", help="cluster config whose cluster.dir to use")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--url", help="ask this coordinator (http://host:port) instead of a local cluster's")
    s.set_defaults(func=cmd_status)

    sv = sub.add_parser("supervise", help="restart the local cluster's services that die (`up` starts it)")
    sv.add_argument("--dir", required=True, help="cluster directory")
    sv.set_defaults(func=cmd_supervise)

    r = sub.add_parser("run", help="run one service in the foreground (what systemd and `up` start)")
    r.add_argument("role", choices=ROLES, help="the service to run")
    r.add_argument("--config", required=True, help="TOML cluster config")
    r.add_argument("--index", type=int, default=0, help="which instance of the role (default 0)")
    r.set_defaults(func=cmd_run)

    dp = sub.add_parser("deploy", help="install the systemd units and configs of a systemd host")
    dsub = dp.add_subparsers(dest="action", required=True, metavar="ACTION")
    di = dsub.add_parser("install", help="write the units to PREFIX/etc/systemd/system and the configs to "
                                         "PREFIX/etc/mariana (an existing config is kept); print what to run next")
    di.add_argument("--prefix", default="/", help="root to install under (default /; a staging dir for packages)")
    di.add_argument("--dry-run", action="store_true", help="write nothing; list what would be written")
    di.add_argument("--mariana", metavar="PATH",
                    help="the mariana executable the units run (default: this install's, beside its python)")
    di.add_argument("--redis-server", metavar="PATH",
                    help="the redis-server mariana-redis.service runs (default: as `mariana up` finds it, "
                         "else /usr/bin/redis-server)")
    di.set_defaults(func=cmd_deploy)


def main(argv: list[str] | None = None, build=build_parser) -> int:
    """Run one command; `build` makes the parser (mariana/cli.py adds serving's commands to ours).
    Without `argv` (this process's own command line) the process is taken to exit next."""
    code = _main(argv, build)
    if argv is None:
        exiting()
    return code


def _main(argv: list[str] | None, build) -> int:
    from mariana.services.runtime.logs import setup_logging

    tune_process()
    mode = _train_mode(sys.argv[1:] if argv is None else argv)
    if mode is not None:  # `mariana train speech ...`: a parser of its own
        return _guarded(lambda: TRAIN_MODES[mode][1](_mode_argv(sys.argv[1:] if argv is None else argv)),
                        exiting=argv is None)
    parser = build()
    _logging_flags_everywhere(parser)
    args = parser.parse_args(argv)
    setup_logging(-1 if args.quiet else args.verbose)
    return _guarded(lambda: args.func(args), exiting=argv is None)


def _guarded(run, exiting: bool = False) -> int:
    """`run()`'s exit code; a user's error as one line `mariana: error: ...` and exit code 2.
    SIGTERM stops a command as Ctrl-C does (its cleanup runs: a cluster job is cancelled, a
    cluster started for it stopped, a version half-written removed); the default action
    killed it where it stood. Services (`run`, `serve`) set handlers of their own."""
    main = threading.current_thread() is threading.main_thread()  # (only there can a handler be set)
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    # SIGHUP (the terminal or ssh session gone) as well: `up` left a half-started cluster running,
    # with no supervisor. Unless it is ignored (nohup), which is left so.
    hup = signal.getsignal(signal.SIGHUP) if main else None
    if hup == signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _terminated)
    try:
        return _run_guarded(run, exiting and main)
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            if hup == signal.SIG_DFL:
                signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _run_guarded(run, exiting: bool = False) -> int:
    """`exiting`: the process ends after this command; a second Ctrl-C while the first one's
    cleanup runs (threads joined, a generator's finally) is then ignored, not a traceback
    ("Exception ignored in: <generator object BatchStream.__iter__>")."""
    try:
        return run()
    except MarianaError as e:
        return _fail(str(e))
    except MemoryError:
        return _fail("out of memory (a training job: lower hashing.bits, tables have 2^bits rows, or "
                     "data.block_bytes)")
    except BrokenPipeError:  # `mariana predict ... | head` (an OSError: it must come first)
        sys.stderr.close()
        return 0
    except OSError as e:  # a path that is missing, a directory, unwritable, ...
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{(e.strerror or str(e)).lower()}")
    except KeyboardInterrupt as e:  # a tune's says what it kept
        if exiting:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not os.environ.get("MARIANA_DIST_RESULT"):  # a rank of our launcher: it says this once for the job
            print(f"mariana: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130


def _train_mode(argv: list[str]) -> str | None:
    """"speech" for `mariana [-v|-q] train speech ...`, else None."""
    words = [a for a in argv if a not in ("-q", "--quiet") and not (a.startswith("-v") and set(a[1:]) <= {"v"})
             and a != "--verbose"]
    if len(words) >= 2 and words[0] == "train" and words[1] in TRAIN_MODES:
        return words[1]
    return None


def _mode_argv(argv: list[str]) -> list[str]:
    """The arguments after `train MODE`, with -v/-q given before `train` kept."""
    at = argv.index("train")
    return argv[:at] + argv[at + 2:]


def _speech_train(argv: list[str]) -> int:
    from mariana.services import speech_cli
    return speech_cli.train_main(argv)


def _image_train(argv: list[str]) -> int:
    return images_cli.train_image_main(argv)


# `mariana train MODE ...`: (help, main(argv)) of the training modes beside the CTR models
TRAIN_MODES = {"speech": ("the speech DNN on spoken digits, data parallel (mariana train speech -h)",
                          _speech_train),
               "image": ("the image CNN, model parallel x data parallel (mariana train image -h)", _image_train)}


def _logging_flags_everywhere(parser: argparse.ArgumentParser) -> None:
    """-q and -v after the command too (`mariana train ... -q`): each command takes them,
    and a flag given there overrides the one before the command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    sub.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                                     help="more log output")
                    sub.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                                     help="warnings and errors only")
                _logging_flags_everywhere(sub)


def _fail(message: str) -> int:
    print(f"mariana: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
