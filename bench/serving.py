"""Online pCTR serving against peers, in one run (the serving issue): mariana
serve with an LR and a DNN model, a FastAPI + scikit-learn server, and an
HTTP floor, under the same load generator, with the same request rows.

The numbers for docs/benchmarks.md come from this command, in the repository root:

    scripts/bootstrap.sh dev,bench && .venv/bin/python bench/serving.py --train-rows 200000 --duration 10

Other uses:

    .venv/bin/python bench/serving.py --quick                      # a smoke run, about a minute and a half
    .venv/bin/python bench/serving.py --systems lr,floor --phases ramp
    .venv/bin/python bench/serving.py --systems lr,dnn,floor --phases ramp,hey --rates 2000   # cost per request
    .venv/bin/python bench/serving.py --systems lr,dnn,floor --phases cost    # the same, 3 interleaved rounds
    .venv/bin/python bench/serving.py --systems dnn --phases swap --swap-duration 30

Systems (each serves POST /v1/predict {"instances": [...]} -> {"pctr": [...],
"model_version": ...}, JSON, on 127.0.0.1 with `--workers` processes, default
one per core):

- `mariana-lr`, `mariana-dnn`: `mariana serve --model-dir DIR --workers N`,
  defaults otherwise (SO_REUSEPORT workers, aiohttp, micro-batching on a model
  thread). DIR holds two versions trained by `mariana train --model lr|dnn` on
  the training file (the same file twice: v000001 and v000002, CURRENT on
  v000002).
- `fastapi-sklearn`: the typical hand-rolled Python model server.
  FastAPI + pydantic request/response models, `uvicorn --workers N`
  (uvicorn's own multi-process mode: one listening socket shared by the
  workers; uvloop and httptools, as `uvicorn[standard]` installs them), an
  `async def` handler that turns each instance into the tokens of
  bench/ctr_peers.py (`I3_-2`, `C1_68fd1e64`, `<field>_m` when missing), hashes
  them with FeatureHasher(2^22, alternate_sign=False) and scores them with an
  SGDClassifier(loss="log_loss") trained, one pass, on the same training file.
- `floor`: a minimal aiohttp app in N forked processes (SO_REUSEPORT), the same
  stack as mariana (aiohttp on asyncio's default loop): it parses the JSON
  body and answers a constant pctr list, no model. What HTTP + JSON alone cost.

Data (bench-out/serving/, reused when the row count matches): `train_<N>.tsv`
(`mariana gen criteo --seed 1`) trains every model; request bodies come from
`test_<B>.tsv` (`--seed 2`): `--bodies` single-instance bodies (one row each)
and bodies of `--batch-size` rows, integers as JSON numbers, categoricals as
strings, missing fields left out, pre-encoded once and sent in turn.

What is timed, by the load generator, which runs in its own process on the same
machine as the servers (so on 2 cores the generator, its kernel work and the
server share them; its CPU share is in the results). It is bench/loadgen.c (its
head comment has the details), built here with `gcc -std=c11 -O2 -Wall -Wextra`
into bench-out/serving/loadgen (rebuilt when the .c is newer): the same
generator as bench/loadgen.py (same options, semantics and JSON) for about a
third of its CPU per request (~0.06 ms instead of ~0.15-0.19 ms, measured on 2
vCPUs at 1,000-2,000/s), CPU that the server under test would otherwise lose.
Where gcc is missing or the build fails, bench/loadgen.py runs instead, with a
note saying why; `--loadgen c` insists on the C one (exit 2 if it cannot be
built), `--loadgen python` picks the Python one. results.json (`loadgen`) and
the header of results.md say which one ran:

- ramp (single-instance requests): open loop at a constant rate on
  `--connections` keep-alive HTTP/1.1 connections, latency from each request's
  *scheduled* send time to the last byte of its answer (no coordinated
  omission); `--warmup` s not counted, then `--duration` s measured. Rates step
  up through `--rates` until p99 > 50 ms, an error, or an abort (a request
  waited 2 s); with `--refine 1` one more run halfway between the last pass
  and the first failure. The targets' rates (1,000/s and 2,000/s) are always
  run. "max QPS" = the highest offered rate that passed.
- hey (when Debian's `hey` is installed; `--hey PATH` names another): a second load
  generator, independent of ours, on 20 connections posting the first single-instance
  body: at 2,000/s (each connection limited to 100/s) and closed loop, `--duration` s
  after a 1 s warm-up. hey measures latency from each request's send (a late send is not
  counted against the server, unlike loadgen.c). Its own CPU is reported beside the
  server's. Every run of every generator reports the server's CPU per answered request;
  with the floor in the run, the issue's targets are checked against it: at 2,000/s, CPU
  per request (LR <= 1.5x the floor's, DNN <= 2.5x) and p99 (<= 2x), under both generators.
- cost (not run by default): the same targets, measured in `--cost-rounds` rounds (3);
  each round starts every server afresh and runs loadgen.c then hey at 2,000/s against it,
  one server at a time, the order rotating from round to round; the targets are checked on
  the medians of the per-round ratios. One run swings 15-30% on a shared 2-core VM.
- swap (mariana only): a fresh server with `serve.watch_seconds = 0.2`
  (config file), stepped through the ramp's rates (the target rate, LR
  2,000/s, DNN 1,000/s, among them) until p99 passes 50 ms, `--swap-duration`
  s each, while CURRENT moves v000001 -> v000002 -> v000003 -> v000001 ...
  every `--swap-every` s (a cycle of three: a worker keeps the version it
  swapped out loaded, so with two versions most swaps would load nothing):
  the same figures as the ramp (p50/p95/p99, the highest rate under 50 ms)
  while swaps happen. `trainer.checkpoint.set_current` in this process,
  which is what `mariana model promote` does (its ~0.3 s of CPU per call would
  otherwise load the 2 cores; `--promote-cli` runs the command instead).
  Counted: promotions, swaps the workers made (`mariana_serve_model_swaps_total`
  from /metrics), versions seen in the answers (X-Model-Version).
- batch: closed loop, `--batch-connections` connections each sending its next
  `--batch-size`-instance body as soon as the last is answered, for
  `--duration` s after the warm-up; predictions/s = answered instances / s.

Every run also records the server's CPU (utime + stime of its process group,
from /proc), the generator's own, and the rest of the machine's busy time
meanwhile ("other cores", from /proc/stat: another user's work shows there),
and the achieved rate (good answers arriving inside the measured window per
second). Servers start in their own process groups and are stopped (SIGTERM,
then SIGKILL) in `finally`, also on Ctrl-C; their logs go to
bench-out/serving/logs/, and lines there that say something failed are
reported, as are mariana's own non-2xx counts from /metrics.

Writes bench-out/serving/results.json (every run, the machine, the versions)
and results.md (to paste into docs/benchmarks.md); exits 1 when a target is
missed or a run had errors, 2 when a server or the generator could not run.
"""
import argparse
import datetime as dt
import http.client
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# No `from __future__ import annotations` here: FastAPI reads the handler's
# annotations (the pydantic models defined inside fastapi_app) at run time.

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after bench/: `serving` here would be this file, so it is never imported

from gendata import synthetic_file  # noqa: E402  (bench/ is on sys.path when run as a script)

SYSTEMS = {"lr": "mariana-lr", "dnn": "mariana-dnn", "fastapi": "fastapi-sklearn", "floor": "floor"}
TARGET = {"lr": (2000, 5.0), "dnn": (1000, 10.0)}   # rate, p99 ms
BATCH_TARGET = 50_000                                 # predictions/s with 256-instance requests
P99_LIMIT_MS = 50.0
TRAIN_SEED, TEST_SEED = 1, 2
NUMERIC = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
DEFAULT_RATES = "500,1000,2000,3000,4000,6000,8000,10000,12000,16000"
QUICK = {"train_rows": 20_000, "duration": 2.0, "warmup": 0.5, "rates": "500,1000,2000,4000", "refine": 0,
         "swap_duration": 4.0, "swap_every": 1.0, "progress": 1.0}
FULL = {"train_rows": 200_000, "duration": 10.0, "warmup": 2.0, "rates": DEFAULT_RATES, "refine": 1,
        "swap_duration": 10.0, "swap_every": 1.5, "progress": 2.5}
PACKAGES = ("mariana", "aiohttp", "torch", "numpy", "msgpack", "fastapi", "starlette", "pydantic", "uvicorn",
            "uvloop", "httptools", "scikit-learn")
PEER_MODEL_ENV = "MARIANA_BENCH_SKLEARN_MODEL"

CHILDREN: list = []   # every process started, for the cleanup in main()


class BenchError(Exception):
    """A server or the generator could not run: the report would be meaningless."""


def note(message: str) -> None:
    print(f"serving: {message}", file=sys.stderr, flush=True)


# ---- processes ---------------------------------------------------------------------------------

