"""`mariana tune` and `train --epochs auto` from the command line (issue 15)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_cli


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
    js = run_cli("tune", "--data", gen_files["train"], "--budget", "30", "--trials", "2", "--json",  # 2 trials end it
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


def test_a_budget_too_short_for_one_epoch_publishes_nothing(gen_files, tmp_path):
    """A trial the budget stopped inside its first epoch is unfinished: it was the best of the
    search and a model of 256 rows replaced the served one."""
    out = tmp_path / "m"
    run_cli("train", "--data", gen_files["train"], "--set", "hashing.bits=18", "--out", out, check=True)
    proc = run_cli("tune", "--data", gen_files["train"], "--budget", "0.01", "--set", "hashing.bits=18",
                   "--out", out)
    assert proc.returncode == 2 and "no trial finished within the budget" in proc.stderr, proc.stderr
    assert (out / "CURRENT").read_text().strip() == "v000001" and not (out / "v000002").exists()


def test_tune_takes_the_kind_from_its_config_and_searches_any(gen_files, tmp_path):
    """--model defaulted to lr: `--set model.kind=dnn` "disagreed" with a flag never given, a
    --config's kind was tuned as LR, and `--model any` failed as an unknown model."""
    # --trials 1 ends each search after its first trial: the budget only has to be past it on a busy host
    common = ("--data", gen_files["test"], "--budget", "300", "--trials", "1", "--no-refit", "--json",
              "--set", "hashing.bits=16")
    for args, kind in ((("--set", "model.kind=dnn"), "dnn"), (("--model", "any"), "any"), ((), "lr")):
        proc = run_cli("tune", *common, *args, "--out", tmp_path / kind, check=True)
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        assert record["tune"]["model"] == kind, (args, record["tune"])
        assert record["model"] == ("dnn" if kind == "dnn" else "lr"), (args, record["model"])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_tune_keeps_its_trials_and_publishes_nothing(gen_files, tmp_path, sig):
    """Ctrl-C threw away every finished trial, after a traceback from optuna's log. (The
    child gets SIGINT's default back: a pytest-xdist worker ignores it, and an ignored SIGINT
    is inherited, so Python would install no KeyboardInterrupt for it.)"""
    out, err = tmp_path / "m", tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "mariana", "tune", "--data", gen_files["train"], "--budget",
                                 "120", "--set", "hashing.bits=18", "--out", out], stderr=f, stdout=subprocess.DEVNULL,
                                cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while "trial 0 " not in err.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert "trial 0 " in err.read_text(), err.read_text()
        proc.send_signal(sig)
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    assert "Traceback" not in text and "saved in" in text and "nothing published" in text, text
    [saved] = (out / "tune").glob("*.json")
    trials = json.loads(saved.read_text())
    assert trials["interrupted"] and trials["trials"][0]["state"] in ("complete", "budget", "pruned"), trials
    assert not list(out.glob("v0*")) and not (out / "CURRENT").exists()
