"""The coordinator's HTTP API as an operator and the web UI meet it, on a real local
cluster: a diverged job's NaN never makes a document no browser can parse, a job list
that pages, an `out` no file can have refused at submit (and never breaking /v1/models),
the coordinator up in its own metrics, and no open admin endpoints off loopback."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from mariana.services import launcher
from mariana.services.launcher import free_port
from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT, run_cli
from tests.debian import can_unshare_mounts
from tests.integration.cluster import Cluster
from tests.integration.test_metrics_endpoints import scrape

pytestmark = pytest.mark.slow


def strict(text: str):
    """json.loads as a browser's JSON.parse reads: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.timeout(240)
def test_a_diverged_job_pages_of_jobs_and_bad_out_dirs(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 3_000, seed=3)
    long_dir = str(tmp_path / ("x" * 300))
    with Cluster(tmp_path / "c", **{"coordinator.model_dirs": [long_dir]}) as c:
        small = {"hashing": {"bits": 14}, "train": {"batch_size": 256}}
        ok = c.submit([data], tmp_path / "ok", config=small)
        assert c.wait(ok)["state"] == "done", c.logs()
        diverged = c.submit([data], tmp_path / "nan", config={
            **small, "optim": {"linear": "adagrad", "lr": 1e300, "initial_accumulator": 1e-300}})
        failed = c.wait(diverged)
        assert failed["state"] == "failed" and "diverged" in failed["error"], failed

        # every document the UI reads parses strictly, the NaN loss as null
        for path in ("/v1/status", "/v1/jobs", f"/v1/jobs/{diverged}", f"/v1/jobs/{diverged}/history",
                     "/v1/models"):
            with launcher._HTTP.open(c.info["http"] + path, timeout=10) as r:
                assert r.status == 200, path
                strict(r.read().decode())
        assert c.job(diverged)["progress"]["loss"] is None

        # pages: newest first; the status poll bounded, with the running and the named jobs
        code, page = c.request("GET", "/v1/jobs?limit=1")
        assert code == 200 and [j["id"] for j in page["jobs"]] == [diverged] and page["total"] == 2
        code, page = c.request("GET", "/v1/jobs?limit=5&offset=1")
        assert [j["id"] for j in page["jobs"]] == [ok]
        code, status = c.request("GET", "/v1/status?jobs=1")
        assert [j["id"] for j in status["jobs"]] == [diverged] and status["jobs_total"] == 2
        code, status = c.request("GET", f"/v1/status?jobs=0&job={ok}")
        assert [j["id"] for j in status["jobs"]] == [ok]
        # brief (the web UI's poll): an ended job's record without its lists, unless it is named
        code, status = c.request("GET", "/v1/status?jobs=5&brief=1")
        brief = {j["id"]: j for j in status["jobs"]}[ok]
        assert brief["brief"] is True and brief["record"]["model_version"] == "v000001", brief
        assert "rows_per_epoch" not in brief["record"] and "rows_per_epoch" in c.job(ok)["record"], brief
        code, status = c.request("GET", f"/v1/status?jobs=5&brief=1&job={ok}")
        assert {j["id"]: j for j in status["jobs"]}[ok]["record"] == c.job(ok)["record"]
        code, reply = c.request("GET", "/v1/status?brief=yes")
        assert code == 400 and "brief must be 0 or 1" in reply["error"], reply
        for query in ("/v1/jobs?limit=-1", "/v1/jobs?offset=abc", "/v1/status?jobs=1e3", "/v1/jobs?limit=%C2%B2"):
            code, reply = c.request("GET", query)
            assert code == 400 and "whole number" in reply["error"], (query, code, reply)

        # an out no file can have: refused at submit, not after training (it was a 201)
        for out, named in ((tmp_path / ("y" * 300), "300 bytes long"), (f"{tmp_path}/m\x00x", "NUL"),
                           (f"{tmp_path}/m\ud800", "not a file name")):
            code, reply = c.request("POST", "/v1/jobs", {"data": [str(data)], "out": str(out)})
            assert code == 400 and named in reply["error"], (out, code, reply)
        code, models = c.request("GET", "/v1/models")  # model_dirs names one: it was a 500
        assert code == 200 and {m["dir"] for m in models["models"]} == {str(tmp_path / "ok")}

        # up in its own metrics while nobody asks /v1/status (it sends itself no heartbeat)
        time.sleep(c.cfg.coordinator.heartbeat_seconds + 0.5)
        series = scrape(c.cfg.coordinator.http_port)[2]
        assert series['mariana_service_up{service="coordinator-0",role="coordinator"}'] == 1


