"""Whom the coordinator takes at `Hello` (services/coord_hello.py), with real processes on a
real cluster: a service whose host runs another config, or whose name a live process holds,
exits at once with status 78 and a line that says what differs, instead of joining a cluster
where its job would hang at 0 rows; a restart on the same host is taken at once; a job left
running is not resumed by a coordinator whose ps.count changed."""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mariana.services.launcher import free_port
from mariana.services.runtime.config import load_cluster_config, to_toml
from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli
from tests.integration.cluster import Cluster, free_base_port
from tests.integration.test_metrics_endpoints import scrape

pytestmark = pytest.mark.slow

EX_CONFIG = 78


def variant(c: Cluster, path: Path, **overrides) -> Path:
    """The cluster's resolved config with `overrides` (one host's differing copy)."""
    cfg = load_cluster_config(c.info["config"], env={}, overrides=overrides)
    path.write_text(to_toml(cfg))
    return path


def run(role: str, index: int, config: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "mariana", "run", role, "--config", str(config), "--index",
                                 str(index)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def ended(p: subprocess.Popen, log: Path, timeout: float = 60.0) -> tuple[int, str]:
    try:
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"still running after {timeout}s:\n{log.read_text()[-2000:]}") from None
    return code, log.read_text()


@pytest.mark.timeout(240)
def test_a_service_whose_host_differs_is_refused_at_once_and_says_what_differs(tmp_path):
    with Cluster(tmp_path / "c", workers=1, **{"cluster.start_seconds": 4.0}) as c:
        c.wait_for(lambda: len(c.status()["services"]) == 5, 60)
        ps = load_cluster_config(c.info["config"], env={}).ps
        cases = {
            # a worker that would send rows to two shards where the cluster has one
            "ps": ("worker", 0, {"ps.count": 2, "ps.endpoints": [*ps.endpoints, f"tcp://127.0.0.1:{free_port()}"],
                                 "ps.metrics_ports": [], "worker.metrics_ports": []},
                   ["ps.count = 2 there, 1 in the coordinator's", "ps.endpoints = "]),
            # a preprocess that would cache batches where no worker reads them
            "db": ("preprocess", 0, {"redis.url": c.cfg.redis.url.rsplit("/", 1)[0] + "/1",
                                     "preprocess.endpoints": [f"tcp://127.0.0.1:{free_port()}"],  # its own host's
                                     "preprocess.metrics_ports": []},
                   ["reaches database 1 of Redis server", "the sample cache must be one Redis"]),
            # an index the coordinator's config has not
            "index": ("worker", 3, {"worker.count": 4, "worker.metrics_ports": []},
                      ["no worker #3 in the coordinator's config: it has worker.count = 1 (indexes 0-0)"]),
            # a second worker-0 while the first runs: refused when its start time is over
            "twice": ("worker", 0, {"worker.metrics_ports": []},
                      [f"worker-0 is already running: pid {c.pid('worker-0')} on "]),
            # a redis.url where no Redis answers, while the coordinator's does: asked again, then refused
            "noredis": ("worker", 0, {"redis.url": f"redis://127.0.0.1:{free_port()}/0", "worker.metrics_ports": []},
                        ["'s redis.url redis://127.0.0.1:", "does not answer, while the coordinator's"]),
        }
        procs = {k: run(role, i, variant(c, tmp_path / f"{k}.toml", **o), tmp_path / f"{k}.log")
                 for k, (role, i, o, _) in cases.items()}
        for key, (role, index, _, says) in cases.items():
            code, log = ended(procs[key], tmp_path / f"{key}.log")
            assert code == EX_CONFIG, (key, code, log[-2000:])
            assert "refused it" in log or "did not take it" in log, (key, log[-2000:])
            for text in says:
                assert text in log, (key, text, log[-2000:])
            if key not in ("twice", "noredis"):  # refused at its first Hello: not retried for cluster.start_seconds
                assert "not registered yet" not in log, (key, log[-2000:])
        status, first = c.status()["services"], c.pid("worker-0")
        coord_log = (tmp_path / "c" / "logs" / "coordinator-0.log").read_text()
    # the cluster as it was: the first worker-0 kept its name, none of the others registered
    assert sorted(status) == ["coordinator-0", "loader-0", "preprocess-0", "ps-0", "worker-0"], status
    assert status["worker-0"]["restarts"] == 0 and status["worker-0"]["pid"] == first
    # named by every Hello (a restarted coordinator learns it from the next heartbeat)
    assert {s["host"] for s in status.values()} == {platform.node()}, status
    # each refusal said once by the coordinator, though the second worker-0 asked every second for 4 s
    assert coord_log.count("refused worker-3: no worker #3") == 1, coord_log[-3000:]
    assert coord_log.count("not yet worker-0: worker-0 is already running") == 1, coord_log[-3000:]
    assert "cannot serve Hello" not in coord_log and "hello: hello:" not in coord_log


