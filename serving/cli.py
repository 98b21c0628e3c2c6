"""Serving's commands of `mariana` (mariana/cli.py adds them to the pipeline's, services/cli.py).

    mariana serve --model-dir DIR [--config FILE] [--host 127.0.0.1] [--port 8080] [--workers N]
                  [--redis-url URL]
    mariana model list --model-dir DIR [--json]
    mariana model promote VERSION --model-dir DIR [--notify REDIS_URL]
    mariana model rollback --model-dir DIR [--notify REDIS_URL]
    mariana model prune --keep N --model-dir DIR [--dry-run] [--json]
    mariana retrain --config FILE [--json]

`model` and `retrain` take the model dir and Redis from `--config` (its
[serve] section) when the flags are not given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from mariana.services.runtime import report
from mariana.services.runtime.redis_url import check_redis_url
from mariana.sparse.errors import MarianaError, ModelDirError
from mariana.sparse.files import loads_json


def cmd_serve(args: argparse.Namespace) -> int:
    from mariana.serving.config import check_retrain_files
    from mariana.serving.server import run_worker, serve

    cfg = _config(args, **{"serve.host": args.host, "serve.port": args.port, "serve.workers": args.workers,
                           "serve.redis_url": args.redis_url})
    if args.worker_index is not None:  # started by the supervisor, from its resolved config
        return run_worker(cfg, args.worker_index, args.run_dir, args.config)
    if not os.path.isdir(cfg.serve.model_dir):
        raise MarianaError(f"{cfg.serve.model_dir}: no such model directory (train one with 'mariana train "
                           "--out DIR', or create it empty to serve what is published there later)")
    _check_not_inside(cfg.serve.model_dir)
    check_retrain_files(cfg)
    verbosity = ["-q"] if args.quiet else ["-v"] * args.verbose
    return serve(cfg, verbosity)


def _check_not_inside(model_dir: str) -> None:
    """MarianaError when `model_dir` holds a manifest.json of its own: a version's directory
    (models/v000001) or a featurizer's, never a model directory (whose versions hold theirs).
    The server would wait for ever for a version to appear there."""
    if not os.path.isfile(os.path.join(model_dir, "manifest.json")):
        return
    try:
        with open(os.path.join(model_dir, "manifest.json")) as f:
            kind = str(loads_json(f.read()).get("format", ""))
    except (OSError, ValueError, AttributeError):
        kind = ""
    what = ("a featurizer (mariana featurizer train), not a model directory" if kind.startswith("mariana-featurizer")
            else "one version's files, not a model directory: name the directory that holds v000001, ... and CURRENT")
    raise MarianaError(f"{model_dir}: holds a manifest.json of its own: {what}")


def cmd_model(args: argparse.Namespace) -> int:
    from mariana.trainer import checkpoint

    if args.action != "prune" and (args.keep is not None or args.dry_run):
        raise MarianaError(f"model {args.action}: --keep and --dry-run are for 'mariana model prune'")
    if args.action == "config" and args.json:  # it printed TOML, exit 0, to a reader of JSON
        raise MarianaError("model config: --json is for list, prune, promote and rollback; config prints the "
                           "version's config as TOML (its manifest.json holds it as JSON)")
    if args.action == "list" and args.version:
        raise MarianaError(f"model list: lists every version; {args.version!r} is for 'mariana model config' "
                           "(or promote)")
    cfg = _config(args)
    model_dir = cfg.serve.model_dir
    if args.action in ("promote", "rollback"):  # a symlink followed once: its checks and the move in one dir
        model_dir = str(checkpoint.resolved(model_dir))
    if args.action == "prune":
        return _prune(args, model_dir)
    if args.action == "config":
        return _print_config(model_dir, args.version)
    if getattr(args, "notify", None):  # before CURRENT moves, not after
        check_redis_url(args.notify, "--notify")
    if args.action == "list":
        rows, broken = _versions(model_dir), _current_problem(model_dir)
        if args.json:
            print(report.dumps({"model_dir": model_dir, "versions": rows, **({"current_error": broken} if broken
                                                                              else {})}))
        else:
            _print_versions(model_dir, rows)
            if broken:  # "(serving nothing)" alone read as an empty directory, while servers went on serving
                print(f"  {broken}: a server keeps what it loaded; `mariana model promote VERSION` sets CURRENT")
        return 0
    if args.action == "promote":
        if not args.version:
            raise MarianaError("model promote: name the VERSION to serve (see 'mariana model list')")
        target, reason = args.version, "promoted"
        _check_loads(model_dir, target, cfg.serve.tables)  # a server would refuse it: CURRENT stays
        before = checkpoint.set_current(model_dir, target, reason=reason)
    else:
        if args.version:
            raise MarianaError("model rollback takes no VERSION (it goes back to the one served before)")
        # CURRENT's version even when deleted by hand (the rollback is what is needed then); when it names
        # none, current_version says why
        before, reason = checkpoint.named_version(model_dir) or checkpoint.current_version(model_dir), "rollback"
        target = checkpoint.rollback_target(model_dir, before)
        _check_loads(model_dir, target, cfg.serve.tables)
        try:  # from the version the target was worked out for: a move meanwhile is not undone blindly
            checkpoint.set_current(model_dir, target, reason=reason, expect=before)
        except checkpoint.CurrentMoved as e:
            raise MarianaError(f"model rollback: CURRENT moved from {before} to {e.found} while the rollback "
                               "was worked out; nothing changed (run it again to roll back from "
                               f"{e.found})") from None
    print(json.dumps({"model_dir": model_dir, "current": target, "previous": before, "reason": reason}))
    url = args.notify or cfg.serve.redis_url
    if url:
        from mariana.services.runtime import model_events

        model_events.publish(url, reason, model_dir, target, target, cfg.serve.channel)
    return 0


def _check_loads(model_dir: str, version: str, tables: str) -> None:
    """ModelDirError unless `version` loads as a server loads it (`serving.speech.load_version`,
    one warm prediction included). Reading its manifest and weights was not enough: a manifest
    whose config does not fit its weights (an embedding dim, the hidden widths) was promoted
    with exit 0, and every worker then refused it and went on serving the old version (an
    exploratory soak)."""
    from mariana.serving.speech import load_version
    from mariana.trainer import checkpoint

    checkpoint.require_version(model_dir, version)  # a name of this dir's versions, in every command's words
    try:
        load_version(model_dir, version, 1, tables)
    except MarianaError:
        checkpoint.require_version(model_dir, version)  # a prune removed it meanwhile: said so, not "no manifest"
        raise
    except Exception as e:  # what a server's load would fail on, whatever it is
        raise ModelDirError(f"{model_dir}/{version}: a server could not load it ({type(e).__name__}: {e})") from None


def _print_config(model_dir: str, version: str | None) -> int:
    """`model config [VERSION]`: the config a version was trained with (default CURRENT's) as
    TOML, for `--config`: a warm start from it, or a tuned config trained again."""
    from mariana.services.runtime.config import tables_to_toml
    from mariana.trainer import checkpoint

    version = version or checkpoint.current_version(model_dir)
    checkpoint.require_version(model_dir, version)  # a path (../other/v000001) read another dir's version
    config = checkpoint.read_manifest(model_dir, version).get("config")
    if not isinstance(config, dict):
        raise MarianaError(f"{model_dir}/{version}: its manifest records no config (not a click model's version?)")
    print(f"# the config {model_dir}/{version} was trained with (mariana model config)")
    print(tables_to_toml(config), end="")
    return 0


def _prune(args: argparse.Namespace, model_dir: str) -> int:
    """`model prune`: one line per version removed (or, with --dry-run, that would be), what
    stays and why, and the bytes freed; exit 1 when a version could not be removed."""
    from mariana.trainer import checkpoint

    if args.version or args.notify:
        raise MarianaError("model prune takes no VERSION and no --notify: it moves no version (CURRENT, the "
                           "rollback target and the newest --keep N stay)")
    if args.keep is None or args.keep < 1:
        got = "none given" if args.keep is None else f"got {args.keep}"
        raise MarianaError(f"model prune: --keep N must be >= 1, the newest versions kept besides CURRENT and the "
                           f"one a rollback goes back to ({got})")
    result = checkpoint.prune(model_dir, args.keep, dry_run=args.dry_run)
    if args.json:
        print(report.dumps(result))
    else:
        _print_pruned(result)
    for why in result["errors"]:
        print(f"mariana: error: {why}", file=sys.stderr)
    return 1 if result["errors"] else 0


def _print_pruned(r: dict) -> None:
    verb = "would remove" if r["dry_run"] else "removed"
    for x in r["removed"]:
        left = ("" if not x["leftover"] else "  (left by an interrupted prune)" if x["name"].startswith(".pruned-")
                else "  (left by an interrupted write)")
        print(f"{verb} {x['name']}  {x['bytes']:,} bytes{left}")
    print("kept " + ", ".join(f"{k['version']} ({', '.join(k['why'])})" for k in r["kept"]))
    leftovers = sum(x["leftover"] for x in r["removed"])
    what = f"{len(r['removed']) - leftovers} version(s)" + (f" and {leftovers} leftover(s)" if leftovers else "")
    if r["dry_run"]:
        print(f"{r['model_dir']}: would remove {what}, freeing {r['bytes_freed']:,} bytes (--dry-run: nothing "
              "was removed)")
    else:
        print(f"{r['model_dir']}: removed {what}, {r['bytes_freed']:,} bytes freed")


def cmd_retrain(args: argparse.Namespace) -> int:
    from mariana.serving.retrain import RetrainFailed, run_retrain

    try:
        decision = run_retrain(_config(args), args.status_file)
    except RetrainFailed as e:  # its decision recorded: a script reading --json gets it too, then the error
        if args.json:
            report.print_record(e.decision, True)
        raise
    report.print_record(decision, args.json)
    return 0


# ---- helpers -----------------------------------------------------------------------------

def _config(args: argparse.Namespace, **overrides):
    from mariana.serving.config import load_serve_config

    if getattr(args, "model_dir", None):
        overrides["serve.model_dir"] = os.path.abspath(args.model_dir)
    cfg = load_serve_config(args.config, overrides)
    if not cfg.serve.model_dir:  # named as this command takes it: `retrain` has no --model-dir
        how = "give --model-dir, or serve.model_dir in --config" if hasattr(args, "model_dir") else \
            "set serve.model_dir in the [serve] section of --config"
        raise MarianaError(f"no model directory: {how}")
    cfg.serve.model_dir = os.path.abspath(cfg.serve.model_dir)
    return cfg


def _versions(model_dir: str) -> list[dict]:
    from mariana.trainer import checkpoint

    if not os.path.isdir(model_dir):
        raise MarianaError(f"{model_dir}: no such model directory")
    try:
        current = checkpoint.current_version(model_dir)
    except MarianaError:
        current = None
    rows = []
    for v in checkpoint.list_versions(model_dir):
        try:
            m = checkpoint.read_manifest(model_dir, v)
        except MarianaError as e:
            if os.path.isdir(os.path.join(model_dir, v)):  # else pruned since it was listed
                rows.append({"version": v, "current": v == current, "error": str(e)})
            continue
        metrics, train, model = (m.get(k) if isinstance(m.get(k), dict) else {} for k in ("metrics", "train", "model"))
        rows.append({"version": v, "current": v == current, "created_at": m.get("created_at"),
                     "kind": model.get("kind"), "auc": metrics.get("auc"),
                     "logloss": metrics.get("logloss"), "rows": checkpoint.rows_learned(m),
                     "data": train.get("data"), "job": train.get("job")})
    return rows


def _current_problem(model_dir: str) -> str | None:
    """Why CURRENT names no version here: a CURRENT naming none, or none at all beside versions
    (removed by hand: "serving nothing" alone read as an empty directory). A directory with
    neither holds no model yet: nothing to say."""
    from mariana.trainer import checkpoint

    try:
        checkpoint.current_version(model_dir)
    except MarianaError as e:
        if not os.path.exists(os.path.join(model_dir, "CURRENT")) and not checkpoint.list_versions(model_dir):
            return None
        return str(e).removeprefix(f"{model_dir}: ")
    return None


def _print_versions(model_dir: str, rows: list[dict]) -> None:
    current = next((r["version"] for r in rows if r["current"]), None)
    report.print_versions(model_dir, current, [{**r, "model": r.get("kind"), "created": r.get("created_at")}
                                               for r in rows])


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`serve`, `model` and `retrain`, added to the `mariana` command's subcommands."""
    s = sub.add_parser("serve", help="serve pCTR over HTTP from a model directory (hot-swaps new versions)")
    s.add_argument("--model-dir", help="model directory: its CURRENT version is served")
    s.add_argument("--config", help="TOML with [serve] (and [retrain] for POST /v1/retrain)")
    s.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8080; 0: any free one)")
    s.add_argument("--workers", type=int, help="processes sharing the port (default: one per CPU it may use)")
    s.add_argument("--redis-url", help="Redis where new versions are announced (default: poll CURRENT only)")
    s.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    s.add_argument("--run-dir", help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_serve)

    m = sub.add_parser("model", help="list the versions of a model directory, promote one, roll back, prune, "
                                     "print a version's config")
    m.add_argument("action", choices=("list", "promote", "rollback", "prune", "config"),
                   help="list the versions, promote VERSION to CURRENT, roll back to the one served before, "
                        "prune: remove the versions but CURRENT, the rollback target and the newest --keep N, or "
                        "config: print the config VERSION (default CURRENT) was trained with, as TOML for --config")
    m.add_argument("version", nargs="?", help="promote: the version to serve; config: the version (default CURRENT)")
    m.add_argument("--model-dir", help="model directory (default: serve.model_dir of --config)")
    m.add_argument("--config", help="serve config (model dir, and the Redis to announce changes on)")
    m.add_argument("--notify", metavar="REDIS_URL", help="announce the change here (servers swap at once)")
    m.add_argument("--keep", type=int, metavar="N", help="prune: the newest versions to keep (>= 1), besides "
                   "CURRENT and the one a rollback goes back to")
    m.add_argument("--dry-run", action="store_true", help="prune: say what would be removed, remove nothing")
    m.add_argument("--json", action="store_true", help="list, prune: print one JSON object")
    m.set_defaults(func=cmd_model)

    r = sub.add_parser("retrain", help="train on the newest data window; promote only if not worse")
    r.add_argument("--config", required=True, help="TOML with [serve] model_dir and [retrain] windows")
    r.add_argument("--json", action="store_true", help="print the decision as one JSON line")
    r.add_argument("--status-file", help=argparse.SUPPRESS)  # kept up to date for POST /v1/retrain
    r.set_defaults(func=cmd_retrain)
