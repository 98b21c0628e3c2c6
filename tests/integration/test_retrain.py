"""The retrain gate on real data windows, from the command line and over HTTP:
a model trained on shuffled labels is refused, a better one is promoted,
every decision is recorded, and a server swaps to what was promoted."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli
from tests.integration.serving import Server

pytestmark = pytest.mark.slow
TOKEN = "retrain-token"


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict[str, Path]:
    """Four days of logs from the planted model, a day with its labels shuffled, and a
    small sample the served model is trained on (so a day of data can beat it)."""
    d = tmp_path_factory.mktemp("logs")
    out = {}
    for i in range(1, 5):
        out[f"day{i}"] = d / f"day0{i}.tsv"
        generate_criteo(out[f"day{i}"], 20_000, seed=10 + i)
    lines = out["day2"].read_text().splitlines(keepends=True)
    labels = [line.split("\t", 1)[0] for line in lines]
    random.Random(7).shuffle(labels)
    out["shuffled"] = d / "shuffled.tsv"
    out["shuffled"].write_text("".join(lab + "\t" + line.split("\t", 1)[1] for lab, line in zip(labels, lines)))
    out["small"] = d / "small.tsv"
    out["small"].write_text("".join(out["day1"].read_text().splitlines(keepends=True)[:3000]))
    return out


def served_model(tmp_path: Path, days) -> Path:
    model_dir = tmp_path / "models"
    run_cli("-q", "train", "--data", days["small"], "--model", "lr", "--batch-size", "256", "--out", model_dir,
            check=True)
    return model_dir


def retrain_config(tmp_path: Path, model_dir: Path, file: str = "retrain.toml", **retrain) -> Path:
    path = tmp_path / file
    lines = ["[serve]", f'model_dir = "{model_dir}"', "[retrain]"] + [f"{k} = {json.dumps(v)}" for k, v in retrain.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def retrain_training(tmp_path: Path, cfg: Path, *flags: str) -> subprocess.Popen:
    """`mariana retrain --config cfg` as a process, returned once its status says it trains."""
    status = tmp_path / "status.json"
    proc = subprocess.Popen([sys.executable, "-m", "mariana", "retrain", "--config", str(cfg), *flags,
                             "--status-file", str(status)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not (status.exists() and json.loads(status.read_text() or "{}").get("state") in ("training", "failed")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    return proc


def decisions(model_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "decisions.jsonl").read_text().splitlines()]


def test_the_gate_refuses_a_worse_model_and_promotes_a_better_one(days, tmp_path):
    model_dir = served_model(tmp_path, days)
    worse = retrain_config(tmp_path, model_dir, train_data=[str(days["shuffled"])], eval_data=[str(days["day4"])])
    refused = json.loads(run_cli("retrain", "--config", worse, "--json", check=True).stdout)
    assert refused["verdict"] == "refused" and refused["new_version"] == "v000002"
    assert refused["served_version"] == "v000001"
    new, served = refused["metrics"]["new"]["auc"], refused["metrics"]["served"]["auc"]
    assert new < served and served > 0.6 and abs(new - 0.5) < 0.05, refused  # shuffled labels: a coin toss
    assert (model_dir / "CURRENT").read_text().strip() == "v000001"         # still the old one
    assert (model_dir / "v000002").is_dir()                                    # the candidate stays, for a look

    better = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"]), str(days["day3"])],
                            eval_data=[str(days["day4"])])
    promoted = json.loads(run_cli("retrain", "--config", better, "--json", check=True).stdout)
    assert promoted["verdict"] == "promoted" and promoted["new_version"] == "v000003"
    assert promoted["metrics"]["new"]["auc"] > promoted["metrics"]["served"]["auc"]
    assert promoted["train_rows"] == 40_000
    assert (model_dir / "CURRENT").read_text().strip() == "v000003"

    log = decisions(model_dir)
    assert [d["verdict"] for d in log] == ["refused", "promoted"]
    assert log[0]["eval_data"] == [str(days["day4"])] and "AUC" in log[0]["reason"]
    moves = [json.loads(line) for line in (model_dir / "promotions.jsonl").read_text().splitlines()]
    assert [(m["from"], m["to"], m["reason"]) for m in moves] == [(None, "v000001", "trained"),
                                                                  ("v000001", "v000003", "retrain")]
    run_cli("model", "rollback", "--model-dir", model_dir, check=True)
    assert (model_dir / "CURRENT").read_text().strip() == "v000001"


def test_with_current_deleted_the_gate_holds_against_the_version_the_servers_serve(days, tmp_path):
    """CURRENT deleted by hand: the servers go on serving the version it was moved to last,
    but a retrain gated against nothing ("nothing was served") and promoted a candidate
    trained on shuffled labels. It is gated against that version now, and a better one
    is promoted over it."""
    model_dir = served_model(tmp_path, days)
    (model_dir / "CURRENT").unlink()
    worse = retrain_config(tmp_path, model_dir, train_data=[str(days["shuffled"])], eval_data=[str(days["day4"])])
    refused = json.loads(run_cli("retrain", "--config", worse, "--json", check=True).stdout)
    assert (refused["verdict"], refused["served_version"]) == ("refused", "v000001"), refused
    assert not (model_dir / "CURRENT").exists()
    better = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])], eval_data=[str(days["day4"])])
    promoted = json.loads(run_cli("retrain", "--config", better, "--json", check=True).stdout)
    assert (promoted["verdict"], promoted["served_version"]) == ("promoted", "v000001"), promoted
    assert (model_dir / "CURRENT").read_text().strip() == "v000003"
    moves = [json.loads(line) for line in (model_dir / "promotions.jsonl").read_text().splitlines()]
    assert (moves[-1]["from"], moves[-1]["to"]) == ("v000001", "v000003")


def test_a_training_file_gone_mid_run_is_a_failed_decision(days, tmp_path, monkeypatch):
    """A file of the window removed while the candidate trained: an OSError, not a MarianaError,
    left no line in decisions.jsonl, and over HTTP the status said "FileNotFoundError: ..." as a
    bug's. (The removal, mid-run, stands in as the error it raises.)"""
    from mariana.serving.config import load_serve_config
    from mariana.serving.retrain import RetrainFailed, run_retrain
    from mariana.trainer import job

    model_dir = served_model(tmp_path, days)
    gone = str(tmp_path / "day3.tsv")

    def removed(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", gone)

    monkeypatch.setattr(job, "run_local_job", removed)
    cfg = load_serve_config(str(retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])],
                                               eval_data=[str(days["day4"])])))
    with pytest.raises(RetrainFailed, match=f"retrain {model_dir}: {gone}: No such file or directory"):
        run_retrain(cfg, str(tmp_path / "status.json"))
    (line,) = decisions(model_dir)
    assert line["verdict"] == "failed" and f"{gone}: No such file or directory" in line["reason"], line
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "failed"


