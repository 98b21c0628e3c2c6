"""Validation-driven training in cluster mode (issue 15): the coordinator scores every
epoch on the job's valid_data (or on the tail of its training files it holds out, which
the loader never sends), stops an `epochs = "auto"` job on it and publishes the best
epoch's tables; with one step in flight it is local mode's early stopping exactly."""
from __future__ import annotations

import json

import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli
from tests.integration.cluster import Cluster, nested

pytestmark = pytest.mark.slow

# Small batches and a high rate: 40k rows overfit after an epoch or two.
SETTINGS = {"hashing.bits": 18, "train.batch_size": 512, "data.block_bytes": 262144, "train.threads": 1,
            "optim.lr": 0.3, "train.epochs": "auto", "train.patience": 1, "train.max_epochs": 5}


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
    # the weights learned from the rows up to the kept epoch: counted so, as local mode does (the cluster
    # counted every epoch it ran, and a warm start from it carried the excess into its parent record)
    local_manifest = json.loads((tmp_path / "local" / local["model_version"] / "manifest.json").read_text())
    assert manifest["rows_trained"] == local_manifest["rows_trained"] == 40_000 * lv["best_epoch"], manifest
    # and listed so (`model list` and /v1/models showed every epoch's rows, 40,000 x epochs run)
    for out, version in ((tmp_path / "local", local["model_version"]), (tmp_path / "m", record["model_version"])):
        listed = json.loads(run_cli("model", "list", "--model-dir", out, "--json", check=True).stdout)["versions"]
        assert [(v["version"], v["rows"]) for v in listed] == [(version, 40_000 * lv["best_epoch"])], listed
    # the job history (what the web UI charts) carries each epoch's validation metrics
    assert code == 200
    assert [e["valid"]["logloss"] for e in history["epochs"]] == [e["logloss"] for e in lv["epochs"]]


@pytest.fixture(scope="module")
def halves(data, tmp_path_factory) -> list:
    """The 40k training rows as two files of 25k and 15k rows (in order)."""
    d = tmp_path_factory.mktemp("halves")
    lines = data["train"].read_text().splitlines(keepends=True)
    (d / "a.tsv").write_text("".join(lines[:25_000]))
    (d / "b.tsv").write_text("".join(lines[25_000:]))
    return [d / "a.tsv", d / "b.tsv"]


