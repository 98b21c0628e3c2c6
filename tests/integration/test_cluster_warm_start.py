"""Warm starts in cluster mode: every parameter-server shard starts from its slice of the
parent version (rows, optimizer state, counts; shard 0 the dense parameters), so with zero
rates the job reproduces its parent exactly, and with its rates it goes on as local mode's
warm start does. A version that does not fit the job is refused before anything starts."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli
from tests.integration.cluster import Cluster, nested
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.data import BatchStream

pytestmark = pytest.mark.slow

# AdaGrad everywhere: a zero rate freezes a weight (FTRL recomputes its weights from its state).
SETTINGS = {"hashing.bits": 18, "train.batch_size": 1024, "data.block_bytes": 262144, "train.threads": 1,
            "model.kind": "dnn", "optim.linear": "adagrad"}
FROZEN = {"optim.lr": 0.0, "optim.embed_lr": 0.0, "optim.dense_lr": 0.0}


def cli_sets(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def predictions(model_dir, version: str, path) -> np.ndarray:
    bundle = ModelBundle.load(str(model_dir), version)
    return np.concatenate([bundle.predict(b) for b in BatchStream([str(path)], bundle.encoder, labeled=True)])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("ws")
    for name, seed in (("day1", 31), ("day2", 32), ("test", 33)):
        generate_criteo(d / f"{name}.tsv", 20_000 if name != "test" else 5_000, seed=seed)
    return {k: d / f"{k}.tsv" for k in ("day1", "day2", "test")}


@pytest.fixture
def parent(data, tmp_path):
    """A DNN version trained in local mode on day 1: m/v000001."""
    run_cli("-q", "train", "--data", data["day1"], *cli_sets(SETTINGS), "--out", tmp_path / "m", check=True)
    return tmp_path / "m"


@pytest.mark.timeout(300)
def test_a_cluster_warm_start_reproduces_its_parent_frozen_and_goes_on_as_local_mode_does(data, parent, tmp_path):
    local = json.loads(run_cli("train", "--data", data["day2"], "--test-data", data["test"], *cli_sets(SETTINGS),
                               "--init-from", f"{parent}:v000001", "--json", "--out", tmp_path / "local",
                               check=True).stdout)
    with Cluster(tmp_path / "c", ps=2, **{"worker.pipeline": 1, "preprocess.threads": 1}) as c:
        frozen = c.wait(c.submit([data["day2"]], parent, [data["test"]], nested({**SETTINGS, **FROZEN}),
                                 init_from=f"{parent}:v000001"), 180)
        assert frozen["state"] == "done", f"{frozen['error']}\n{c.logs()}"
        moved = c.wait(c.submit([data["day2"]], parent, [data["test"]], nested(SETTINGS),
                                init_from=f"{parent}:v000001"), 180)
        assert moved["state"] == "done", f"{moved['error']}\n{c.logs()}"
    assert (frozen["record"]["model_version"], moved["record"]["model_version"]) == ("v000002", "v000003")
    before = predictions(parent, "v000001", data["test"])
    # zero rates: every shard held its slice of v000001, and nothing moved
    assert np.array_equal(predictions(parent, "v000002", data["test"]), before)
    manifest = json.loads((parent / "v000002" / "manifest.json").read_text())
    assert manifest["parent"] == {"model_dir": str(parent), "version": "v000001", "rows_trained": 20_000,
                                  "learned": [str(data["day1"])]}
    assert manifest["rows_trained"] == 40_000 and manifest["train"]["mode"] == "cluster/async"
    # its rates: it goes on from the parent's weights and optimizer state, as local mode's warm start
    assert not np.array_equal(predictions(parent, "v000003", data["test"]), before)
    for key in ("train_loss", "auc", "logloss"):  # the DNN: to float rounding (see the strict-order test)
        assert moved["record"][key] == pytest.approx(local[key], rel=1e-7, abs=0), key


@pytest.mark.timeout(240)
def test_a_mismatched_or_missing_cluster_warm_start_is_refused_before_it_starts(data, parent, tmp_path):
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(f'[cluster]\ndir = "{tmp_path / "up"}"\n')
    cli = run_cli("train", "--mode", "cluster", "--cluster-config", cfg, "--data", data["day2"],
                  *cli_sets({**SETTINGS, "hashing.bits": 20}), "--init-from", parent, "--out", tmp_path / "x")
    assert cli.returncode == 2 and "hashing.bits: the version has 18, this job 20" in cli.stderr, cli.stderr
    assert "starting one" not in cli.stderr  # refused before any process started
    with Cluster(tmp_path / "c") as c:
        cases = [
            ({"hashing": {"bits": 20}}, str(parent), "hashing.bits: the version has 18, this job 20"),
            ({"model": {"kind": "lr"}}, str(parent), "model.kind: the version has 'dnn', this job 'lr'"),
            ({}, f"{parent}:v000009", "no version 'v000009' to warm-start from (versions: v000001;"),
            ({}, str(tmp_path / "none"), "no such model directory"),
            ({}, "m:v000001", "init_from: 'm:v000001' is a relative path"),
        ]
        for changes, init_from, named in cases:
            config = nested(SETTINGS)
            for section, values in changes.items():
                config[section] = {**config[section], **values}
            body = {"data": [str(data["day2"])], "out": str(tmp_path / "x"), "config": config, "init_from": init_from}
            code, reply = c.request("POST", "/v1/jobs", body)
            assert code == 400 and named in reply["error"], (init_from, code, reply)
        assert c.request("GET", "/v1/jobs")[1]["jobs"] == []
        # queued behind another job, its parent removed meanwhile: failed, saying so (it was shard 0's raw
        # "ModelDirError: .../v000001: no manifest.json")
        first = c.submit([data["day1"]], tmp_path / "y", config=nested(SETTINGS))
        queued = c.submit([data["day2"]], tmp_path / "x", config=nested(SETTINGS), init_from=f"{parent}:v000001")
        shutil.copytree(parent / "v000001", tmp_path / "kept")
        shutil.rmtree(parent / "v000001")
        assert c.wait(first, 180)["state"] == "done"
        ended = c.wait(queued, 180)
        assert ended["state"] == "failed" and f"{parent}/v000001, the version this job warm-starts from, is no " \
            "longer there: it was removed after the job was submitted" in ended["error"], ended["error"]
        shutil.copytree(tmp_path / "kept", parent / "v000001")
    assert (parent / "CURRENT").read_text().strip() == "v000001" and not (tmp_path / "x").exists()
