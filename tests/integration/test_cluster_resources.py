"""A cluster job whose resources fail it: a Redis that is full or refuses the credentials, a
shard that is not running. Each fails the job with a line that says what is wrong (or, while
it may still come back, says what the job waits for), never a job that sits at "0 rows".
Real processes and a real redis-server (tests/integration/cluster.py)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import redis

from mariana.services.launcher import free_port
from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

JOB = {"hashing": {"bits": 16}, "train": {"batch_size": 1024, "epochs": 2}, "data": {"block_bytes": 131072},
       "model": {"kind": "lr"}}
SECRET = "s3kr1t-in-the-url"  # must never show in an error, a log line, or the HTTP API
SERVICE_LOGS = ("coordinator-0", "loader-0", "preprocess-0", "worker-0", "ps-0")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("resources")
    generate_criteo(d / "train.tsv", 30_000, seed=21)
    generate_criteo(d / "test.tsv", 2_000, seed=22)
    return {"train": d / "train.tsv", "test": d / "test.tsv"}


def admin(c: Cluster, password: str | None = None) -> redis.Redis:
    """A client of the cluster's Redis, past whatever redis.url says."""
    port = int(c.cfg.redis.url.rsplit(":", 1)[1].split("/")[0])
    return redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5)


def failed(c: Cluster, job: str, timeout: float) -> dict:
    summary = c.wait(job, timeout)
    assert summary["state"] == "failed", f"{summary}\n{c.logs()}"
    return summary


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_full_redis_fails_the_job_and_preprocess_goes_on(data, tmp_path):
    """maxmemory reached (noeviction): the write is refused; the job fails saying so (it sat at
    "0 rows" while preprocess died of a raw OutOfMemoryError and restarted again and again)."""
    with Cluster(tmp_path / "c") as c:
        r = admin(c)
        r.config_set("maxmemory", "1mb")  # the default policy, noeviction: writes past it are refused
        try:
            pid = c.pid("preprocess-0")
            job = c.submit([data["train"]], tmp_path / "m", [data["test"]], JOB)
            summary = failed(c, job, 45)
            time.sleep(1.0)  # preprocess has had its chunks in hand refused too
            log = (c.root / "logs" / "preprocess-0.log").read_text()
            preprocess_alive = alive(pid)
        finally:
            r.config_set("maxmemory", "0")
    assert "refused a write: OOM command not allowed" in summary["error"], summary
    assert "raise its maxmemory, or lower cache.max_bytes" in summary["error"], summary
    assert preprocess_alive, log[-3000:]
    assert "Traceback" not in log and "refused a write" in log, log[-3000:]


@pytest.mark.timeout(120)
def test_a_wrong_redis_password_fails_the_job_at_once_and_is_never_shown(data, tmp_path):
    """A password in redis.url that Redis refuses: not an outage to wait out for redis.retry_seconds
    (60 s here) but an error at once; and the password shows nowhere (the job's error, /v1/jobs,
    /v1/status, the services' logs), the URL with *** in its place."""
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"
    with Cluster(tmp_path / "c", **{"redis.url": url}) as c:
        r = admin(c)
        r.config_set("requirepass", "the-real-one")
        r = admin(c, "the-real-one")
        r.client_kill_filter(_type="normal", skipme=True)  # connections opened before it go again
        t0 = time.monotonic()
        job = c.submit([data["train"]], tmp_path / "m", [data["test"]], JOB)
        summary = failed(c, job, 30)
        seconds = time.monotonic() - t0
        shown = json.dumps([c.request("GET", "/v1/jobs")[1], c.status(), c.job(job)])
        logs = {n: (c.root / "logs" / f"{n}.log").read_text() for n in SERVICE_LOGS}
        r.config_set("requirepass", "")
    assert "refused the credentials in redis.url" in summary["error"], summary
    assert url.replace(SECRET, "***") in summary["error"], summary
    assert seconds < 20, seconds
    assert SECRET not in shown
    assert [n for n, text in logs.items() if SECRET in text] == []