@pytest.mark.timeout(240)
def test_a_service_restarted_on_its_host_is_taken_at_once(tmp_path):
    """SIGKILL a worker and start it again at once: the coordinator heard the dead one within
    heartbeat_seconds (30 s here), and takes the new one because it names the pid it replaces,
    which it saw gone on its own host; the heartbeats then name the host."""
    with Cluster(tmp_path / "c", workers=1, **{"coordinator.heartbeat_seconds": 30.0}) as c:
        c.wait_for(lambda: len(c.status()["services"]) == 5, 60)
        old = c.pid("worker-0")
        c.kill("worker-0", signal.SIGKILL)
        new = c.restart("worker-0")
        info = c.wait_for(lambda: (lambda s: s if s["pid"] == new.pid else None)(c.status()["services"]["worker-0"]),
                          60)
        log = (tmp_path / "c" / "logs" / "worker-0.log").read_text()
    assert new.pid != old and info["restarts"] == 1, info
    assert info["host"] == platform.node(), info
    assert "not registered yet" not in log, log[-2000:]  # it did not wait for the dead one's name to lapse


@pytest.mark.timeout(240)
def test_a_service_stopped_cleanly_is_down_at_once(tmp_path):
    """A worker stopped by SIGTERM showed "alive" for up to heartbeat_seconds (30 s here) after
    it exited. Its last message (Bye) makes it down at once, in the status, `mariana status`,
    the metrics and the log; a restart is taken at once."""
    with Cluster(tmp_path / "c", workers=1, **{"coordinator.heartbeat_seconds": 30.0}) as c:
        c.wait_for(lambda: len(c.status()["services"]) == 5, 60)
        old = c.pid("worker-0")
        c.kill("worker-0", signal.SIGTERM)  # waits for it to exit
        # (its Bye was answered before it exited, unless the coordinator took over 0.5 s: then
        # the wait ends at heartbeat_seconds, 30 s, and fails)
        info = c.wait_for(lambda: (lambda s: s if s["stopped"] else None)(c.status()["services"]["worker-0"]), 10)
        table = run_cli("status", "--dir", c.root, check=True).stdout
        up = scrape(c.cfg.coordinator.http_port)[2]['mariana_service_up{service="worker-0",role="worker"}']
        new = c.restart("worker-0")
        back = c.wait_for(lambda: (lambda s: s if s["pid"] == new.pid and s["alive"] else None)(
            c.status()["services"]["worker-0"]), 60)
        log = (tmp_path / "c" / "logs" / "coordinator-0.log").read_text()
    assert (info["alive"], info["stopped"], info["pid"]) == (False, True, old), info
    assert any(line.split()[:4] == ["worker-0", "worker", "0", "stopped"] for line in table.splitlines()), table
    assert up == 0
    assert f"worker-0 stopped (pid {old})" in log, log[-2000:]
    assert back["stopped"] is False and back["restarts"] == 1, back


