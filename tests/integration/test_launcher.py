"""The local-cluster launcher with real processes: redis-server on free ports,
`mariana` subprocesses, and plain processes standing in for recorded services."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mariana.services import cli
from mariana.services.launcher import RedisServer, find_redis_server, free_port, resolve
from mariana.services.runtime.procs import start_time
from mariana.services.runtime.config import ROLES, load_cluster_config, to_toml
from mariana.sparse.errors import MarianaError
from tests.conftest import run_cli
from tests.integration.cluster import free_base_port

# A process that ignores SIGTERM, so only SIGKILL stops it; it says when it is ready.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"


def error_line(proc, code: int = 2) -> str:
    """The exit code is `code`, no traceback; the last stderr line."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def started(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def write_state(root, recs: list[tuple[str, subprocess.Popen, int | None]]) -> None:
    """A cluster.json as `mariana up` writes it, recording (name, process, start time)."""
    services = [{"name": name, "role": name.split("-")[0], "index": 0, "pid": p.pid, "start": start,
                 "cmd": p.args, "log": str(root / f"{name}.log")} for name, p, start in recs]
    state = {"dir": str(root), "config": str(root / "cluster.toml"), "token": "t", "started_at": time.time(),
             "http": f"http://127.0.0.1:{free_port()}", "redis": None, "services": services}
    (root / "cluster.json").write_text(json.dumps(state))


