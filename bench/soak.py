"""Soak (issue 19): `mariana serve` under steady open-loop load for a long time while new
versions come and go, watching for leaks and for requests that fail.

    .venv/bin/python bench/soak.py                                  # 20 minutes: the record in docs/benchmarks.md
    .venv/bin/python bench/soak.py --minutes 2 --promote-every 20   # the suite's short version
    .venv/bin/python bench/soak.py --minutes 5 --promote-every 15 --models lr:26,dnn:22,lr:18,dnn:24
                                            # kinds and table forms in turn (frozen at bits 26 and 22)

What runs, on this machine: an embedded Redis; `mariana serve` (2 worker processes, a
token, a [retrain] section) on an LR model; bench/loadgen.py sending single-instance
requests open-loop at `--rate` for the whole run; every `--promote-every` seconds a new
version trained (`mariana train --notify`, a new window of generated rows) and promoted;
every `--retrain-every` seconds a retrain through `POST /v1/retrain` (the gate decides).
`--models` cycles the versions' kind and hashing bits (default `lr:18`): a server then swaps
between an LR and a DNN, and between tables it loads dense and frozen (`serve.tables` "auto").
Every 5 s it samples each process of the server and Redis: RSS, open file descriptors,
threads; and Redis's used memory. After each promotion it asks the server with fresh
connections until every worker process answers with the new version.

Targets: 0 failed requests; every promotion seen by every worker; after the warm-up (the
first `--warmup-minutes`, default a fifth of the run, at most 4), RSS and fd counts of
every process grow less than 5% (the median of the last fifth of the samples against the
median of the first fifth after warm-up). Writes bench-out/soak/results.json, results.md
and soak.png (RSS, fds, threads, Redis memory and latency over time, promotions marked).
Exits 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import datetime as dt
import http.client
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from ctr_peers import machine_info  # noqa: E402  (bench/ is on sys.path when run as a script)
_spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
bench_serving = importlib.util.module_from_spec(_spec)  # (a plain `import serving` finds the package)
_spec.loader.exec_module(bench_serving)
group_pids, start_process, stop_process = (bench_serving.group_pids, bench_serving.start_process,
                                          bench_serving.stop_process)

from mariana.services.launcher import RedisServer, free_port  # noqa: E402
from mariana.sparse.synth import generate_criteo  # noqa: E402

TOKEN = "soak-token"
SAMPLE_SECONDS = 5.0
GROWTH = 0.05


def run(cmd: list, log: Path) -> int:
    with open(log, "ab") as f:
        return subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def proc_sample(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "fds": fds, "threads": int(fields["Threads"])}


def get(port: int, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # a fresh connection: any worker
    try:
        conn.request("GET" if body is None else "POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


class Soak:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()  # the serve config names paths in it: relative, they were its dir's
        self.t0 = time.time()
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.stop = threading.Event()

    def log(self, text: str) -> None:
        print(f"soak {time.time() - self.t0:7.1f}s: {text}", file=sys.stderr, flush=True)

    # ---- set-up ---------------------------------------------------------------------------

    def prepare(self) -> None:
        a, out = self.args, self.out
        out.mkdir(parents=True, exist_ok=True)
        self.windows = []
        for k in range(4):  # training windows the promotions cycle through
            path = out / f"window-{k}.tsv"
            if not path.exists():
                generate_criteo(path, a.window_rows, seed=100 + k)
            self.windows.append(path)
        self.test = out / "test.tsv"
        if not self.test.exists():
            generate_criteo(self.test, 5_000, seed=99)
        bodies = out / "bodies.jsonl"  # one instance a request, as bench/serving.py sends them
        bench_serving.write_bodies(bench_serving.read_instances(self.test, 5_000), 1, bodies)
        self.bodies = bodies

    def start(self) -> None:
        out = self.out
        self.models = out / "models"
        if self.models.exists():
            shutil.rmtree(self.models)
        self.redis = RedisServer("127.0.0.1", free_port(), str(out / "redis")).start()
        self.redis.wait_ready()
        self.train(0)  # v000001
        self.port = free_port()
        config = out / "serve.toml"
        config.write_text(
            f'[serve]\nmodel_dir = "{self.models}"\nport = {self.port}\nworkers = {self.args.workers}\n'
            f'redis_url = "{self.redis.url}"\ntoken = "{TOKEN}"\nwatch_seconds = 2.0\n'
            f'[retrain]\ntrain_data = ["{self.windows[1]}"]\neval_data = ["{self.test}"]\nauc_tolerance = 0.002\n'
            'skip_unchanged = false\n')  # the same window each time: a candidate (and load) each time
        self.serve_log = open(out / "serve.log", "ab")
        self.server = start_process([sys.executable, "-m", "mariana", "serve", "--config", config], self.serve_log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status, body = get(self.port, "/readyz")
                if status == 200 and body["workers"]["listening"] == self.args.workers:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the server did not come up: see {out / 'serve.log'}")

    def train(self, k: int) -> str:
        """A new version from window k, promoted and announced; its name."""
        log = self.out / "train.log"
        kind, bits = self.args.models[k % len(self.args.models)]
        rc = run([sys.executable, "-m", "mariana", "train", "--data", self.windows[k % len(self.windows)],
                  "--model", kind, "--out", self.models, "--notify", self.redis.url, "--set", f"hashing.bits={bits}",
                  "--quiet"], log)
        if rc != 0:
            raise SystemExit(f"mariana train failed ({rc}): see {log}")
        return (self.models / "CURRENT").read_text().strip()

    # ---- the run ---------------------------------------------------------------------------

    def sampler(self) -> None:
        import redis

        r = redis.Redis.from_url(self.redis.url)
        while not self.stop.wait(SAMPLE_SECONDS):
            procs = {f"serve-{pid}": pid for pid in sorted(group_pids(self.server.pid))}  # main, workers, retrains
            procs["redis"] = self.redis.pid
            row = {"t": round(time.time() - self.t0, 1)}
            for name, pid in procs.items():
                s = proc_sample(pid)
                if s:
                    row[name] = s
            try:
                row["redis_used_memory"] = int(r.info("memory")["used_memory"])
            except Exception as e:  # noqa: BLE001  a sample missed, said so
                row["redis_error"] = str(e)
            self.samples.append(row)

    def seen_by_every_worker(self, version: str, timeout: float = 20.0) -> dict:
        """Fresh connections until each worker process has answered with `version`."""
        seen, t0 = {}, time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                status, body = get(self.port, "/readyz")
                if status == 200:
                    seen[body["worker"]] = body["model_version"]
            except OSError:
                pass
            if len(seen) == self.args.workers and all(v == version for v in seen.values()):
                return {"all": True, "seconds": round(time.monotonic() - t0, 2), "workers": seen}
            time.sleep(0.05)
        return {"all": False, "seconds": timeout, "workers": seen}

    def changes(self) -> None:
        a = self.args
        next_promote, next_retrain, k = a.promote_every, a.retrain_every, 1
        while not self.stop.wait(1.0):
            now = time.time() - self.t0
            if now >= next_promote:
                version = self.train(k)
                seen = self.seen_by_every_worker(version)
                self.events.append({"t": round(now, 1), "kind": "promotion", "version": version, **seen})
                self.log(f"promoted {version}; every worker serves it: {seen['all']} ({seen['seconds']} s)")
                k, next_promote = k + 1, next_promote + a.promote_every
            if now >= next_retrain:
                status, body = get(self.port, "/v1/retrain", b"", {"Authorization": f"Bearer {TOKEN}"})
                self.events.append({"t": round(now, 1), "kind": "retrain", "status": status, "id": body.get("id")})
                self.log(f"retrain started: {status} {body.get('id') or body.get('error')}")
                next_retrain += a.retrain_every

    def load(self) -> dict:
        a = self.args
        cmd = [sys.executable, ROOT / "bench" / "loadgen.py", "--port", self.port, "--bodies", self.bodies,
               "--rate", a.rate, "--connections", 16, "--duration", a.minutes * 60, "--warmup", 0,
               "--abort-after", 10, "--progress", 60, "--label", "soak"]
        proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
        (self.out / "loadgen.log").write_text(proc.stderr)
        if proc.returncode != 0 or not proc.stdout.strip():
            raise SystemExit(f"loadgen failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def run(self) -> dict:
        self.prepare()
        try:
            self.start()
        except BaseException:  # a server that did not come up left its Redis running
            if getattr(self, "server", None) is not None:
                stop_process(self.server)
            if getattr(self, "redis", None) is not None:
                self.redis.stop()
            raise
        self.t0 = time.time()
        threads = [threading.Thread(target=self.sampler, daemon=True),
                   threading.Thread(target=self.changes, daemon=True)]
        for t in threads:
            t.start()
        try:
            self.log(f"{self.args.rate:g} requests/s for {self.args.minutes:g} min")
            load = self.load()
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=120)
            stop_process(self.server)
            self.redis.stop()
        return self.report(load)

    # ---- the record ------------------------------------------------------------------------

    def growth(self) -> dict:
        """Per process and measure: the median of the last fifth of the samples after warm-up
        against the median of the first fifth."""
        warm = min(self.args.warmup_minutes if self.args.warmup_minutes is not None else self.args.minutes / 5, 4.0)
        after = [s for s in self.samples if s["t"] >= warm * 60]
        n = max(1, len(after) // 5)
        out = {}
        names = sorted({k for s in after for k in s if isinstance(s.get(k), dict)})
        for name in names:
            for measure in ("rss_kb", "fds"):
                first = [s[name][measure] for s in after[:n] if name in s]
                last = [s[name][measure] for s in after[-n:] if name in s]
                if first and last:
                    a, b = statistics.median(first), statistics.median(last)
                    out[f"{name}.{measure}"] = {"from": a, "to": b, "growth": round(b / a - 1, 4) if a else None}
        return out

    def report(self, load: dict) -> dict:
        a = self.args
        growth = self.growth()
        promotions = [e for e in self.events if e["kind"] == "promotion"]
        retrains = [e for e in self.events if e["kind"] == "retrain"]
        checks = {
            "0 failed requests": load["error_count"] == 0,
            f"every promotion seen by every worker ({len(promotions)})": bool(promotions) and all(
                e["all"] for e in promotions),
            f"RSS and fds of every process grow < {GROWTH:.0%} after warm-up": bool(growth) and all(
                g["growth"] is not None and g["growth"] < GROWTH for g in growth.values()),
            f"every retrain asked for started ({len(retrains)}; the gate then decides)": all(
                e["status"] == 202 for e in retrains),
        }
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        lat = load["latency_ms"]
        lines = [f"Soak ({when}): `.venv/bin/python bench/soak.py --minutes {a.minutes:g} --rate {a.rate:g} "
                 f"--promote-every {a.promote_every:g} --retrain-every {a.retrain_every:g}"
                 f"{' --models ' + ','.join(f'{k}:{b}' for k, b in a.models) if a.models != [('lr', 18)] else ''}`",
                 "",
                 f"{load['answered']:,} requests answered ({load['ok']:,} ok, {load['error_count']} failed), "
                 f"latency p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms, max {lat.get('max')} ms; "
                 f"{len(promotions)} promotions (slowest seen by every worker after "
                 f"{max((e['seconds'] for e in promotions), default=0)} s), "
                 f"{sum(e['kind'] == 'retrain' for e in self.events)} retrains; versions answered: "
                 f"{len(load.get('versions') or {})}.", "",
                 "| process.measure | after warm-up | at the end | growth |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['from']:,} | {v['to']:,} | {100 * v['growth']:+.1f}% |" for k, v in growth.items()]
        lines += [""] + [f"- {'met' if ok else 'MISSED'}: {what}" for what, ok in checks.items()]
        result = {"machine": machine_info(), "date": when, "args": vars(a), "checks": checks,
                  "met": all(checks.values()), "load": {k: v for k, v in load.items() if k != "per_second"},
                  "latency_per_second": load.get("per_second"), "samples": self.samples, "events": self.events,
                  "growth": growth, "markdown": "\n".join(lines) + "\n"}
        self.plot(load.get("per_second") or [])
        return result

    def plot(self, per_second: list[dict]) -> None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.log("matplotlib is missing (pip install -e '.[bench]'): no plot")
            return
        fig, axes = plt.subplots(5, 1, figsize=(10, 13), sharex=True)
        names = sorted({k for s in self.samples for k in s if isinstance(s.get(k), dict)})
        ts = [s["t"] / 60 for s in self.samples]
        for ax, measure, label in zip(axes[:3], ("rss_kb", "fds", "threads"), ("RSS (MiB)", "open fds", "threads")):
            for name in names:
                ys = [s[name][measure] / (1024 if measure == "rss_kb" else 1) if name in s else None
                      for s in self.samples]
                ax.plot(ts, ys, label=name)
            ax.set_ylabel(label)
        axes[0].legend(fontsize=7, ncol=3)
        axes[3].plot(ts, [s.get("redis_used_memory", 0) / 2**20 for s in self.samples])
        axes[3].set_ylabel("Redis used (MiB)")
        if per_second:
            xs = [p["s"] / 60 for p in per_second]
            axes[4].plot(xs, [p["p50"] for p in per_second], label="p50", lw=0.8)
            axes[4].plot(xs, [p["p99"] for p in per_second], label="p99", lw=0.8)
            axes[4].set_yscale("log")
            axes[4].legend(fontsize=7)
        axes[4].set_ylabel("latency (ms)")
        axes[4].set_xlabel("minutes")
        for e in self.events:
            for ax in axes:
                ax.axvline(e["t"] / 60, color="green" if e["kind"] == "promotion" else "orange", lw=0.5, alpha=0.5)
        fig.suptitle("mariana serve soak: promotions green, retrains orange")
        fig.tight_layout()
        fig.savefig(self.out / "soak.png", dpi=80)
        plt.close(fig)


def parse_models(text: str) -> list[tuple[str, int]]:
    """'lr:26,dnn:22' -> [('lr', 26), ('dnn', 22)]."""
    out = []
    for item in text.split(","):
        kind, _, bits = item.strip().partition(":")
        if kind not in ("lr", "dnn") or not bits.isdigit() or not 8 <= int(bits) <= 30:
            raise argparse.ArgumentTypeError(f"{item!r}: KIND:BITS with KIND lr or dnn and BITS 8-30")
        out.append((kind, int(bits)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=300.0, help="requests per second, open loop")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--promote-every", type=float, default=60.0, help="seconds between promotions")
    ap.add_argument("--retrain-every", type=float, default=240.0, help="seconds between retrains")
    ap.add_argument("--warmup-minutes", type=float, default=None, help="default: a fifth of the run, at most 4")
    ap.add_argument("--window-rows", type=int, default=20_000, help="rows of each training window")
    ap.add_argument("--models", type=parse_models, default=[("lr", 18)],
                    help="versions' KIND:BITS in turn, comma-separated (default lr:18)")
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "soak"))
    args = ap.parse_args()
    result = Soak(args).run()
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(result["markdown"])
    print(result["markdown"])
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