def test_the_gate_can_hold_the_logloss_too(days, tmp_path):
    """retrain.gate = ["logloss"] judges the candidate's logloss (AUC alone cannot see pCTRs
    that are off); with both, a better candidate passes both and the reason names both."""
    model_dir = served_model(tmp_path, days)
    shuffled = retrain_config(tmp_path, model_dir, "ll.toml", train_data=[str(days["shuffled"])],
                              eval_data=[str(days["day4"])], gate=["logloss"])
    refused = json.loads(run_cli("retrain", "--config", shuffled, "--json", check=True).stdout)
    assert refused["verdict"] == "refused" and refused["gate"] == ["logloss"], refused
    why = refused["reason"]
    assert why.startswith("logloss ") and "> served" in why and "AUC" not in why, why
    both = retrain_config(tmp_path, model_dir, "both.toml", train_data=[str(days["day2"]), str(days["day3"])],
                          eval_data=[str(days["day4"])], gate=["auc", "logloss"], logloss_tolerance=0.01)
    promoted = json.loads(run_cli("retrain", "--config", both, "--json", check=True).stdout)
    assert promoted["verdict"] == "promoted" and promoted["logloss_tolerance"] == 0.01, promoted
    assert "AUC " in promoted["reason"] and "logloss " in promoted["reason"] and "(1 + tolerance 0.01)" in \
        promoted["reason"], promoted
    bad = retrain_config(tmp_path, model_dir, "bad.toml", gate=["ndcg"])
    proc = run_cli("retrain", "--config", bad)
    assert proc.returncode == 2 and "retrain.gate must name one or both of ['auc', 'logloss'], got ['ndcg']" in \
        proc.stderr, proc.stderr