def processes_naming(text: str) -> list[int]:
    """Pids of running processes whose command line contains text."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:  # exited while we looked
            pass
    return pids


def answers_ping(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)) as client:
            return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


# ---- redis --------------------------------------------------------------------------

def test_find_redis_server_finds_an_executable():
    path = find_redis_server(load_cluster_config(env={}))
    assert os.path.isfile(path) and os.access(path, os.X_OK)


def test_find_redis_server_names_a_bad_binary(tmp_path):
    cfg = load_cluster_config(overrides={"redis.binary": str(tmp_path / "nope")}, env={})
    with pytest.raises(MarianaError, match=r"redis.binary = .*nope.*not an executable"):
        find_redis_server(cfg)


def test_redis_server_starts_answers_and_stops(tmp_path):
    port = free_port()
    server = RedisServer("127.0.0.1", port, str(tmp_path / "redis")).start()
    try:
        server.wait_ready(10.0)
        with redis.Redis(port=port) as client:
            assert client.ping()
            client.set("k", b"v")
            assert client.get("k") == b"v"
            assert client.config_get("save") == {"save": ""}
    finally:
        code = server.stop()
    assert code == 0
    assert not os.path.exists(f"/proc/{server.pid}")  # exited and reaped
    assert not answers_ping(port)


def test_redis_server_reports_a_taken_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = RedisServer("127.0.0.1", taken.getsockname()[1], str(tmp_path / "redis")).start()
        try:
            with pytest.raises(MarianaError, match="exited with code"):
                server.wait_ready(10.0)
        finally:
            server.stop()


# ---- config ---------------------------------------------------------------------------

def test_resolve_fills_every_endpoint_with_distinct_ports(tmp_path):
    cfg = load_cluster_config(overrides={"cluster.dir": str(tmp_path), "ps.count": 3, "preprocess.count": 2},
                              env={})
    r = resolve(cfg)
    endpoints = [r.coordinator.endpoint, r.redis.url, *r.ps.endpoints, *r.preprocess.endpoints]
    ports = [int(e.rsplit(":", 1)[1].split("/")[0]) for e in endpoints] + [r.coordinator.http_port]
    assert len(ports) == 8 and len(set(ports)) == 8 and all(p > 0 for p in ports)
    assert r.redis.url.startswith("redis://127.0.0.1:") and r.redis.url.endswith("/0")
    assert all(e.startswith("tcp://127.0.0.1:") for e in endpoints if e is not r.redis.url)
    assert len(r.coordinator.token) >= 32
    assert cfg.coordinator.endpoint == "" and cfg.coordinator.token == ""  # the input is left alone


def test_resolve_keeps_what_is_given():
    cfg = load_cluster_config(overrides={"cluster.base_port": 7000, "coordinator.token": "secret"}, env={})
    r = resolve(cfg)
    assert (r.coordinator.endpoint, r.coordinator.http_port, r.coordinator.token) == ("tcp://127.0.0.1:7000",
                                                                                    7001, "secret")
    given = load_cluster_config(overrides={"redis.embedded": False, "redis.url": "redis://db:6379/2"}, env={})
    assert resolve(given).redis.url == "redis://db:6379/2"
    with pytest.raises(MarianaError, match="redis.url"):  # not embedded and not given: nothing to pick
        resolve(load_cluster_config(overrides={"redis.embedded": False}, env={}))


def test_resolved_config_round_trips_through_toml(tmp_path):
    r = resolve(load_cluster_config(overrides={"cluster.dir": str(tmp_path), "worker.count": 3}, env={}))
    path = tmp_path / "cluster.toml"
    path.write_text(to_toml(r))
    assert load_cluster_config(path, env={}) == r


def test_cli_roles_are_the_config_roles():
    assert cli.ROLES == ROLES


# ---- cli ----------------------------------------------------------------------------------

def test_run_rejects_an_index_out_of_range(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("[cluster]\nbase_port = 7000\n[ps]\ncount = 1\n")
    line = error_line(run_cli("run", "ps", "--config", path, "--index", "5"))
    assert line.startswith("mariana: error: --index 5") and "0..0" in line


def test_down_and_status_without_a_cluster(tmp_path):
    assert "no cluster is up in" in error_line(run_cli("down", "--dir", tmp_path))
    assert "no cluster is up in" in error_line(run_cli("status", "--dir", tmp_path), code=1)
    proc = run_cli("status", "--dir", tmp_path, "--json")  # a document on stdout, as for a silent coordinator
    assert proc.returncode == 1 and json.loads(proc.stdout)["error"].startswith(f"no cluster is up in {tmp_path}")


def test_a_cluster_json_or_a_status_url_of_another_shape_is_one_line_not_a_traceback(tmp_path):
    """cluster.json holding JSON of another shape, and `status --url` at a server that answers
    JSON but is no coordinator, were an AttributeError, KeyError or TypeError; the web UI's
    address given to --url was "unreachable: 404"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.conftest import run_cli_cases

    answers = {"/a/v1/status": b"[]", "/b/v1/status": b'{"services": 5}', "/c/v1/status": b'{"services": {}}',
               "/c/v1/models": b'{"models": [{"dir": "/m", "versions": []}, 7]}'}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = answers.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cases = []
    for i, state in enumerate(("[]", "{}", '{"dir": "/x", "services": [{"pid": "12"}]}')):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "cluster.json").write_text(state)
        cases += [["status", "--dir", tmp_path / str(i)], ["down", "--dir", tmp_path / str(i)]]
    cases += [["status", "--url", f"{url}/a"], ["status", "--url", f"{url}/b"], ["status", "--url", f"{url}/c/ui/"]]
    try:
        got = run_cli_cases(cases)
    finally:
        server.shutdown()
        server.server_close()
    for code, err in got[:6]:
        assert code == 2 and "cluster.json: JSON, but no cluster's state" in err and "Traceback" not in err, err
    assert [code for code, _ in got[6:]] == [1, 1, 0] and not any(err for _, err in got[6:]), got[6:]


@pytest.mark.slow
def test_up_that_fails_leaves_nothing_running(tmp_path):
    """The coordinator's ports are taken, so it cannot start: up stops everything it started."""
    with socket.socket() as zmq_port, socket.socket() as http_port:
        for s in (zmq_port, http_port):
            s.bind(("127.0.0.1", 0))
            s.listen()
        config = tmp_path / "in.toml"
        config.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\nstart_seconds = 20\n'
                          f'[coordinator]\nendpoint = "tcp://127.0.0.1:{zmq_port.getsockname()[1]}"\n'
                          f'http_port = {http_port.getsockname()[1]}\n')
        proc = run_cli("up", "--config", config, "--ps", "2")
    # The message goes on with log tails, which may hold the failed service's traceback.
    assert proc.returncode == 2 and "mariana: error: cluster in" in proc.stderr, proc.stderr
    assert "did not start" in proc.stderr and "coordinator-0" in proc.stderr
    assert not (tmp_path / "c" / "cluster.json").exists()
    assert processes_naming(str(tmp_path / "c" / "cluster.toml")) == []
    assert processes_naming(str(tmp_path / "c" / "redis")) == []
    written = load_cluster_config(tmp_path / "c" / "cluster.toml", env={})
    assert written.ps.count == 2 and written.coordinator.token  # the flags, and a token
    assert oct((tmp_path / "c" / "cluster.toml").stat().st_mode & 0o777) == "0o600"


