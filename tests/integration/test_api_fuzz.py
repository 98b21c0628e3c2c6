"""Schemathesis (an API fuzzer nobody here wrote) against both HTTP APIs, each a real server
in its own processes, reading the OpenAPI document the server publishes: at least 1,000
generated requests per API, and no 5xx, no response that breaks the document, no request
the document forbids that the server takes, and the token respected (submit, cancel and
retrain without it are refused with 401).

The endpoint runs every check (`--checks all`). The coordinator runs every check but
`positive_data_acceptance`: a job the document allows still needs files that exist and
parse, which no schema can say, so a generated job is rightly refused with a 400 naming
the file. The seed is fixed so that a failure reproduces (MARIANA_FUZZ_SEED varies it);
schemathesis prints a curl command for each failure it finds.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT, run_cli
from tests.integration.cluster import Cluster
from tests.integration.serving import Server

pytestmark = pytest.mark.slow

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
SEED = int(os.environ.get("MARIANA_FUZZ_SEED", "20261125"))
AT_LEAST = 1_000


def fuzz(url: str, token: str | None, *extra: str, examples: int = 100, at_least: int = AT_LEAST,
         cwd: Path) -> str:
    """Run schemathesis on the document at `url`; its report, after checking it passed and
    how many requests it made."""
    if not SCHEMATHESIS.exists():
        pytest.skip(f"schemathesis is not installed in {SCHEMATHESIS.parent} (pip install -e '.[dev]')")
    cmd = [str(SCHEMATHESIS), "run", url, "--checks", "all", "-n", str(examples), "--seed", str(SEED),
           "--request-timeout", "30", *extra]
    if token:
        cmd += ["-H", f"Authorization: Bearer {token}"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "NO_COLOR": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"schemathesis found problems (rc {proc.returncode}):\n{report[-12000:]}"
    m = re.search(r"(\d+) generated", report)
    assert m, report[-3000:]
    assert int(m.group(1)) >= at_least, f"only {m.group(1)} requests generated:\n{report[-3000:]}"
    return report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    generate_criteo(d / "train.tsv", 3_000, seed=3)
    run_cli("train", "--data", str(d / "train.tsv"), "--model", "lr", "--out", str(d / "m"),
            "--set", "hashing.bits=16", check=True)
    return d / "m"


@pytest.mark.timeout(600)
def test_the_endpoint_agrees_with_its_document(model_dir, tmp_path):
    """With admin endpoints on (a token; retrain not configured: 403) and a model in service,
    whose fields the document describes."""
    with Server(tmp_path / "s", model_dir, serve={"token": "fuzz-token"}) as s:
        s.wait_for("/readyz")
        fuzz(f"http://127.0.0.1:{s.port}/openapi.json", "fuzz-token", cwd=tmp_path)
        text = s.get("/metrics")[1]["text"]
        assert 'code="5' not in text, "a 5xx was answered"
        assert 'code="200",route="/v1/predict"' in text  # generated instances were scored, not only refused


@pytest.mark.timeout(600)
def test_the_endpoint_without_admin_agrees_with_its_document(model_dir, tmp_path):
    """Admin endpoints off (no token): the retrain routes, with and without a token sent."""
    with Server(tmp_path / "s", model_dir) as s:
        s.wait_for("/readyz")
        fuzz(f"http://127.0.0.1:{s.port}/openapi.json", None, "--include-path-regex", "retrain", at_least=200,
             cwd=tmp_path)


@pytest.mark.timeout(600)
def test_the_coordinator_agrees_with_its_document(tmp_path):
    data = tmp_path / "train.tsv"
    generate_criteo(data, 2_000, seed=4)
    with Cluster(tmp_path / "c") as c:
        job = c.submit([data], tmp_path / "m", config={"hashing": {"bits": 14}})  # a real job to read back
        assert c.wait(job)["state"] == "done", c.logs()
        fuzz(c.info["http"] + "/openapi.json", c.info["token"], "--exclude-checks", "positive_data_acceptance",
             cwd=tmp_path)
        code, jobs = c.request("GET", "/v1/jobs")
        assert code == 200 and [j["id"] for j in jobs["jobs"]] == [job], "the fuzzer submitted a job"
