"""The server's processes: `serve.workers` worker processes share one port
(SO_REUSEPORT: the kernel spreads connections over them), so a request is
answered on any core; a supervisor starts them, restarts one that dies, and
stops them on SIGTERM (exit 0, also when it comes before they all listen: a stop asked for
is no failure). With one worker there is no supervisor.

    supervisor (mariana serve)            reserves host:port, writes <run>/serve.toml
      ├─ worker 0 (mariana serve --worker-index 0 --run-dir <run>)
      └─ worker 1 ...                     each: aiohttp app + model + batcher thread

Workers write their metrics to <run>/metrics-<i>.json each second; any of them
answers /metrics with the sum. On SIGTERM a worker stops taking connections,
answers what it holds (up to serve.drain_seconds) and exits 0.

Under systemd (Type=notify) the main process — the supervisor, or the lone
worker — sends READY=1 once every worker listens, WATCHDOG=1 while it is
healthy, and STOPPING=1 on SIGTERM (services/runtime/sdnotify.py); the
supervised workers are started without $NOTIFY_SOCKET.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from mariana.serving.config import ServeConfig, ready_path, snapshot_path, worker_files
from mariana.services.runtime import procs, sdnotify
from mariana.services.runtime.accept_loop import MendedLoop
from mariana.services.runtime.config import to_toml
from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)
READY_SECONDS = 120.0       # how long the supervisor waits for every worker to listen
RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0)
QUICK_DEATHS = 5            # a worker dying this many times in a row within 10 s of its start: give up


# ---- one worker --------------------------------------------------------------------------

SUPERVISOR_ENV = "MARIANA_SERVE_SUPERVISOR"  # a worker's supervisor's pid


def run_worker(cfg: ServeConfig, index: int = 0, run_dir: str | None = None, config_path: str | None = None) -> int:
    """Serve until SIGTERM/SIGINT/SIGHUP, or until its supervisor dies; 0 after a clean stop,
    1 when it could not start."""
    from mariana.services.runtime.tuning import pin_to_cpu

    supervisor = _follow_supervisor()

    # Before any thread starts (they inherit it): a worker that stays on its core keeps its caches.
    cpu = pin_to_cpu(index) if cfg.serve.pin_workers and cfg.serve.worker_count > 1 else None
    if cpu is not None:
        log.info("serve-%d: runs on CPU %d (serve.pin_workers)", index, cpu)
    sys.setswitchinterval(0.001)  # the event loop gets the GIL back from the model thread within 1 ms
    try:
        with asyncio.Runner(loop_factory=MendedLoop) as runner:
            return runner.run(_serve(cfg, index, run_dir, config_path))
    except OSError as e:  # the port is taken, the host is not ours, ...
        log.error("serve-%d: cannot listen on %s:%d: %s", index, cfg.serve.host, cfg.serve.port, e)
        return 1
    finally:
        if supervisor is not None and os.getppid() != supervisor and run_dir:
            _leave_orphaned(run_dir, index)


def _follow_supervisor() -> int | None:
    """A worker started by a supervisor (`SUPERVISOR_ENV`) gets SIGTERM when it dies (Linux's
    parent-death signal): SIGKILLed, it left its workers serving with nobody to restart them,
    /readyz saying all was well and the port taken from the next `mariana serve`. Returns the
    supervisor's pid (None: none)."""
    supervisor = int(os.environ.pop(SUPERVISOR_ENV, "0")) or None  # (not passed on to a retrain it starts)
    if supervisor is None:
        return None
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: it is noticed when this worker stops, no sooner
        pass
    if os.getppid() != supervisor:  # it died before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)
    return supervisor


def _leave_orphaned(run_dir: str, index: int) -> None:
    """The files of a worker whose supervisor died (nobody else removes them): its own, and the
    run dir once no other worker's are left in it."""
    for path in (ready_path(run_dir, index), snapshot_path(run_dir, index)):
        with contextlib.suppress(OSError):
            os.remove(path)
    if os.path.isdir(run_dir) and not worker_files(run_dir):  # (gone already: nothing to do)
        shutil.rmtree(run_dir, ignore_errors=True)
    log.info("serve-%d: stopped: its supervisor is gone", index)