def test_a_retrain_with_nothing_new_to_learn_trains_nothing(days, tmp_path):
    """A timer retraining while no new log came trained the same window again and again: each
    time a copy of the served model (promoted, equal AUC), and retrain.keep_versions pruned the
    versions a rollback needs to make room for the copies. Now such a retrain is "skipped";
    a file written since, or skip_unchanged = false, trains again."""
    model_dir = served_model(tmp_path, days)  # v000001, trained on days["small"]
    window = {"train_data": [str(days["small"])], "eval_data": [str(days["day4"])]}
    same = retrain_config(tmp_path, model_dir, **window)
    skipped = json.loads(run_cli("retrain", "--config", same, "--json", check=True).stdout)
    assert skipped["verdict"] == "skipped" and skipped["new_version"] is None, skipped
    assert skipped["reason"].startswith("v000001, in service, was trained on these 1 file(s) with this recipe, and "
                                        "none has changed since: nothing new to learn"), skipped
    assert sorted(p.name for p in model_dir.glob("v0*")) == ["v000001"]
    force = retrain_config(tmp_path, model_dir, "forced.toml", skip_unchanged=False, **window)
    forced = json.loads(run_cli("retrain", "--config", force, "--json", check=True).stdout)
    assert forced["verdict"] in ("promoted", "refused") and forced["new_version"] == "v000002", forced
    again = json.loads(run_cli("retrain", "--config", same, "--json", check=True).stdout)
    assert again["verdict"] == "skipped", again  # whichever of the two is in service learned this window
    served_recipe = tmp_path / "served-recipe.toml"  # the recipe in service, its "auto"s left to resolve
    served_recipe.write_text('[model]\nkind = "lr"\n[train]\nbatch_size = 256\n')
    by_config = json.loads(run_cli("retrain", "--config", retrain_config(
        tmp_path, model_dir, "by-config.toml", job_config=str(served_recipe), **window), "--json", check=True).stdout)
    assert by_config["verdict"] == "skipped", by_config  # was trained again: 'auto' != the manifest's -3.2, 256, 0
    other = json.loads(run_cli("retrain", "--config", retrain_config(
        tmp_path, model_dir, "other.toml", train_data=[str(days["small"])], eval_data=[str(days["day4"])],
        job_config=str(recipe(tmp_path))), "--json", check=True).stdout)
    assert other["new_version"] == "v000003", other  # another recipe: something new to learn
    os.utime(days["small"])  # written since: trained again
    touched = json.loads(run_cli("retrain", "--config", same, "--json", check=True).stdout)
    assert touched["new_version"] == "v000004", touched
    copied, sources = tmp_path / "small.tsv", [tmp_path / "a.tsv", tmp_path / "b.tsv"]
    for source, day in zip(sources, ("day2", "day3")):
        source.write_text("".join(days[day].read_text().splitlines(keepends=True)[:3000]))
    shutil.copy2(sources[0], copied)
    window["train_data"] = [str(copied)]
    json.loads(run_cli("retrain", "--config", retrain_config(tmp_path, model_dir, "copied.toml", **window),
                       "--json", check=True).stdout)
    os.utime(sources[1], (0, 0))
    shutil.copy2(sources[1], copied)  # `cp -p` of other rows over the window: their old mtime kept
    again = json.loads(run_cli("retrain", "--config", retrain_config(tmp_path, model_dir, "copied.toml", **window),
                               "--json", check=True).stdout)
    assert again["verdict"] != "skipped", again  # new rows under an old mtime: skipped, as if nothing came
    assert [d["verdict"] for d in decisions(model_dir)][0:1] == ["skipped"]


