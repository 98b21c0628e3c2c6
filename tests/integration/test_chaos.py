"""Chaos, the short version (bench/chaos.py runs >= 30 kills): during a 3-epoch job on a
supervised cluster of 2 workers, 2 shards and 2 preprocess, a seeded chaos monkey
SIGKILLs a randomly chosen worker, shard, preprocess, loader, coordinator or Redis every
1.5-3 s; the supervisor restarts each. The job completes, every row is applied exactly
once per epoch, and the published model's test AUC is within 0.005 of an undisturbed run
of the same job on the same cluster."""
from __future__ import annotations

import os
import time

import pytest

from mariana.services.chaos import Chaos
from mariana.sparse.synth import generate_criteo
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

ROWS, EPOCHS = 50_000, 3
JOB = {"hashing": {"bits": 18}, "train": {"epochs": EPOCHS, "batch_size": 32}}  # many steps: 10-20 s a job
SEED = int(os.environ.get("MARIANA_CHAOS_SEED", "19"))


def check_exactly_once(summary: dict, logs: str) -> dict:
    assert summary["state"] == "done", (summary, logs)
    record = summary["record"]
    assert record["rows_in_data"] == ROWS, record
    assert record["rows_applied"] == ROWS * EPOCHS, record
    assert record["rows_applied_per_epoch"] == [ROWS] * EPOCHS, record
    return record


def wait_through_restarts(c: Cluster, job: str, timeout: float) -> dict:
    """The job's summary once it has ended, asking again while the coordinator is down."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            summary = c.job(job)
        except OSError:  # being restarted
            summary = None
        if summary is not None and summary["state"] not in ("queued", "running"):
            return summary
        time.sleep(0.2)
    raise AssertionError(f"job {job} not done after {timeout:g}s\n{c.logs()}")


@pytest.mark.timeout(600)
def test_a_job_survives_random_kills_of_every_kind_of_service(tmp_path):
    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    generate_criteo(train, ROWS, seed=11)
    generate_criteo(test, 20_000, seed=12)
    with Cluster(tmp_path / "c", workers=2, ps=2, preprocess=2, **{"cluster.supervise": True}) as c:
        calm = check_exactly_once(c.wait(c.submit([train], tmp_path / "calm", [test], JOB), timeout=240), c.logs())
        chaos = Chaos(str(c.root), seed=SEED, every=(1.5, 3.0), max_kills=6)
        job = c.submit([train], tmp_path / "chaos", [test], JOB)
        chaos.start()
        try:
            summary = wait_through_restarts(c, job, timeout=420)
        finally:
            kills = chaos.finish()
        record = check_exactly_once(summary, c.logs())
        assert kills, f"the job ended before the first kill: {record['epoch_seconds']}"
        assert abs(record["auc"] - calm["auc"]) <= 0.005, (record["auc"], calm["auc"], kills)
        print(f"chaos: {len(kills)} kills ({', '.join(k.name for k in kills)}); auc {record['auc']:.4f} "
              f"vs {calm['auc']:.4f} undisturbed; {summary['restarts']} coordinator restarts seen by the job")
