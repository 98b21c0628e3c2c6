"""A retrain started over HTTP when things go wrong, on real processes: the server stops
right after answering 202, the retrain's process dies, the served version cannot be
loaded (before the training, or during it), a second POST meets a running retrain; and
how the server reports each ending (a log line, mariana_serve_retrains_total)."""
from __future__ import annotations

import json
import os
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli, run_cli_cases
from tests.debian import debian_tool, promtool_check
from tests.integration.rankkill import running
from tests.integration.serving import Server
from tests.integration.test_retrain import decisions, retrain_config, retrain_training

pytestmark = pytest.mark.slow
TOKEN = "retrain-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    """A day to train on, a later one to score on, a small sample the served model knows,
    and a recipe of 12 epochs: a training of ~1.5 s, long enough to act on while it runs."""
    d = tmp_path_factory.mktemp("logs")
    out = {name: d / f"{name}.tsv" for name in ("train", "eval", "small")}
    generate_criteo(out["train"], 20_000, seed=21)
    generate_criteo(out["eval"], 20_000, seed=22)
    generate_criteo(out["small"], 2_000, seed=23)
    out["job"] = d / "job.toml"
    out["job"].write_text("[train]\nepochs = 12\n")
    return out


def served(tmp_path: Path, logs) -> Path:
    model_dir = tmp_path / "models"
    run_cli("-q", "train", "--data", logs["small"], "--model", "lr", "--out", model_dir, check=True)
    return model_dir


def windows(logs, **more) -> dict:
    return {"train_data": [str(logs["train"])], "eval_data": [str(logs["eval"])], **more}


def wait_state(s: Server, run: str, until: tuple[str, ...], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while (state := s.get(f"/v1/retrain/{run}", AUTH)[1])["state"] not in until:
        assert time.monotonic() < deadline, (state, s.logs())
        time.sleep(0.01)
    return state


def wait_job(s: Server, run: str, timeout: float = 90.0) -> dict:
    """The status of cluster retrain `run` once it names its job."""
    deadline = time.monotonic() + timeout
    while "job" not in (state := s.get(f"/v1/retrain/{run}", AUTH)[1]):
        assert time.monotonic() < deadline and state["state"] not in ("done", "failed"), (state, s.logs())
        time.sleep(0.05)
    return state


def kill_and_wait_reaped(s: Server, state: dict, run: str) -> None:
    """kill -9 a cluster retrain; back once its server has reaped it and said what became of its job."""
    os.kill(state["pid"], signal.SIGKILL)
    wait_state(s, run, ("failed",))
    deadline = time.monotonic() + 30
    while "its cluster job" not in s.logs():
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.2)


def wait_metric(s: Server, series: str, want: float, timeout: float = 20.0) -> str:
    """The /metrics page once `series` (name and labels, exactly) reads `want`."""
    deadline = time.monotonic() + timeout
    while True:
        text = s.get("/metrics")[1]["text"]
        if f"{series} {want:g}" in text.splitlines():
            return text
        assert time.monotonic() < deadline, (series, [line for line in text.splitlines() if "retrain" in line])
        time.sleep(0.2)


@contextmanager
def cluster_retrain(tmp_path: Path, logs, model_dir: Path):
    """A cluster, a server of `model_dir` whose retrain runs on it, and a retrain started over
    HTTP: (cluster, server, the 202's body, the retrain's status once it names its job)."""
    from tests.integration.cluster import Cluster

    with Cluster(tmp_path / "c") as c:
        retrain = windows(logs, mode="cluster", cluster_config=str(c.info["config"]), job_config=str(logs["job"]))
        with Server(tmp_path / "s", model_dir, serve={"token": TOKEN}, retrain=retrain) as s:
            status, started = s.post("/v1/retrain", b"", headers=AUTH)
            assert status == 202, started
            yield c, s, started, wait_job(s, started["id"])


def test_a_retrain_outlives_its_server_and_a_dead_one_is_failed(logs, tmp_path):
    """The retrain runs with a config of its own under .retrain/ (0600, no token): the server
    stopped right after its 202, a server started again finds it done. One whose process
    died before it said anything is failed with why, never "starting" for ever."""
    model_dir = served(tmp_path, logs)
    s = Server(tmp_path / "s", model_dir, serve={"token": TOKEN}, retrain=windows(logs))
    with s:
        status, killed = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 202, killed
        os.kill(int((model_dir / ".retrain.lock").read_text()), signal.SIGKILL)  # before its Python is up
        state = wait_state(s, killed["id"], ("done", "failed"), timeout=20)
        assert state["state"] == "failed" and "ended without a decision" in state["error"], state
        # recorded as every retrain's end is (the metric counted it, decisions.jsonl did not), its file too
        deadline = time.monotonic() + 10
        while not (model_dir / "decisions.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        (last,) = decisions(model_dir)
        assert last["verdict"] == "failed" and last["reason"] == "the retrain process ended without a decision"
        on_disk = json.loads((model_dir / ".retrain" / f"{killed['id']}.json").read_text())
        assert on_disk["state"] == "failed" and on_disk["killed"], on_disk
        # what a server that stopped as it started a retrain left, while no retrain runs: a status with no pid
        orphan = "r20260101-000000-abcdef"
        (model_dir / ".retrain" / f"{orphan}.json").write_text(json.dumps({"id": orphan, "state": "starting"}))
        state = s.get(f"/v1/retrain/{orphan}", AUTH)[1]
        assert state["state"] == "failed" and "before it recorded its pid" in state["error"], state
        status, started = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 202, started
    assert s.returncode == 0  # stopped (SIGTERM) while its retrain starts
    run = started["id"]
    config = model_dir / ".retrain" / f"{run}.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and TOKEN not in config.read_text()
    with s:  # the same server again, on a fresh run dir
        state = wait_state(s, run, ("done", "failed"))
        assert state["state"] == "done" and state["decision"]["verdict"] == "promoted", state


def test_a_busy_retrain_is_named_and_its_verdict_logged_and_counted(logs, tmp_path):
    """A 409 names the pid of the retrain running (the lock file holds it, without the NUL
    bytes a write at the inherited descriptor's offset left); its end is a log line of the
    server's and a count in mariana_serve_retrains_total{verdict}."""
    model_dir = served(tmp_path, logs)
    with Server(tmp_path / "s", model_dir, serve={"token": TOKEN},
                retrain=windows(logs, job_config=str(logs["job"]))) as s:
        status, started = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 202, started
        run = started["id"]
        pid = wait_state(s, run, ("training",))["pid"]
        status, busy = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 409 and f"running already (pid {pid})" in busy["error"], busy
        assert wait_state(s, run, ("done", "failed"))["decision"]["verdict"] == "promoted"
        assert (model_dir / ".retrain.lock").read_bytes() == f"{pid}\n".encode()
        text = wait_metric(s, 'mariana_serve_retrains_total{verdict="promoted"}', 1)
        promtool_check(debian_tool("promtool", "prometheus"), text)
        assert f"retrain {run} of {model_dir} ended: promoted (v000002: AUC " in s.log.read_text()


def test_a_served_version_that_cannot_be_loaded_trains_nothing(logs, tmp_path):
    """Checked before the training: one clear error, no candidate, no decision; over HTTP
    the retrain is failed, saying so, in the status, the server's log and its counter."""
    model_dir = served(tmp_path, logs)
    os.truncate(model_dir / "v000001" / "weights.safetensors", 1000)
    cfg = retrain_config(tmp_path, model_dir, **windows(logs))
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "the version in service, v000001, cannot be loaded" in proc.stderr and "nothing was trained" in proc.stderr
    with Server(tmp_path / "s", model_dir, serve={"token": TOKEN}, retrain=windows(logs)) as s:
        status, started = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 202, started
        state = wait_state(s, started["id"], ("done", "failed"))
        assert state["state"] == "failed" and "v000001, cannot be loaded" in state["error"], state
        wait_metric(s, 'mariana_serve_retrains_total{verdict="failed"}', 1)
        ended = f"retrain {started['id']} of {model_dir} ended: failed ({model_dir}: the version in service"
        assert ended in s.log.read_text()
    assert sorted(p.name for p in model_dir.glob("v*")) == ["v000001"] and not (model_dir / "decisions.jsonl").exists()


def test_a_candidate_that_cannot_be_gated_is_recorded_as_failed(logs, tmp_path):
    """The served version goes bad while the candidate trains: the gate cannot score it, and
    decisions.jsonl says so for the candidate left in the directory (verdict failed)."""
    model_dir = served(tmp_path, logs)
    cfg = retrain_config(tmp_path, model_dir, **windows(logs, job_config=str(logs["job"])))
    status = tmp_path / "status.json"
    proc = retrain_training(tmp_path, cfg, "--json")
    os.truncate(model_dir / "v000001" / "weights.safetensors", 1000)  # while it trains
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "v000002 was trained but could not be gated" in err, err
    last = decisions(model_dir)[-1]
    assert json.loads(out.strip().splitlines()[-1]) == last, out  # --json printed nothing on a failed verdict
    assert (last["verdict"], last["new_version"], last["served_version"]) == ("failed", "v000002", "v000001"), last
    assert "v000001/weights.safetensors: changed or damaged since the version was written" in last["reason"], last
    assert json.loads(status.read_text())["state"] == "failed"
    assert (model_dir / "CURRENT").read_text().strip() == "v000001"


def test_a_retrain_stopped_by_sigterm_while_training_is_recorded_as_failed(logs, tmp_path):
    """`systemctl stop` of the retrain timer's unit (SIGTERM) while it trained left no line in
    decisions.jsonl: only a retrain started over HTTP had its server record its end."""
    model_dir = served(tmp_path, logs)
    cfg = retrain_config(tmp_path, model_dir, **windows(logs, job_config=str(logs["job"])))
    status = tmp_path / "status.json"
    proc = retrain_training(tmp_path, cfg)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err
    last = decisions(model_dir)[-1]
    assert (last["verdict"], last["new_version"], last["served_version"]) == ("failed", None, "v000001"), last
    assert last["reason"] == "the retrain was stopped while training (stopped by SIGTERM); nothing was gated", last
    assert json.loads(status.read_text())["decision"] == last
    assert sorted(p.name for p in model_dir.glob("v0*")) == ["v000001"]


def test_retrain_without_a_model_dir_names_what_it_takes(tmp_path):
    """`mariana retrain` has no --model-dir: its error names only the config key."""
    cfg = tmp_path / "retrain.toml"
    cfg.write_text('[retrain]\ndata = "logs/*.tsv"\n')
    (code, err), (model_code, model_err) = run_cli_cases([["retrain", "--config", cfg],
                                                          ["model", "list", "--config", cfg]])
    assert code == 2 and "serve.model_dir" in err and "--model-dir" not in err, err
    assert model_code == 2 and "give --model-dir" in model_err, model_err  # `model` takes it


def test_an_eval_window_the_served_model_was_trained_on_is_refused(logs, tmp_path):
    """Scored on rows it learned from, the served model wins any gate; so is a model it was
    warm-started from. Refused before any training, naming the file and the version."""
    model_dir = tmp_path / "models"
    run_cli("-q", "train", "--data", logs["eval"], "--model", "lr", "--out", model_dir, check=True)
    cfg = retrain_config(tmp_path, model_dir, **windows(logs))
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{logs['eval']} is in the eval window, but the version in service was trained on it (v000001" \
        in proc.stderr, proc.stderr
    run_cli("-q", "train", "--data", logs["small"], "--model", "lr", "--init-from", model_dir, "--out", model_dir,
            check=True)  # v000002 goes on from v000001, which learned from the eval window
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and "(v000001, which v000002 was warm-started from, learned from it)" in proc.stderr
    assert sorted(p.name for p in model_dir.glob("v*")) == ["v000001", "v000002"]  # nothing trained
    small = tmp_path / "other"  # the control: a served model that never saw the eval window passes the check
    run_cli("-q", "train", "--data", logs["small"], "--model", "lr", "--out", small, check=True)
    assert run_cli("retrain", "--config", retrain_config(tmp_path, small, **windows(logs))).returncode == 0


@pytest.mark.timeout(240)
def test_a_killed_cluster_retrain_cancels_its_job_and_says_so(logs, tmp_path):
    """A cluster retrain killed (kill -9) while its job ran left the job running: it wrote a
    candidate no decision named, never gated (a second exploratory round). The server that
    started it now cancels the job and records a "failed" decision saying so."""
    model_dir = served(tmp_path, logs)
    with cluster_retrain(tmp_path, logs, model_dir) as (c, s, started, state):
        kill_and_wait_reaped(s, state, started["id"])
        job = c.job(state["job"])
    assert job["state"] == "cancelled", job
    last = decisions(model_dir)[-1]
    assert last["verdict"] == "failed" and last["job"] == state["job"], last
    assert last["reason"] == f"the retrain process ended without a decision; its cluster job {state['job']} cancelled"
    assert sorted(p.name for p in model_dir.glob("v0*")) == ["v000001"]  # nothing written after all


@pytest.mark.timeout(240)
def test_a_retrain_whose_job_another_client_cancels_is_recorded_as_failed(logs, tmp_path):
    """The retrain's cluster job cancelled by someone else (the web UI, `mariana cancel`):
    the retrain ended "failed" in its status, but decisions.jsonl (and so the UI's list of
    decisions) had no line for it (an exploratory run of concurrent use)."""
    model_dir = served(tmp_path, logs)
    with cluster_retrain(tmp_path, logs, model_dir) as (c, s, started, state):
        code, _ = c.request("POST", f"/v1/jobs/{state['job']}/cancel")
        assert code == 200
        ended = wait_state(s, started["id"], ("failed", "done"))
    assert ended["state"] == "failed", ended
    last = decisions(model_dir)[-1]
    assert (last["verdict"], last["job"], last["served_version"]) == ("failed", state["job"], "v000001"), last
    assert last["reason"].startswith("its training job ended without a version: job ") \
        and "cancelled by request" in last["reason"], last
    assert (model_dir / "CURRENT").read_text().strip() == "v000001"


def test_a_retrain_whose_training_fails_is_recorded_as_failed(logs, tmp_path):
    """Local mode, a training window of non-clicks only (refused after training): recorded."""
    model_dir = served(tmp_path, logs)
    zeros = tmp_path / "zeros.tsv"
    zeros.write_text("".join("0" + line[1:] for line in logs["small"].read_text().splitlines(keepends=True)))
    proc = run_cli("retrain", "--config", retrain_config(tmp_path, model_dir, train_data=[str(zeros)],
                                                         eval_data=[str(logs["eval"])]), "--json")
    assert proc.returncode == 2 and "is a non-click" in proc.stderr, proc.stderr
    last = decisions(model_dir)[-1]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == last, proc.stdout
    assert (last["verdict"], last["new_version"], last["train_data"]) == ("failed", None, [str(zeros)]), last
    assert last["reason"].startswith("training failed: ") and "non-click" in last["reason"], last


def test_a_killed_retrain_on_a_temporary_cluster_stops_it_and_says_so(logs, tmp_path):
    """With no cluster up in its config's dir, a cluster retrain runs its job on a temporary one.
    Killed (kill -9), it left that cluster running for ever (its job too), and the server looked
    for the job in the configured dir, where no cluster was: "could not be cancelled". The
    temporary cluster now stops once its retrain is gone, and the decision says so."""
    model_dir = served(tmp_path, logs)
    cluster_cfg = tmp_path / "cluster.toml"
    cluster_cfg.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\n')  # nothing is up there
    retrain = windows(logs, mode="cluster", cluster_config=str(cluster_cfg), job_config=str(logs["job"]))
    with Server(tmp_path / "s", model_dir, serve={"token": TOKEN}, retrain=retrain,
                prefix=["env", f"TMPDIR={tmp_path}"]) as s:
        status, started = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 202, started
        state = wait_job(s, started["id"])
        (cluster_dir,) = tmp_path.glob("mariana-cluster-*")
        assert state["temporary_cluster"] == str(cluster_dir), state
        pids = [r["pid"] for r in json.loads((cluster_dir / "cluster.json").read_text())["services"]]
        kill_and_wait_reaped(s, state, started["id"])
    last = decisions(model_dir)[-1]
    assert last["verdict"] == "failed" and last["job"] == state["job"], last
    assert last["reason"] == (f"the retrain process ended without a decision; its cluster job {state['job']} ended "
                              f"with the temporary cluster it ran on ({cluster_dir}), stopped"), last
    assert not (cluster_dir / "cluster.json").exists()
    assert not [p for p in pids if running(p)], pids
    assert sorted(p.name for p in model_dir.glob("v0*")) == ["v000001"]