async def _serve(cfg: ServeConfig, index: int, run_dir: str | None, config_path: str | None) -> int:
    from aiohttp import web

    from mariana.serving.app import METRICS, SETTINGS, create_app
    from mariana.services.runtime.http_idle import IdleClosingRunner
    from mariana.services.runtime.tuning import freeze_imports

    s = cfg.serve
    app = create_app(cfg, index, run_dir, config_path)
    # lingering_time: how long a connection answered before its body was all read (a 408, a 413) reads the rest
    # before it closes (aiohttp's 10 s held the socket of a client too slow to send it anyway)
    # shutdown_timeout: what aiohttp's own shutdown gives a request still running after _drain's serve.drain_seconds
    # auto_decompress off: the app decodes gzip and deflate itself (serving/app.py, _decompress); aiohttp's own
    # parser answered a Content-Encoding it knows but cannot decode (br without Brotli, zstd) with a plain-text
    # 400 telling the client to install a package, before the app could answer its JSON 415
    runner = IdleClosingRunner(app, access_log=None, handle_signals=False, shutdown_timeout=min(2.0, s.drain_seconds),
                               keepalive_timeout=s.keepalive_seconds, lingering_time=LINGER_SECONDS,
                               auto_decompress=False)
    await runner.setup()
    client_errors = _ClientErrors(app[METRICS])
    logging.getLogger("aiohttp.server").addFilter(client_errors)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal closed; never orphaned
        loop.add_signal_handler(sig, stop.set)
    freeze_imports()  # the model is loaded: the collector need not walk torch's and aiohttp's objects again
    watchdog = None
    try:
        # Workers of one server share the port; a server of one worker owns it alone.
        site = web.TCPSite(runner, s.host, s.port, reuse_port=s.worker_count > 1, backlog=1024)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else s.port  # port 0: the one the OS picked
        log.info("serve-%d: listening on http://%s:%d (pid %d, model dir %s)", index, s.host, port, os.getpid(),
                 s.model_dir)
        if run_dir:
            open(ready_path(run_dir, index), "w").close()
        # A lone worker is systemd's main process (a supervised one has no NOTIFY_SOCKET: no-ops).
        sdnotify.notify("READY=1", f"STATUS=serving on {s.host}:{port}")
        period = sdnotify.watchdog_period()
        watchdog = asyncio.create_task(sdnotify.watchdog(period), name="watchdog") if period else None
        await stop.wait()
        log.info("serve-%d: stopping: answering the requests in flight (up to %.0fs)", index, s.drain_seconds)
        sdnotify.notify("STOPPING=1", "STATUS=stopping")
        app[SETTINGS]["draining"] = True
        await _drain(runner, app[METRICS], s.drain_seconds)
    finally:
        await runner.cleanup()
        logging.getLogger("aiohttp.server").removeFilter(client_errors)
        if watchdog is not None:
            watchdog.cancel()
    m = app[METRICS]
    log.info("serve-%d: stopped after %d requests, %d predictions", index,
             m.value("mariana_serve_requests_total"), m.value("mariana_serve_predictions_total"))
    return 0


LINGER_SECONDS = 2.0


async def _drain(runner, metrics, seconds: float) -> None:
    """Stop taking connections, then wait up to `seconds` for the requests in flight, those
    whose bodies are still arriving included. aiohttp's own shutdown (runner.cleanup) marks
    every connection closing first, and a closing connection drops what it receives: a
    request whose body was still coming in was never answered. Answers given meanwhile close
    their connections (SETTINGS "draining"): keep-alive clients go to another worker."""
    loop = asyncio.get_running_loop()
    for site in list(runner.sites):
        server = getattr(site, "_server", None)  # the listening asyncio.Server (aiohttp's field, 3.9-3.14)
        if server is not None:
            server.close()  # stops accepting; the connections it made stay open
    deadline, idle = loop.time() + seconds, 0
    while idle < 2 and loop.time() < deadline:  # none twice in a row: a request whose head was just parsed
        await asyncio.sleep(0.02)  # reaches the middleware's count on the loop's next turn
        idle = idle + 1 if metrics.value("mariana_serve_in_flight") == 0 else 0


