"""Chaos, the long version (issue 19; tests/integration/test_chaos.py is the short one).

A supervised local cluster (`mariana up`: 2 workers, 2 shards, 2 preprocess, Redis) trains
the same job twice: undisturbed, then while a seeded chaos monkey (services/chaos.py)
SIGKILLs a worker, shard, preprocess, loader, coordinator or Redis every few seconds,
>= 30 times. Reports: the job completed, rows applied == rows x epochs (per epoch too),
test AUC of both runs and their difference (target: within 0.005), the kills by role, the
restarts the supervisor made, and the job's wall time against the undisturbed run's.

    .venv/bin/python bench/chaos.py                        # the record in docs/benchmarks.md
    .venv/bin/python bench/chaos.py --kills 10 --rows 200000   # a quicker look

Writes bench-out/chaos/results.json and results.md. Exits 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from ctr_peers import machine_info  # noqa: E402  (bench/ is on sys.path when run as a script)

from mariana.services import launcher  # noqa: E402
from mariana.services.chaos import ROLES, Chaos  # noqa: E402
from mariana.services.runtime.config import load_cluster_config  # noqa: E402
from mariana.sparse.synth import generate_criteo  # noqa: E402

# The suite's short timers (tests/integration/cluster.py): a lost lease or chunk is noticed in seconds.
TIMERS = {"coordinator.lease_seconds": 3.0, "coordinator.chunk_seconds": 20.0, "worker.rpc_seconds": 3.0,
          "coordinator.heartbeat_seconds": 2.0, "ps.checkpoint_seconds": 0.5, "redis.retry_seconds": 60.0,
          "cluster.start_seconds": 90.0, "cluster.supervise": True}
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(http: str, method: str, path: str, token: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(http + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with DIRECT.open(req, timeout=30) as r:
        return json.loads(r.read())


def run_job(info: dict, body: dict, timeout: float) -> tuple[dict, float]:
    """(the job's final summary, wall seconds from submit to its end), asking again while the
    coordinator is being restarted."""
    t0 = time.monotonic()
    try:
        job = call(info["http"], "POST", "/v1/jobs", info["token"], body)["job"]
    except urllib.error.HTTPError as e:  # refused: the coordinator says why
        raise SystemExit(f"the job was refused: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    last = 0.0
    while time.monotonic() - t0 < timeout:
        try:
            summary = call(info["http"], "GET", f"/v1/jobs/{job}", info["token"])
        except (OSError, ValueError):
            summary = None
        if summary is not None:
            if summary["state"] not in ("queued", "running"):
                return summary, time.monotonic() - t0
            p = summary["progress"]
            if time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"  {job}: epoch {p['epoch']}/{p['epochs']}, {p['rows']:,} rows, {p['rows_per_s']:,.0f} rows/s",
                      flush=True)
        time.sleep(0.5)
    raise SystemExit(f"job {job} not done after {timeout:g}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kills", type=int, default=32)
    ap.add_argument("--every", default="1.5,3.5", help="seconds between kills: MIN,MAX (default 1.5,3.5)")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--roles", default=",".join(ROLES), help=f"roles to kill (default {','.join(ROLES)})")
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "chaos"))
    args = ap.parse_args()
    out = Path(args.out).resolve()  # the coordinator is given absolute paths; its cwd is not ours
    out.mkdir(parents=True, exist_ok=True)
    train, test = out / f"train-{args.rows}.tsv", out / "test-20000.tsv"
    if not train.exists():
        generate_criteo(train, args.rows, seed=11)
    if not test.exists():
        generate_criteo(test, 20_000, seed=12)
    lo, hi = (float(x) for x in args.every.split(","))
    job = {"hashing": {"bits": 18}, "train": {"epochs": args.epochs, "batch_size": 32}}
    cfg = load_cluster_config(env={}, overrides={**TIMERS, "cluster.dir": str(out / "cluster"), "worker.count": 2,
                                                 "ps.count": 2, "preprocess.count": 2})
    launcher.up(cfg)
    info = launcher.cluster_info(str(out / "cluster"))
    try:
        print("undisturbed run", flush=True)
        calm, calm_s = run_job(info, {"data": [str(train)], "test_data": [str(test)], "out": str(out / "calm"),
                                      "config": job}, timeout=1800)
        print(f"chaos run: {args.kills} kills, one every {lo:g}-{hi:g} s, seed {args.seed}", flush=True)
        chaos = Chaos(str(out / "cluster"), seed=args.seed, every=(lo, hi), max_kills=args.kills,
                      roles=tuple(args.roles.split(",")))
        body = {"data": [str(train)], "test_data": [str(test)], "out": str(out / "chaos"), "config": job}
        chaos.start()
        try:
            hit, hit_s = run_job(info, body, timeout=3600)
        finally:
            kills = chaos.finish()
        state = launcher._load_state(str(out / "cluster"))
        restarts = {r["name"]: r.get("restarts", 0) for r in launcher._records(state)}
    finally:
        launcher.down(str(out / "cluster"), timeout=30)
    result = report(args, calm, calm_s, hit, hit_s, kills, restarts)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(result["markdown"])
    print(result["markdown"])
    return 0 if result["met"] else 1


def report(args, calm: dict, calm_s: float, hit: dict, hit_s: float, kills: list, restarts: dict) -> dict:
    rows = args.rows * args.epochs
    records = {name: s.get("record") or {} for name, s in (("undisturbed", calm), ("chaos", hit))}
    by_role = collections.Counter(k.name.split("-")[0] for k in kills)
    auc = {name: r.get("auc") for name, r in records.items()}
    checks = {
        "both jobs done": calm["state"] == hit["state"] == "done",
        "rows applied == rows x epochs, both": all(r.get("rows_applied") == rows and r.get("rows_applied_per_epoch")
                                                   == [args.rows] * args.epochs for r in records.values()),
        f">= {min(args.kills, 30)} kills": len(kills) >= min(args.kills, 30),
        "test AUC within 0.005": None not in auc.values() and abs(auc["chaos"] - auc["undisturbed"]) <= 0.005,
    }
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Chaos ({when}; {machine_info()}): `.venv/bin/python bench/chaos.py --rows {args.rows} --epochs "
             f"{args.epochs} --kills {args.kills} --every {args.every} --seed {args.seed} --roles {args.roles}`", "",
             "| run | state | rows applied | per epoch | test AUC | wall s |", "|---|---|---:|---|---:|---:|"]
    for (name, s), secs in zip((("undisturbed", calm), ("chaos", hit)), (calm_s, hit_s)):
        r = records[name]
        lines.append(f"| {name} | {s['state']} | {r.get('rows_applied', 0):,} | {r.get('rows_applied_per_epoch')} | "
                     f"{r.get('auc', float('nan')):.4f} | {secs:.1f} |")
    lines += ["", f"Kills: {len(kills)} ({', '.join(f'{role} {n}' for role, n in sorted(by_role.items()))}); "
              f"supervisor restarts: {sum(restarts.values())} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(restarts.items()) if v)}); "
              f"job restarts seen by the coordinator: {hit.get('restarts', 0)}; steps whose rows differed from "
              f"their batch's first parse: {records['chaos'].get('row_count_mismatches')}; "
              f"wall time {hit_s / max(calm_s, 1e-9):.2f}x the undisturbed run's.", ""]
    lines += [f"- {'met' if ok else 'MISSED'}: {what}" for what, ok in checks.items()]
    return {"machine": machine_info(), "date": when, "args": vars(args), "checks": checks, "met": all(checks.values()),
            "undisturbed": {"seconds": calm_s, **records["undisturbed"]},
            "chaos": {"seconds": hit_s, **records["chaos"]},
            "kills": [k.__dict__ for k in kills], "restarts": restarts, "markdown": "\n".join(lines) + "\n"}


if __name__ == "__main__":
    sys.exit(main())