def test_a_refused_candidate_is_not_trained_again_on_the_same_windows(days, tmp_path):
    """skip_unchanged looked only at what the served version learned: a candidate refused on
    a window was trained and refused again on each timer tick with no new logs (a refused
    copy each time, taking the newest slots keep_versions keeps)."""
    model_dir = served_model(tmp_path, days)
    worse = retrain_config(tmp_path, model_dir, train_data=[str(days["shuffled"])], eval_data=[str(days["day4"])])
    first = json.loads(run_cli("retrain", "--config", worse, "--json", check=True).stdout)
    assert first["verdict"] == "refused" and first["new_version"] == "v000002", first
    for _ in range(2):  # the skipped line in between does not hide the refusal from the next one
        again = json.loads(run_cli("retrain", "--config", worse, "--json", check=True).stdout)
        assert again["verdict"] == "skipped" and again["reason"].startswith(
            "v000002 was trained on this window with this recipe and refused against v000001, still in service"), again
    assert sorted(p.name for p in model_dir.glob("v0*")) == ["v000001", "v000002"]
    other_eval = retrain_config(tmp_path, model_dir, "e5.toml", train_data=[str(days["shuffled"])],
                                eval_data=[str(days["day3"])])
    assert json.loads(run_cli("retrain", "--config", other_eval, "--json", check=True).stdout)["new_version"] == \
        "v000003"  # another eval window: decided anew


def test_a_rollback_is_not_undone_by_the_next_retrain_on_the_same_windows(days, tmp_path):
    """Promoted, then rolled back by the operator: the next retrain with no new logs trained a
    copy of the rolled-back version and promoted it again. It is skipped now."""
    model_dir = served_model(tmp_path, days)
    head = tmp_path / "day2-head.tsv"
    head.write_text("".join(days["day2"].read_text().splitlines(keepends=True)[:3000]))
    cfg = retrain_config(tmp_path, model_dir, train_data=[str(head)], eval_data=[str(days["day4"])],
                         auc_tolerance=0.5)  # promoted whatever it scores
    assert json.loads(run_cli("retrain", "--config", cfg, "--json", check=True).stdout)["verdict"] == "promoted"
    run_cli("model", "rollback", "--model-dir", model_dir, check=True)
    again = json.loads(run_cli("retrain", "--config", cfg, "--json", check=True).stdout)
    assert again["verdict"] == "skipped" and "promoted over v000001 and rolled back to it" in again["reason"], again
    assert (model_dir / "CURRENT").read_text().strip() == "v000001"


def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text('[model]\nkind = "lr"\n[train]\nbatch_size = 512\n')
    return path


def test_a_warm_start_retrain_goes_on_from_the_served_version(days, tmp_path):
    """Daily incremental training: the candidate starts from the served version's weights
    and optimizer state (its manifest names that parent) and sees only the new day."""
    model_dir = served_model(tmp_path, days)
    cfg = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])], eval_data=[str(days["day4"])],
                         warm_start=True)
    decision = json.loads(run_cli("retrain", "--config", cfg, "--json", check=True).stdout)
    assert decision["warm_start"] is True and decision["train_rows"] == 20_000
    manifest = json.loads((model_dir / decision["new_version"] / "manifest.json").read_text())
    assert manifest["parent"]["version"] == "v000001" and manifest["parent"]["model_dir"] == str(model_dir)
    assert manifest["rows_trained"] == 3_000 + 20_000  # the parent's rows, then the day's
    cold = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])], eval_data=[str(days["day4"])],
                          skip_unchanged=False)  # the served version learned day 2: trained again on purpose
    decision = json.loads(run_cli("retrain", "--config", cold, "--json", check=True).stdout)
    manifest = json.loads((model_dir / decision["new_version"] / "manifest.json").read_text())
    assert decision["warm_start"] is False and "parent" not in manifest and manifest["rows_trained"] == 20_000


