"""Version retention on real model directories, by real processes: `mariana model prune`
keeps CURRENT, the rollback target and the newest N, and nothing but versions (and what an
interrupted prune left) is removed; a rollback after a prune still works, a server whose
swapped-out version was pruned keeps serving, and `retrain.keep_versions` / `keep_runs`
keep a daily retrain from filling the disk."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from mariana.serving.config import ServeConfig, load_serve_config
from mariana.sparse.errors import ConfigError
from mariana.sparse.synth import generate_criteo
from mariana.trainer import checkpoint
from tests.conftest import ROOT, run_cli, run_cli_cases
from tests.integration.serving import Server, tsv_instances
from tests.integration.test_retrain import decisions, retrain_config, served_model



def versions_made(d: Path, *moves: str | None) -> None:
    """One version per item: a reason moves CURRENT to it (recorded), None leaves it a candidate.
    Each a real (untrained, bits 10) LR: `model promote` and `rollback` load what they move to."""
    from mariana.trainer.bundle import ModelBundle
    from mariana.trainer.config import load_config

    cfg = load_config(env={}, overrides={"model.kind": "lr", "hashing.bits": 10})
    bundle = ModelBundle(cfg, cfg.data.resolve_schema())
    for reason in moves:
        version = bundle.save(str(d), make_current=False)
        if reason is not None:
            checkpoint.set_current(d, version, reason=reason)


def on_disk(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_prune_keeps_current_the_rollback_target_and_the_newest(tmp_path):
    d = tmp_path / "m"
    # v1 served, v2 promoted over it, v3 refused, v4 promoted (its rollback target: v2), v5 and v6 candidates
    versions_made(d, "trained", "promoted", None, "retrain", None, None)
    crashed = d / ".pruned-v000009-4242"  # what a prune killed mid-delete left
    crashed.mkdir()
    (crashed / checkpoint.WEIGHTS).write_bytes(b"x" * 1000)
    others = {"notes.txt": "a file", "v000099": "a file named like a version", ".tmp-abc/w": "a write in progress",
              "v7/w": "not a version name", ".pruned-notes": "not what a prune leaves"}
    for name, text in others.items():
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text(text)
    sizes = {p.name: size(p) for p in d.iterdir() if p.is_dir()}
    before = on_disk(d)

    dry = run_cli("model", "prune", "--keep", "2", "--model-dir", d, "--dry-run", check=True).stdout
    assert on_disk(d) == before, "--dry-run removed something"
    assert f"would remove v000001  {sizes['v000001']:,} bytes" in dry and "would remove v000003" in dry
    assert "would remove .pruned-v000009-4242  1,000 bytes  (left by an interrupted prune)" in dry
    assert "--dry-run: nothing was removed" in dry

    out = run_cli("model", "prune", "--keep", "2", "--model-dir", d, check=True).stdout
    removed = ["v000001", "v000003", ".pruned-v000009-4242"]
    freed = sum(sizes[n] for n in removed)
    lines = out.splitlines()
    leftover = "  (left by an interrupted prune)"
    assert lines[:3] == [f"removed {n}  {sizes[n]:,} bytes" + (leftover if n[0] == "." else "") for n in removed], out
    assert lines[3] == "kept v000002 (rollback target), v000004 (CURRENT), v000005 (newest 2), v000006 (newest 2)"
    assert lines[4] == f"{d}: removed 2 version(s) and 1 leftover(s), {freed:,} bytes freed"
    assert on_disk(d) == before - set(removed)  # every other name untouched
    for name, text in others.items():
        assert (d / name).read_text() == text
    assert checkpoint.current_version(d) == "v000004"

    # --keep 1 with CURRENT and the rollback target the oldest: they stay, the newest too
    report = json.loads(run_cli("model", "prune", "--keep", "1", "--model-dir", d, "--json", check=True).stdout)
    assert [r["name"] for r in report["removed"]] == ["v000005"] and report["bytes_freed"] == sizes["v000005"]
    assert checkpoint.list_versions(d) == ["v000002", "v000004", "v000006"]

    # history stays, naming versions no longer here: the listings cope
    assert [m["to"] for m in checkpoint.promotions(d)] == ["v000001", "v000002", "v000004"]
    listed = json.loads(run_cli("model", "list", "--model-dir", d, "--json", check=True).stdout)
    assert [v["version"] for v in listed["versions"]] == ["v000002", "v000004", "v000006"]
    assert [v["version"] for v in checkpoint.overview(d)["versions"]] == ["v000006", "v000004", "v000002"]


def test_a_bad_keep_is_refused_with_one_line(tmp_path):
    d = tmp_path / "m"
    versions_made(d, "trained", "trained", "trained")
    cases = [["model", "prune", "--keep", "0", "--model-dir", d], ["model", "prune", "--keep", "-3", "--model-dir", d],
             ["model", "prune", "--model-dir", d], ["model", "list", "--keep", "1", "--model-dir", d],
             ["model", "prune", "v000001", "--keep", "1", "--model-dir", d],
             ["model", "config", "--json", "--model-dir", d],  # it printed TOML, exit 0
             ["model", "list", "v000001", "--model-dir", d]]  # the version was ignored
    got = run_cli_cases(cases)
    for (code, err), says in zip(got, ("(got 0)", "(got -3)", "(none given)", "are for 'mariana model prune'",
                                       "takes no VERSION", "model config: --json is for list, prune",
                                       "model list: lists every version; 'v000001' is for")):
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (code, err)
    assert "--keep N must be >= 1" in got[0][1]
    assert checkpoint.list_versions(d) == ["v000001", "v000002", "v000003"]


def test_rollback_after_a_prune_goes_to_the_target_it_kept(tmp_path):
    d = tmp_path / "m"
    versions_made(d, "trained", "promoted", None, "retrain", None)  # CURRENT v4, rollback target v2
    run_cli("model", "prune", "--keep", "1", "--model-dir", d, check=True)
    assert checkpoint.list_versions(d) == ["v000002", "v000004", "v000005"]
    back = json.loads(run_cli("model", "rollback", "--model-dir", d, check=True).stdout)
    assert (back["current"], back["previous"]) == ("v000002", "v000004")
    # the one served before v2 was pruned: said in one line, nothing moved
    again = run_cli("model", "rollback", "--model-dir", d)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert again.stderr.strip() == (f"mariana: error: {d}: nothing to roll back to: v000001, served before v000002, "
                                    "is no longer in the directory (pruned or deleted); promote a version by name "
                                    "instead (see 'mariana model list')")
    assert checkpoint.current_version(d) == "v000002"


def test_a_rollback_to_a_removed_version_is_one_clear_error_not_a_candidate_never_served(tmp_path):
    """The version served before was deleted by hand: the rollback went to the version below
    CURRENT by name instead, a refused candidate that had never served."""
    d = tmp_path / "m"
    versions_made(d, "trained", None, "promoted")  # v2: refused
    shutil.rmtree(d / "v000001")
    proc = run_cli("model", "rollback", "--model-dir", d)
    assert proc.returncode == 2 and "nothing to roll back to: v000001, served before v000003" in proc.stderr, \
        proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and checkpoint.current_version(d) == "v000003"


def test_a_server_whose_swapped_out_version_was_pruned_keeps_serving(tmp_path):
    """A server keeps the version it swapped out loaded (for an instant rollback); prune may
    remove that one from disk. The server goes on, and a rollback goes to the target prune kept."""
    data = tmp_path / "day.tsv"
    generate_criteo(data, 3000, seed=3)
    d = tmp_path / "m"
    run_cli("-q", "train", "--data", data, "--model", "lr", "--out", d, check=True)
    rows = tsv_instances(data, 3)
    with Server(tmp_path / "s", d, serve={"watch_seconds": 0.1}) as s:
        def serving(version: str) -> None:
            deadline = time.monotonic() + 30
            while s.get("/readyz")[1].get("model_version") != version:
                assert time.monotonic() < deadline, s.logs()
                time.sleep(0.05)
            status, answer = s.predict(rows)
            assert status == 200 and answer["model_version"] == version and len(answer["pctr"]) == 3, answer

        serving("v000001")
        for version in ("v000002", "v000003"):
            run_cli("-q", "train", "--data", data, "--model", "lr", "--out", d, check=True)
            serving(version)
        run_cli("model", "promote", "v000001", "--model-dir", d, check=True)
        serving("v000001")
        run_cli("model", "rollback", "--model-dir", d, check=True)  # back to v3: the server holds v1 aside
        serving("v000003")
        pruned = json.loads(run_cli("model", "prune", "--keep", "1", "--model-dir", d, "--json", check=True).stdout)
        assert [r["name"] for r in pruned["removed"]] == ["v000001"] and pruned["rollback_target"] == "v000002"
        serving("v000003")
        run_cli("model", "rollback", "--model-dir", d, check=True)
        serving("v000002")
        assert "Traceback" not in s.logs()


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict[str, Path]:
    """Small days of logs, the served model's sample, and a day of one class (its AUC is
    undefined: a candidate scored on it is refused, every time)."""
    d = tmp_path_factory.mktemp("logs")
    out = {f"day{i}": d / f"day0{i}.tsv" for i in range(1, 5)}
    for i, path in enumerate(out.values(), 1):
        generate_criteo(path, 5000, seed=20 + i)
    out["small"] = d / "small.tsv"
    out["small"].write_text("".join(out["day1"].read_text().splitlines(keepends=True)[:3000]))
    out["clicks"] = d / "clicks.tsv"
    out["clicks"].write_text("".join("1\t" + line.split("\t", 1)[1] for line in out["day4"].read_text().splitlines(
        keepends=True)))
    return out


def planted_runs(d: Path, n: int, live_pid: int) -> list[str]:
    """n finished retrains' files under .retrain/ (ids in time order), one still running
    (its status names `live_pid`), and a file of another name."""
    runs = d / ".retrain"
    runs.mkdir(parents=True)
    ids = [f"r202601{i // 24 + 1:02d}-{i % 24:02d}0000-abcdef" for i in range(n + 1)]
    for i, run in enumerate(ids):
        state = {"state": "training", "pid": live_pid} if i == 1 else {"state": "done" if i % 2 else "failed"}
        (runs / f"{run}.json").write_text(json.dumps({"id": run, **state}))
        (runs / f"{run}.log").write_text("log\n")
        (runs / f"{run}.toml").write_text("[serve]\n")
    (runs / "notes.txt").write_text("mine")
    return ids


@pytest.mark.slow
def test_retrain_keeps_versions_and_runs_bounded(days, tmp_path):
    d = served_model(tmp_path, days)  # v1
    ids = planted_runs(d, 25, os.getpid())
    windows = {"train_data": [str(days["day2"])], "eval_data": [str(days["day3"])], "keep_versions": 2, "keep_runs": 3,
               "skip_unchanged": False}  # the same window again and again: a version each time
    promote = retrain_config(tmp_path, d, auc_tolerance=0.5, **windows)
    (tmp_path / "r").mkdir()
    refuse = retrain_config(tmp_path / "r", d, **{**windows, "eval_data": [str(days["clicks"])]})
    for cfg in (promote, refuse, promote, refuse):
        run_cli("retrain", "--config", cfg, check=True)
        current = checkpoint.current_version(d)
        kept = {current, checkpoint.rollback_target(d)} | set(checkpoint.list_versions(d)[-2:])
        assert set(checkpoint.list_versions(d)) == kept and len(kept) <= 4
    assert [x["verdict"] for x in decisions(d)] == ["promoted", "refused", "promoted", "refused"]
    assert checkpoint.list_versions(d) == ["v000002", "v000004", "v000005"]  # v1 and v3 pruned
    assert checkpoint.current_version(d) == "v000004"
    assert json.loads(run_cli("model", "rollback", "--model-dir", d, check=True).stdout)["current"] == "v000002"
    left = sorted(p.name for p in (d / ".retrain").iterdir())
    kept_runs = [ids[1]] + ids[-3:]  # the running one, and the newest 3 that ended
    assert left == sorted(["notes.txt"] + [f"{r}.{ext}" for r in kept_runs for ext in ("json", "log", "toml")])


@pytest.mark.slow
def test_a_prune_that_fails_is_a_warning_not_a_failed_retrain(days, tmp_path):
    """Nothing served yet and the candidate refused: no CURRENT, so prune refuses to choose
    what stays; the retrain's verdict stands, exit 0."""
    d = tmp_path / "empty"
    d.mkdir()
    job = tmp_path / "job.toml"
    job.write_text('[model]\nkind = "lr"\n')
    cfg = retrain_config(tmp_path, d, train_data=[str(days["day2"])], eval_data=[str(days["clicks"])],
                         job_config=str(job), keep_versions=1)
    proc = run_cli("retrain", "--config", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "refused"
    assert "the old versions were not pruned" in proc.stderr and "no CURRENT file" in proc.stderr, proc.stderr
    assert checkpoint.list_versions(d) == ["v000001"]


def test_keep_versions_and_keep_runs_are_checked(tmp_path):
    for key in ("keep_versions", "keep_runs"):
        with pytest.raises(ConfigError, match=rf"retrain.{key} must be >= 0 \(0: keep every one\), got -1"):
            load_serve_config(overrides={f"retrain.{key}": -1}, env={})
    assert (ServeConfig().retrain.keep_versions, ServeConfig().retrain.keep_runs) == (0, 20)


def test_serve_example_config_lists_every_key_with_its_default():
    """(tests/unit/test_config.py checks the cluster and job examples; this one, the serve example.)"""
    path = ROOT / "deploy/config/serve.example.toml"
    assert load_serve_config(str(path), env={}) == ServeConfig()
    text = path.read_text()
    for section, values in {"serve": ServeConfig().serve, "retrain": ServeConfig().retrain}.items():
        assert f"\n[{section}]" in text
        for key in vars(values):
            assert f"\n{key} = " in text, f"{section}.{key} missing from {path.name}"


def test_keep_runs_counts_the_retrain_that_prunes(tmp_path):
    """A retrain started over HTTP prunes while its own run is unfinished: keep_runs = 5 kept
    five other finished runs and its own, six once it ended (an exploratory soak)."""
    from mariana.serving.retrain import prune_runs

    ids = planted_runs(tmp_path, 8, os.getpid())  # 9 runs: ids[1] live, the other 8 ended
    own = ids[-1]
    gone = prune_runs(str(tmp_path), 5, str(tmp_path / ".retrain" / f"{own}.json"))
    runs = sorted({p.name.split(".")[0] for p in (tmp_path / ".retrain").iterdir() if p.name != "notes.txt"})
    assert gone == [ids[0]] + ids[2:4], gone
    assert runs == sorted([ids[1]] + ids[4:]), runs  # the live one; the newest 4 that ended and this one: 5
