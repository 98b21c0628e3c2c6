"""The coordinator's HTTP API as an operator and the web UI meet it, on a real local
cluster: a diverged job's NaN never makes a document no browser can parse, a job list
that pages, an `out` no file can have refused at submit (and never breaking /v1/models),
the coordinator up in its own metrics, and no open admin endpoints off loopback."""
from __future__ import annotations

import json
import time

import pytest

from mariana.services import launcher
from mariana.services.launcher import free_port
from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli
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