class _ClientErrors(logging.Filter):
    """aiohttp answers a request its parser refuses (a malformed head, a broken chunked stream,
    a Content-Encoding it cannot decode) with a 400 of its own, before any route, and logged an
    ERROR with an 11-line traceback for each: any client could fill the log. Such a record is
    counted (mariana_serve_bad_http_total) and logged as one line at debug level instead."""

    def __init__(self, metrics) -> None:
        super().__init__()
        self.metrics = metrics

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.metrics.inc("mariana_serve_bad_http_total")
        log.debug("a request aiohttp's parser refused: %s", " ".join(str(exc).split())[:300])
        return False


# ---- the supervisor ------------------------------------------------------------------------

def serve(cfg: ServeConfig, verbosity: list[str] = ()) -> int:
    """Run the server: in this process with one worker, else supervise `worker_count`.

    The resolved config (flags and environment applied) goes to <run>/serve.toml:
    the workers start from it; POST /v1/retrain runs `mariana retrain` with a copy of it under
    <model_dir>/.retrain/ (this one goes with the run dir).
    """
    n = cfg.serve.worker_count
    # resolved once, here: a worker pinned to one CPU would count 1 (and bind without SO_REUSEPORT)
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, workers=n))
    if n == 1:  # before the model loads, as the supervisor's reservation is (port 0 too: a host not this
        _check_free(cfg.serve.host, cfg.serve.port)  # machine's was a log line and exit 1 after the load)
    reserved = _reserve(cfg.serve.host, cfg.serve.port) if n > 1 else None
    run_dir = ""  # made once the port is ours: a start refused for a taken port left an empty one each time
    try:
        run_dir = tempfile.mkdtemp(prefix="mariana-serve-")
        if reserved is not None:
            cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, port=reserved.getsockname()[1]))
        resolved = os.path.join(run_dir, "serve.toml")
        fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the admin token
        with os.fdopen(fd, "w") as f:
            f.write(to_toml(cfg))
        if n == 1:
            return run_worker(cfg, 0, run_dir, resolved)
        return _Supervisor(cfg, n, run_dir, resolved, list(verbosity)).run()
    finally:
        if reserved is not None:
            reserved.close()
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _check_free(host: str, port: int) -> int:
    """The port (a concrete one for 0), after a plain bind that nothing else holds it; a
    MarianaError (one line, exit 2) when it is taken or the host is not this machine's."""
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a past server's TIME_WAIT is no owner
    try:
        probe.bind((host, port))
        return probe.getsockname()[1]
    except OSError as e:
        who = procs.holder_of(port) if e.errno == errno.EADDRINUSE else ""
        raise MarianaError(f"cannot listen on {host}:{port}: {e.strerror or e}{who}") from None
    finally:
        probe.close()