@pytest.mark.timeout(240)
def test_a_job_waiting_for_a_refused_service_says_it_was_refused_not_silent(tmp_path):
    """The only worker runs with another ps.count and is refused: the job's phase said
    "no heartbeat ... (is it running?)" until it failed. It names the refusal while it waits,
    and its error says it once."""
    generate_criteo(tmp_path / "train.tsv", 5_000, seed=5)
    with Cluster(tmp_path / "c", workers=1, **{"cluster.start_seconds": 6.0}) as c:
        c.kill("worker-0", signal.SIGTERM)
        shards = [*c.cfg.ps.endpoints, f"tcp://127.0.0.1:{free_port()}"]
        config = variant(c, tmp_path / "w.toml", **{"ps.count": 2, "ps.metrics_ports": [], "ps.endpoints": shards,
                                                     "worker.metrics_ports": []})
        code, _ = ended(run("worker", 0, config, tmp_path / "w.log"), tmp_path / "w.log")
        assert code == EX_CONFIG
        job = c.submit([tmp_path / "train.tsv"], tmp_path / "m", config={"hashing": {"bits": 16}})
        phase = c.wait(job, 60, until=lambda s: "worker-0" in (s.get("phase") or ""))["phase"]
        table = run_cli("status", "--dir", c.root, check=True).stdout
        summary = c.wait(job, 60)
    says = ("the coordinator refused worker-0: worker-0's config differs", "ps.count = 2 there, 1 in the coordinator's")
    assert all(s in phase for s in says) and "is it running?" not in phase, phase
    assert summary["state"] == "failed" and all(s in summary["error"] for s in says), summary
    assert summary["error"].count("ps.count = 2 there") == 1 and "is it running?" not in summary["error"], summary
    # `mariana status` lists it, with the reason, under the services
    assert any(line.startswith("refused worker-0: worker-0's config differs") and "ps.count = 2 there" in line
               for line in table.splitlines()), table


@pytest.mark.timeout(300)
def test_a_job_is_not_resumed_by_a_coordinator_with_another_ps_count(tmp_path):
    """A job left running by a stopped coordinator fails when a coordinator restarted with
    another ps.count resumes it, saying so (it used to blame a shard that ran fine)."""
    generate_criteo(tmp_path / "train.tsv", 20_000, seed=5)
    with Cluster(tmp_path / "c", workers=1) as c:
        c.kill("worker-0", signal.SIGTERM)  # no worker: the job stays running, at 0 rows
        job = c.submit([tmp_path / "train.tsv"], tmp_path / "m", config={"hashing": {"bits": 16}})
        c.wait(job, 60, until=lambda s: s["state"] == "running")
        c.kill("coordinator-0", signal.SIGTERM)  # a running job is left running, to resume
        shards = [*c.cfg.ps.endpoints, f"tcp://127.0.0.1:{free_port()}"]
        config = variant(c, tmp_path / "ps2.toml", **{"ps.count": 2, "ps.metrics_ports": [], "ps.endpoints": shards})
        coord = run("coordinator", 0, config, tmp_path / "c" / "logs" / "coordinator-0.log")
        coord.mariana_name = "coordinator-0"
        c.restarted.append(coord)  # stopped with the cluster
        c.wait_http()
        summary = c.wait(job, 60)
        # the services that run with the old config: their heartbeats are refused, and status says why
        refused = c.wait_for(lambda: (lambda r: r if "ps-0" in r else None)(c.status()["refused"]), 30)
    assert "ps.count = 1 there, 2 in the coordinator's" in refused["ps-0"], refused
    assert summary["state"] == "failed", summary
    assert "started with ps.count = 1, and the coordinator restarted with ps.count = 2" in summary["error"], summary
    assert "submit it again" in summary["error"]
    assert time.time() - summary["ended"] < 120


