"""`mariana train --mode cluster` polls the coordinator's HTTP API for its job: a coordinator
that stops answering for a while (the supervisor restarts a killed one within a second or
two, and it replays its journal) is waited for, not taken for a failed job."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mariana.services.launcher import free_port
from mariana.services.runtime import cluster_job


def answer(handler: BaseHTTPRequestHandler, status: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def serving(port: int, summary: dict) -> ThreadingHTTPServer:
    """A real HTTP server on loopback answering every GET with `summary` (the job's)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            answer(self, 200, summary)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


RUNNING = {"state": "running", "progress": {}, "phase": None}


def test_a_coordinator_that_is_away_for_a_while_is_waited_for(caplog):
    caplog.set_level("INFO")
    port = free_port()
    info = {"http": f"http://127.0.0.1:{port}"}
    first = serving(port, RUNNING)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(record=cluster_job.wait(info, "j1", None)))
    thread.start()
    time.sleep(0.7)
    first.shutdown()
    first.server_close()  # killed: nothing listens on its port
    time.sleep(1.5)
    second = serving(port, {"state": "done", "record": {"auc": 0.75}})  # restarted, the job ended meanwhile
    try:
        thread.join(10)
    finally:
        second.shutdown()
        second.server_close()
    assert got == {"record": {"auc": 0.75}}
    assert "unreachable" in caplog.text and "the coordinator answers again after" in caplog.text


def test_a_coordinator_away_for_longer_than_the_bound_is_an_error_that_says_the_job_goes_on(monkeypatch):
    monkeypatch.setattr(cluster_job, "AWAY_SECONDS", 0.5)
    info = {"http": f"http://127.0.0.1:{free_port()}"}  # nothing ever listens
    with pytest.raises(cluster_job.Unreachable, match="for 0.5s; job j1 goes on when the cluster is up again"):
        cluster_job.wait(info, "j1", None)


def test_a_lost_temporary_cluster_is_said_to_end_its_job_not_to_go_on(monkeypatch):
    """The cluster the command started for its job is stopped when the command gives up on it:
    "goes on when the cluster is up again (`mariana up`)" sent the user to a cluster that was gone."""
    monkeypatch.setattr(cluster_job, "AWAY_SECONDS", 0.5)
    info = {"http": f"http://127.0.0.1:{free_port()}", "temporary": True}
    with pytest.raises(cluster_job.Unreachable) as e:
        cluster_job.wait(info, "j1", None)
    assert "job j1 ends with the temporary cluster" in str(e.value) and "mariana up" not in str(e.value)


def test_a_cluster_up_again_on_other_ports_is_followed(tmp_path, caplog):
    """`mariana down` then `up` (the supervisor's restart keeps the ports; a new `up` picks
    others): the job went on in the new coordinator and ended, but its client polled the old
    port for two minutes and exited 2 ("unreachable"), a cluster retrain recorded "failed"
    and left the version its job wrote ungated. The client follows cluster.json now."""
    from mariana.services.runtime import procs

    caplog.set_level("INFO")
    port = free_port()
    new = serving(port, {"state": "done", "record": {"auc": 0.75}})
    state = {"dir": str(tmp_path), "http": f"http://127.0.0.1:{port}", "token": None, "redis": None,
             "services": [{"name": "coordinator-0", "role": "coordinator", "index": 0, "pid": os.getpid(),
                           "start": procs.start_time(os.getpid())}]}
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    info = {"http": f"http://127.0.0.1:{free_port()}", "dir": str(tmp_path)}  # the old coordinator's: gone
    try:
        assert cluster_job.wait(info, "j1", None) == {"auc": 0.75}
    finally:
        new.shutdown()
        new.server_close()
    assert info["http"] == state["http"] and "is up again, its coordinator at" in caplog.text


class JobsServer(BaseHTTPRequestHandler):
    """POST /v1/jobs -> {"job": "j7"}, counting the posts (a job must not be sent twice)."""
    posts: list = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        JobsServer.posts.append(self.path)
        answer(self, 201, {"job": "j7"})

    def log_message(self, *args):
        pass