@pytest.mark.timeout(300)
def test_cluster_auto_without_valid_data_holds_out_local_modes_tail_and_stops_where_it_does(data, halves, tmp_path):
    """`epochs = "auto"` with no validation files holds out the last 10 % of the training
    lines (file order: the cut falls inside the second file, mid-chunk), as local mode does:
    with one step in flight the same epochs, validation metrics and model, to the last bit."""
    sets = [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    local = json.loads(run_cli("train", "--data", ",".join(map(str, halves)), "--test-data", data["test"], *sets,
                               "--json", "--out", tmp_path / "local", check=True).stdout)
    lv = local["valid"]
    assert lv["kept"] == "best" and lv["best_epoch"] < len(lv["epochs"]) < 5, lv  # it did stop early
    with Cluster(tmp_path / "c", **{"worker.pipeline": 1, "preprocess.threads": 1}) as c:
        job = c.submit(halves, tmp_path / "m", [data["test"]], nested(SETTINGS))
        summary = c.wait(job, 240)
        assert summary["state"] == "done", f"{summary['state']}: {summary['error']}\n{c.logs()}"
        record = summary["record"]
    cv = record["valid"]
    assert cv["source"] == lv["source"] == "the last 0.1 of the training rows (4,000 lines)"
    assert [e["logloss"] for e in cv["epochs"]] == [e["logloss"] for e in lv["epochs"]]
    assert [e["rows"] for e in cv["epochs"]] == [4_000] * len(lv["epochs"])
    assert cv["best_epoch"] == lv["best_epoch"] and cv["kept"] == "best" and cv["stopped"] == lv["stopped"]
    epochs = len(lv["epochs"])
    assert record["rows_in_data"] == 36_000 and record["rows_per_epoch"] == local["rows_per_epoch"] == [36_000] * epochs
    assert record["rows_applied_per_epoch"] == [36_000] * epochs
    assert record["auc"] == local["auc"] and record["logloss"] == local["logloss"]


@pytest.mark.timeout(300)
def test_a_cluster_valid_fraction_never_trains_on_the_held_out_rows(data, halves, tmp_path):
    """`train.valid_fraction` in cluster mode: the loader sends only the lines before the cut
    (here the end of the first file: the second is never read), every epoch trains on exactly
    those, and the coordinator scores the rest after each. Bad requests are 400s naming why."""
    config = {"hashing": {"bits": 18}, "train": {"epochs": 2, "valid_fraction": 0.375, "batch_size": 256}}
    with Cluster(tmp_path / "c", workers=2, ps=2) as c:
        refused = [
            ({**config, "train": {"valid_fraction": 1.0}}, {}, "train.valid_fraction must be in [0, 1)"),
            (config, {"valid_data": [str(data["valid"])]}, "give validation rows one way"),
            ({"train": {"valid_fraction": 0.00001}}, {}, "leaves no rows"),  # 0.4 of 40k rows
        ]
        for cfg, fields, named in refused:
            body = {"data": [str(p) for p in halves], "out": str(tmp_path / "x"), "config": cfg, **fields}
            code, reply = c.request("POST", "/v1/jobs", body)
            assert code == 400 and named in reply["error"], (body, code, reply)
        job = c.submit(halves, tmp_path / "m", [], config)
        summary = c.wait(job, 240)
        assert summary["state"] == "done", f"{summary['state']}: {summary['error']}\n{c.logs()}"
        record = summary["record"]
    assert record["rows_in_data"] == 25_000 and record["rows_lost"] == 0  # the second file was never sent
    assert record["rows_per_epoch"] == record["rows_applied_per_epoch"] == [25_000, 25_000]
    valid = record["valid"]
    assert valid["source"] == "the last 0.375 of the training rows (15,000 lines)"
    assert [(e["epoch"], e["rows"]) for e in valid["epochs"]] == [(1, 15_000), (2, 15_000)]
    # each epoch's model has learned (an untrained one scores NE 1, AUC 0.5). Not "epoch 2 beats epoch 1":
    # two async workers on 25k rows are converged after one pass (0.4693 -> 0.4689 in one run, and
    # 0.4718 -> 0.4757 in one under the full suite's load). Batches of 256, so ~100 steps an epoch: with 25
    # (batches of 1024) the steps two workers take on stale weights weighed enough that one epoch 1 under
    # the suite's load scored a logloss of 0.5+ (NE > 0.95) against 0.469-0.474 in 6 runs alone
    assert valid["kept"] == "last" and all(e["ne"] < 0.95 and e["auc"] > 0.68 for e in valid["epochs"]), valid
    manifest = json.loads((tmp_path / "m" / record["model_version"] / "manifest.json").read_text())
    assert manifest["valid"]["source"] == valid["source"] and manifest["rows_trained"] == 50_000


def test_cluster_validation_flags_are_checked_before_anything_starts(data, tmp_path):
    both = run_cli("train", "--mode", "cluster", "--data", data["train"], "--valid-data", data["valid"],
                   "--valid-fraction", "0.1", "--out", tmp_path / "m")
    assert both.returncode == 2 and "one way" in both.stderr, both.stderr
    out_of_range = run_cli("train", "--mode", "cluster", "--data", data["train"], "--valid-fraction", "1.5",
                           "--out", tmp_path / "m")
    assert out_of_range.returncode == 2 and "valid_fraction must be in [0, 1)" in out_of_range.stderr
    assert "starting one" not in both.stderr + out_of_range.stderr  # no cluster was started for them
