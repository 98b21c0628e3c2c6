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


def serving(port: int, summary: dict) -> ThreadingHTTPServer:
    """A real HTTP server on loopback answering every GET with `summary` (the job's)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(summary).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

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
