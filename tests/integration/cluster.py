"""A real local cluster for tests: `launcher.up` (redis-server and every
service as its own OS process, on free loopback ports), jobs submitted over
HTTP, and the means to kill and restart any process."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from mariana.services import launcher
from mariana.services.runtime.config import load_cluster_config

FAST = {  # short timers so failures are noticed in seconds, not minutes
    "coordinator.lease_seconds": 3.0,
    "coordinator.chunk_seconds": 20.0,
    "worker.rpc_seconds": 3.0,
    "coordinator.heartbeat_seconds": 2.0,
    "ps.checkpoint_seconds": 0.5,
    "redis.retry_seconds": 60.0,
    "cluster.start_seconds": 90.0,
    "cluster.supervise": False,  # tests kill and restart services themselves (test_supervise.py: the supervisor)
}


def free_base_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A `cluster.base_port` whose derived ports (services/runtime/config.py: base .. base + 3,
    base + 10, + 100, + 200, + 300, + 400, `count` of each role's) bind now, below the kernel's
    ephemeral range. A base from `free_port()` lies inside it: a client socket of a test running
    beside (another pytest worker) took base + 3 before the loader bound it, and the cluster
    did not start (a CI run)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(low, 20_000) - 500
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, top)
        ports = [base, base + 1, base + 2, base + 3] + [base + off + i for off in (10, 100, 200, 300, 400)
                                                         for i in range(count)]
        socks = []
        try:
            for port in ports:
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no free block of cluster ports below {top} on {host}")


class Cluster:
    def __init__(self, root: Path, workers: int = 1, ps: int = 1, preprocess: int = 1, **overrides):
        self.root = Path(root)
        values = {**FAST, "cluster.dir": str(self.root), "worker.count": workers, "ps.count": ps,
                  "preprocess.count": preprocess, **overrides}
        self.cfg = load_cluster_config(overrides=values, env={})
        self.info: dict = {}
        self.restarted: list[subprocess.Popen] = []

    def __enter__(self) -> "Cluster":
        launcher.up(self.cfg)
        self.info = launcher.cluster_info(str(self.root))
        self.cfg = load_cluster_config(self.info["config"], env={})  # resolved: ports, token
        return self

    def __exit__(self, *exc) -> None:
        # `down` stops only what `up` recorded: restarted services go first (Redis still up for
        # their drain), a restarted Redis last. (Left alone, each cost a 30 s wait here.)
        self.stop_restarted(skip=("redis",))
        self.summary = launcher.down(str(self.root), timeout=30.0)
        self.stop_restarted()

    # ---- HTTP ---------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None,
                token: str | None = "default") -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        token = self.info.get("token") if token == "default" else token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.info["http"] + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"{}")

    def submit(self, data: list, out: Path, test_data: list | None = None, config: dict | None = None,
               **fields) -> str:
        body = {"data": [str(p) for p in data], "test_data": [str(p) for p in test_data or []],
                "out": str(out), "config": config or {}, **fields}
        code, reply = self.request("POST", "/v1/jobs", body)
        assert code == 201, (code, reply)
        return reply["job"]

    def job(self, job: str) -> dict:
        code, reply = self.request("GET", f"/v1/jobs/{job}")
        assert code == 200, (code, reply)
        return reply

    def wait(self, job: str, timeout: float = 120.0, until=None) -> dict:
        """The job's summary once it has ended (or once until(summary) holds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            summary = self.job(job)
            if until is not None and until(summary):
                return summary
            if until is None and summary["state"] not in ("queued", "running"):
                return summary
            time.sleep(0.1)
        raise AssertionError(f"job {job} not there after {timeout}s: {self.job(job)}\n{self.logs()}")

    def wait_for(self, probe, timeout: float = 30.0):
        """probe()'s first truthy answer, polled until `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = probe()
            if got:
                return got
            time.sleep(0.1)
        raise AssertionError(f"nothing after {timeout}s\n{self.logs()}")

    def wait_http(self, timeout: float = 60.0) -> None:
        """Until the coordinator answers HTTP (after a restart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.info["http"] + "/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"the coordinator did not answer in {timeout}s\n{self.logs()}")

    def status(self) -> dict:
        return self.request("GET", "/v1/status")[1]

    # ---- processes --------------------------------------------------------------------

    def record(self, name: str) -> dict:
        state = json.loads((self.root / "cluster.json").read_text())
        for rec in state["services"]:
            if rec["name"] == name:
                return rec
        if name == "redis":
            return state["redis"]
        raise KeyError(name)

    def pid(self, name: str) -> int:
        for p in reversed(self.restarted):
            if getattr(p, "mariana_name", None) == name:
                return p.pid
        return self.record(name)["pid"]

    def kill(self, name: str, sig: int = signal.SIGKILL, wait: bool = True) -> None:
        pid = self.pid(name)
        os.kill(pid, sig)
        if wait:
            self.wait_gone(pid)

    def wait_gone(self, pid: int, timeout: float = 30.0) -> int | None:
        """Wait for a process to exit; its exit code when it is our child."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.restarted:
                if p.pid == pid:
                    try:
                        return p.wait(timeout=deadline - time.monotonic())
                    except subprocess.TimeoutExpired:
                        raise AssertionError(f"pid {pid} still running") from None
            code = launcher.reap(pid)
            if code is not None:
                return code
            if pid not in launcher._CHILDREN and (not os.path.exists(f"/proc/{pid}") or _zombie(pid)):
                return None  # not ours to reap: gone is all we can know
            time.sleep(0.05)  # our child: wait until it can be reaped (a zombie's threads may still exit)
        raise AssertionError(f"pid {pid} still running after {timeout}s")

    def restart(self, name: str) -> subprocess.Popen:
        """Start a service again with the command line it was started with."""
        rec = self.record(name)
        with open(rec["log"], "ab") as log:
            p = subprocess.Popen(rec["cmd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        p.mariana_name = name
        self.restarted.append(p)
        return p

    def stop_restarted(self, timeout: float = 30.0, skip: tuple[str, ...] = ()) -> dict[str, int | None]:
        """SIGTERM what `restart` started and still runs (but the names in `skip`), in the
        launcher's stop order; name -> exit code (None: killed after `timeout`).
        `launcher.down` stops only what `up` recorded."""
        order = {role: i for i, role in enumerate(launcher.STOP_ORDER)}
        live = [p for p in self.restarted if p.poll() is None and p.mariana_name not in skip]
        codes: dict[str, int | None] = {}
        for p in sorted(live, key=lambda p: order.get(p.mariana_name.split("-")[0], len(order))):
            p.send_signal(signal.SIGTERM)
            try:
                codes[p.mariana_name] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[p.mariana_name] = None
        return codes

    def logs(self, lines: int = 30) -> str:
        out = []
        for path in sorted((self.root / "logs").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==> {path.name}\n" + "\n".join(tail))
        return "\n".join(out)


def nested(settings: dict) -> dict:
    """{"hashing.bits": 18} -> {"hashing": {"bits": 18}}: a job request's config."""
    out: dict = {}
    for key, value in settings.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