@pytest.mark.timeout(120)
def test_redis_requiring_a_password_mid_job_fails_the_job_at_once(data, tmp_path):
    """`config set requirepass` while a job trains: every new connection is refused; the job
    fails at once with that line instead of each service waiting it out and restarting."""
    with Cluster(tmp_path / "c") as c:
        job = c.submit([data["train"]], tmp_path / "m", [data["test"]], JOB)
        c.wait(job, 60, until=lambda s: s["state"] != "running" or s["progress"]["rows_total"] > 0)
        r = admin(c)
        r.config_set("requirepass", "sekret")
        r = admin(c, "sekret")
        r.client_kill_filter(_type="normal", skipme=True)
        t0 = time.monotonic()
        summary = failed(c, job, 30)
        seconds = time.monotonic() - t0
        r.config_set("requirepass", "")
    # redis.url gives no password: "refused the credentials in redis.url" sent the user to credentials it had none of
    assert "requires a password, and redis.url gives none" in summary["error"], summary
    assert seconds < 20, seconds


@pytest.mark.timeout(120)
def test_a_worker_refused_its_reads_fails_the_job(data, tmp_path):
    """Redis refuses the worker's MGET (an ACL without it) while writes and PINGs go through:
    the worker says so and the job fails with its line (the worker died of it, and the job
    waited for one that could read)."""
    with Cluster(tmp_path / "c") as c:
        r = admin(c)
        r.execute_command("ACL", "SETUSER", "default", "-mget")
        try:
            pid = c.pid("worker-0")
            job = c.submit([data["train"]], tmp_path / "m", [data["test"]], JOB)
            summary = failed(c, job, 30)
            worker_alive = alive(pid)
        finally:
            r.execute_command("ACL", "SETUSER", "default", "+@all")
    assert summary["error"].startswith("worker-0: reading "), summary  # "... 8 batches: the sample cache's ..."
    assert "does not let the user in redis.url run a command" in summary["error"], summary
    assert worker_alive


@pytest.mark.timeout(120)
def test_a_job_waiting_for_a_dead_shard_says_so_and_goes_on_when_it_is_back(data, tmp_path):
    """ps-0 dead when the job is submitted: its phase says what it waits for (where the client
    and `mariana status` show it); once ps-0 is back the phase clears and the job is done."""
    with Cluster(tmp_path / "c") as c:
        c.kill("ps-0", signal.SIGTERM)
        job = c.submit([data["train"]], tmp_path / "m", [data["test"]], JOB)
        waiting = c.wait(job, 30, until=lambda s: (s["phase"] or "").startswith("waiting for ps-0"))
        listed = c.status()["jobs"][0]
        c.restart("ps-0")
        going = c.wait(job, 60, until=lambda s: s["state"] != "running" or s["progress"]["rows_total"] > 0)
        summary = c.wait(job, 60)
    assert waiting["state"] == "running" and "(is it running?)" in waiting["phase"], waiting
    assert listed["id"] == job and listed["phase"].startswith("waiting for ps-0"), listed
    assert going["phase"] is None or not going["phase"].startswith("waiting"), going
    assert summary["state"] == "done", summary


@pytest.mark.timeout(150)
def test_the_client_shows_what_a_job_waits_for_and_it_fails_when_nothing_comes(data, tmp_path):
    """`train --mode cluster` with ps-0 and worker-0 dead: the client prints what the job waits
    for (it printed "epoch 1/2: 0 rows" for minutes), and after cluster.start_seconds of it the
    job fails with that line."""
    with Cluster(tmp_path / "c", **{"cluster.start_seconds": 8.0}) as c:
        c.kill("ps-0", signal.SIGTERM)
        c.kill("worker-0", signal.SIGTERM)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "mariana", "train", "--mode", "cluster", "--cluster-config",
                               c.info["config"], "--data", str(data["train"]), "--test-data", str(data["test"]),
                               "--out", str(tmp_path / "m"), "--model", "lr", "--epochs", "2",
                               "--set", "hashing.bits=16"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        seconds = time.monotonic() - t0
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "job: waiting for ps-0:" in proc.stderr, proc.stderr[-3000:]
    assert "gave up waiting for ps-0 after 8s (cluster.start_seconds)" in proc.stderr, proc.stderr[-3000:]
    assert seconds < 100, seconds