def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of the group's live processes (a process that exited is not counted)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in group_pids(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every core; /proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def start_process(cmd: list, log=None, stdout=None) -> subprocess.Popen:
    """In its own session (its own process group), so that it can be stopped whole."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=stdout if stdout is not None else log,
                            stderr=log if log is not None else None, start_new_session=True)
    CHILDREN.append(proc)
    return proc


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM to the whole group; SIGKILL to what is left after `grace` seconds."""
    pgid = proc.pid
    if proc.poll() is None or group_pids(pgid):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or group_pids(pgid)):
            time.sleep(0.05)
        if proc.poll() is None or group_pids(pgid):
            note(f"pid {pgid} did not stop within {grace:.0f} s of SIGTERM: killing its group")
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if proc in CHILDREN:
        CHILDREN.remove(proc)


def cleanup() -> None:
    for proc in list(CHILDREN):
        stop_process(proc, grace=5.0)


def shown_path(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# ---- the servers -------------------------------------------------------------------------------

class Server:
    """One system's server: its process group, its log, its readiness."""

    def __init__(self, system: str, cmd: list, port: int, workers: int, log_path: Path, ready: str):
        self.system, self.cmd, self.port, self.workers, self.log_path, self.ready = (
            system, cmd, port, workers, log_path, ready)
        self.proc = None
        self.log = None
        self.started_s = None

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = start_process(self.cmd, log=self.log)
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.started_s = time.perf_counter() - t0
        note(f"{SYSTEMS[self.system]}: ready on port {self.port} with {self.workers} workers "
             f"in {self.started_s:.1f} s (log: {shown_path(self.log_path)})")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        if self.log is not None:
            self.log.close()

    def wait_ready(self, timeout: float = 180.0) -> None:
        """/readyz answers 200, and every worker is listening: distinct `worker`
        ids from /healthz on fresh connections (SO_REUSEPORT picks a worker per
        connection), or for uvicorn, its "Application startup complete" per worker."""
        deadline = time.monotonic() + timeout
        seen: set = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{SYSTEMS[self.system]} exited with code {self.proc.returncode} while starting; "
                                 f"see {self.log_path}:\n    " + "\n    ".join(self.log_tail(12)))
            try:
                status, _ = http_get(self.port, "/readyz")
                if status == 200:
                    if self.ready == "uvicorn-log":
                        text = self.log_path.read_text(errors="replace")
                        if text.count("Application startup complete") >= self.workers:
                            return
                    else:
                        status, body = http_get(self.port, "/healthz")
                        if status == 200:
                            seen.add(json.loads(body)["worker"])
                            if len(seen) >= self.workers:
                                return
                            continue  # another fresh connection at once
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise BenchError(f"{SYSTEMS[self.system]} not ready within {timeout:.0f} s (workers seen: {len(seen)}); "
                         f"see {self.log_path}")

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.proc.pid)

    def log_tail(self, n: int) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []

    def log_problems(self, limit: int = 12) -> list[str]:
        """Lines of its log that say something went wrong (errors, tracebacks, restarts)."""
        pattern = re.compile(r"Traceback|ERROR|CRITICAL|Exception|exited with code|killing|failed", re.I)
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line[:300] for line in lines if pattern.search(line)][:limit]


def server_for(system: str, args, models: dict, port: int, config: Path | None = None, tag: str = "") -> Server:
    log = args.out_dir / "logs" / f"{SYSTEMS[system]}{tag}.log"
    common = ["--host", "127.0.0.1", "--port", port, "--workers", args.workers]
    if system in ("lr", "dnn"):
        cmd = [sys.executable, "-m", "mariana", "serve", "--model-dir", models[system], *common]
        if config is not None:
            cmd += ["--config", config]
        return Server(system, cmd, port, args.workers, log, "healthz")
    if system == "fastapi":
        return Server(system, [sys.executable, __file__, "--child", "fastapi", "--model", models["fastapi"],
                               *common], port, args.workers, log, "uvicorn-log")
    return Server(system, [sys.executable, __file__, "--child", "floor", *common], port, args.workers, log, "healthz")


def scrape_metrics(port: int) -> dict:
    """mariana's /metrics (summed over workers): requests by code, swaps, load failures, batch sizes."""
    try:
        status, body = http_get(port, "/metrics", timeout=5)
    except (OSError, http.client.HTTPException) as e:
        return {"error": str(e)}
    if status != 200:
        return {"error": f"HTTP {status}"}
    out = {"requests_by_code": {}, "model_swaps": 0.0, "model_load_failures": 0.0,
           "batch_requests_sum": 0.0, "batch_requests_count": 0.0, "unknown_fields": 0.0}
    for line in body.decode().splitlines():
        m = re.match(r"^(\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "mariana_serve_requests_total" and 'route="/v1/predict"' in labels:
            code = re.search(r'code="(\d+)"', labels).group(1)
            out["requests_by_code"][code] = out["requests_by_code"].get(code, 0) + int(value)
        elif name == "mariana_serve_model_swaps_total":
            out["model_swaps"] += value
        elif name == "mariana_serve_model_load_failures_total":
            out["model_load_failures"] += value
        elif name == "mariana_serve_unknown_fields_total":
            out["unknown_fields"] += value
        elif name == "mariana_serve_batch_requests_sum":
            out["batch_requests_sum"] += value
        elif name == "mariana_serve_batch_requests_count":
            out["batch_requests_count"] += value
    c = out["batch_requests_count"]
    out["mean_requests_per_model_call"] = round(out["batch_requests_sum"] / c, 2) if c else None
    return out


# ---- the peers' servers (run as `serving.py --child ...`) --------------------------------------

def peer_tokens(instance: dict, scale: float) -> list[str]:
    """The tokens bench/ctr_peers.py's token_columns makes from a TSV row, from one instance."""
    out = []
    for name in NUMERIC:
        x = instance.get(name)
        if x is None:
            out.append(f"{name}_m")
        else:
            b = int(math.floor(math.log1p(abs(x)) * scale))
            out.append(f"{name}_{-b if x < 0 else b}")
    for name in CATEGORICAL:
        v = instance.get(name)
        out.append(f"{name}_m" if v is None or v == "" else f"{name}_{v}")
    return out


def load_peer(np, path: str):
    """(FeatureHasher, SGDClassifier, bucket scale, version) from the peer's .npz: the
    classifier's fitted arrays, put back into sklearn's own classes (no pickle here either)."""
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import SGDClassifier

    saved = np.load(path, allow_pickle=False)
    hasher = FeatureHasher(n_features=int(saved["n_features"]), input_type="string", alternate_sign=False)
    model = SGDClassifier(loss="log_loss")
    model.coef_, model.intercept_, model.classes_ = saved["coef"], saved["intercept"], saved["classes"]
    return hasher, model, float(saved["bucket_scale"]), "sklearn-sgd"


def fastapi_app():
    """The FastAPI app of one uvicorn worker (uvicorn calls this factory in each worker)."""
    import numpy as np
    from fastapi import FastAPI
    from pydantic import BaseModel

    hasher, model, scale, version = load_peer(np, os.environ[PEER_MODEL_ENV])
    pid = os.getpid()

    class PredictRequest(BaseModel):
        instances: list[dict[str, int | float | str | None]]

    class PredictResponse(BaseModel):
        pctr: list[float]
        model_version: str

    app = FastAPI(title="sklearn pCTR (bench peer)")

    @app.post("/v1/predict", response_model=PredictResponse)
    async def predict(request: PredictRequest):
        x = hasher.transform([peer_tokens(instance, scale) for instance in request.instances])
        return PredictResponse(pctr=model.predict_proba(x)[:, 1].tolist(), model_version=version)

    @app.get("/readyz")
    async def readyz():
        return {"ready": True, "model_version": version}

    @app.get("/healthz")
    async def healthz():
        return {"ok": True, "worker": pid}

    return app


def child_fastapi(args) -> int:
    import uvicorn

    os.environ[PEER_MODEL_ENV] = str(Path(args.model).resolve())
    # workers > 1: uvicorn spawns each worker, which imports this file again and calls the factory
    uvicorn.run("__main__:fastapi_app", factory=True, host=args.host, port=args.port, workers=args.workers,
                log_level="info", access_log=False)
    return 0


def child_floor(args) -> int:
    """aiohttp, N processes forked after the imports, each listening with SO_REUSEPORT."""
    import json as json_

    from aiohttp import web

    for _ in range(args.workers - 1):
        if os.fork() == 0:
            break
    pid = os.getpid()

    async def predict(request: web.Request) -> web.Response:
        n = len(json_.loads(await request.read())["instances"])
        body = json_.dumps({"pctr": [0.5] * n, "model_version": "floor"}, separators=(",", ":")).encode()
        return web.Response(body=body, content_type="application/json")

    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "model_version": "floor"})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "worker": pid})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/predict", predict)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/healthz", healthz)
    web.run_app(app, host=args.host, port=args.port, reuse_port=True, access_log=None, print=None)
    return 0