@pytest.mark.timeout(300)
def test_train_in_cluster_mode_uses_a_deployed_cluster_it_has_no_cluster_json_of(tmp_path):
    """A cluster deployed host by host (or by systemd) has no cluster.json where `train --mode
    cluster` looks; its config names the coordinator's fixed ports. The job goes to that
    coordinator, instead of a temporary cluster on the same ports whose services knocked at
    it under the same names. Another job's temporary cluster there is refused, saying whose."""
    from mariana.services import launcher

    generate_criteo(tmp_path / "d.tsv", 5_000, seed=3)
    with Cluster(tmp_path / "c", workers=1) as c:
        config = variant(c, tmp_path / "host.toml", **{"cluster.dir": str(tmp_path / "elsewhere")})
        state = tmp_path / "c" / "cluster.json"
        state.rename(tmp_path / "away.json")  # as on a host where the services were started by hand
        try:
            proc = run_cli("train", "--mode", "cluster", "--cluster-config", config, "--data", tmp_path / "d.tsv",
                           "--out", tmp_path / "m", "--set", "hashing.bits=14")
            status = run_cli("status", "--config", config, "--json")  # by the config's fixed port
        finally:
            (tmp_path / "away.json").rename(state)
        jobs = c.request("GET", "/v1/jobs")[1]["jobs"]
    assert status.returncode == 0, status.stderr
    assert sorted(json.loads(status.stdout)["coordinator"]["services"]) == [
        "coordinator-0", "loader-0", "preprocess-0", "ps-0", "worker-0"], status.stdout[:2000]
    # the deployed cluster down: no temporary cluster on its endpoints (it would take its ports and services)
    down = run_cli("train", "--mode", "cluster", "--cluster-config", config, "--data", tmp_path / "d.tsv",
                   "--out", tmp_path / "m3")
    assert down.returncode == 2 and f"no coordinator answers at {c.info['http']}: this config names the " \
        "cluster's endpoints" in down.stderr, down.stderr[-2000:]
    assert "starting one" not in down.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"using the cluster whose coordinator answers at {c.info['http']}" in proc.stderr, proc.stderr[-3000:]
    assert "starting one" not in proc.stderr
    assert [(j["state"], j["data"]) for j in jobs] == [("done", [str(tmp_path / "d.tsv")])], jobs

    cfg = load_cluster_config(overrides={"cluster.dir": str(tmp_path / "t"), "cluster.base_port": free_base_port()},
                              env={})
    launcher.up(cfg, owner=os.getpid())  # as `train --mode cluster` does for its temporary cluster
    try:
        other = load_cluster_config(overrides={"cluster.dir": str(tmp_path / "t2"),
                                               "cluster.base_port": cfg.cluster.base_port}, env={})
        (tmp_path / "t2.toml").write_text(to_toml(other))
        proc = run_cli("train", "--mode", "cluster", "--cluster-config", tmp_path / "t2.toml", "--data",
                       tmp_path / "d.tsv", "--out", tmp_path / "m2")
    finally:
        launcher.down(str(tmp_path / "t"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is the temporary cluster of another job (pid {os.getpid()}" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "m2").exists()


@pytest.mark.timeout(240)
def test_a_process_that_lost_its_name_while_silent_stops_and_leaves_it_to_its_successor(tmp_path):
    """worker-0 stopped (SIGSTOP) longer than heartbeat_seconds; a new worker-0 is taken; the
    old one resumes: its heartbeats and leases are refused, and it exits 78 saying why. Its
    leases kept the name's last heartbeat fresh before, so a successor that died looked alive."""
    with Cluster(tmp_path / "c", workers=1) as c:  # heartbeat_seconds 2
        c.wait_for(lambda: len(c.status()["services"]) == 5, 60)
        old = c.pid("worker-0")
        os.kill(old, signal.SIGSTOP)
        try:
            config = variant(c, tmp_path / "w.toml", **{"worker.metrics_ports": []})
            new = run("worker", 0, config, tmp_path / "new.log")
            c.wait_for(lambda: c.status()["services"]["worker-0"]["pid"] == new.pid, 60)
        finally:
            os.kill(old, signal.SIGCONT)
        code = c.wait_gone(old, 30)
        log = (tmp_path / "c" / "logs" / "worker-0.log").read_text()
        alive = c.status()["services"]["worker-0"]
        new.send_signal(signal.SIGTERM)
        new.wait(30)
        gone = c.wait_for(lambda: (lambda s: s if not s["alive"] else None)(c.status()["services"]["worker-0"]), 30)
    assert code in (EX_CONFIG, None), code  # (None: not our child to reap; its log says the rest)
    assert "the coordinator took another process under its name while this one was silent" in log, log[-2000:]
    assert alive["pid"] == new.pid and alive["alive"], alive
    assert gone["pid"] == new.pid, gone  # the old one's leases did not keep the name alive
