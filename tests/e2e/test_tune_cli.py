"""`mariana tune` and `train --epochs auto` from the command line (issue 15)."""
from __future__ import annotations

import json

from tests.conftest import run_cli


def test_tune_prints_its_trials_and_publishes_the_best(gen_files, tmp_path):
    proc = run_cli("tune", "--data", gen_files["train"], "--test-data", gen_files["test"], "--budget", "4",
                   "--set", "hashing.bits=18", "--out", tmp_path / "m", check=True)
    assert "best of" in proc.stdout and "valid logloss" in proc.stdout and "tune.best_params" in proc.stdout
    manifest = json.loads((tmp_path / "m" / "v000001" / "manifest.json").read_text())
    # the best config refit on every row (no validation rows left), or, without time for that,
    # the best trial's own model at its best epoch
    refit = manifest["tune"]["refit"]
    assert manifest["tune"]["trials"] >= 1 and (refit["done"] or manifest["valid"]["kept"] == "best"), refit
    assert refit["done"] == ("valid" not in manifest)
    js = run_cli("tune", "--data", gen_files["train"], "--budget", "2", "--trials", "2", "--json",
                 "--set", "hashing.bits=18", "--out", tmp_path / "m", check=True)
    record = json.loads(js.stdout.strip().splitlines()[-1])
    assert record["model_version"] == "v000002" and len(record["trials"]) <= 2


def test_tune_and_auto_epochs_refuse_bad_input(gen_files, tmp_path):
    for args, needle in (
            (("tune", "--data", gen_files["test"], "--budget", "0", "--out", tmp_path / "m"), "--budget"),
            (("tune", "--data", gen_files["test"], "--budget", "2", "--trials", "0", "--out", tmp_path / "m"),
             "--trials"),
            (("tune", "--mode", "cluster", "--data", gen_files["test"], "--valid-fraction", "1.5", "--budget", "2",
              "--out", tmp_path / "m"), "valid_fraction must be in [0, 1)"),
            (("tune", "--mode", "cluster", "--data", gen_files["test"], "--valid-data", gen_files["test"],
              "--valid-fraction", "0.2", "--budget", "2", "--out", tmp_path / "m"), "not both"),
            (("tune", "--data", gen_files["test"], "--workers", "2", "--budget", "2", "--out", tmp_path / "m"),
             "--workers needs --mode cluster"),
            (("train", "--data", gen_files["test"], "--epochs", "often", "--out", tmp_path / "m"), "'auto'"),
            (("train", "--data", gen_files["test"], "--valid-fraction", "1.5", "--out", tmp_path / "m"),
             "valid_fraction"),
            (("train", "--data", gen_files["test"], "--init-from", tmp_path / "none", "--out", tmp_path / "m"),
             "no such model directory")):
        proc = run_cli(*args)
        last = proc.stderr.strip().splitlines()[-1]  # argparse's own errors come after its usage lines
        assert proc.returncode == 2 and needle in last and "error" in last, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
