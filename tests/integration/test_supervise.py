"""`mariana up` supervises what it starts (services/supervisor.py): a service or Redis
killed with SIGKILL is started again, with backoff, its restarts counted in cluster.json,
`mariana status` and the coordinator's /v1/status; the cluster goes on training; `down`
stops the supervisor first, then everything, leaving no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mariana.services import launcher
from mariana.services.supervisor import Supervisor
from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT
from tests.debian import can_unshare_mounts
from tests.integration.cluster import Cluster

SUPERVISED = {"cluster.supervise": True}


def test_a_process_that_keeps_dying_is_restarted_with_growing_backoff(tmp_path):
    """One recorded service that exits at once with code 3: restarted after 0.5 s, then 1 s, ..."""
    cmd = [sys.executable, "-c", "raise SystemExit(3)"]
    (tmp_path / "logs").mkdir()
    rec = {"name": "worker-0", "role": "worker", "index": 0, "pid": os.getpid() + 10**6, "start": None,
           "cmd": cmd, "log": str(tmp_path / "logs" / "worker-0.log")}  # a pid that does not exist: dead
    launcher._save_state({"dir": str(tmp_path), "services": [rec], "redis": None})
    sup = Supervisor(str(tmp_path))
    restarts_at, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 4.0:
        state = launcher._load_state(str(tmp_path))
        if sup.tick(state, dict(os.environ)):
            launcher._save_state(state)
            if state["services"][0].get("restarts", 0) > len(restarts_at):
                restarts_at.append(time.monotonic() - t0)
        time.sleep(0.02)
    rec = launcher._load_state(str(tmp_path))["services"][0]
    assert 2 <= rec["restarts"] <= 3, restarts_at  # 0.5 + 1 + 2 s: three restarts fit in 4 s, not four
    gaps = [b - a for a, b in zip(restarts_at, restarts_at[1:])]
    assert all(g2 > g1 * 1.5 for g1, g2 in zip(gaps, gaps[1:])) and gaps[0] >= 0.9, restarts_at
    assert rec["last_exit"]["code"] == 3, rec  # started by the supervisor: its exit code is known
    for pid, child in list(launcher._CHILDREN.items()):  # reap the last one
        if child.args == cmd:
            child.wait()
            del launcher._CHILDREN[pid]


def test_a_service_the_coordinator_refused_is_not_restarted(tmp_path):
    """Exit 78 (procs.EX_CONFIG): the coordinator refused the service (its config differs from
    the cluster's, or its name is held): a restart would be refused again, so the supervisor
    leaves it, as systemd's units do (RestartPreventExitStatus=78), and says so."""
    cmd = [sys.executable, "-c", "raise SystemExit(78)"]
    (tmp_path / "logs").mkdir()
    rec = {"name": "worker-0", "role": "worker", "index": 0, "pid": os.getpid() + 10**6, "start": None,
           "cmd": cmd, "log": str(tmp_path / "logs" / "worker-0.log")}  # gone, its exit code unknown: restarted
    launcher._save_state({"dir": str(tmp_path), "services": [rec], "redis": None})
    sup = Supervisor(str(tmp_path))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:  # the first restart after 0.5 s; a second would come 1 s after its exit
        state = launcher._load_state(str(tmp_path))
        if sup.tick(state, dict(os.environ)):
            launcher._save_state(state)
        time.sleep(0.02)
    rec = launcher._load_state(str(tmp_path))["services"][0]
    assert rec["restarts"] == 1 and rec["refused"] and rec["last_exit"]["code"] == 78, rec
    for pid, child in list(launcher._CHILDREN.items()):
        if child.args == cmd:
            child.wait()
            del launcher._CHILDREN[pid]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_services_and_redis_come_back_and_the_cluster_trains(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 20_000, seed=7)
    with Cluster(tmp_path / "c", workers=1, ps=1, **SUPERVISED) as c:
        state = json.loads((c.root / "cluster.json").read_text())
        sup = state["supervisor"]["pid"]
        assert alive(sup)
        old = {n: c.record(n)["pid"] for n in ("worker-0", "ps-0", "redis")}
        for name in old:
            c.kill(name, signal.SIGKILL)  # and reaped: up's children are this test's

        def back() -> dict | None:
            recs = {n: c.record(n) for n in old}
            return recs if all(r.get("restarts") == 1 and r["pid"] != old[n] and alive(r["pid"])
                               for n, r in recs.items()) else None

        recs = c.wait_for(back, 30.0)
        assert all(r["last_exit"]["ran_seconds"] >= 0 for r in recs.values())
        st = launcher.status(str(c.root))
        assert st["supervisor"]["running"] and st["processes"]["worker-0"]["restarts"] == 1
        # each registered again (restarts 1): "alive" alone may be the killed one's last heartbeat, still recent
        services = c.wait_for(lambda: (lambda s: s if s["worker-0"]["alive"] and s["ps-0"]["alive"] and
                                       s["worker-0"]["restarts"] == 1 and s["ps-0"]["restarts"] == 1 else None)(
            c.status()["services"]), 60.0)
        assert services["ps-0"]["restarts"] == 1
        job = c.submit([data], tmp_path / "m", config={"hashing": {"bits": 16}, "train": {"epochs": 2}})
        summary = c.wait(job, timeout=180)
        assert summary["state"] == "done", (summary, c.logs())
        record = summary["record"]
        assert record["rows_applied"] == record["rows_in_data"] * 2 == 2 * 20_000, record  # exactly once
        # the coordinator restarted: /v1/status (the web UI) says the restarts `mariana status` says (it said 0
        # for every service: its counts were of registrations it saw, and it never counted its own restart)
        c.kill("coordinator-0", signal.SIGKILL)
        c.wait_for(lambda: c.record("coordinator-0").get("restarts") == 1, 30.0)
        c.wait_http()
        services = c.wait_for(lambda: (lambda s: s if "worker-0" in s else None)(c.status()["services"]), 30.0)
        assert (services["coordinator-0"]["restarts"], services["worker-0"]["restarts"]) == (1, 1), services
        pids = [sup] + [r["pid"] for r in launcher._records(json.loads((c.root / "cluster.json").read_text()))]
        log = (c.root / "logs" / "supervisor.log").read_text()
        assert "restarted worker-0" in log and "restarted redis" in log, log
    assert not (c.root / "cluster.json").exists()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "down left processes running"


FULL_DIR = r"""
import json, os, signal, sys, time
from pathlib import Path
from tests.integration.cluster import Cluster
from tests.integration.rankkill import running
root = Path(sys.argv[1])
out = {}
with Cluster(root / "c", **{"cluster.supervise": True}) as c:
    c.wait_for(lambda: "watching" in (c.root / "logs" / "supervisor.log").read_text(), 30.0)
    try:
        with open(root / "c" / "fill", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
    except OSError:
        pass
    sup = json.loads((c.root / "cluster.json").read_text())["supervisor"]["pid"]
    old = c.record("worker-0")["pid"]
    c.kill("worker-0", signal.SIGKILL)
    time.sleep(4)  # the restart is due after 0.5 s
    out["supervisor_alive"] = os.path.exists(f"/proc/{sup}") and "Z" not in open(f"/proc/{sup}/stat").read().split()[2]
    out["worker"] = c.wait_for(lambda: (lambda s: s if s["worker-0"]["alive"] and s["worker-0"]["pid"] != old
                                        else None)(c.status()["services"]), 60.0)["worker-0"]["pid"]
    out["log"] = (c.root / "logs" / "supervisor.log").read_text()[-2000:]
    os.unlink(root / "c" / "fill")


deadline = time.monotonic() + 15
while running(out["worker"]) and time.monotonic() < deadline:
    time.sleep(0.2)
out["worker_left_running"] = running(out["worker"])
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_a_full_disk_does_not_stop_the_supervisor_restarting(tmp_path):
    """The supervisor died of ENOSPC writing cluster.json after its first restart, and restarted nothing more."""
    if not can_unshare_mounts():
        pytest.skip("unshare -m is not allowed here (needs root or CAP_SYS_ADMIN): no small filesystem to fill")
    (tmp_path / "c").mkdir()
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=8m none {tmp_path / "c"} && exec '
                           f'{sys.executable} -c "$0" {tmp_path}', FULL_DIR], cwd=ROOT, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["supervisor_alive"] and out["worker"], out
    assert not out["worker_left_running"], out  # `down` stopped the worker restarted while cluster.json was stale
    assert "cannot write cluster.json" in out["log"], out["log"]


def test_a_second_supervisor_of_a_cluster_is_refused(tmp_path):
    """It overwrote the first one's record: `down` stopped only the second, and the first
    restarted the services `down` was stopping, left running after it."""
    from mariana.services.runtime import procs
    from tests.conftest import run_cli

    (tmp_path / "logs").mkdir()
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        launcher._save_state({"dir": str(tmp_path), "services": [], "redis": None,
                              "supervisor": {"pid": first.pid, "start": procs.start_time(first.pid)}})
        proc = run_cli("supervise", "--dir", tmp_path)
        assert proc.returncode == 2 and f"a supervisor already watches this cluster (pid {first.pid})" in proc.stderr
        assert launcher._load_state(str(tmp_path))["supervisor"]["pid"] == first.pid  # its record stands
    finally:
        first.kill()
        first.wait()
    launcher._save_state({**launcher._load_state(str(tmp_path)), "dir": str(tmp_path)})  # the first one gone:
    proc = subprocess.Popen([sys.executable, "-m", "mariana.services.cli", "supervise", "--dir", str(tmp_path)])
    deadline = time.monotonic() + 20  # a new one takes over
    while launcher._load_state(str(tmp_path))["supervisor"]["pid"] != proc.pid:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(10) == 0
