"""Validation-driven training in cluster mode (issue 15): the coordinator scores every
epoch on the job's valid_data, stops an `epochs = "auto"` job on it and publishes the
best epoch's tables; with one step in flight it is local mode's early stopping exactly."""
from __future__ import annotations

import json

import pytest

from sparse.synth import generate_criteo
from tests.conftest import run_cli
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

# Small batches and a high rate: 40k rows overfit after an epoch or two.
SETTINGS = {"hashing.bits": 18, "train.batch_size": 512, "data.block_bytes": 262144, "train.threads": 1,
            "optim.lr": 0.3, "train.epochs": "auto", "train.patience": 1, "train.max_epochs": 5}


def nested(settings: dict) -> dict:
    out: dict = {}
    for key, value in settings.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("cv")
    generate_criteo(d / "train.tsv", 40_000, seed=21)
    generate_criteo(d / "valid.tsv", 8_000, seed=22)
    generate_criteo(d / "test.tsv", 8_000, seed=23)
    return {k: d / f"{k}.tsv" for k in ("train", "valid", "test")}


@pytest.mark.timeout(240)
def test_cluster_early_stopping_is_local_modes_exactly_and_keeps_the_best_epoch(data, tmp_path):
    sets = [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    local = json.loads(run_cli("train", "--data", data["train"], "--valid-data", data["valid"], "--test-data",
                               data["test"], *sets, "--json", "--out", tmp_path / "local", check=True).stdout)
    lv = local["valid"]
    assert lv["kept"] == "best" and lv["best_epoch"] < len(lv["epochs"]) < 5, lv  # it did stop early
    with Cluster(tmp_path / "c", **{"worker.pipeline": 1, "preprocess.threads": 1}) as c:
        job = c.submit([data["train"]], tmp_path / "m", [data["test"]], nested(SETTINGS),
                       valid_data=[str(data["valid"])])
        summary = c.wait(job, 180)
        assert summary["state"] == "done", f"{summary['state']}: {summary['error']}\n{c.logs()}"
        record = summary["record"]
        code, history = c.request("GET", f"/v1/jobs/{job}/history")
    cv = record["valid"]
    assert [e["logloss"] for e in cv["epochs"]] == [e["logloss"] for e in lv["epochs"]]
    assert cv["best_epoch"] == lv["best_epoch"] and cv["kept"] == "best" and cv["stopped"] == lv["stopped"]
    assert record["epochs"] == len(lv["epochs"]) and record["rows_applied"] == 40_000 * record["epochs"]
    # the published model is the best epoch's: the same test metrics as local mode's
    assert record["auc"] == local["auc"] and record["logloss"] == local["logloss"]
    manifest = json.loads((tmp_path / "m" / record["model_version"] / "manifest.json").read_text())
    assert manifest["valid"]["best_epoch"] == lv["best_epoch"]
    # the job history (what the web UI charts) carries each epoch's validation metrics
    assert code == 200
    assert [e["valid"]["logloss"] for e in history["epochs"]] == [e["logloss"] for e in lv["epochs"]]


def test_a_cluster_job_refuses_validation_it_cannot_do(data, tmp_path):
    auto = run_cli("train", "--mode", "cluster", "--data", data["train"], "--epochs", "auto", "--out", tmp_path / "m")
    assert auto.returncode == 2 and "--valid-data" in auto.stderr
    frac = run_cli("train", "--mode", "cluster", "--data", data["train"], "--valid-fraction", "0.1",
                   "--out", tmp_path / "m")
    assert frac.returncode == 2 and "--valid-fraction runs in local mode" in frac.stderr