@pytest.mark.timeout(300)
def test_a_cluster_retrain_warm_starts_from_the_served_version(days, tmp_path):
    """retrain.mode = "cluster" with warm_start: the job (on a cluster started for it) goes on
    from the served version, every shard from its slice of it; the manifest names the parent."""
    model_dir = served_model(tmp_path, days)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(f'[cluster]\ndir = "{tmp_path / "c"}"\n[worker]\ncount = 1\n[ps]\ncount = 2\n')
    cfg = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])], eval_data=[str(days["day4"])],
                         warm_start=True, mode="cluster", cluster_config=str(cluster))
    decision = json.loads(run_cli("retrain", "--config", cfg, "--json", check=True).stdout)
    assert decision["warm_start"] is True and decision["train_rows"] == 20_000
    manifest = json.loads((model_dir / decision["new_version"] / "manifest.json").read_text())
    assert manifest["train"]["mode"].startswith("cluster/") and manifest["train"]["shards"] == 2
    assert manifest["parent"] == {"model_dir": str(model_dir), "version": "v000001", "rows_trained": 3_000,
                                  "learned": [str(days["small"])]}
    assert manifest["rows_trained"] == 3_000 + 20_000
    assert decision["metrics"]["new"]["auc"] > decision["metrics"]["served"]["auc"]  # a day more than 3,000 rows


def rolled_back(tmp_path: Path, days) -> Path:
    """A model dir whose v000002 was rolled back: v000001 served."""
    model_dir = served_model(tmp_path, days)
    run_cli("-q", "train", "--data", days["day1"], "--model", "lr", "--out", model_dir, check=True)  # v000002
    run_cli("model", "rollback", "--model-dir", model_dir, check=True)  # v000001 is served again
    return model_dir


def test_a_promotion_during_the_retrain_stands(days, tmp_path):
    """The candidate was gated against the version served when the retrain began; if an
    operator promotes another one meanwhile, the retrain does not move CURRENT over it: the
    verdict is refused, saying why, and the operator's promotion stays."""
    from mariana.trainer import checkpoint

    model_dir = rolled_back(tmp_path, days)
    proc = retrain_training(tmp_path, retrain_config(tmp_path, model_dir, train_data=[str(days["day2"]),
                                                                                   str(days["day3"])],
                                                     eval_data=[str(days["day4"])]), "--json")
    checkpoint.set_current(model_dir, "v000002", reason="promoted")  # the operator, while it trains
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    decision = json.loads(out)
    assert decision["verdict"] == "refused" and decision["served_version"] == "v000001", decision
    assert "CURRENT moved from v000001 to v000002 during the retrain" in decision["reason"], decision
    assert decision["metrics"]["new"]["auc"] > decision["metrics"]["served"]["auc"]  # the gate itself passed
    assert (model_dir / "CURRENT").read_text().strip() == "v000002"
    assert decisions(model_dir)[-1]["verdict"] == "refused"


def test_retrain_needs_a_window_and_a_recipe(days, tmp_path):
    model_dir = tmp_path / "empty"
    model_dir.mkdir()
    cfg = retrain_config(tmp_path, model_dir, data=str(days["day1"].parent / "day*.tsv"), train_files=9)
    short = run_cli("retrain", "--config", cfg)
    assert short.returncode == 2 and "matches 4 file(s)" in short.stderr
    cfg = retrain_config(tmp_path, model_dir, data=str(days["day1"].parent / "day*.tsv"))
    no_recipe = run_cli("retrain", "--config", cfg)
    assert no_recipe.returncode == 2 and "set retrain.job_config" in no_recipe.stderr


