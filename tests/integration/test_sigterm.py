"""SIGTERM to each kind of service while a job runs, with real processes: it
drains, persists what it owns (a ps shard writes its checkpoint), exits 0
within the drain timeout; the service is started again and the job still
trains every row exactly once. Then `launcher.down` stops the rest, each with
exit code 0."""
from __future__ import annotations

import json
import re
import signal
import time

import pytest

from mariana.services import launcher
from mariana.services.runtime.lifecycle import DRAIN_SECONDS
from mariana.sparse.synth import generate_criteo
from tests.integration.cluster import Cluster
from mariana.trainer import checkpoint

pytestmark = pytest.mark.slow

EPOCHS = 2  # the shard is stopped in epoch 2, which the job then trains to its end
# Small chunks and batches: the loader streams epoch 1 as fast as the workers train (back-pressure),
# so epoch 1 lasts long enough to stop the loader and preprocess in it.
JOB = {"train": {"batch_size": 1024, "epochs": EPOCHS}, "model": {"kind": "dnn"}, "hashing": {"bits": 18},
       "data": {"block_bytes": 262144}}
CLUSTER = {
    "ps.checkpoint_seconds": 0,  # no timer: a checkpoint on disk was written by SIGTERM
    "worker.rpc_seconds": 2.0,   # a request lost with a stopped shard is sent again soon
}


def sigterm(c: Cluster, name: str) -> str:
    """SIGTERM one service; it must exit 0 within the drain timeout. Its log from the signal on."""
    path = c.root / "logs" / f"{name}.log"
    seen = path.stat().st_size
    pid = c.pid(name)
    t0 = time.monotonic()
    c.kill(name, signal.SIGTERM, wait=False)
    code = c.wait_gone(pid, timeout=DRAIN_SECONDS + 10)
    took = time.monotonic() - t0
    while code is None and time.monotonic() - t0 < DRAIN_SECONDS:
        # wait_gone calls a zombie gone, but the kernel lets its parent reap it only once every
        # thread of it has exited: a moment later
        code = launcher.reap(pid)
        time.sleep(0.02)
    with open(path, "rb") as f:
        f.seek(seen)
        text = f.read().decode(errors="replace")
    assert code == 0, f"{name} exited with {code} after SIGTERM:\n{text[-3000:]}"
    assert took < DRAIN_SECONDS, f"{name} took {took:.1f}s to stop:\n{text[-3000:]}"
    return text


def unclean(name: str, text: str) -> list[str]:
    """How a stop's log differs from a clean one: drain, one summary line last, no traceback."""
    lines = text.rstrip().splitlines()
    problems = []
    if f"{name}: stopping: draining work in flight" not in text:
        problems.append("never drained (no 'stopping: draining work in flight' line)")
    if "drain took longer" in text:
        problems.append("drain timed out")
    if not lines or not re.search(rf"{name}: stopped after [\d.]+s", lines[-1]):
        problems.append(f"the last line is not the summary line: {lines[-1:]}")
    problems += [f"after the stop: {ln}" for ln in lines if "Traceback" in ln or " ERROR " in ln]
    return problems


def running(c: Cluster, job: str, until, timeout: float = 60.0) -> dict:
    """The job's progress once until(progress) holds; it must still be running then."""
    summary = c.wait(job, timeout, until=lambda s: s["state"] != "running" or until(s["progress"]))
    assert summary["state"] == "running", f"the job ended too early: {summary}"
    return summary["progress"]


def restarted(c: Cluster, name: str, timeout: float = 60.0) -> None:
    """Start a stopped service again and wait until it has registered (a new pid)."""
    pid = c.restart(name).pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = c.status()["services"].get(name, {})
        if info.get("pid") == pid and info.get("alive"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} did not register again in {timeout}s\n{c.logs()}")


def checkpoint_of(c: Cluster, job: str) -> tuple[list[str], dict]:
    """(versions, newest manifest) of shard 0's checkpoints of the job."""
    d = c.root / "ps" / "shard-0" / job
    versions = checkpoint.list_versions(d)
    manifest = json.loads((d / versions[-1] / checkpoint.MANIFEST).read_text()) if versions else {}
    return versions, manifest


def summary_counters(c: Cluster, name: str) -> dict[str, int]:
    """The counters of the last `NAME: stopped after ...s (k=v, ...)` line of a service's log."""
    log = (c.root / "logs" / f"{name}.log").read_text()
    found = re.findall(rf"{name}: stopped after [\d.]+s \((.*)\)", log)
    assert found, log[-3000:]
    return {k: int(v) for k, v in (kv.split("=") for kv in found[-1].split(", "))}


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sigterm") / "train.tsv"
    generate_criteo(path, 150_000, seed=31)
    return path


@pytest.mark.timeout(240)
def test_sigterm_to_each_service_mid_job_drains_exits_0_and_loses_nothing(train_file, tmp_path):
    with Cluster(tmp_path / "c", workers=2, ps=1, preprocess=1, **CLUSTER) as c:
        job = c.submit([train_file], tmp_path / "m", config=JOB)
        stops = {}  # name -> its log from SIGTERM on; checked at the end, so one bad stop hides no other

        # epoch 1, source half read: the loader records its offset per chunk, a new one resumes there
        p = running(c, job, lambda p: p["rows"] >= 5_000)
        assert p["epoch"] == 1 and not p["source_done"], p
        stops["loader-0"] = sigterm(c, "loader-0")
        restarted(c, "loader-0")

        # still epoch 1: preprocess finishes the chunk in hand; the ones queued to it are read again
        assert c.job(job)["progress"]["epoch"] == 1
        stops["preprocess-0"] = sigterm(c, "preprocess-0")
        restarted(c, "preprocess-0")

        # a worker finishes its batch in hand; the one it leased ahead lapses and goes to worker-0
        stops["worker-1"] = sigterm(c, "worker-1")

        # epoch 2: the shard drains its requests and checkpoints everything it applied
        running(c, job, lambda p: p["epoch"] >= 2 and p["rows"] >= 5_000, timeout=120)
        assert checkpoint_of(c, job)[0] == []  # no timer here: nothing written yet
        stops["ps-0"] = sigterm(c, "ps-0")
        versions, manifest = checkpoint_of(c, job)
        counted = summary_counters(c, "ps-0")
        assert len(versions) == 1, versions
        assert len(manifest["applied"]) == counted["steps_applied"] > 0, (counted, len(manifest["applied"]))
        assert sum(manifest["applied"].values()) == counted["rows_applied"]
        restarted(c, "ps-0")

        summary = c.wait(job, 150)
        assert summary["state"] == "done", f"{summary['state']}: {summary['error']}\n{c.logs()}"
        record = summary["record"]
        assert "restored job" in (c.root / "logs" / "ps-0.log").read_text()
        assert c.stop_restarted() == {"loader-0": 0, "preprocess-0": 0, "ps-0": 0}
    down = c.summary
    assert down["killed"] == [] and set(down["stopped"]) == {"worker-0", "coordinator-0", "redis"}, down
    assert down["exit_codes"] == {name: 0 for name in down["exit_codes"]}, down
    assert record["rows_applied"] == record["rows_in_data"] * EPOCHS == 150_000 * EPOCHS, record
    assert record["rows_applied_per_epoch"] == [record["rows_in_data"]] * EPOCHS, record
    assert record["rows_lost"] == 0 and record["lines_lost"] == 0, record
    assert record["batches_replayed"] == 0, record  # the shard persisted every step it acknowledged
    problems = {name: unclean(name, text) for name, text in stops.items()}
    assert problems == {name: [] for name in stops}, json.dumps(problems, indent=1)
