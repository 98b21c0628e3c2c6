"""SIGTERM to a command, as `kill`, `timeout` or systemd send it to the process alone, stops
it as Ctrl-C does: its cleanup runs. The default action killed it where it stood: a
cluster job submitted by `train --mode cluster` went on and published, and the cluster
started for that job (redis, five services, a supervisor) was left running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT
from tests.integration.rankkill import children, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def cluster_train(tmp_path, data, cfg, log, env: dict | None = None) -> tuple[subprocess.Popen, list[int]]:
    """`train --mode cluster` of 50 epochs, started with no cluster up; returned once its job
    is submitted, with the processes it started for it (redis, the services, a supervisor)."""
    with open(log, "w") as err:
        client = subprocess.Popen([sys.executable, "-m", "mariana", "train", "--data", str(data), "--mode", "cluster",
                                   "--cluster-config", str(cfg), "--epochs", "50", "--set", "train.batch_size=64",
                                   "--out", str(tmp_path / "m")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                  env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 120
    while "submitted" not in log.read_text() and client.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    started = descendants(client.pid)
    if "submitted" not in log.read_text() or len(started) < 6:
        for pid in [client.pid, *started]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError((started, log.read_text()))
    return client, started


def test_sigterm_to_a_cluster_train_cancels_its_job_and_stops_the_cluster_it_started(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 200_000, seed=41)
    cfg = tmp_path / "cluster.toml"  # no cluster is up in its dir: the command starts one for the job
    cfg.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\nsupervise = true\n')
    log = tmp_path / "train.log"
    client, started = cluster_train(tmp_path, data, cfg, log)
    try:
        client.send_signal(signal.SIGTERM)
        assert client.wait(90) == 130
    finally:
        for pid in ([client.pid] if client.poll() is None else []) + [p for p in started if running(p)]:
            os.kill(pid, signal.SIGKILL)  # a failed test leaves nothing running
    text = log.read_text()
    assert "mariana: interrupted" in text and "Traceback" not in text, text
    deadline = time.monotonic() + 30
    while any(running(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in started if running(p)], text
    assert not (tmp_path / "m").exists() or not list((tmp_path / "m").glob("v0*")), text


def test_a_killed_cluster_train_leaves_no_cluster_running(tmp_path):
    """SIGKILL runs no cleanup: the cluster `train --mode cluster` started for its job (redis, the
    services) ran on for ever, its job with it. Its supervisor stops it once the command is gone,
    even with `cluster.supervise` off (then it restarts nothing)."""
    data = tmp_path / "train.tsv"
    generate_criteo(data, 100_000, seed=42)
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\nsupervise = false\n')
    log = tmp_path / "train.log"
    client, started = cluster_train(tmp_path, data, cfg, log, {"TMPDIR": str(tmp_path)})  # the temporary cluster's
    try:
        client.kill()
        client.wait(10)
        deadline = time.monotonic() + 30
        while any(running(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in started if running(p)]
    finally:
        for pid in ([client.pid] if client.poll() is None else []) + [p for p in started if running(p)]:
            os.kill(pid, signal.SIGKILL)  # a failed test leaves nothing running
    assert not left, log.read_text()
    (cluster_dir,) = tmp_path.glob("mariana-cluster-*")
    deadline = time.monotonic() + 30
    while "its state removed" not in (supervisor_log := (cluster_dir / "logs" / "supervisor.log").read_text()) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "which started this temporary cluster, is gone" in supervisor_log, supervisor_log
    # its logs stay, for a look; the shard's checkpoints, Redis's dump and the job store (nobody's now) do not
    assert sorted(p.name for p in cluster_dir.iterdir()) == ["logs"], list(cluster_dir.iterdir())