def _reserve(host: str, port: int) -> socket.socket:
    """Bind (not listen) host:port with SO_REUSEPORT: the workers bind it too, and a
    port 0 becomes one concrete port for all of them, kept across worker restarts.

    First a plain bind: with SO_REUSEPORT alone, a second server started on a port
    that one already serves would join it and take half its connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    port = _check_free(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MarianaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _Supervisor:
    def __init__(self, cfg: ServeConfig, n: int, run_dir: str, resolved: str, verbosity: list[str]):
        self.cfg, self.n, self.run_dir, self.resolved, self.verbosity = cfg, n, run_dir, resolved, verbosity
        self.children: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.quick_deaths: dict[int, int] = {}
        self.stopping, self.signalled = False, ""
        self.watchdog_period, self.next_ping = sdnotify.watchdog_period(), 0.0

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP killed this process and left its
            signal.signal(sig, self._on_signal)  # workers serving with no supervisor (none restarted, /readyz lying)
        for i in range(self.n):
            if not self.stopping:
                self._start(i)
        s = self.cfg.serve
        if not self._wait_ready():  # a stop asked for (SIGTERM, SIGINT) is no failure: exit 0
            log.info("serve: asked to stop before the workers were ready (%s): stopping them", self.signalled)
            sdnotify.notify("STOPPING=1", "STATUS=stopping")
            self._stop_all()
            return 0
        log.info("serving %s on http://%s:%d with %d worker processes", s.model_dir, s.host, s.port, self.n)
        sdnotify.notify("READY=1", f"STATUS=serving on {s.host}:{s.port} with {self.n} workers")
        failed = False
        while not self.stopping:
            time.sleep(0.2)
            for i, child in list(self.children.items()):
                if child.poll() is not None and not self.stopping:
                    failed = not self._restart(i, child.returncode)
                    if failed:
                        self.stopping = True
                        break
            self._feed_watchdog()
        if self.signalled:
            log.info("serve: %s: stopping the workers", self.signalled)
        sdnotify.notify("STOPPING=1", "STATUS=stopping")
        self._stop_all()
        return 1 if failed else 0

    def _feed_watchdog(self) -> None:
        """WATCHDOG=1 every half WatchdogSec while this loop runs and a worker serves: a
        supervisor that hangs, or whose workers are all down, gets restarted by systemd."""
        if self.watchdog_period is None or time.monotonic() < self.next_ping:
            return
        alive = sum(c.poll() is None for c in self.children.values())
        if alive:
            sdnotify.notify("WATCHDOG=1", f"STATUS=serving with {alive} of {self.n} workers")
            self.next_ping = time.monotonic() + self.watchdog_period

    def _on_signal(self, signum, frame) -> None:
        self.stopping, self.signalled = True, signal.Signals(signum).name

    def _start(self, i: int) -> None:
        cmd = [sys.executable, "-m", "mariana", *self.verbosity, "serve", "--config", self.resolved,
               "--worker-index", str(i), "--run-dir", self.run_dir]
        env = {**sdnotify.child_env(), SUPERVISOR_ENV: str(os.getpid())}  # the worker stops when this process dies
        self.children[i] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
        self.started[i] = time.monotonic()

    def _restart(self, i: int, code: int) -> bool:
        quick = time.monotonic() - self.started[i] < 10.0
        self.quick_deaths[i] = self.quick_deaths.get(i, 0) + 1 if quick else 0
        if self.quick_deaths[i] >= QUICK_DEATHS:
            log.error("serve: worker %d exited (code %s) %d times in a row right after starting; giving up",
                      i, code, self.quick_deaths[i])
            return False
        delay = RESTART_DELAYS[min(self.quick_deaths[i], len(RESTART_DELAYS) - 1)]
        log.warning("serve: worker %d exited with code %s; starting it again in %.1fs", i, code, delay)
        with contextlib.suppress(FileNotFoundError):  # /readyz and /metrics: not listening, serving nothing
            os.remove(ready_path(self.run_dir, i))
        time.sleep(delay)
        self._start(i)
        return True

    def _wait_ready(self) -> bool:
        """True once every worker listens, False when asked to stop meanwhile; MarianaError
        (the workers stopped) when one exits first or they do not all listen in READY_SECONDS."""
        s = self.cfg.serve
        deadline = time.monotonic() + READY_SECONDS
        while not self.stopping:
            if all(os.path.exists(ready_path(self.run_dir, i)) for i in range(self.n)):
                return True
            dead = [(i, c.returncode) for i, c in self.children.items() if c.poll() is not None]
            if self.stopping:  # a Ctrl-C reaches the workers too: they may have died of it first
                break
            if dead or time.monotonic() > deadline:
                self._stop_all()
                why = (f"worker {dead[0][0]} exited with code {dead[0][1]} before it listened" if dead
                       else f"the workers did not all start listening within {READY_SECONDS:.0f}s")
                raise MarianaError(f"cannot serve on {s.host}:{s.port}: {why} (see the workers' log lines above)")
            time.sleep(0.05)
        return False

    def _stop_all(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.serve.drain_seconds + 10.0
        for i, child in self.children.items():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("serve: worker %d did not stop in time; killing it", i)
                child.kill()
                child.wait()
        log.info("serve: stopped (%d workers)", self.n)
