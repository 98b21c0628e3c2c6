"""`mariana tune --mode cluster`: every trial a job on a running cluster (real processes,
Redis and ZeroMQ); the pruner's trials are cancelled jobs, the best trial's version is the
one published, and the losers' versions are gone."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli
from tests.integration.cluster import Cluster
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.strategies.local import evaluate

pytestmark = pytest.mark.slow

BUDGET = 8.0
# A pruned trial's job is cancelled, or got done before the cancel came (after its last
# epoch's validation): then its version is deleted, and none is left in OUT either way.
PRUNED_JOB = ("cancelled", "done")


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    path = tmp_path_factory.mktemp("tc") / "valid.tsv"
    generate_criteo(path, 4_000, seed=7)
    return path


@pytest.mark.timeout(120)
def test_a_cluster_search_publishes_its_best_trial_and_cancels_the_pruned_jobs(gen_files, valid, tmp_path):
    out = tmp_path / "m"
    with Cluster(tmp_path / "c") as c:
        t0 = time.monotonic()
        proc = run_cli("tune", "--mode", "cluster", "--cluster-config", c.info["config"], "--data", gen_files["train"],
                       "--valid-data", valid, "--test-data", gen_files["test"], "--budget", BUDGET,
                       "--set", "hashing.bits=18", "--out", out, check=True)
        spent = time.monotonic() - t0
        manifest = checkpoint.read_manifest(out, checkpoint.current_version(out))
        saved = json.loads(Path(manifest["tune"]["trials_file"]).read_text())
        jobs = {t["number"]: c.job(t["job"])["state"] for t in saved["trials"]}
    # the CLI's start (imports) and the end (the last job cancelled, the best copied) are all it adds
    assert manifest["tune"]["seconds"] < BUDGET + 2.0 and spent < BUDGET + 12.0, (spent, proc.stderr)
    assert "best of" in proc.stdout and "tune.best_params" in proc.stdout
    trials = saved["trials"]
    done = [t for t in trials if t["state"] == "complete"]
    best = min(done, key=lambda t: t["value"])
    assert saved["best_trial"] == best["number"] == manifest["tune"]["best_trial"]
    assert manifest["tune"]["best_params"] == best["params"] and manifest["valid"]["kept"] == "best"
    assert saved["model_version"] == "v000001" == manifest["version"]
    assert all(t["version"] for t in done) and trials[0]["params"]["optim.linear"] == "ftrl"  # the defaults first
    # only the best version is left: in OUT, with no scratch dir of the trials' versions
    assert checkpoint.list_versions(out) == ["v000001"] and sorted(p.name for p in (out / "tune").iterdir()) == [
        manifest["tune"]["trials_file"].rsplit("/", 1)[1]]
    assert not any(isinstance(v, str) and v.endswith("-trials") for v in saved.values())  # no dir since removed
    # the deadline cancelled the job under way (the pruner's are checked below: how many trials
    # fit in 8 s depends on the machine's load)
    # (a job the deadline cancels may finish before the cancel reaches it: "done" then, as a pruned one)
    for t in trials:
        assert jobs[t["number"]] in {"pruned": PRUNED_JOB, "budget": PRUNED_JOB, "complete": ("done",)}[t["state"]], t
    # the published version is the best trial's model: its test metrics are the job's
    metrics, _ = evaluate(ModelBundle.load(str(out)), [str(gen_files["test"])])
    assert metrics["auc"] == pytest.approx(manifest["metrics"]["auc"]) and metrics["auc"] > 0.7
    for key, value in best["params"].items():
        section, name = key.split(".", 1)
        assert manifest["config"][section][name] == value


@pytest.mark.timeout(120)
def test_a_cluster_search_on_the_held_out_tail_prunes_by_cancelling_and_refits_on_every_row(gen_files, tmp_path):
    out = tmp_path / "m"
    with Cluster(tmp_path / "c") as c:
        run_cli("tune", "--mode", "cluster", "--cluster-config", c.info["config"], "--data", gen_files["train"],
                "--valid-fraction", "0.2", "--budget", 120, "--trials", 4, "--set", "hashing.bits=18", "--out", out,
                check=True)
        manifest = checkpoint.read_manifest(out, checkpoint.current_version(out))
        saved = json.loads(Path(manifest["tune"]["trials_file"]).read_text())
        jobs = [c.job(t["job"]) for t in saved["trials"]]
    assert manifest["tune"]["validation"] == "the last 0.2 of the training rows (6,000 lines)"
    # the successive-halving pruner stopped trials by cancelling their jobs
    states = [t["state"] for t in saved["trials"]]
    assert states[0] == "complete" and "pruned" in states and set(states) <= {"complete", "pruned"}, states
    for job, state in zip(jobs, states):
        assert job["state"] in (PRUNED_JOB if state == "pruned" else ("done",)), (job["state"], state)
    # the loader never sent the tail: every epoch trained on the first 80% of the lines
    lines = Path(gen_files["train"]).read_bytes().count(b"\n")
    assert set(jobs[0]["record"]["rows_per_epoch"]) == {lines - lines // 5}, jobs[0]["record"]["rows_per_epoch"]
    # the published version: the best config trained again on every line, for its best epoch count
    best = next(t for t in saved["trials"] if t["number"] == saved["best_trial"])
    refit = manifest["tune"]["refit"]
    assert refit["done"] and refit["epochs"] == best["best_epoch"] and refit["rows"] == lines * best["best_epoch"]
    assert refit["job"] == manifest["train"]["job"] and manifest["config"]["train"]["valid_fraction"] == 0.0
    assert "valid" not in manifest and manifest["tune"]["best_params"] == best["params"]