def test_an_up_while_another_starts_a_cluster_in_the_dir_is_refused(tmp_path):
    """Two `up`s at once in one dir both started a cluster there (2 of 9 tries), sharing its
    cluster.toml and job store; `down` stopped one, and the other ran on, recorded nowhere."""
    from mariana.services.launcher import _starting

    with _starting(str(tmp_path / "c")):  # what the first `up` holds until its cluster is up
        line = error_line(run_cli("up", "--dir", tmp_path / "c"))
    assert line == (f"mariana: error: another `mariana up` is starting a cluster in {tmp_path / 'c'} right now; "
                    "wait for it, then use that cluster (or `mariana down --dir` it)")
    assert not (tmp_path / "c" / "cluster.json").exists() and processes_naming(str(tmp_path / "c")) == []
    (tmp_path / "afile").write_text("")
    assert error_line(run_cli("up", "--dir", tmp_path / "afile")).endswith("afile: not a directory (the cluster's "
                                                                            "dir: its state, config and logs go there)")


def test_a_hangup_during_the_start_stops_what_was_started(tmp_path):
    """SIGHUP to `up` (its terminal or ssh session gone) left the half-started cluster running
    with no supervisor; SIGINT and SIGTERM stopped it. It is stopped as they stop it now."""
    d = tmp_path / "c"
    up = subprocess.Popen([sys.executable, "-m", "mariana", "up", "--dir", str(d)], stderr=subprocess.PIPE, text=True,
                          # as from a terminal: a suite run under nohup passes SIGHUP on ignored, which `up` leaves so
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (d / "cluster.json").exists() or "coordinator-0" not in (d / "cluster.json").read_text():
            assert up.poll() is None and time.monotonic() < deadline, up.stderr.read() if up.poll() else "slow"
            time.sleep(0.02)
        up.send_signal(signal.SIGHUP)
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
        if (d / "cluster.json").exists():  # a failed test leaves no cluster running
            run_cli("down", "--dir", d)
    assert up.returncode == 130 and "mariana: interrupted: stopped by SIGHUP" in err, (up.returncode, err[-2000:])
    assert not (d / "cluster.json").exists() and processes_naming(str(d)) == []


def test_a_cluster_whose_external_redis_does_not_answer_says_so_at_up_and_in_status(tmp_path):
    """With redis.embedded off and nothing at redis.url, `up` said the cluster was up and
    `status` listed every service alive, with no word of Redis (its /v1/status had it)."""
    config = tmp_path / "c.toml"
    config.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\n[redis]\nembedded = false\n'
                      f'url = "redis://127.0.0.1:{free_port()}/0"\n')
    try:
        up = run_cli("up", "--config", config, "--ps", "1", "--workers", "1", "--preprocess", "1")
        assert up.returncode == 0, up.stderr
        assert "the cluster is up, but its Redis does not answer (" in up.stderr, up.stderr
        shown = run_cli("status", "--dir", tmp_path / "c")
        assert "redis: does not answer (" in shown.stdout and "jobs wait for it (redis.url)" in shown.stdout
    finally:
        run_cli("down", "--dir", tmp_path / "c")
    # a Redis that answers, refusing (a db it does not have) or only INFO (an ACL): said as what it is. Both
    # read "does not answer ... jobs wait for it", though jobs failed at once in the first, and ran in the second
    with RedisServer("127.0.0.1", free_port(), str(tmp_path / "r")) as server:
        server.wait_ready()
        redis.Redis(port=server.port).execute_command("ACL", "SETUSER", "noinfo", "on", ">pw12345", "~*", "&*",
                                                      "+@all", "-info")
        for name, url, says in (("db", f"redis://127.0.0.1:{server.port}/99", "refused a command: DB index is out "
                                 "of range: jobs fail until redis.url (or the Redis's ACL) is fixed"),
                                ("acl", f"redis://noinfo:pw12345@127.0.0.1:{server.port}/0", None)):
            config.write_text(f'[cluster]\ndir = "{tmp_path / name}"\n[redis]\nembedded = false\nurl = "{url}"\n')
            try:
                up = run_cli("up", "--config", config, "--ps", "1", "--workers", "1", "--preprocess", "1")
                shown = run_cli("status", "--dir", tmp_path / name).stdout
            finally:
                run_cli("down", "--dir", tmp_path / name)
            assert up.returncode == 0, up.stderr
            if says:
                assert f"the cluster is up, but its Redis {says}" in up.stderr and f"redis: {says}" in shown, shown
            else:
                assert "its Redis" not in up.stderr and "redis:" not in shown and "pw12345" not in shown, shown
    for bad, says in (("127.0.0.1:5701", "give the coordinator's address with its scheme, e.g. http://127.0.0.1:5701"),
                      ("http://127.0.0.1:99999", "the port is not in 0..65535")):  # was: "unreachable", exit 1
        assert error_line(run_cli("status", "--url", bad)) == f"mariana: error: --url {bad!r}: {says}"