def test_a_coordinator_off_loopback_without_a_token_does_not_start(tmp_path):
    """Anyone reaching the port could submit jobs writing wherever the coordinator may
    (`mariana up` makes a token; a config for systemd may leave it empty)."""
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\nbase_port = {free_port()}\n'
                      '[coordinator]\nhttp_host = "0.0.0.0"\ntoken = ""\n')
    proc = run_cli("run", "coordinator", "--config", config)
    assert proc.returncode != 0 and "not a loopback address, and coordinator.token is empty" in proc.stderr, \
        proc.stderr
    assert "Traceback" not in proc.stderr


def test_pages_of_other_sites_can_neither_submit_nor_read_through_a_rebound_name(tmp_path):
    """A coordinator run by hand with no token on loopback: a page of another site POSTed a
    job as text/plain (no preflight: the browser sends it) that read and wrote paths of its
    choosing, and a page whose name was re-pointed at 127.0.0.1 (DNS rebinding) read the API.
    A request with a foreign Origin is refused (403), and one naming another Host (421)."""
    import urllib.error
    import urllib.request

    from tests.integration.cluster import free_base_port

    base = free_base_port()
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\nbase_port = {base}\n[coordinator]\ntoken = ""\n')
    proc = subprocess.Popen([sys.executable, "-m", "mariana", "run", "coordinator", "--config", str(config)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{base + 1}"

    def ask(path: str, headers: dict, body: bytes | None = None) -> tuple[int, str]:
        req = urllib.request.Request(url + path, data=body, headers=headers, method="POST" if body else "GET")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ask("/healthz", {})[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        job = json.dumps({"data": [str(tmp_path / "d.tsv")], "out": str(tmp_path / "m")}).encode()
        code, said = ask("/v1/jobs", {"Content-Type": "text/plain", "Origin": "http://evil.example"}, job)
        assert code == 403 and "a page of another origin (http://evil.example) is refused" in said, (code, said)
        code, said = ask("/v1/status", {"Host": f"evil.example:{base + 1}"})
        assert code == 421 and "is not this coordinator's: it listens on loopback" in said, (code, said)
        assert ask("/v1/status", {"Host": f"localhost:{base + 1}"})[0] == 200
        with urllib.request.urlopen(url + "/v1/jobs", timeout=10) as r:  # the API's JSON too, as the UI's files
            assert r.headers["X-Content-Type-Options"] == "nosniff"
        status = json.loads(ask("/v1/status", {})[1])
        assert status["jobs_total"] == 0 and status["counters"]["http_unauthorized"] == 1
        # its own pages' requests (same origin) and clients without an Origin go on as before
        code, said = ask("/v1/jobs", {"Content-Type": "application/json", "Origin": url}, job)
        assert code == 400 and "d.tsv" in said, (code, said)  # refused for the missing file, not its origin
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "from a page of another origin (http://evil.example): refused (403)" in err, err[-2000:]


FULL_STATE = r"""
import json, sys
from pathlib import Path
from tests.integration.cluster import Cluster
root, data, state = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
out = {}
with Cluster(root / "c", **{"coordinator.state_dir": str(state)}) as c:
    fill = state / "fill"
    try:
        with open(fill, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
    except OSError:
        pass
    body = {"data": [data], "out": str(root / "m")}
    out["full"] = c.request("POST", "/v1/jobs", body)
    out["jobs"] = c.request("GET", "/v1/jobs")[1]["total"]
    fill.unlink()
    out["again"] = c.request("POST", "/v1/jobs", body)
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_a_job_the_coordinator_cannot_save_is_a_503_and_not_queued(tmp_path):
    """A state dir on a full disk answered a submit with a bare 500 and kept the job queued
    in memory for good (it was added before it was saved); its cancel was a 500 too."""
    if not can_unshare_mounts():
        pytest.skip("unshare -m is not allowed here (needs root or CAP_SYS_ADMIN): no small filesystem to fill")
    data = tmp_path / "train.tsv"
    generate_criteo(data, 2_000, seed=4)
    state = tmp_path / "state"
    state.mkdir()
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=2m none {state} && exec '
                           f'{sys.executable} -c "$0" {tmp_path} {data} {state}', FULL_STATE],
                          cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    code, reply = out["full"]
    assert code == 503 and "cannot save its state" in reply["error"], out
    assert out["jobs"] == 0, out  # not queued: nothing to lose at the next restart
    assert out["again"][0] == 201, out


@pytest.mark.timeout(120)
def test_idle_connections_to_the_coordinator_and_a_metrics_port_are_closed(tmp_path):
    """aiohttp keeps an idle connection an hour by default: 170 idle sockets kept a restarted
    worker under a 64-descriptor limit from registering."""
    with Cluster(tmp_path / "c", **{"cluster.keepalive_seconds": 1.0}) as c:
        for port in (c.cfg.coordinator.http_port, c.cfg.metrics_port("worker", 0)):
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                assert sock.recv(1) == b""  # closed by the server, not by the timeout
            assert time.monotonic() - t0 < 10, port