@pytest.mark.timeout(150)
def test_a_client_whose_cluster_is_taken_down_says_so_at_once(data, tmp_path):
    """`mariana down` while `train --mode cluster` waited on its job: the client said the
    coordinator was away and waited 120 s for a restart nobody would make. The cluster's
    cluster.json is gone: it says the cluster was stopped, and that the job goes on when it
    is up again, within a poll or two."""
    from mariana.services import launcher

    c, proc = Cluster(tmp_path / "c", **{"cluster.start_seconds": 600.0}).__enter__(), None
    try:
        c.kill("worker-0", signal.SIGTERM)  # the job waits at 0 rows
        log = tmp_path / "train.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "mariana", "train", "--mode", "cluster", "--cluster-config",
                                     c.info["config"], "--data", str(data["train"]), "--out", str(tmp_path / "m"),
                                     "--model", "lr", "--set", "hashing.bits=16"], stderr=err, cwd=ROOT)
        deadline = time.monotonic() + 60
        while "submitted" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "submitted" in log.read_text(), log.read_text()[-3000:]
        while not re.search(r"\([1-9]\d* batches ready", log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)  # preprocess's reports held (on a loaded host, a down before any chunk held none)
        launcher.down(str(c.root), timeout=30.0)
        t0 = time.monotonic()
        code = proc.wait(60)
        seconds = time.monotonic() - t0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if launcher.recorded(str(c.root)):
            c.__exit__(None, None, None)
    err = log.read_text()
    assert code == 2, err[-3000:]
    assert f"the cluster in {c.root} was stopped (`mariana down`); job " in err, err[-3000:]
    assert "goes on when it is up again" in err and seconds < 10, (seconds, err[-3000:])
    # preprocess's reports were held (no worker took a batch): its stop let them go, where it
    # waited out the 20 s drain limit, and `mariana down` took 22 s
    pre = (c.root / "logs" / "preprocess-0.log").read_text()
    assert "held by the coordinator (back-pressure)" in pre and "drain took longer" not in pre, pre[-2000:]


@pytest.mark.timeout(150)
def test_the_client_and_the_api_say_when_a_shards_tables_outgrow_its_memory(data, tmp_path):
    """A shard whose share of the tables would outgrow its memory said so in its own log only:
    the user who submitted the job saw nothing until the kernel killed the shard. Here the
    limit is cluster.memory_max_bytes (40 MiB) and LR at hashing.bits 22 takes 52 MiB once
    written: the job's summary carries the shard's line once, and `train --mode cluster` prints it."""
    with Cluster(tmp_path / "c", **{"cluster.memory_max_bytes": 40 << 20}) as c:
        proc = subprocess.run([sys.executable, "-m", "mariana", "train", "--mode", "cluster", "--cluster-config",
                               c.info["config"], "--data", str(data["train"]), "--out", str(tmp_path / "m"),
                               "--model", "lr", "--epochs", "1", "--set", "hashing.bits=22", "--json"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        job = json.loads(proc.stdout)["job"]
        warnings = c.job(job)["warnings"]
        status = subprocess.run([sys.executable, "-m", "mariana", "status", "--config", c.info["config"]],
                                capture_output=True, text=True, cwd=ROOT, timeout=60)
        small = subprocess.run([sys.executable, "-m", "mariana", "train", "--mode", "cluster", "--cluster-config",
                                c.info["config"], "--data", str(data["train"]), "--out", str(tmp_path / "m2"),
                                "--model", "lr", "--epochs", "1", "--set", "hashing.bits=16", "--json"],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert small.returncode == 0, small.stderr[-3000:]
        assert c.job(json.loads(small.stdout)["job"])["warnings"] == []
    said = ("ps-0: parameter-server shard 0 of 1: its tables take up to 52.0 MiB once written (hashing.bits = 22: "
            "2^22 rows each), more than its limit of 40.0 MiB (cluster.memory_max_bytes): lower hashing.bits")
    assert len(warnings) == 1 and warnings[0].startswith(said), warnings
    assert f"job {job}: {said}" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count(said) == 1 and "Traceback" not in proc.stderr
    assert said not in small.stderr
    assert status.stdout.count(f"job {job}: warning: {said}") == 1 and status.stdout.count("warning:") == 1, \
        status.stdout