def child_train_sklearn(args) -> int:
    """Train the peer's model (one pass, like bench/ctr_peers.py) and save its arrays; check
    that the server's per-instance tokens equal the training tokens on test rows."""
    import numpy as np
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import SGDClassifier

    from ctr_peers import read_tsv_chunks, token_columns
    from mariana.sparse.hashing import HashSpec

    scale = HashSpec().bucket_scale
    hasher = FeatureHasher(n_features=1 << args.bits, input_type="string", alternate_sign=False)
    model = SGDClassifier(loss="log_loss", random_state=0)
    rows, t0 = 0, time.perf_counter()
    for table in read_tsv_chunks(Path(args.train), 50_000):
        x = hasher.transform(zip(*(col.to_pylist() for col in token_columns(table))))
        model.partial_fit(x, table.column("label").to_numpy(), classes=np.array([0, 1]))
        rows += table.num_rows
    seconds = time.perf_counter() - t0
    table = next(read_tsv_chunks(Path(args.test), 500))
    want = [list(t) for t in zip(*(col.to_pylist() for col in token_columns(table)))]
    got = [peer_tokens(instance, scale) for instance in read_instances(Path(args.test), 500)]
    if want != got:
        bad = next(i for i, (w, g) in enumerate(zip(want, got)) if w != g)
        raise SystemExit(f"peer tokens differ from the training tokens on test row {bad}: {want[bad]} vs {got[bad]}")
    with open(args.out, "wb") as f:  # the fitted arrays; load_peer rebuilds the classifier
        np.savez(f, coef=model.coef_, intercept=model.intercept_, classes=model.classes_,
                 n_features=np.array(1 << args.bits), bucket_scale=np.array(scale))
    hasher2, model2, _, _ = load_peer(np, str(args.out))
    x = hasher2.transform(got[:50])
    if not np.array_equal(model2.predict_proba(x), model.predict_proba(x)):
        raise SystemExit("the peer model read back from its .npz predicts differently")
    print(json.dumps({"train_rows": rows, "train_seconds": round(seconds, 2), "model": repr(model)}))
    return 0


def run_child(args) -> int:
    return {"fastapi": child_fastapi, "floor": child_floor, "train-sklearn": child_train_sklearn}[args.child](args)


# ---- data and models ---------------------------------------------------------------------------

def read_instances(path: Path, n: int) -> list[dict]:
    """The first n rows of a Criteo TSV as instances: integers as numbers, categoricals as
    strings, missing fields left out."""
    out = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            inst = {}
            for name, v in zip(NUMERIC, parts[1:14]):
                if v != "":
                    inst[name] = int(v) if re.fullmatch(r"-?\d+", v) else float(v)
            for name, v in zip(CATEGORICAL, parts[14:40]):
                if v != "":
                    inst[name] = v
            out.append(inst)
            if len(out) == n:
                break
    return out


def write_bodies(instances: list[dict], per_body: int, path: Path) -> dict:
    """One JSON body per line, `per_body` instances each (as many whole bodies as the rows give)."""
    n = len(instances) // per_body
    with open(path, "w") as f:
        for i in range(n):
            body = {"instances": instances[i * per_body:(i + 1) * per_body]}
            f.write(json.dumps(body, separators=(",", ":")) + "\n")
    size = path.stat().st_size
    return {"path": path, "bodies": n, "instances_per_body": per_body, "mean_bytes": round(size / max(n, 1))}


def prepare_data(args) -> dict:
    out = args.out_dir
    test_rows = max(args.bodies, args.batch_size * 16)
    train = synthetic_file(out, "train", args.train_rows, TRAIN_SEED, note)
    test = synthetic_file(out, "test", test_rows, TEST_SEED, note)
    instances = read_instances(test, test_rows)
    return {"train": train, "test": test, "train_rows": args.train_rows, "test_rows": test_rows,
            "single": write_bodies(instances[:args.bodies], 1, out / "bodies-1.jsonl"),
            "hey": write_bodies(instances[:1], 1, out / "hey-body.json"),  # hey posts one body, always the same
            "batch": write_bodies(instances, args.batch_size, out / f"bodies-{args.batch_size}.jsonl")}


def train_models(args, data: dict, systems: list[str]) -> tuple[dict, dict]:
    models, records = {}, {}
    for kind in ("lr", "dnn"):
        if kind not in systems:
            continue
        model_dir = args.out_dir / "models" / kind
        shutil.rmtree(model_dir, ignore_errors=True)  # mariana would add versions to an old dir
        records[kind] = []
        for _ in range(3):  # v000001..v000003 (CURRENT): the swap phase cycles through them
            cmd = [sys.executable, "-m", "mariana", "-q", "train", "--data", data["train"], "--model", kind,
                   "--out", model_dir, "--json"]
            proc = subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BenchError(f"mariana train --model {kind} failed (exit {proc.returncode}): "
                                 + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]))
            record = json.loads(proc.stdout.strip().splitlines()[-1])
            records[kind].append({k: record.get(k) for k in ("model_version", "train_rows", "train_seconds",
                                                             "promoted")})
            note(f"trained mariana-{kind} {record['model_version']} on {record['train_rows']:,} rows "
                 f"in {record['train_seconds']:.1f} s")
        models[kind] = model_dir
    if "fastapi" in systems:
        path = args.out_dir / "models" / f"sklearn-{args.train_rows}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--child", "train-sklearn", "--train", data["train"], "--test", data["test"],
               "--out", path, "--bits", args.bits]
        proc = subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BenchError(f"training the sklearn peer failed (exit {proc.returncode}): "
                             + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]))
        records["fastapi"] = json.loads(proc.stdout.strip().splitlines()[-1])
        note(f"trained the sklearn peer on {records['fastapi']['train_rows']:,} rows "
             f"in {records['fastapi']['train_seconds']:.1f} s")
        models["fastapi"] = path
    return models, records


# ---- one load run ------------------------------------------------------------------------------

LOADGEN_C, LOADGEN_PY = BENCH / "loadgen.c", BENCH / "loadgen.py"
LOADGEN_CFLAGS = ("-std=c11", "-O2", "-Wall", "-Wextra")