def test_retrain_refuses_a_model_dir_serving_a_speech_version(days, tmp_path):
    from tests.speechdata import write_archive
    model_dir = tmp_path / "speech"
    run_cli("-q", "train", "speech", "--data", write_archive(tmp_path / "fsdd_recordings.tar.gz"), "--epochs", "1",
            "--batch-size", "256", "--out", model_dir, env={"MARIANA_CACHE": str(tmp_path / "cache")}, check=True)
    cfg = retrain_config(tmp_path, model_dir, train_data=[str(days["day1"])], eval_data=[str(days["day4"])])
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and "v000001, is a speech model" in proc.stderr, proc.stderr
    assert sorted(p.name for p in model_dir.iterdir() if p.name.startswith("v")) == ["v000001"]  # nothing trained


def test_retrain_publishes_nothing_from_an_empty_or_diverged_training(days, tmp_path):
    """A window with no valid rows, or a recipe that diverges, leaves no candidate version and
    CURRENT where it was, and a "failed" decision saying why; a window refused before any
    training leaves no decision."""
    model_dir = served_model(tmp_path, days)
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    cfg = retrain_config(tmp_path, model_dir, train_data=[str(empty)], eval_data=[str(days["day4"])])
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and "no valid training rows in empty.tsv: nothing to publish" in proc.stderr
    recipe = tmp_path / "job.toml"
    recipe.write_text('[optim]\nlinear = "adagrad"\nlr = 1e38\n[train]\nbatch_size = 512\n')
    cfg = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])], eval_data=[str(days["day4"])],
                         job_config=str(recipe))
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and "training diverged" in proc.stderr, proc.stderr
    # a mistyped model dir: it was made, and trained into with "nothing was served"
    cfg = retrain_config(tmp_path, tmp_path / "typo", "typo.toml", train_data=[str(days["day2"])],
                         eval_data=[str(days["day4"])], job_config=str(recipe))
    proc = run_cli("retrain", "--config", cfg)
    assert proc.returncode == 2 and "typo: no such model directory" in proc.stderr, proc.stderr
    assert not (tmp_path / "typo").exists()
    # an eval window that could score nothing is refused before the training, not after it
    garbage = tmp_path / "garbage.tsv"
    garbage.write_bytes(bytes(range(256)) * 64)
    for window, says in ((empty, "no valid eval window rows in"), (garbage, "not in criteo format")):
        cfg = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"])], eval_data=[str(window)])
        proc = run_cli("retrain", "--config", cfg)
        assert proc.returncode == 2 and says in proc.stderr and "training" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in model_dir.glob("v*")) == ["v000001"]
    assert (model_dir / "CURRENT").read_text().strip() == "v000001"
    failed = decisions(model_dir)
    assert [(d["verdict"], d["new_version"]) for d in failed] == [("failed", None)] * 2, failed
    assert "no valid training rows" in failed[0]["reason"] and "training diverged" in failed[1]["reason"], failed