def test_a_start_interrupted_before_a_process_is_recorded_stops_that_process_too(tmp_path):
    """A Ctrl-C between a service's start and its record in cluster.json left it running (a
    coordinator held its ports for good) and `down` knew nothing of it."""
    from mariana.services import launcher

    before = set(launcher._CHILDREN)
    recorded = launcher._popen([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "a.log"))
    unrecorded = launcher._popen([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "b.log"))
    state = {"redis": None, "services": [{"pid": recorded.pid}]}
    launcher._stop_unrecorded(state, before)
    assert unrecorded.poll() is not None and recorded.poll() is None  # the recorded one is _stop_all's
    recorded.kill()
    recorded.wait()


@pytest.mark.slow
def test_a_saved_job_this_version_cannot_read_does_not_stop_the_coordinator(tmp_path):
    """A check added to job specs since a job was saved (a batch bound, say) makes its spec
    fail to read: the coordinator starts anyway, leaves the job out with a warning, and a
    job that was running is saved as failed, saying why. (It used to exit 1 at every start,
    restarted by the supervisor for good, until someone edited the SQLite file.)"""
    from mariana.services.jobstore import JobStore

    state = tmp_path / "c" / "coordinator"
    spec = {"config": {"train": {"batch_size": 10 ** 10}}, "schema": {}}
    with JobStore(str(state)) as store:
        for job, st in (("j-done", "done"), ("j-running", "running")):
            store.save_job(job, {"id": job, "state": st, "spec": spec, "request": {}, "submitted": 1.0}, 1.0)
    proc = run_cli("up", "--dir", tmp_path / "c")
    try:
        assert proc.returncode == 0, proc.stderr
        log = (tmp_path / "c" / "logs" / "coordinator-0.log").read_text()
        assert "job j-done (done)" in log and "does not read under this version" in log, log
        assert "job j-running (running)" in log and "marked failed" in log, log
    finally:
        run_cli("down", "--dir", tmp_path / "c")
    with JobStore(str(state)) as store:
        saved = {d["id"]: d for d in store.load_jobs()}
    assert saved["j-done"]["state"] == "done"
    assert saved["j-running"]["state"] == "failed" and "its saved spec does not read" in saved["j-running"]["error"]


def test_down_stops_recorded_processes_and_kills_stubborn_ones(tmp_path):
    with started(SLEEPER) as worker, started(STUBBORN) as coordinator:
        write_state(tmp_path, [("coordinator-0", coordinator, start_time(coordinator.pid)),
                               ("worker-0", worker, start_time(worker.pid))])
        assert "already up" in error_line(run_cli("up", "--dir", tmp_path))

        st = run_cli("status", "--dir", tmp_path)  # the coordinator's HTTP port answers nothing
        assert st.returncode == 1 and "unreachable" in st.stdout and str(worker.pid) in st.stdout, st.stdout
        st = json.loads(run_cli("status", "--dir", tmp_path, "--json").stdout)
        assert st["processes"]["worker-0"] == {"role": "worker", "index": 0, "pid": worker.pid, "running": True,
                                               "restarts": 0, "last_exit": None}

        proc = run_cli("down", "--dir", tmp_path, "--timeout", "1")
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout)
        assert (summary["stopped"], summary["killed"], summary["not_running"]) == (["worker-0"],
                                                                                 ["coordinator-0"], [])
        assert worker.wait(5) == -signal.SIGTERM and coordinator.wait(5) == -signal.SIGKILL
    assert not (tmp_path / "cluster.json").exists()