def build_c_loadgen(exe: Path) -> tuple[str | None, dict]:
    """bench/loadgen.c built into `exe` with gcc, unless `exe` is newer than the .c; then a trial run
    (--help). Returns (why it cannot be used, or None; what was done)."""
    info = {"binary": str(shown_path(exe)), "cflags": " ".join(LOADGEN_CFLAGS), "built": False}
    gcc = shutil.which("gcc")
    if gcc:
        version = subprocess.run([gcc, "--version"], capture_output=True, text=True)
        info["compiler"] = version.stdout.splitlines()[0] if version.returncode == 0 and version.stdout else gcc
    if not exe.exists() or exe.stat().st_mtime < LOADGEN_C.stat().st_mtime:
        if gcc is None:
            return "gcc not found on PATH", info
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(f".{exe.name}.{os.getpid()}")  # then renamed: a concurrent run never sees half a file
        cmd = [gcc, *LOADGEN_CFLAGS, "-o", str(tmp), str(LOADGEN_C), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            output = (proc.stderr or proc.stdout).strip()
            info["build_command"], info["build_output"] = shlex.join(cmd), output[-4000:]
            first = next((line for line in output.splitlines() if "error" in line), output[:200] or "no output")
            return f"gcc failed (exit {proc.returncode}): {first.strip()}", info
        os.replace(tmp, exe)
        info["built"] = True
        if proc.stderr.strip():
            info["compiler_warnings"] = proc.stderr.strip()[-2000:]
            note(f"gcc warned while building {shown_path(exe)}:\n    "
                 + "\n    ".join(proc.stderr.strip().splitlines()[-8:]))
        note(f"built the C load generator: {shown_path(exe)} ({info.get('compiler', 'gcc')})")
    try:
        trial = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{shown_path(exe)} does not run: {e}", info
    if trial.returncode != 0:
        return f"{shown_path(exe)} --help exited with code {trial.returncode}", info
    return None, info


def choose_loadgen(args) -> dict:
    """The load generator for every run: `kind` (c or python), `cmd` (its argv prefix), `startup_s`
    (its start-up before its clock starts, for the swap phase's timing), and how it was chosen."""
    python = {"kind": "python", "cmd": [sys.executable, str(LOADGEN_PY)], "source": "bench/loadgen.py",
              "startup_s": 0.3}  # imports and connections, ~0.1 s on an idle machine
    if args.loadgen == "python":
        return {**python, "chosen": "--loadgen python"}
    exe = args.out_dir / "loadgen"
    problem, info = build_c_loadgen(exe)
    if problem is None:
        return {"kind": "c", "cmd": [str(exe)], "source": "bench/loadgen.c", "startup_s": 0.05,
                "chosen": "--loadgen c" if args.loadgen == "c" else "default", **info}
    if args.loadgen == "c":
        raise BenchError(f"--loadgen c: the C load generator cannot be used: {problem}")
    note(f"NOTE: the C load generator cannot be used ({problem}); falling back to bench/loadgen.py, "
         f"which costs about 3x the CPU per request on the cores the servers use, so the servers' latencies "
         f"come out somewhat higher than with the C one")
    return {**python, "chosen": "fallback", "fallback_reason": problem, **info}


def loadgen_text(gen: dict) -> str:
    """Which generator ran, for the report's header."""
    if gen["kind"] == "c":
        return f"`bench/loadgen.c` (C, `gcc {gen['cflags']}`; own process)"
    if gen.get("fallback_reason"):
        return f"`bench/loadgen.py` (Python, own process; the fallback: {gen['fallback_reason']})"
    return "`bench/loadgen.py` (Python, own process; `--loadgen python`)"


def loadgen_command(args, server: Server, bodies: Path, label: str, rate: float | None = None,
                    closed: int | None = None, duration: float | None = None) -> list:
    cmd = [*args.gen["cmd"], "--port", server.port, "--bodies", bodies,
           "--duration", duration or args.duration, "--warmup", args.warmup, "--progress", args.progress,
           "--label", f"serving: {label}"]
    if closed:
        cmd += ["--closed", closed, "--drain", 10]
    else:
        cmd += ["--rate", rate, "--connections", args.connections]
    return cmd


def run_load(args, server: Server, cmd: list, during=None) -> dict:
    """Run the generator to its end (calling `during(elapsed)` every 50 ms meanwhile, when
    given); its JSON result plus the server's CPU over the run."""
    cpu0, busy0, t0 = server.cpu_seconds(), machine_busy_seconds(), time.perf_counter()
    stdout = tempfile.TemporaryFile()  # not a pipe: a long run's JSON could fill one and block the generator
    proc = start_process(cmd, stdout=stdout)
    # The server's CPU over the measured window only (from the end of the warm-up to the end):
    # a fresh server's first requests cost more (every value hashed once), and the warm-up's
    # requests are not counted in ok_per_s. Read twice, not polled: this script reading /proc
    # every 50 ms (~1 ms of a core each time) put a pinned server's p99 at 2,000/s from 0.35
    # to 1.5 ms (a worker bound to its core waits while the script runs there).
    warm = last = None
    try:
        limit = args.warmup + max(args.duration, args.swap_duration) + 60
        while True:
            elapsed = time.perf_counter() - t0
            if warm is None and elapsed >= args.warmup:
                warm = (server.cpu_seconds(), time.perf_counter())
            if elapsed > limit:
                raise BenchError(f"the load generator did not finish within {limit:.0f} s")
            if during is not None:
                during(elapsed)
            wait = 0.05 if during is not None else (args.warmup if warm is None else limit) - elapsed
            try:
                proc.wait(timeout=max(wait, 0.001))
                break
            except subprocess.TimeoutExpired:
                continue
        last = (server.cpu_seconds(), time.perf_counter()) if warm else None
        stdout.seek(0)
        out = stdout.read().decode()
    finally:
        stop_process(proc, grace=2.0)
        stdout.close()
    wall = time.perf_counter() - t0
    cpu = server.cpu_seconds() - cpu0
    busy = machine_busy_seconds() - busy0
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise BenchError(f"the load generator failed (exit {proc.returncode}): {out.strip()[-500:]}")
    result = json.loads(lines[-1])
    if "fatal" in result:
        raise BenchError(f"the load generator could not run: {result['fatal']}")
    result["loadgen"] = args.gen["kind"]
    result["server_cpu_s"] = round(cpu, 2)
    measured = last is not None and last[1] - warm[1] > 0.5
    result["server_cores"] = round((last[0] - warm[0]) / (last[1] - warm[1]) if measured else cpu / wall, 4)
    # everything else the machine ran meanwhile (other users' work, this script, the generator's
    # start-up): a run where this is large was measured on a busy machine
    result["other_cores"] = round(max(0.0, busy - cpu - result["loadgen_cpu_s"]) / wall, 2)
    if server.proc.poll() is not None:
        raise BenchError(f"{SYSTEMS[server.system]} exited (code {server.proc.returncode}) during the run; "
                         f"see {server.log_path}")
    return result


def open_run(args, server: Server, rate: int, phase: str, during=None, duration: float | None = None) -> dict:
    label = f"{SYSTEMS[server.system]} {rate:,}/s{' (swapping)' if phase == 'swap' else ''}"
    r = run_load(args, server, loadgen_command(args, server, args.data["single"]["path"], label, rate=rate,
                                                duration=duration), during)
    p = r["latency_ms"]
    r.update(system=SYSTEMS[server.system], phase=phase, rate=rate,
             server_us_per_request=round(r["server_cores"] / r["ok_per_s"] * 1e6, 1) if r["ok_per_s"] else None,
             passed=(p["p99"] is not None and p["p99"] <= P99_LIMIT_MS and r["error_count"] == 0
                     and not r["aborted"]))
    errors = f", ERRORS {r['errors']}" if r["error_count"] else ""
    note(f"{label}: p50 {fmt(p['p50'], '.2f')} p95 {fmt(p['p95'], '.2f')} p99 {fmt(p['p99'], '.2f')} ms, "
         f"{fmt(r['ok_per_s'], ',.0f')} ok/s{errors}{' ABORTED' if r['aborted'] else ''}; server "
         f"{r['server_cores']:.2f} cores, generator {fmt(r['loadgen_cpu_share'], '.2f')}, other "
         f"{r['other_cores']:.2f}; "
         f"{'pass' if r['passed'] else 'OVER (p99 > 50 ms or errors)'}")
    return r


# ---- the phases --------------------------------------------------------------------------------

def ramp(args, server: Server) -> list[dict]:
    """Step the rate up until a run fails; one refining run between the last pass and
    the first failure; then any target rate not yet run."""
    runs, last_pass, first_fail = [], None, None
    for rate in args.rates:
        r = open_run(args, server, rate, "ramp")
        runs.append(r)
        time.sleep(0.5)
        if not r["passed"]:
            first_fail = rate
            break
        last_pass = rate
    for _ in range(args.refine):
        if first_fail is None or last_pass is None:
            break
        mid = int(round((last_pass + first_fail) / 2 / 250) * 250)
        if not last_pass < mid < first_fail:
            break
        r = open_run(args, server, mid, "ramp")
        runs.append(r)
        time.sleep(0.5)
        last_pass, first_fail = (mid, first_fail) if r["passed"] else (last_pass, mid)
    done = {r["rate"] for r in runs}
    for rate in sorted({rate for rate, _ in TARGET.values()} - done):
        runs.append(open_run(args, server, rate, "reference"))
        time.sleep(0.5)
    return runs


def max_qps(runs: list[dict]) -> dict:
    """The highest offered rate that passed, among the ramp's runs (a failure stops the ramp)."""
    ramp_runs = [r for r in runs if r["phase"] == "ramp"]
    passed = [r["rate"] for r in ramp_runs if r["passed"]]
    failed = [r["rate"] for r in ramp_runs if not r["passed"]]
    best = max((rate for rate in passed if not failed or rate < min(failed)), default=None)
    return {"max_qps": best, "first_failed_rate": min(failed) if failed else None,
            "capped": not failed and bool(passed)}  # capped: never failed, the true max is higher


def batch_run(args, server: Server) -> dict:
    label = f"{SYSTEMS[server.system]} batch-{args.batch_size} x {args.batch_connections} connections"
    r = run_load(args, server, loadgen_command(args, server, args.data["batch"]["path"], label,
                                               closed=args.batch_connections))
    r.update(system=SYSTEMS[server.system], phase="batch", instances_per_request=args.batch_size,
             predictions_per_s=round(r["ok_per_s"] * args.batch_size) if r["ok_per_s"] is not None else None)
    p = r["latency_ms"]
    errors = f", ERRORS {r['errors']}" if r["error_count"] else ""
    note(f"{label}: {fmt(r['predictions_per_s'], ',')} predictions/s ({fmt(r['ok_per_s'], ',.1f')} requests/s), "
         f"request p50 {fmt(p['p50'], '.1f')} p99 {fmt(p['p99'], '.1f')} ms{errors}; "
         f"server {r['server_cores']:.2f} cores, other {r['other_cores']:.2f}")
    return r


# ---- hey: an independent load generator (Debian's `hey`, Go, nobody here wrote it) ------------

COST_RATE = 2000         # the issue's rate: CPU per request and p99 against the floor's, both generators
HEY_CONNECTIONS = 20


def hey_command(args, server: Server, body: Path, duration: float, rate: int | None) -> list:
    """hey with `HEY_CONNECTIONS` workers, each limited to rate / workers requests/s (None: as fast
    as they go, closed loop), posting the same single-instance body."""
    cmd = [args.hey, "-z", f"{duration:g}s", "-c", str(HEY_CONNECTIONS), "-m", "POST", "-T", "application/json",
           "-D", str(body), "-disable-compression"]
    if rate:
        cmd += ["-q", f"{rate / HEY_CONNECTIONS:g}"]
    return cmd + [f"http://127.0.0.1:{server.port}/v1/predict"]


def parse_hey(text: str) -> dict:
    """hey's summary -> requests/s, latency percentiles (ms), answers by status, errors."""
    rps = re.search(r"Requests/sec:\s+([0-9.]+)", text)
    pct = {f"p{int(k)}": round(float(v) * 1000, 3) for k, v in re.findall(r"(\d+)%+ in ([0-9.]+) secs", text)}
    codes = {c: int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", text)}
    errors = re.findall(r"^\s+\[(\d+)\]\s+(.+)$", text.split("Error distribution:", 1)[1], re.M) \
        if "Error distribution:" in text else []
    return {"requests_per_s": float(rps.group(1)) if rps else None, "latency_ms": pct, "codes": codes,
            "errors": [f"{n} x {what.strip()}" for n, what in errors]}


def hey_run(args, server: Server, rate: int | None) -> dict:
    """One hey run (after a 1 s warm-up run, not counted): its figures, the server's CPU and hey's own."""
    body = args.data["hey"]["path"]
    subprocess.run(hey_command(args, server, body, 1, rate), capture_output=True, timeout=60)
    own0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, busy0, t0 = server.cpu_seconds(), machine_busy_seconds(), time.perf_counter()
    proc = subprocess.run(hey_command(args, server, body, args.duration, rate), capture_output=True, text=True,
                          timeout=args.duration + 60)
    wall = time.perf_counter() - t0
    cpu, busy = server.cpu_seconds() - cpu0, machine_busy_seconds() - busy0
    own1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    hey_cpu = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
    if proc.returncode != 0:
        raise BenchError(f"hey failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-300:]}")
    r = parse_hey(proc.stdout)
    ok = r["codes"].get("200", 0)
    r.update(system=SYSTEMS[server.system], rate=rate, connections=HEY_CONNECTIONS, ok=ok,
             error_count=sum(n for c, n in r["codes"].items() if c != "200") + len(r["errors"]),
             server_cores=round(cpu / wall, 2), hey_cores=round(hey_cpu / wall, 2),
             other_cores=round(max(0.0, busy - cpu - hey_cpu) / wall, 2),
             server_us_per_request=round(cpu / ok * 1e6, 1) if ok else None)
    p = r["latency_ms"]
    note(f"hey {SYSTEMS[server.system]} {'closed loop' if rate is None else f'{rate:,}/s'}: "
         f"{fmt(r['requests_per_s'], ',.0f')} requests/s, p50 {fmt(p.get('p50'), '.2f')} p99 "
         f"{fmt(p.get('p99'), '.2f')} ms, server {r['server_cores']:.2f} cores "
         f"({fmt(r['server_us_per_request'], '.0f')} us/request), hey {r['hey_cores']:.2f} cores"
         + (f", ERRORS {r['codes']} {r['errors']}" if r["error_count"] else ""))
    return r


def hey_phase(args, server: Server) -> dict:
    return {"rate": hey_run(args, server, COST_RATE), "closed": hey_run(args, server, None)}


def hey_table(heys: dict) -> str:
    lines = ["| system | load | requests/s | p50 | p90 | p99 ms | errors | server cores | server CPU us/request | "
             "hey cores | other cores |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, h in heys.items():
        for what, r in (("2,000/s", h["rate"]), (f"closed, {HEY_CONNECTIONS} conns", h["closed"])):
            p = r["latency_ms"]
            lines.append(f"| {name} | {what} | {fmt(r['requests_per_s'], ',.0f')} | {fmt(p.get('p50'), '.2f')} | "
                         f"{fmt(p.get('p90'), '.2f')} | {fmt(p.get('p99'), '.2f')} | {r['error_count']} | "
                         f"{r['server_cores']:.2f} | {fmt(r['server_us_per_request'], '.0f')} | "
                         f"{r['hey_cores']:.2f} | {r['other_cores']:.2f} |")
    return "\n".join(lines)



def cost_phase(args, models: dict) -> list[dict]:
    """The cost of a request, interleaved: each round starts every system's server afresh and runs
    loadgen.c then hey at COST_RATE against it, one server at a time; the systems' order rotates
    from round to round, so a drift of the host over the phase falls on all of them. A single run
    swings 15-30% on a shared VM; the medians of per-round ratios do not."""
    systems = [s for s in args.systems if s in ("lr", "dnn", "floor")]
    rounds = []
    for r in range(args.cost_rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        row = {}
        for system in order:
            with server_for(system, args, models, free_port(), tag=f"-cost{r + 1}") as server:
                row[SYSTEMS[system]] = {"loadgen": open_run(args, server, COST_RATE, "cost"),
                                        "hey": hey_run(args, server, COST_RATE) if args.hey else None}
        rounds.append(row)
        note(f"cost round {r + 1} of {args.cost_rounds}: " + ", ".join(
            f"{name} {fmt(x['loadgen'].get('server_us_per_request'), '.0f')}"
            + (f"/{fmt(x['hey'].get('server_us_per_request'), '.0f')}" if x["hey"] else "")
            for name, x in row.items()) + " us/request (loadgen.c/hey)")
    return rounds


def cost_ratios(rounds: list[dict]) -> list[dict]:
    """Per system and generator: each round's CPU per request and p99 against that round's floor,
    and their medians."""
    out = []
    for kind in ("lr", "dnn"):
        ours = SYSTEMS[kind]
        for gen in ("loadgen", "hey"):
            pairs = [(x[ours][gen], x["floor"][gen]) for x in rounds
                     if ours in x and "floor" in x and x[ours][gen] and x["floor"][gen]]
            if not pairs:
                continue
            cpu = [ratio(a.get("server_us_per_request"), b.get("server_us_per_request")) for a, b in pairs]
            p99 = [ratio(a["latency_ms"].get("p99"), b["latency_ms"].get("p99")) for a, b in pairs]
            out.append({"system": ours, "generator": gen, "kind": kind,
                        "us": [a.get("server_us_per_request") for a, _ in pairs],
                        "floor_us": [b.get("server_us_per_request") for _, b in pairs],
                        "cpu_ratios": cpu, "p99_ratios": p99, "cpu_median": median_of(cpu),
                        "p99_median": median_of(p99)})
    return out


def median_of(values: list) -> float | None:
    known = sorted(v for v in values if v is not None)
    return statistics.median(known) if known else None


def cost_targets(ratios: list[dict]) -> list[dict]:
    out = []
    for c in ratios:
        how = f"median of {len(c['cpu_ratios'])} interleaved rounds"
        out += cost_target_pair(c["kind"], c["generator"], c["cpu_median"], c["p99_median"], how, how)
    return out


def cost_table(ratios: list[dict]) -> str:
    lines = ["| system | generator | CPU us/request by round | floor's | CPU ratio by round | median | "
             "p99 ratio by round | median |", "|---|---|---|---|---|---:|---|---:|"]
    for c in ratios:
        row = lambda values, spec: " / ".join(fmt(v, spec) for v in values)  # noqa: E731
        lines.append(f"| {c['system']} | {c['generator']} | {row(c['us'], '.0f')} | {row(c['floor_us'], '.0f')} | "
                     f"{row(c['cpu_ratios'], '.2f')} | **{fmt(c['cpu_median'], '.2f', 'x')}** | "
                     f"{row(c['p99_ratios'], '.2f')} | **{fmt(c['p99_median'], '.2f', 'x')}** |")
    return "\n".join(lines)


class Promoter:
    """Moves CURRENT to the next of three versions every `every` s, from `start` s on, until `stop` s."""

    def __init__(self, model_dir: Path, versions: list[str], every: float, start: float, stop: float, cli: bool):
        self.model_dir, self.versions, self.every, self.cli = model_dir, versions, every, cli
        self.next_at, self.stop = start, stop
        self.done: list[dict] = []

    def __call__(self, elapsed: float) -> None:
        if elapsed < self.next_at or elapsed > self.stop:
            return
        from mariana.trainer import checkpoint

        # The version after CURRENT, in a cycle of three: never the one a worker just swapped
        # out (which it keeps loaded), so every promotion makes every worker load a version.
        current = checkpoint.current_version(self.model_dir)
        target = self.versions[(self.versions.index(current) + 1) % len(self.versions)]
        t0 = time.perf_counter()
        if self.cli:
            subprocess.run([sys.executable, "-m", "mariana", "model", "promote", target, "--model-dir",
                            str(self.model_dir)], cwd=REPO, check=True, capture_output=True)
        else:
            checkpoint.set_current(self.model_dir, target, reason="promoted")
        self.done.append({"at_s": round(elapsed, 3), "version": target,
                          "seconds": round(time.perf_counter() - t0, 4)})
        self.next_at += self.every


def swap_run(args, system: str, models: dict) -> tuple[dict, dict]:
    """One fresh server (watch_seconds 0.2) with CURRENT moving all the time, stepped
    through the ramp's rates until a run fails (p99 > 50 ms or errors): the figures at
    each rate while swaps happen, and the highest rate that passed. Returns the run at
    the target rate, with the whole ladder under "ladder"."""
    target = TARGET[system][0]
    model_dir = models[system]
    config = args.out_dir / f"serve-swap-{system}.toml"
    config.write_text("[serve]\nwatch_seconds = 0.2\n")
    from mariana.trainer import checkpoint

    versions = checkpoint.list_versions(model_dir)[:3]
    if len(versions) < 3:
        raise BenchError(f"{model_dir} holds {len(versions)} versions; the swap phase cycles through three")
    checkpoint.set_current(model_dir, versions[-1], reason="promoted")
    ladder = sorted(set(args.rates) | {target})
    runs = []
    with server_for(system, args, models, free_port(), config=config, tag="-swap") as server:
        time.sleep(1.2)  # every worker's first metrics snapshot is written
        for rate in ladder:
            if runs and not runs[-1]["passed"] and rate > target:
                break
            runs.append(_swapping(args, server, system, model_dir, versions, rate))
            time.sleep(0.5)
        after = scrape_metrics(server.port)
        problems = server.log_problems()
    checkpoint.set_current(model_dir, versions[-1], reason="promoted")
    at_target = next(r for r in runs if r["rate"] == target)
    at_target.update(ladder=[{k: r[k] for k in ("rate", "ok_per_s", "latency_ms", "error_count", "aborted", "passed",
                                                "promotions_count", "worker_swaps", "versions", "server_cores",
                                                "other_cores", "loadgen_cpu_share")} for r in runs],
                     max_qps=max_qps([dict(r, phase="ramp") for r in runs]))
    return at_target, {"metrics": after, "log_problems": problems}


def _swapping(args, server: Server, system: str, model_dir: Path, versions: list[str], rate: int) -> dict:
    """One open-loop run at `rate` while CURRENT moves through the versions."""
    before = scrape_metrics(server.port)
    # promotions start 0.3 s into the measured window and stop one interval before its end
    startup = args.gen["startup_s"]  # the generator's start-up (imports, connections) before its clock starts
    promoter = Promoter(model_dir, versions, args.swap_every,
                        start=startup + args.warmup + 0.3, stop=startup + args.warmup + args.swap_duration
                        - args.swap_every, cli=args.promote_cli)
    r = open_run(args, server, rate, "swap", during=promoter, duration=args.swap_duration)
    time.sleep(1.2)  # the workers write their metrics every second
    after = scrape_metrics(server.port)
    swaps = None if "error" in before or "error" in after else int(after["model_swaps"] - before["model_swaps"])
    failures = None if "error" in before or "error" in after else int(
        after["model_load_failures"] - before["model_load_failures"])
    r.update(promotions=promoter.done, promotions_count=len(promoter.done), worker_swaps=swaps,
             load_failures=failures, versions_seen=sorted(r["versions"]), watch_seconds=0.2,
             promote="mariana model promote (CLI)" if args.promote_cli else "mariana.trainer.checkpoint.set_current")
    note(f"{SYSTEMS[system]} swap at {rate:,}/s: {len(promoter.done)} promotions, {swaps} worker swaps, "
         f"versions seen {r['versions']}, errors {r['error_count']}")
    return r


# ---- the report --------------------------------------------------------------------------------

def fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def ratio(a, b):
    return a / b if a is not None and b else None


def run_at(results: dict, system: str, rate: int) -> dict | None:
    runs = [r for r in results.get(system, {}).get("runs", []) if r["rate"] == rate]
    return runs[-1] if runs else None


def p99_at(results: dict, system: str, rate: int):
    r = run_at(results, system, rate)
    return None if r is None else r["latency_ms"]["p99"]


def targets(results: dict, swaps: dict, batches: dict) -> list[dict]:
    out = []
    for kind, (rate, limit) in TARGET.items():
        name = SYSTEMS[kind]
        if name in results:
            r = run_at(results, name, rate)
            p99 = None if r is None else r["latency_ms"]["p99"]
            errors = None if r is None else r["error_count"]
            out.append({"target": f"{name} single-instance p99 <= {limit:g} ms at {rate:,}/s",
                        "value": p99, "errors": errors,
                        "pass": p99 is not None and p99 <= limit and errors == 0 and not r["aborted"]})
        if name in swaps:  # the issue asks for the figures while swapping, and no failed request
            ladder = swaps[name]["ladder"]
            errors = sum(r["error_count"] for r in ladder if r["passed"] or r["rate"] <= rate)
            promotions = sum(r["promotions_count"] for r in ladder)
            out.append({"target": f"{name} while swapping ({promotions} promotions, rates up to the highest "
                                  f"that kept p99 < 50 ms): 0 errors", "value": errors, "pass": errors == 0})
        if name in batches:
            b = batches[name]
            out.append({"target": f"{name} batch-256: >= {BATCH_TARGET:,} predictions/s",
                        "value": b["predictions_per_s"],
                        "pass": (b["predictions_per_s"] or 0) >= BATCH_TARGET and b["error_count"] == 0})
    return out


FLOOR_CPU = {"lr": 1.5, "dnn": 2.5}   # server CPU per request at 2,000/s, at most this x the floor's
FLOOR_P99 = 2.0                       # p99 at 2,000/s, at most this x the floor's (either generator)


def floor_targets(results: dict, heys: dict) -> list[dict]:
    """The cost of a request against the floor's, measured in the same run: CPU per request and
    p99 at 2,000/s, under bench/loadgen.c (the ramp's run at that rate) and under hey."""
    out = []
    for kind in FLOOR_CPU:
        ours = SYSTEMS[kind]
        for gen, get in (("loadgen", lambda n: run_at(results, n, COST_RATE)),
                         ("hey", lambda n: heys.get(n, {}).get("rate"))):
            a, b = get(ours), get("floor")
            if a is None or b is None:
                continue
            out += cost_target_pair(
                kind, gen, ratio(a.get("server_us_per_request"), b.get("server_us_per_request")),
                ratio(a["latency_ms"].get("p99"), b["latency_ms"].get("p99")),
                f"{fmt(a.get('server_us_per_request'), '.0f')} vs {fmt(b.get('server_us_per_request'), '.0f')} us",
                f"{fmt(a['latency_ms'].get('p99'), '.2f')} vs {fmt(b['latency_ms'].get('p99'), '.2f')} ms")
    return out


def cost_target_pair(kind: str, gen: str, cpu: float | None, p99: float | None, cpu_how: str,
                     p99_how: str) -> list[dict]:
    """The issue's two targets for one system under one generator: CPU per request and p99 at
    COST_RATE against the floor's (`cpu`, `p99`: ours / the floor's; `*_how`: what they came from)."""
    ours = SYSTEMS[kind]
    return [{"target": f"{ours} server CPU per request at {COST_RATE:,}/s under {gen} <= {FLOOR_CPU[kind]:g}x "
                       f"the floor's ({cpu_how})", "value": cpu, "pass": cpu is not None and cpu <= FLOOR_CPU[kind]},
            {"target": f"{ours} p99 at {COST_RATE:,}/s under {gen} <= {FLOOR_P99:g}x the floor's ({p99_how})",
             "value": p99, "pass": p99 is not None and p99 <= FLOOR_P99}]


def compute_ratios(results: dict, batches: dict) -> list[dict]:
    out = []
    for kind in ("lr", "dnn"):
        ours = SYSTEMS[kind]
        if ours not in results:
            continue
        rate = TARGET[kind][0]
        for peer in ("fastapi-sklearn", "floor"):
            if peer not in results:
                continue
            value, text = qps_ratio(results[ours], results[peer])
            out.append({"what": f"{ours} / {peer}: max QPS (p99 < 50 ms)", "value": value, "text": text,
                        "detail": f"{qps_text(results[ours])} vs {qps_text(results[peer])}/s"})
            a, b = p99_at(results, ours, rate), p99_at(results, peer, rate)
            out.append({"what": f"{ours} / {peer}: p99 at {rate:,}/s", "value": ratio(a, b),
                        "detail": f"{fmt(a, '.2f')} vs {fmt(b, '.2f')} ms"})
            if ours in batches and peer in batches:
                a, b = batches[ours]["predictions_per_s"], batches[peer]["predictions_per_s"]
                out.append({"what": f"{ours} / {peer}: batch-256 predictions/s", "value": ratio(a, b),
                            "detail": f"{fmt(a, ',')} vs {fmt(b, ',')}"})
    return out


def qps_text(s: dict) -> str:
    """'2,000', '>= 16,000' (every rate passed), '< 500' (the first rate failed)."""
    if s["max_qps"] is None:
        return f"< {s['first_failed_rate']:,}" if s["first_failed_rate"] else "n/a"
    return f">= {s['max_qps']:,}" if s["capped"] else f"{s['max_qps']:,}"


def qps_ratio(a: dict, b: dict) -> tuple:
    """max QPS a / b, and its text: a bound where a side is only bounded (capped or failed at once)."""
    if a["max_qps"] is not None and b["max_qps"] is not None:
        value = a["max_qps"] / b["max_qps"]
        sign = "" if a["capped"] == b["capped"] else (">= " if a["capped"] else "<= ")
        return value, f"{sign}{value:.2f}x" + (" (both capped by the top rate)" if a["capped"] and b["capped"] else "")
    if a["max_qps"] is not None and b["first_failed_rate"]:
        return None, f"> {a['max_qps'] / b['first_failed_rate']:.2f}x"
    if b["max_qps"] is not None and a["first_failed_rate"]:
        return None, f"< {a['first_failed_rate'] / b['max_qps']:.2f}x"
    return None, "n/a"


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    p = r["latency_ms"]
    text = f"{fmt(p['p50'], '.2f')} / {fmt(p['p95'], '.2f')} / {fmt(p['p99'], '.2f')}"
    if r["aborted"]:
        return f"overloaded (aborted; {fmt(p['p99'], '.0f')})"
    if r["error_count"]:
        text += f" ({r['error_count']} errors)"
    return text if r["passed"] else f"{text} ✗"


def summary_table(results: dict, batches: dict) -> str:
    lines = ["| system | p50 / p95 / p99 ms at 1,000/s | at 2,000/s | max QPS, p99 < 50 ms | batch-256 predictions/s |",
             "|---|---:|---:|---:|---:|"]
    for name, s in results.items():
        mq_text = qps_text(s)
        b = batches.get(name)
        lines.append(f"| {name} | {cell(run_at(results, name, 1000))} | {cell(run_at(results, name, 2000))} | "
                     f"{mq_text} | {fmt(b and b['predictions_per_s'], ',')} |")
    return "\n".join(lines)


def rate_table(results: dict) -> str:
    names = list(results)
    rates = sorted({r["rate"] for s in results.values() for r in s["runs"]})
    lines = ["| offered/s | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for rate in rates:
        lines.append(f"| {rate:,} | " + " | ".join(cell(run_at(results, n, rate)) for n in names) + " |")
    return "\n".join(lines)


def runs_table(runs: list[dict]) -> str:
    lines = ["| system | phase | offered/s | ok/s | p50 | p95 | p99 | max | errors | generator lag p99 | "
             "server cores | server CPU us/request | generator cores | other cores |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        p, lag = r["latency_ms"], r["lag_ms"]
        err = str(r["error_count"]) + (" (aborted)" if r["aborted"] else "")
        lines.append(f"| {r['system']} | {r['phase']} | {r['rate']:,} | {fmt(r['ok_per_s'], ',.0f')} | "
                     f"{fmt(p['p50'], '.2f')} | {fmt(p['p95'], '.2f')} | {fmt(p['p99'], '.2f')} | "
                     f"{fmt(p['max'], '.1f')} | {err} | {fmt(lag['p99'], '.2f')} | {r['server_cores']:.2f} | "
                     f"{fmt(r.get('server_us_per_request'), '.0f')} | "
                     f"{fmt(r['loadgen_cpu_share'], '.2f')} | {r['other_cores']:.2f} |")
    return "\n".join(lines)


def swap_table(swaps: dict) -> str:
    lines = ["| system | offered/s | ok/s | p50 | p95 | p99 | max ms | errors | promotions | worker swaps | "
             "versions seen (answers) | server / generator / other cores |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, s in swaps.items():
        for r in s["ladder"]:
            p = r["latency_ms"]
            seen = ", ".join(f"{v}: {n:,}" for v, n in sorted(r["versions"].items()))
            lines.append(f"| {name} | {r['rate']:,} | {fmt(r['ok_per_s'], ',.0f')} | {fmt(p['p50'], '.2f')} | "
                         f"{fmt(p['p95'], '.2f')} | {fmt(p['p99'], '.2f')}{'' if r['passed'] else ' ✗'} | "
                         f"{fmt(p['max'], '.1f')} | {r['error_count']}{' (aborted)' if r['aborted'] else ''} | "
                         f"{r['promotions_count']} | {fmt(r['worker_swaps'], 'd')} | {seen} | "
                         f"{r['server_cores']:.2f} / {fmt(r['loadgen_cpu_share'], '.2f')} / {r['other_cores']:.2f} |")
        m = s["max_qps"]
        lines.append(f"| {name} | **max QPS while swapping, p99 < 50 ms: "
                     f"{'>= ' if m['capped'] else ''}{fmt(m['max_qps'], ',')}** | | | | | | | | | | |")
    return "\n".join(lines)


def batch_table(batches: dict) -> str:
    lines = ["| system | connections | requests/s | predictions/s | request p50 ms | p99 ms | errors | server cores | "
             "other cores |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, b in batches.items():
        p = b["latency_ms"]
        lines.append(f"| {name} | {b['connections']} | {fmt(b['ok_per_s'], ',.1f')} | "
                     f"{fmt(b['predictions_per_s'], ',')} | {fmt(p['p50'], '.1f')} | {fmt(p['p99'], '.1f')} | "
                     f"{b['error_count']} | {b['server_cores']:.2f} | {b['other_cores']:.2f} |")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def report_body(args, data: dict, results: dict, swaps: dict, batches: dict, t: list, rat: list,
                servers: dict, heys: dict | None = None) -> str:
    parts = []
    if results:
        parts += ["Single-instance requests, open loop. p50 / p95 / p99 in ms from the scheduled send time; "
                  "✗: p99 over 50 ms or errors.", summary_table(results, batches),
                  "By offered rate (p50 / p95 / p99 ms):", rate_table(results),
                  "Every run (ms; ok/s: 2xx answers with a pctr list per second; errors include requests "
                  "still waiting when an overloaded run was aborted):", runs_table(
                      [r for s in results.values() for r in s["runs"]])]
    if swaps:
        parts += [f"While CURRENT cycles v000001 -> v000002 -> v000003 every {args.swap_every:g} s "
                  f"(`serve.watch_seconds = 0.2`; each promotion makes every worker load and swap in the version), "
                  "stepped up until p99 passed 50 ms (✗):", swap_table(swaps)]
    if batches and not results:
        parts += [batch_table(batches)]
    elif batches:
        parts += [f"Batches of {args.batch_size} instances, closed loop:", batch_table(batches)]
    if heys:
        parts += [f"Under hey ({HEY_CONNECTIONS} connections, the same single-instance body each time; "
                  f"{args.duration:g} s after a 1 s warm-up; latency from each request's send, as hey measures "
                  "it): at 2,000/s (each connection limited to its share), and closed loop:", hey_table(heys)]
    parts.append("\n".join(f"- {t_['target']}: {fmt(t_['value'], ',.2f' if isinstance(t_['value'], float) else ',')}"
                           f" {verdict(t_['pass'])}" for t_ in t) or "- (no target measured)")
    if rat:
        parts.append("Ratios (mariana / peer; max QPS and predictions/s: higher is better for mariana above 1, "
                     "p99: lower is better below 1):\n" + "\n".join(
                         f"- {x['what']}: **{x.get('text') or fmt(x['value'], '.2f', 'x')}** ({x['detail']})"
                         for x in rat))
    errors = [r for s in results.values() for r in s["runs"] if r["error_count"]] + \
             [dict(r, system=name, phase="swap") for name, s in swaps.items() for r in s["ladder"]
              if r["error_count"]] + [r for r in batches.values() if r["error_count"]]
    flagged = [f"- {r['system']} {r['phase']}{' ' + format(r['rate'], ',') + '/s' if r.get('rate') else ''}: "
               f"{r['errors']}{' (overloaded: the run was aborted)' if r['aborted'] else ''}" for r in errors]
    for name, info in servers.items():
        m = info.get("metrics") or {}
        codes = m.get("requests_by_code") or {}
        bad = {c: n for c, n in codes.items() if not c.startswith("2")}
        if bad:
            flagged.append(f"- {name}: the server counted non-2xx answers to /v1/predict: {bad}")
        if m.get("model_load_failures"):
            flagged.append(f"- {name}: {m['model_load_failures']:.0f} model load failures")
        for line in info.get("log_problems", []):
            flagged.append(f"- {name} log: `{line.strip()}`")
    parts.append("Errors and server log problems:\n" + ("\n".join(flagged) if flagged else
                                                         "- none: every answer was a 2xx with a pctr list"))
    calls = {n: i["metrics"].get("mean_requests_per_model_call") for n, i in servers.items()
             if (i.get("metrics") or {}).get("mean_requests_per_model_call")}
    if calls:
        parts.append("mariana's micro-batching over the whole run (mean requests per model call): "
                     + ", ".join(f"{n} {v}" for n, v in calls.items()))
    parts.append("The generator shares the server's cores: \"generator lag\" is how late requests left it "
                 "(waiting for a free connection or for a core); \"cores\" are CPU seconds per second of the run: "
                 "the server's process group, the generator, and \"other\": the rest of the machine's busy time "
                 "(/proc/stat) meanwhile, which on a quiet machine is near 0.")
    return "\n\n".join(parts)


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0)
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv), "cpu_model": cpu, "cores": len(os.sched_getaffinity(0)),
            "mem_gib": round(mem / (1 << 20)), "platform": platform.platform(), "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions, "git": git.stdout.strip() or None}


def markdown(machine: dict, args, data: dict, body: str) -> str:
    v = machine["versions"]
    versions = ", ".join(f"{k} {x}" for k, x in v.items() if x and k != "mariana")
    return (f"## Online serving against peers (`bench/serving.py`)\n\n"
            f"- **Date:** {machine['date'][:10]}, at commit {machine['git']}\n"
            f"- **Machine:** {machine['cores']} cores ({machine['cpu_model']}), {machine['mem_gib']} GiB; "
            f"Linux {machine['kernel']}, Python {machine['python']}; servers and load generator on the same cores\n"
            f"- **Versions:** {versions}\n"
            f"- **Command:** `{machine['command']}`\n"
            f"- **Data:** models trained on {data['train_rows']:,} rows (`mariana gen criteo --seed 1`); "
            f"requests made of {data['test_rows']:,} rows of `--seed 2` ({data['single']['bodies']:,} "
            f"single-instance bodies of {data['single']['mean_bytes']:,} bytes on average; "
            f"{data['batch']['bodies']} bodies of {data['batch']['instances_per_body']} instances, "
            f"{data['batch']['mean_bytes'] / 1024:,.0f} KiB), JSON\n"
            f"- **Servers:** {args.workers} worker processes each: mariana serve (aiohttp, SO_REUSEPORT); "
            f"FastAPI + uvicorn --workers {args.workers} (uvloop, httptools, pydantic) with scikit-learn "
            f"FeatureHasher(2^{args.bits}) + SGDClassifier(log_loss); floor: aiohttp, JSON parse, constant answer\n"
            f"- **Load generator:** {loadgen_text(args.gen)}; its CPU per run is in the tables\n"
            f"- **What is timed:** open loop, {args.connections} keep-alive "
            f"connections, latency from the scheduled send time to the full answer; {args.warmup:g} s warm-up, "
            f"then {args.duration:g} s measured per rate; batches: closed loop on {args.batch_connections} "
            f"connections\n\n{body}\n")


# ---- main --------------------------------------------------------------------------------------

def bench(args) -> int:
    out = args.out_dir
    (out / "logs").mkdir(parents=True, exist_ok=True)
    args.gen = choose_loadgen(args)
    note(f"load generator: {args.gen['source']} ({args.gen['chosen']})")
    args.data = data = prepare_data(args)
    models, train_records = train_models(args, data, args.systems)
    results, swaps, batches, servers, heys = {}, {}, {}, {}, {}
    if {"hey", "cost"} & set(args.phases) and not args.hey:
        note("hey is not installed (Debian: apt-get install hey): its runs are left out")
    for system in args.systems:
        name = SYSTEMS[system]
        if {"ramp", "batch", "hey"} & set(args.phases):
            with server_for(system, args, models, free_port()) as server:
                if "ramp" in args.phases:
                    runs = ramp(args, server)
                    results[name] = {"runs": runs, **max_qps(runs), "startup_s": round(server.started_s, 1)}
                    mq = results[name]
                    note(f"{name}: max QPS with p99 < 50 ms: {fmt(mq['max_qps'], ',')}"
                         f"{' (every rate passed)' if mq['capped'] else ''}")
                if "hey" in args.phases and args.hey:
                    heys[name] = hey_phase(args, server)
                if "batch" in args.phases and system in args.batch_systems:
                    batches[name] = batch_run(args, server)
                metrics = scrape_metrics(server.port) if system in ("lr", "dnn") else None
                servers[name] = {"metrics": metrics, "log_problems": server.log_problems(),
                                 "startup_s": round(server.started_s, 1)}
        if "swap" in args.phases and system in TARGET:
            swaps[name], servers[f"{name} (swap)"] = swap_run(args, system, models)

    rounds = cost_phase(args, models) if "cost" in args.phases else []
    costs = cost_ratios(rounds)
    t = targets(results, swaps, batches) + floor_targets(results, heys) + cost_targets(costs)
    rat = compute_ratios(results, batches)
    body = report_body(args, data, results, swaps, batches, t, rat, servers, heys)
    if costs:
        body = (f"The cost of a request, {args.cost_rounds} interleaved rounds (each: every server started afresh, "
                f"loadgen.c then hey at {COST_RATE:,}/s for {args.duration:g} s each, one server at a time, the "
                "order rotating" + ("" if args.hey else "; hey is not installed here, so its runs are left out")
                + "):\n\n" + cost_table(costs) + "\n\n" + body)
        failed = [f"{name} round {i + 1} under {gen}: {r.get('errors') or r.get('codes')}" for i, x in enumerate(rounds)
                  for name, runs in x.items() for gen, r in runs.items() if r and r["error_count"]]
        if failed:
            body = "Errors in the cost phase:\n" + "\n".join(f"- {f}" for f in failed) + "\n\n" + body
    print("\n" + body)
    machine = machine_info()
    (out / "results.md").write_text(markdown(machine, args, data, body))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("data", "gen")}
    loadgen = {k: v for k, v in args.gen.items() if k not in ("cmd", "startup_s")}
    (out / "results.json").write_text(json.dumps({
        "machine": machine, "settings": settings, "loadgen": loadgen,
        "data": {k: ({kk: str(vv) for kk, vv in v.items()} if isinstance(v, dict) else str(v))
                 for k, v in data.items()},
        "training": train_records, "results": results, "swap": swaps, "batch": batches, "hey": heys,
        "servers": servers, "cost": {"rounds": rounds, "ratios": costs},
        "targets": t, "ratios": rat}, indent=1) + "\n")
    note(f"wrote {out / 'results.md'} and results.json")
    # errors in a run that was not past capacity (an aborted run is overloaded by definition)
    any_errors = any(r["error_count"] and not r["aborted"] for r in
                     [r for s in results.values() for r in s["runs"]] + list(swaps.values()) + list(batches.values()))
    any_errors = any_errors or any(r["error_count"] for h in heys.values() for r in h.values())
    any_errors = any_errors or any(r and r["error_count"] for x in rounds for runs in x.values() for r in runs.values())
    return 0 if all(x["pass"] for x in t) and not any_errors else 1


def parse_list(spec: str, allowed: dict | tuple, what: str) -> list[str]:
    aliases = {v: k for k, v in allowed.items()} if isinstance(allowed, dict) else {}
    items = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        item = aliases.get(item, item)
        if item not in allowed:
            raise argparse.ArgumentTypeError(f"unknown {what} {item!r}; choose from {', '.join(allowed)}")
        items.append(item)
    if not items:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return list(dict.fromkeys(items))


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 20k training rows, 2 s per rate, rates 500,1000,2000,4000, 4 s of swaps")
    p.add_argument("--systems", type=lambda s: parse_list(s, SYSTEMS, "system"), default=list(SYSTEMS),
                   help="comma-separated subset of lr,dnn,fastapi,floor (default: all)")
    p.add_argument("--phases", type=lambda s: parse_list(s, ("ramp", "hey", "swap", "batch", "cost"), "phase"),
                   default=["ramp", "hey", "swap", "batch"],
                   help="comma-separated subset of ramp,hey,swap,batch,cost (default: all but cost)")
    p.add_argument("--cost-rounds", type=int, default=3,
                   help="rounds of the cost phase: each starts every server afresh (default 3)")
    p.add_argument("--hey", default=shutil.which("hey"),
                   help="the hey binary (default: hey on PATH; Debian's package); without it the hey runs are left out")
    p.add_argument("--train-rows", type=int, help=f"generated training rows (default {FULL['train_rows']:,})")
    p.add_argument("--duration", type=float, help=f"measured seconds per run (default {FULL['duration']:g})")
    p.add_argument("--warmup", type=float, help=f"seconds before each measured window (default {FULL['warmup']:g})")
    p.add_argument("--rates", help=f"open-loop rates to step through (default {DEFAULT_RATES})")
    p.add_argument("--refine", type=int, help="extra runs bisecting between the last pass and the first failure "
                                              "(default 1)")
    p.add_argument("--swap-duration", type=float, help=f"measured seconds of the swap phase "
                                                       f"(default {FULL['swap_duration']:g})")
    p.add_argument("--swap-every", type=float, help=f"seconds between promotions (default {FULL['swap_every']:g})")
    p.add_argument("--promote-cli", action="store_true",
                   help="promote with `mariana model promote` processes instead of in this process")
    p.add_argument("--connections", type=int, default=64, help="open-loop keep-alive connections (default 64)")
    p.add_argument("--bodies", type=int, default=4096, help="distinct single-instance request bodies (default 4096)")
    p.add_argument("--batch-size", type=int, default=256, help="instances per batch request (default 256)")
    p.add_argument("--batch-connections", type=int, default=4, help="closed-loop connections of the batch phase")
    p.add_argument("--batch-systems", type=lambda s: parse_list(s, SYSTEMS, "system"), default=list(SYSTEMS),
                   help="systems that run the batch phase (default: all)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="worker processes of every server (default: one per core)")
    p.add_argument("--bits", type=int, default=22, help="the sklearn peer's hash bits (default 22)")
    p.add_argument("--progress", type=float, help="seconds between the generator's progress lines (0: none)")
    p.add_argument("--loadgen", choices=("c", "python"),
                   help="the load generator: c (bench/loadgen.c, built with gcc into the out dir) or python "
                        "(bench/loadgen.py); default: c, falling back to python when it cannot be built")
    p.add_argument("--out-dir", default=str(REPO / "bench-out" / "serving"),
                   help="data, models, logs and results (default: bench-out/serving/)")
    # the peers' processes: this file, run again
    p.add_argument("--child", choices=("fastapi", "floor", "train-sklearn"), help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--train", help=argparse.SUPPRESS)
    p.add_argument("--test", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.rates = sorted({int(float(r)) for r in str(args.rates).split(",") if r.strip()})
    except ValueError:
        p.error(f"--rates: want numbers, e.g. {DEFAULT_RATES}")
    if not args.rates or min(args.rates) <= 0:
        p.error("--rates: want positive rates")
    if args.train_rows < 1000 or args.duration <= 0 or args.warmup < 0 or args.workers < 1 \
            or args.connections < 1 or args.batch_connections < 1 or args.swap_every <= 0 or args.cost_rounds < 1:
        p.error("--train-rows >= 1000; --duration, --swap-every > 0; --workers, --connections, --cost-rounds >= 1")
    args.out_dir = Path(args.out_dir).resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        return bench(args)
    except BenchError as e:
        note(f"stopped: {e}")
        return 2
    except KeyboardInterrupt:
        note("interrupted")
        return 130
    finally:
        cleanup()


if __name__ == "__main__":
    sys.exit(main())