def test_retrain_over_http_behind_a_token(days, tmp_path):
    model_dir = served_model(tmp_path, days)
    retrain = {"data": str(days["day1"].parent / "day0*.tsv"), "train_files": 2, "eval_files": 1}
    with Server(tmp_path / "s", model_dir, workers=2, serve={"token": TOKEN, "watch_seconds": 0.3},
                retrain=retrain) as s:
        s.wait_for("/readyz")
        assert s.post("/v1/retrain", b"")[0] == 401
        assert s.post("/v1/retrain", b"", headers={"Authorization": "Bearer wrong"})[0] == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, refused = s.post("/v1/retrain", b'{"data": "/elsewhere/*.tsv"}', headers=auth)  # was a 202
        assert status == 400 and "takes no body" in refused["error"], refused
        status, started = s.post("/v1/retrain", b"", headers=auth)
        assert status == 202 and started["state"] == "starting", started
        # at once, before the child's Python is up, on fresh connections (so both workers get
        # some): the lock was taken before the child started, for every worker to see
        again = [s.post("/v1/retrain", b"", headers=auth) for _ in range(4)]
        assert all(st == 409 and "running already" in a["error"] for st, a in again), again
        run = started["id"]
        deadline = time.monotonic() + 120
        while (state := s.get(f"/v1/retrain/{run}", auth)[1])["state"] in ("starting",):
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        if state["state"] in ("training", "evaluating"):  # one at a time
            status, busy = s.post("/v1/retrain", b"", headers=auth)
            assert status == 409 and "running already" in busy["error"], busy
        while state["state"] not in ("done", "failed"):
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
            state = s.get(f"/v1/retrain/{run}", auth)[1]
        assert state["state"] == "done", state
        decision = state["decision"]
        assert decision["verdict"] == "promoted" and decision["served_version"] == "v000001"
        assert [Path(p).name for p in decision["train_data"]] == ["day02.tsv", "day03.tsv"]
        assert [Path(p).name for p in decision["eval_data"]] == ["day04.tsv"]
        new = decision["new_version"]
        while s.get("/readyz")[1]["model_version"] != new:  # the server swaps to the promoted version
            assert time.monotonic() < deadline, s.logs()
            time.sleep(0.1)
        assert s.get("/v1/retrain/r20260101-000000-abcdef", auth)[0] == 404
        assert s.get("/v1/retrain/..%2F..%2Fetc", auth)[0] == 404
        (model_dir / ".retrain" / f"{run}.json").write_text("[1, 2]")  # damaged: was a 500
        status, damaged = s.get(f"/v1/retrain/{run}", auth)
        assert status == 200 and damaged["state"] == "unknown" and "holds no status object" in damaged["error"]
    assert decisions(model_dir)[-1]["new_version"] == new


def test_admin_endpoints_are_off_without_a_token(days, tmp_path):
    model_dir = served_model(tmp_path, days)
    with Server(tmp_path / "s", model_dir) as s:
        status, answer = s.post("/v1/retrain", b"", headers={"Authorization": "Bearer "})
        assert status == 403 and "serve.token" in answer["error"]


def test_a_promotion_whose_decision_cannot_be_written_stands_and_says_so(days, tmp_path):
    """decisions.jsonl unwritable (a full disk, a file of another owner): the retrain exited
    2 with "permission denied" while its candidate was in service, unannounced, and its
    status said failed. The promotion stands, the retrain ends, and the log says it was not
    recorded."""
    model_dir = served_model(tmp_path, days)
    (model_dir / "decisions.jsonl").mkdir()  # an append to it fails, as to a file it may not write
    config = retrain_config(tmp_path, model_dir, train_data=[str(days["day2"]), str(days["day3"])],
                            eval_data=[str(days["day4"])])
    proc = run_cli("retrain", "--config", config, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "promoted"
    assert (model_dir / "CURRENT").read_text().strip() == "v000002"
    assert "promoted v000002, but decisions.jsonl could not record it (Is a directory); CURRENT names v000002" \
        in proc.stderr, proc.stderr


def test_a_served_version_promoted_away_and_pruned_during_the_retrain_is_a_refusal(days, tmp_path):
    """As above, and a prune then removes the version the retrain began with: the verdict is
    still refused because CURRENT moved (it was "failed", saying that CURRENT still named the
    removed version)."""
    from mariana.trainer import checkpoint

    model_dir = rolled_back(tmp_path, days)
    proc = retrain_training(tmp_path, retrain_config(tmp_path, model_dir, train_data=[str(days["day2"]),
                                                                                   str(days["day3"])],
                                                     eval_data=[str(days["day4"])]), "--json")
    # while it trains: a promotion, another publish (a version only named here, never loaded), a prune
    checkpoint.set_current(model_dir, "v000002", reason="promoted")
    newer = checkpoint.save_version(model_dir, {}, {"w": np.zeros(1, np.float32)}, reason="trained")
    assert "v000001" in [x["name"] for x in checkpoint.prune(model_dir, keep=1)["removed"]]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    decision = json.loads(out)
    assert decision["verdict"] == "refused" and decision["served_version"] == "v000001", decision
    assert f"CURRENT moved from v000001 to {newer} during the retrain" in decision["reason"], decision
    assert (model_dir / "CURRENT").read_text().strip() == newer
    assert decisions(model_dir)[-1]["verdict"] == "refused"