def test_down_leaves_a_reused_pid_alone(tmp_path):
    """A cluster.json outliving a reboot may name pids that now belong to others."""
    with started(SLEEPER) as other:
        write_state(tmp_path, [("coordinator-0", other, start_time(other.pid) - 1)])
        proc = run_cli("status", "--dir", tmp_path)
        assert "none of the processes" in error_line(proc, code=1)
        summary = json.loads(run_cli("down", "--dir", tmp_path).stdout)
        assert summary["not_running"] == ["coordinator-0"] and summary["stopped"] == []
        assert other.poll() is None  # still running
        other.kill()


def test_a_temporary_cluster_on_fixed_ports_that_are_taken_says_why_and_what_to_do(tmp_path):
    """Jobs started at once with `cluster.base_port` set and no cluster up each start a
    temporary cluster on the same ports: all but the first failed on redis-server's bind
    (an exploratory run), with nothing said of base_port."""
    from mariana.sparse.synth import generate_criteo

    generate_criteo(tmp_path / "d.tsv", 500, seed=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        base = taken.getsockname()[1] - 2  # Redis's port, base + 2, is the one taken
        config = tmp_path / "c.toml"
        config.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\nbase_port = {base}\n')
        proc = run_cli("train", "--mode", "cluster", "--cluster-config", config, "--data", tmp_path / "d.tsv",
                       "--out", tmp_path / "m", env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 2 and "in use" in proc.stderr, proc.stderr
    assert f"(cluster.base_port = {base} gives a temporary cluster fixed ports" in proc.stderr, proc.stderr


def test_up_on_fixed_ports_another_cluster_holds_is_refused_naming_it(tmp_path):
    """With Redis outside the cluster (nothing of `up`'s own binds first), a second `up` on
    the same fixed ports in another dir said "cluster up" (an exploratory upgrade run): the
    services it waited for were the first cluster's, while its own failed to bind, again and
    again. It is refused before any process starts, naming the cluster that holds the ports."""
    from mariana.services import launcher

    base = free_base_port()
    redis_server = RedisServer("127.0.0.1", free_port(), str(tmp_path / "redis"))
    redis_server.start().wait_ready()
    settings = {"cluster.base_port": base, "redis.embedded": False, "redis.url": redis_server.url,
                "cluster.supervise": False}
    try:
        launcher.up(load_cluster_config(overrides={**settings, "cluster.dir": str(tmp_path / "a")}, env={}))
        try:
            with pytest.raises(MarianaError) as e:
                launcher.up(load_cluster_config(overrides={**settings, "cluster.dir": str(tmp_path / "b")}, env={}))
            assert f"a coordinator already answers at http://127.0.0.1:{base + 1} (its cluster.dir: " \
                   f"{tmp_path / 'a'})" in str(e.value), str(e.value)
            assert not (tmp_path / "b" / "cluster.json").exists() and not (tmp_path / "b" / "logs").exists()
        finally:
            launcher.down(str(tmp_path / "a"))
    finally:
        redis_server.stop()


@pytest.mark.slow
def test_a_free_port_taken_before_its_service_binds_starts_the_cluster_again_on_others(tmp_path, monkeypatch, caplog):
    """Parallel clusters of the suite: a port `up` chose was taken by another process before
    the loader bound it, and the cluster (and the job) failed: "address already in use"."""
    from mariana.services import launcher

    real, chosen = launcher._fill_free_ports, []

    def fill(cfg):
        real(cfg)
        if not chosen:  # the first start's loader finds its metrics port taken
            cfg.loader.metrics_port = taken.getsockname()[1]
        chosen.append(cfg.loader.metrics_port)

    monkeypatch.setattr(launcher, "_fill_free_ports", fill)
    cfg = load_cluster_config(overrides={"cluster.dir": str(tmp_path / "c"), "cluster.supervise": False}, env={})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            launcher.up(cfg)
        finally:
            launcher.down(str(tmp_path / "c"))
    assert len(chosen) == 2 and chosen[0] != chosen[1], chosen
    assert "a port chosen for the cluster was taken meanwhile (start 1 of 3)" in caplog.text