def test_a_job_sent_while_the_coordinator_starts_listening_is_sent_again_once_it_listens(caplog):
    """A restarted coordinator's process runs a moment before it listens: the submit failed at
    once ("Connection refused", exit 2), while `wait` rode out the same restart. A refused
    connection never reached a coordinator, so it is tried again (the job is sent once)."""
    caplog.set_level("INFO")
    port, JobsServer.posts = free_port(), []
    info = {"http": f"http://127.0.0.1:{port}", "dir": None}
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(job=cluster_job.submit(info, {"data": []})))
    thread.start()
    time.sleep(1.2)  # refused meanwhile
    server = ThreadingHTTPServer(("127.0.0.1", port), JobsServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        thread.join(10)
    finally:
        server.shutdown()
        server.server_close()
    assert got == {"job": "j7"} and JobsServer.posts == ["/v1/jobs"]
    assert "trying again for up to" in caplog.text


def test_a_cluster_whose_coordinator_is_being_restarted_is_waited_for_not_replaced(tmp_path, caplog):
    """cluster.json there and its supervisor running, its coordinator dead (the supervisor's
    back-off after deaths in a row): the job ran on a temporary 1-worker cluster of its own,
    exit 0, said only in a log line. It waits for the coordinator now; a cluster stopped
    meanwhile is an error, not a temporary cluster either."""
    from mariana.services.runtime import procs
    from mariana.services.runtime.config import load_cluster_config

    caplog.set_level("INFO")
    me = {"pid": os.getpid(), "start": procs.start_time(os.getpid())}
    dead = {"pid": os.getpid() + 10**6, "start": None}
    coordinator = {"name": "coordinator-0", "role": "coordinator", "index": 0}
    state = {"dir": str(tmp_path), "http": "http://127.0.0.1:1", "token": None, "redis": None, "supervisor": me,
             "services": [{**coordinator, **dead}]}
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    cfg = load_cluster_config(overrides={"cluster.dir": str(tmp_path)}, env={})

    def restarted():
        time.sleep(1.0)
        (tmp_path / "cluster.json").write_text(json.dumps({**state, "services": [{**coordinator, **me}]}))

    threading.Thread(target=restarted).start()
    info = cluster_job.coordinator_back(cfg)
    assert info is not None and info["dir"] == str(tmp_path) and info["services"][0]["pid"] == os.getpid()
    assert "is up, but its coordinator is not running: waiting up to" in caplog.text
    (tmp_path / "cluster.json").write_text(json.dumps({**state, "supervisor": dead}))
    assert cluster_job.coordinator_back(cfg) is None  # no supervisor: nothing restarts it (a stale record)
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    threading.Timer(0.8, lambda: (tmp_path / "cluster.json").unlink()).start()  # `mariana down` meanwhile
    with pytest.raises(cluster_job.Unreachable, match="stopped while its coordinator was down"):
        cluster_job.coordinator_back(cfg)


def test_a_base_port_cluster_whose_coordinator_is_down_is_not_replaced_on_its_ports(tmp_path):
    """A cluster deployed on cluster.base_port (the systemd layout), its coordinator down: a
    temporary cluster took the coordinator's free ports, and the deployed shard registered with
    it. The config's other ports answering says a cluster holds them: refused, naming them."""
    import socket

    from mariana.services.runtime.config import load_cluster_config
    from tests.integration.cluster import free_base_port

    cfg = load_cluster_config(overrides={"cluster.dir": str(tmp_path / "c"), "cluster.base_port": free_base_port()},
                              env={})
    assert cluster_job.held_ports(cfg) == []
    ps = socket.socket()
    ps.bind(("127.0.0.1", int(cfg.ps.endpoints[0].rpartition(":")[2])))
    ps.listen()
    try:
        assert cluster_job.held_ports(cfg) == [f"ps.endpoints[0] ({cfg.cluster.base_port + 10})"]
        with pytest.raises(cluster_job.Unreachable, match=r"no coordinator answers at http://127.0.0.1:\d+, but ports "
                           r"of this config's cluster are taken \(ps.endpoints\[0\]"):
            with cluster_job.cluster_session(cfg):
                pass
    finally:
        ps.close()
    assert not (tmp_path / "c").exists()
