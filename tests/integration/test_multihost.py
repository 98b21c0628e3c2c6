"""A cluster as four "hosts" on this machine, by config alone (docs/operations.md,
"Several hosts"): each host its own working directory and its own loopback address, every
socket bound and dialled by the configured address.

    host A 127.0.0.2   coordinator (its state, the model directory), mariana serve
    host B 127.0.0.3   loader (the only copy of the data)
    host C 127.0.0.4   ps shard, preprocess
    host D 127.0.0.5   two workers, Redis

`coordinator.data_via_loader` makes the coordinator have the loader check a job's files
and send the validation and test rows. Where `unshare -m` works (root, as in CI), each
host's processes run in a mount namespace where the other hosts' directories are empty
tmpfs mounts: a process that reached for another host's files would fail. Two 2-epoch
jobs (validation rows held out of the data, test data scored) complete with every row
applied exactly once per epoch, and the server on host A swaps to each new version.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mariana.services.launcher import RedisServer, free_port
from mariana.sparse.synth import generate_criteo
from tests.debian import can_unshare_mounts
from tests.integration.serving import Server

pytestmark = pytest.mark.slow

HOSTS = {"A": "127.0.0.2", "B": "127.0.0.3", "C": "127.0.0.4", "D": "127.0.0.5"}
ROLES = {"A": [("coordinator", 0)], "B": [("loader", 0)], "C": [("ps", 0), ("preprocess", 0)],
         "D": [("worker", 0), ("worker", 1)]}
ROWS = 20_000
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (address, port) pairs process `pid` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            if width == 8:
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(addr)))
            else:
                ip = "ipv6:" + addr
            out.add((ip, int(port, 16)))
    return out


class Hosts:
    def __init__(self, root: Path):
        self.root = root
        self.dirs = {h: root / f"host-{h}" for h in HOSTS}
        for d in self.dirs.values():
            d.mkdir(parents=True)
        self.isolated = can_unshare_mounts()
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis: RedisServer | None = None

    def prefix(self, host: str) -> list[str]:
        """Run in a mount namespace of `host`'s own: the other hosts' dirs are empty there."""
        if not self.isolated:
            return []
        hide = " && ".join(f"mount -t tmpfs none {d}" for h, d in self.dirs.items() if h != host)
        return ["unshare", "-m", "sh", "-c", f'{hide} && exec "$@"', "sh"]

    def config(self) -> dict:
        port = free_port
        a, b, c, d = (HOSTS[h] for h in "ABCD")
        return {
            "cluster": {"start_seconds": 60.0, "supervise": False},
            "redis": {"url": f"redis://{d}:{port(d)}/0", "embedded": False, "retry_seconds": 60.0},
            "coordinator": {"endpoint": f"tcp://{a}:{port(a)}", "http_host": a, "http_port": port(a),
                            "token": "four-hosts", "state_dir": str(self.dirs["A"] / "coordinator"),
                            "data_via_loader": True, "lease_seconds": 3.0, "heartbeat_seconds": 2.0},
            "loader": {"metrics_port": port(b)},
            "preprocess": {"count": 1, "endpoints": [f"tcp://{c}:{port(c)}"], "metrics_ports": [port(c)]},
            "ps": {"count": 1, "endpoints": [f"tcp://{c}:{port(c)}"], "metrics_ports": [port(c)],
                   # every 0.1 s: the 2-epoch job takes about a second, so checkpoints surely land
                   # on C while it runs (at 0.5 s a fast run could end between two, writing none)
                   "state_dir": str(self.dirs["C"] / "ps"), "checkpoint_seconds": 0.1},
            "worker": {"count": 2, "metrics_ports": [port(d), port(d)], "rpc_seconds": 3.0},
        }

    def start(self, cfg: dict) -> None:
        text = "\n".join(f"[{section}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items())
                         for section, values in cfg.items()) + "\n"
        url = cfg["redis"]["url"]
        self.redis = RedisServer(HOSTS["D"], int(url.rsplit(":", 1)[1].split("/")[0]), str(self.dirs["D"] / "redis"))
        self.redis.start().wait_ready()
        for host, roles in ROLES.items():
            conf = self.dirs[host] / "cluster.toml"  # each host its own copy of the one config
            conf.write_text(text)
            env = {**os.environ, "MARIANA_CLUSTER__HOST": HOSTS[host], "MARIANA_CLUSTER__DIR": str(self.dirs[host])}
            for role, index in roles:
                log = open(self.dirs[host] / f"{role}-{index}.log", "ab")
                self.procs[f"{role}-{index}"] = subprocess.Popen(
                    [*self.prefix(host), sys.executable, "-m", "mariana", "run", role, "--config", str(conf),
                     "--index", str(index)], cwd=self.dirs[host], env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
                log.close()

    def stop(self) -> None:
        for name in ("worker-1", "worker-0", "preprocess-0", "loader-0", "ps-0", "coordinator-0"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.redis:
            self.redis.stop()

    def logs(self) -> str:
        out = []
        for path in sorted(self.root.glob("host-*/*.log")):
            out.append(f"==> {path.relative_to(self.root)}\n" + "\n".join(path.read_text(errors="replace")
                                                                           .splitlines()[-20:]))
        return "\n".join(out)


def api(cfg: dict, method: str, path: str, body: dict | None = None) -> dict:
    c = cfg["coordinator"]
    req = urllib.request.Request(f"http://{c['http_host']}:{c['http_port']}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {c['token']}"})
    with DIRECT.open(req, timeout=30) as r:
        return json.loads(r.read())


def wait_until(probe, timeout: float, what: str, logs) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = probe()
        except OSError:
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not after {timeout:g}s\n{logs()}")


@pytest.mark.timeout(300)
def test_four_hosts_by_config_alone(tmp_path):
    hosts = Hosts(tmp_path)
    data = hosts.dirs["B"] / "data"  # the data: only on the loader's host
    data.mkdir()
    generate_criteo(data / "train.tsv", ROWS, seed=21)
    generate_criteo(data / "test.tsv", 4_000, seed=22)
    models = hosts.dirs["A"] / "models" / "ctr"  # the model directory: only on the coordinator's host
    models.mkdir(parents=True)  # empty: the server serves what is published there
    cfg = hosts.config()
    hosts.start(cfg)
    server = Server(hosts.dirs["A"] / "serve", models, serve={"host": HOSTS["A"], "redis_url": cfg["redis"]["url"],
                                                              "watch_seconds": 30.0}, prefix=hosts.prefix("A"))
    try:
        wait_until(lambda: (lambda services: len(services) == 6 and all(s["alive"] for s in services.values()))(
            api(cfg, "GET", "/v1/status")["services"]), 90, "every service registered", hosts.logs)
        server.start()
        versions = []
        for run in range(2):
            job = api(cfg, "POST", "/v1/jobs", {
                "data": [str(data / "train.tsv")], "test_data": [str(data / "test.tsv")], "out": str(models),
                "config": {"hashing": {"bits": 16}, "train": {"epochs": 2, "valid_fraction": 0.1}}})["job"]
            summary = wait_until(lambda: (lambda s: s if s["state"] not in ("queued", "running") else None)(
                api(cfg, "GET", f"/v1/jobs/{job}")), 120, f"job {job} ended", hosts.logs)
            assert summary["state"] == "done", (summary, hosts.logs())
            record = summary["record"]
            train_rows = ROWS - ROWS // 10  # the last 10% held out for validation
            assert record["rows_applied_per_epoch"] == [train_rows] * 2, record
            assert record["rows_applied"] == 2 * train_rows == 2 * record["rows_in_data"], record
            assert record["test_rows"] == 4_000 and record["auc"] > 0.6, record
            assert [e["rows"] for e in record["valid"]["epochs"]] == [ROWS // 10] * 2, record["valid"]
            versions.append(record["model_version"])
            wait_until(lambda: server.get("/v1/model")[1].get("model_version") == versions[-1], 30,
                       f"the server on host A serves {versions[-1]}", lambda: server.logs() + hosts.logs())
        assert versions == ["v000001", "v000002"]
        status, body = server.request("POST", "/v1/predict", json.dumps({"instances": [{"I1": 3, "C1": "ab"}]})
                                      .encode(), {"Content-Type": "application/json"})[:2]
        assert status == 200

        # every process listens on its host's address only, never 127.0.0.1 or all interfaces
        where = {name: HOSTS[h] for h, roles in ROLES.items() for name in (f"{r}-{i}" for r, i in roles)}
        for name, proc in hosts.procs.items():
            addrs = listening(proc.pid)
            assert {ip for ip, _ in addrs} <= {where[name]}, (name, addrs)
        assert {ip for ip, _ in listening(server.proc.pid)} <= {HOSTS["A"]}
        assert listening(hosts.procs["ps-0"].pid) and listening(hosts.procs["coordinator-0"].pid)
        # what each host wrote stayed on its disk: versions only on A, shard checkpoints only on C
        assert (models / "CURRENT").exists()
        assert not list(tmp_path.glob("host-[BCD]/**/v00000*")), "a version was written off the coordinator's host"
        assert list((hosts.dirs["C"] / "ps").iterdir()) and not (hosts.dirs["A"] / "ps").exists()
        print(f"four hosts: isolated mounts {hosts.isolated}; versions {versions}")
    finally:
        server.stop()
        hosts.stop()


def _run_worker(tmp_path: Path, endpoint: str, wait_for: str) -> tuple[int | None, str]:
    """Start `mariana run worker` with the coordinator at `endpoint`; its output up to the line
    holding `wait_for`, or to its exit. (A worker binds nothing: it only dials.)"""
    conf = tmp_path / "cluster.toml"
    conf.write_text(f'[coordinator]\nendpoint = "{endpoint}"\n[redis]\nurl = "redis://127.0.0.1:1/0"\n'
                    '[ps]\nendpoints = ["tcp://127.0.0.1:2"]\n[preprocess]\nendpoints = ["tcp://127.0.0.1:3"]\n'
                    f'[cluster]\ndir = "{tmp_path}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "mariana", "run", "worker", "--config", str(conf)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if wait_for in line:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        out.append(proc.stdout.read())
        proc.stdout.close()
    return proc.returncode, "".join(out)


def test_a_service_off_loopback_without_a_curve_key_warns_and_a_malformed_endpoint_is_refused(tmp_path):
    # 0.0.0.0 is "every address": what an operator writes to reach a service from other hosts
    _, out = _run_worker(tmp_path, f"tcp://0.0.0.0:{free_port()}", "no cluster.curve_key")
    assert "ZeroMQ endpoints off loopback (tcp://0.0.0.0:" in out and "any peer that reaches them" in out, out
    rc, out = _run_worker(tmp_path, "127.0.0.1:5700", "\x00")  # no scheme: runs to its exit
    assert rc == 2 and "coordinator.endpoint = '127.0.0.1:5700' is not a ZeroMQ endpoint" in out, out
    assert "Traceback" not in out, out
