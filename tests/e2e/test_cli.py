"""`mariana` end to end, as real subprocesses, on small generated files."""
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli

SMALL = ("--bits", "16", "--set", "model.embed_dim=4", "--set", "model.hidden=[8]")


def last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_line_error(proc, *needles):
    """Exit 2, no traceback, and the last stderr line is the error, naming what was wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"^mariana( \w+)*: error: ", last), proc.stderr  # ours, or argparse's
    for n in needles:
        assert n in last, proc.stderr


@pytest.fixture(scope="module")
def models(gen_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "m"
    lr = last_json(run_cli("train", "--data", gen_files["train"], "--test-data", gen_files["test"],
                           "--model", "lr", "--out", out, "--json", *SMALL))
    dnn = last_json(run_cli("train", "--data", gen_files["train"], "--test-data", gen_files["test"],
                            "--model", "dnn", "--out", out, "--json", *SMALL))
    return {"dir": out, "lr": lr, "dnn": dnn}


def test_train_reports_and_versions(models, gen_files):
    lr, dnn = models["lr"], models["dnn"]
    for rec in (lr, dnn):
        for key in ("auc", "logloss", "train_rows", "train_seconds", "rows_per_s", "peak_rss_mb",
                    "model_dir", "epoch_seconds", "calibration"):
            assert rec[key] is not None, key
        assert rec["train_rows"] == 30_000 and rec["test_rows"] == 8_000 and rec["bad_rows"] == 0
        assert 0.6 < rec["auc"] < 0.95 and rec["logloss"] < 0.55  # learned the planted model
    assert (lr["model_version"], dnn["model_version"]) == ("v000001", "v000002")
    assert (models["dir"] / "CURRENT").read_text().strip() == "v000002"


def test_evaluate_agrees_with_train(models, gen_files):
    rec = last_json(run_cli("evaluate", "--model", models["dir"], "--data", gen_files["test"], "--json"))
    assert rec["model_version"] == "v000002" and rec["rows"] == 8_000
    assert rec["auc"] == pytest.approx(models["dnn"]["auc"], abs=1e-12)
    assert rec["logloss"] == pytest.approx(models["dnn"]["logloss"], rel=1e-9)


def test_predict_prints_one_pctr_per_row_in_order(models, gen_files, tmp_path):
    from mariana.trainer.bundle import ModelBundle
    from mariana.trainer.data import BatchStream

    lines = gen_files["test"].read_text().splitlines()[:50]
    lines[10] = "1\tnot enough fields"
    lines[20] = lines[20].replace("\t", "\tx", 1)  # I1 = 'x...' is not a number
    data = tmp_path / "p.tsv"
    data.write_text("\n".join(lines) + "\n")
    proc = run_cli("predict", "--model", models["dir"], "--data", data)
    assert proc.returncode == 0, proc.stderr
    aligned = proc.stdout.splitlines()  # line N of the output is row N of the input
    assert len(aligned) == 50 and [i for i, x in enumerate(aligned) if x == "nan"] == [10, 20], aligned
    assert "2 malformed rows printed as nan" in proc.stderr
    assert "p.tsv:11: expected 40 fields, got 2" in proc.stderr and "p.tsv:21: I1 is not a number" in proc.stderr
    skipped = run_cli("predict", "--model", models["dir"], "--data", data, "--skip-bad")
    got = np.array([float(x) for x in skipped.stdout.split()])
    assert len(got) == 48 and ((got > 0) & (got < 1)).all()
    assert "2 malformed rows skipped" in skipped.stderr
    assert [float(x) for x in aligned if x != "nan"] == got.tolist()
    bundle = ModelBundle.load(str(models["dir"]))
    want = np.concatenate([bundle.predict(b) for b in BatchStream([str(data)], bundle.encoder)])
    np.testing.assert_allclose(got, want, atol=1e-7)
    # unlabeled rows (the label column dropped) give the same answers
    unlabeled = tmp_path / "u.tsv"
    unlabeled.write_text("\n".join(ln.split("\t", 1)[1] for i, ln in enumerate(lines) if i not in (10, 20)) + "\n")
    proc = run_cli("predict", "--model", models["dir"], "--data", unlabeled)
    np.testing.assert_allclose([float(x) for x in proc.stdout.split()], got, atol=1e-9)
    # an empty line is a row that cannot be read too: still one output line per input line
    gap = tmp_path / "g.tsv"
    gap.write_text("\n".join(lines[:5] + [""] + lines[5:8]) + "\n")
    out = run_cli("predict", "--model", models["dir"], "--data", gap).stdout.splitlines()
    assert len(out) == 9 and out[5] == "nan", out
    # the same rows in a block of another size: equal up to float32 summation order in the MLP
    np.testing.assert_allclose([float(x) for x in out[:5] + out[6:]], [float(x) for x in aligned[:5] + aligned[5:8]],
                               rtol=1e-6)


def test_human_output_is_for_people_and_flags_go_anywhere(models, gen_files):
    """No Python reprs (None, True, {...}, [...]) in what a person reads; -q after the command."""
    proc = run_cli("train", "--data", gen_files["test"], "--out", models["dir"].parent / "h", *SMALL, "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # -q: no progress lines
    for bad in ("None", "True", "False", "{", "["):
        assert bad not in proc.stdout, proc.stdout
    assert re.search(r"^ *auc: n/a$", proc.stdout, re.M) and re.search(r"^ *promoted: yes$", proc.stdout, re.M)


def test_every_option_says_what_it_is_for():
    import argparse

    from mariana.cli import build_parser

    def silent(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from silent(sub, f"{path} {name}")
            elif not action.help:
                yield f"{path} {'/'.join(action.option_strings) or action.dest}"

    assert list(silent(build_parser(), "mariana")) == []


def test_epochs_config_and_env(gen_files, tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text((ROOT / "deploy/config/train.example.toml").read_text().replace("bits = 22", "bits = 16"))
    rec = last_json(run_cli("train", "--data", gen_files["test"], "--config", cfg, "--out", tmp_path / "m",
                            "--json", env={"MARIANA_TRAIN__EPOCHS": "2"}))
    assert rec["epochs"] == 2 and len(rec["epoch_seconds"]) == 2 and rec["rows_per_epoch"] == [8000, 8000]
    assert rec["train_rows"] == 16_000 and rec["model"] == "lr"


def test_real_criteo_rows(criteo_sample, tmp_path):
    rec = last_json(run_cli("train", "--data", criteo_sample, "--test-data", criteo_sample, "--out",
                            tmp_path / "m", "--json", "--bits", "16"))
    assert rec["train_rows"] == 1000 and rec["test_rows"] == 1000 and rec["bad_rows"] == 0


def test_error_paths_exit_2_with_one_line(gen_files, tmp_path, models):
    garbage = tmp_path / "image.png"
    garbage.write_bytes(bytes(range(256)) * 40)
    csv = tmp_path / "x.csv"
    csv.write_text("a,b,c\n1,2,3\n")
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    unlabeled = tmp_path / "u.tsv"
    unlabeled.write_text("".join(ln.split("\t", 1)[1] + "\n" for ln in gen_files["test"].read_text().splitlines()[:20]))
    emptydir = tmp_path / "nothing"
    emptydir.mkdir()
    bad_tail = tmp_path / "bad_tail.tsv"  # the last tenth, validation's under --epochs auto, malformed
    bad_tail.write_text("".join(gen_files["test"].read_text().splitlines(keepends=True)[:900]) + "2\tx\n" * 100)
    # Vowpal Wabbit's -1/+1 labels: every click malformed, a model of non-clicks published and promoted
    lines = [ln.split("\t", 1) for ln in gen_files["test"].read_text().splitlines()[:2000]]
    plus_minus = tmp_path / "pm1.tsv"
    plus_minus.write_text("".join(f"{'-1' if label == '1' else label}\t{rest}\n" for label, rest in lines))
    no_clicks = tmp_path / "no_clicks.tsv"
    no_clicks.write_text("".join(f"0\t{rest}\n" for _, rest in lines))
    cases = [
        (("train", "--data", plus_minus, "--out", tmp_path / "o"),
         ["every valid training row in pm1.tsv is a non-click (label 0; ", "malformed rows skipped, the first: "
          "pm1.tsv:", "label is not 0 or 1", "a click model needs both, nothing to publish"]),
        (("train", "--data", no_clicks, "--out", tmp_path / "o"),
         ["every valid training row in no_clicks.tsv is a non-click (label 0): a click model needs both"]),
        (("train", "--data", tmp_path / "missing.tsv", "--out", tmp_path / "o"), ["missing.tsv", "no such file"]),
        (("train", "--data", gen_files["test"], "--format", "parquet", "--out", tmp_path / "o"), ["parquet"]),
        (("train", "--data", csv, "--out", tmp_path / "o"), ["not in criteo format"]),
        (("train", "--data", garbage, "--out", tmp_path / "o"), ["image.png"]),
        (("train", "--data", csv, "--format", "avazu", "--out", tmp_path / "o"), ["header does not match"]),
        (("train", "--data", gen_files["test"], "--set", "model.kidn=dnn", "--out", tmp_path / "o"),
         ["unknown key 'model.kidn'"]),
        (("train", "--data", gen_files["test"], "--format", "csv", "--out", tmp_path / "o"), ["data.schema"]),
        (("evaluate", "--model", tmp_path / "nomodel", "--data", gen_files["test"]), ["no such model directory"]),
        (("predict", "--model", models["dir"], "--data", emptydir), ["holds no data files"]),
        (("predict", "--model", models["dir"], "--data", gen_files["test"], "--format", "avazu"), ["does not match"]),
        (("gen", "criteo", "--rows", "10", "--out", tmp_path / "no" / "dir" / "f.tsv"), ["does not exist"]),
        (("gen", "criteo", "--rows", "10", "--out", tmp_path), ["is a directory"]),
        (("train", "--data", empty, "--out", tmp_path / "o"), ["no valid training rows"]),
        (("train", "--data", ",", "--out", tmp_path / "o"), ["no training files"]),
        # checked before training starts: a bad test file, a second bad data file, an --out that is a file
        (("train", "--data", gen_files["test"], "--test-data", unlabeled, "--out", tmp_path / "o"),
         ["u.tsv: not in criteo format"]),
        (("train", "--data", f"{gen_files['test']},{csv}", "--out", tmp_path / "o"), ["x.csv: not in criteo format"]),
        (("train", "--data", gen_files["test"], "--out", csv), ["x.csv: exists and is not a directory"]),
        (("train", "--data", gen_files["test"], "--set", "model.slots=1", "--out", tmp_path / "o"), ["model.slots"]),
        (("evaluate", "--model", models["dir"], "--data", unlabeled), ["not in criteo format"]),
        (("evaluate", "--model", models["dir"], "--data", empty), ["no valid rows in empty.tsv: nothing to evaluate"]),
        # validation rows none of which is valid: said after the first epoch's pass, not a
        # traceback after every epoch ran with "n/a"; the same in a tune's first trial
        (("train", "--data", gen_files["test"], "--valid-data", empty, "--epochs", "auto", "--out", tmp_path / "o"),
         ["no valid validation rows in", "empty.tsv"]),
        (("train", "--data", bad_tail, "--epochs", "auto", "--out", tmp_path / "o"),
         ["no valid validation rows in the last 0.1 of the training rows (100 lines) (100 malformed)"]),
        (("tune", "--data", gen_files["test"], "--valid-data", empty, "--budget", "30", "--out", tmp_path / "o"),
         ["no valid validation rows in", "empty.tsv"]),
        (("tune", "--data", gen_files["test"], "--budget", "inf", "--trials", "1", "--out", tmp_path / "o"),
         ["--budget must be a finite number of seconds"]),
        (("train", "--data", gen_files["test"], "--model", "dnn", "--set", "model.kind=lr", "--out", tmp_path / "o"),
         ["--model dnn and --set model.kind=lr disagree"]),
        (("train", "--data", gen_files["test"], "--out", ""), ["--out is empty: give it a value"]),
        # an empty value read as the option left out: trained without the test set, exit 0
        (("train", "--data", gen_files["test"], "--test-data", "", "--out", tmp_path / "o"),
         ["mariana train: error: --test-data is empty: give it a value, or leave the option out"]),
        (("train", "--data", gen_files["test"], "--config", "", "--out", tmp_path / "o"), ["--config is empty"]),
        (("train", "--data", gen_files["test"], "--init-from", "", "--out", tmp_path / "o"), ["--init-from is empty"]),
        (("status", "--dir", ""), ["mariana status: error: --dir is empty"]),
        # writable by its mode bits, not in fact: found before training, not at the publish after it
        (("train", "--data", gen_files["test"], "--out", "/proc/mariana-model"),
         ["--out) /proc/mariana-model: cannot create a directory in /proc ("]),
        (("train", "--data", gen_files["test"], "--test-data", empty, "--out", tmp_path / "o"),
         ["no valid test rows in", "empty.tsv"]),
        (("train", "--data", gen_files["test"], "--patience", "3", "--out", tmp_path / "o"),
         ["--patience is for --epochs auto"]),
        (("train", "--data", gen_files["test"], "--out", gen_files["test"].parent),
         ["holds", "other files", "and no model: --out takes a model directory"]),
        (("predict", "--model", models["dir"] / "v000001", "--data", gen_files["test"]),
         ["a version's directory, not a model directory", str(models["dir"])]),
        (("train", "--data", gen_files["test"], "--init-from", f"{models['dir']}:", "--out", tmp_path / "o"),
         ["name a version after the ':'"]),
        (("gen", "criteo", "--rows", "10", "--seed", "-1", "--out", tmp_path / "g.tsv"),
         ["--seed: expected an integer in [0, 4294967295], got '-1'"]),
        (("train", "--data", gen_files["test"], "--out", tmp_path / "o", "--bogus"),  # was `mariana --help`
         ["mariana train: error: unrecognized arguments: --bogus (`mariana train --help` lists the options)"]),
        (("train", "--data", gen_files["test"], "--set", "model.seed=-1", "--out", tmp_path / "o"),
         ["model.seed must be an integer in [0, 4294967295], got -1"]),
        (("train", "--data", gen_files["test"], "--set", "optim.linear=adagrad", "--set", "optim.lr=1e38",
          "--batch-size", "512",
          "--out", tmp_path / "o"), ["training diverged in epoch 1", "nothing to publish"]),
        # every trial diverged: it blamed the budget ("no trial finished within the budget")
        (("tune", "--data", gen_files["test"], "--budget", "60", "--trials", "1", "--set", "optim.linear=adagrad",
          "--set", "optim.lr=1e300", "--out", tmp_path / "o"),
         ["tune: every trial failed (1); the first: training diverged in epoch 1"]),
        # a --notify URL no client can use: said before the training or the move of CURRENT, not after
        (("train", "--data", gen_files["test"], "--notify", "localhost:6379", "--out", tmp_path / "o"),
         ["--notify 'localhost:6379' is not a Redis URL"]),
        (("model", "promote", "v000001", "--model-dir", models["dir"], "--notify", "http://x"),
         ["--notify 'http://x' is not a Redis URL"]),
    ]
    with ThreadPoolExecutor(2) as pool:  # independent processes: two at a time on two cores
        results = list(pool.map(lambda case: run_cli(*case[0]), cases))
    for (args, needles), proc in zip(cases, results):
        one_line_error(proc, *needles)
        assert "RuntimeWarning" not in proc.stderr, proc.stderr  # a diverged run: 8 lines of them came first
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_avazu_and_csv_formats_train(tmp_path):
    rng = np.random.default_rng(0)
    header = ",".join(["id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
                       "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
                       "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"])
    rows = []
    for i in range(3000):
        site = rng.integers(0, 20)
        click = int(rng.random() < (0.6 if site < 5 else 0.1))
        rows.append(",".join([str(i), str(click), f"141021{rng.integers(0, 24):02d}"]
                             + [f"s{site}"] + [f"v{rng.integers(0, 50)}" for _ in range(20)]))
    data = tmp_path / "avazu.csv"
    data.write_text(header + "\n" + "\n".join(rows) + "\n")
    rec = last_json(run_cli("train", "--data", f"{data},{data}", "--test-data", data, "--format", "avazu",
                            "--out", tmp_path / "m", "--json", "--bits", "16"))
    assert rec["train_rows"] == 6000 and rec["auc"] > 0.7  # two files; learns the planted site effect
    # served: the load's warm-up instance was {}, which an hour schema refuses (no hour), so a server
    # never loaded an Avazu version and answered every request 503
    from mariana.serving.predictor import Predictor

    pctr = Predictor.load(str(tmp_path / "m")).predict([{"hour": "14102105", "C1": "s1"}])
    assert pctr.shape == (1,) and 0 < pctr[0] < 1
    cfg = tmp_path / "csv.toml"
    cfg.write_text('[data]\nformat = "csv"\n[data.schema]\ncolumns = ["y", "n", "c"]\nlabel = "y"\n'
                   'numeric = ["n"]\ncategorical = ["c"]\ndelimiter = ","\nheader = true\n')
    csv = tmp_path / "d.csv"
    csv.write_text("y,n,c\n" + "".join(f"{i % 2},{i},{'ab'[i % 2]}\n" for i in range(500)))
    rec = last_json(run_cli("train", "--data", csv, "--test-data", csv, "--config", cfg,
                            "--out", tmp_path / "c", "--json", "--bits", "12", "--set", "hashing.numeric=both"))
    assert rec["train_rows"] == 500 and rec["auc"] > 0.99
    # the same rows as a CSV writer quoting every field: `predict` hashed the values with their quotes and
    # gave every row the bias's pCTR, in silence; refused now, naming the setting, which reads them right
    quoted = tmp_path / "q.csv"
    quoted.write_text('"n","c"\n' + "".join(f'"{i}","{"ab"[i % 2]}"\n' for i in range(10)))
    refused = run_cli("predict", "--model", tmp_path / "c", "--data", quoted)
    one_line_error(refused, 'q.csv: line 1 holds fields in double quotes ("n")', "set data.schema.quoted = true")
    plain = tmp_path / "p.csv"
    plain.write_text("n,c\n" + "".join(f"{i},{'ab'[i % 2]}\n" for i in range(10)))
    cfg.write_text(cfg.read_text().replace("header = true", "header = true\nquoted = true"))
    run_cli("train", "--data", csv, "--config", cfg, "--out", tmp_path / "cq", "--bits", "12", "--set",
            "hashing.numeric=both", "-q", check=True)
    want = run_cli("predict", "--model", tmp_path / "cq", "--data", plain, check=True).stdout
    got = run_cli("predict", "--model", tmp_path / "cq", "--data", quoted, check=True).stdout
    assert got == want and len(set(got.split())) == 10, (got, want)  # not the bias for every row


@pytest.mark.parametrize("argv", [["train", "--data", "x", "--format", "parquetx", "--out", "y"],
                                  ["train", "speech", "--nproc", "x"], ["serve", "--workers", "x"], ["bogus"],
                                  ["down", "--timeout", "nan"]])  # it SIGKILLed every process, undrained
def test_a_usage_error_is_one_line_exit_2(argv):
    """README: a bad flag prints one line `mariana ...: error: ...` and exits 2 (argparse's own
    errors printed the usage block first)."""
    proc = run_cli(*argv)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ": error: argument " in proc.stderr and "--help` lists the options" in proc.stderr


def test_evaluate_and_predict_take_a_version_current_does_not_name(gen_files, tmp_path):
    """--model DIR:vNNNNNN scores that version (a refused retrain candidate "stays for a
    look": it could not be scored); a missing one, or 'DIR:', is one clear line."""
    m = tmp_path / "m"
    for _ in range(2):
        run_cli("-q", "train", "--data", gen_files["test"], "--out", m, check=True)
    (m / "CURRENT").write_text("v000002\n")
    one = last_json(run_cli("evaluate", "--model", f"{m}:v000001", "--data", gen_files["test"], "--json", check=True))
    assert one["model_version"] == "v000001" and one["model_dir"] == str(m)  # not ".../m:v000001"
    assert last_json(run_cli("evaluate", "--model", m, "--data", gen_files["test"], "--json",
                             check=True))["model_version"] == "v000002"
    pred = run_cli("predict", "--model", f"{m}:v000001", "--data", gen_files["test"], check=True).stdout.split()
    assert len(pred) == one["rows"]
    for spec, says in ((f"{m}:v000009", f"{m}: no version 'v000009' (versions: v000001, v000002;"),
                       (f"{m}:", "name a version after the ':'"),
                       (f"{tmp_path / 'nope'}:v000001", "no such model directory"),
                       (f"{m}:1", "'1' is not a version name: DIR:vNNNNNN")):  # was "no such model directory"
        proc = run_cli("evaluate", "--model", spec, "--data", gen_files["test"])
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_model_list_says_when_current_names_no_version(gen_files, tmp_path):
    """It printed "(serving nothing)" alone, as for an empty directory, while servers went on
    serving what they had loaded and retrains failed on it."""
    m = tmp_path / "m"
    run_cli("-q", "train", "--data", gen_files["test"], "--out", m, check=True)
    assert "CURRENT" not in run_cli("model", "list", "--model-dir", m, check=True).stdout.split("\n", 1)[1]
    (m / "CURRENT").write_text("v000099\n")
    text = run_cli("model", "list", "--model-dir", m, check=True).stdout
    assert "CURRENT names 'v000099', which is not a version here" in text and "model promote VERSION" in text
    js = json.loads(run_cli("model", "list", "--model-dir", m, "--json", check=True).stdout)
    assert js["current_error"] == "CURRENT names 'v000099', which is not a version here"
    (m / "CURRENT").unlink()  # removed by hand, versions left: not an empty directory either
    text = run_cli("model", "list", "--model-dir", m, check=True).stdout
    assert "no CURRENT file, so no version serves; it holds v000001" in text


def test_a_rollback_from_a_deleted_version_goes_to_the_one_served_before(gen_files, tmp_path):
    """The version in service deleted by hand: a rollback said CURRENT names no version here
    (exit 2), though the version before it was on disk."""
    m = tmp_path / "m"
    for _ in range(2):
        run_cli("-q", "train", "--data", gen_files["test"], "--out", m, "--set", "hashing.bits=16", check=True)
    shutil.rmtree(m / "v000002")
    moved = json.loads(run_cli("model", "rollback", "--model-dir", m, check=True).stdout)
    assert (moved["current"], moved["previous"]) == ("v000001", "v000002")


def test_model_config_prints_a_versions_config_that_a_warm_start_takes(gen_files, tmp_path):
    """A warm start from a tuned version needs its settings; the refusal pointed at "the
    version's config in a --config file", which no command wrote (and a manifest is JSON).
    `mariana model config` prints it as TOML; trained with it, the warm start keeps every
    tuned setting (the defaults had replaced them where only the mismatched keys were set)."""
    from mariana.sparse.settings import from_dict
    from mariana.trainer.config import JobConfig, load_config

    parent = tmp_path / "tuned"
    run_cli("-q", "train", "--data", gen_files["test"], "--out", parent, "--set", "optim.ftrl_l2=26.1",
            "--set", "hashing.bucket_scale=2.0", "--batch-size", "1024", check=True)
    refused = run_cli("train", "--data", gen_files["test"], "--out", tmp_path / "w", "--init-from", parent)
    assert refused.returncode == 2 and "`mariana model config --model-dir DIR VERSION > job.toml`" in refused.stderr
    printed = run_cli("model", "config", "--model-dir", parent, check=True).stdout
    assert printed.startswith(f"# the config {parent}/v000001 was trained with")
    (tmp_path / "job.toml").write_text(printed)
    manifest = json.loads((parent / "v000001" / "manifest.json").read_text())
    assert load_config(str(tmp_path / "job.toml"), env={}) == from_dict(JobConfig, manifest["config"])
    run_cli("-q", "train", "--data", gen_files["test"], "--out", tmp_path / "w", "--init-from", parent,
            "--config", tmp_path / "job.toml", check=True)
    child = json.loads((tmp_path / "w" / "v000001" / "manifest.json").read_text())
    assert child["config"]["optim"]["ftrl_l2"] == 26.1 and child["config"]["train"]["batch_size"] == 1024
    assert child["parent"]["version"] == "v000001"
    missing = run_cli("model", "config", "v000009", "--model-dir", parent)
    assert missing.returncode == 2 and "v000009" in missing.stderr and "Traceback" not in missing.stderr
    outside = run_cli("model", "config", f"../{tmp_path.name}/w/v000001", "--model-dir", parent)  # another dir's
    assert outside.returncode == 2 and "no version '../" in outside.stderr, outside.stderr  # was printed


def test_a_version_worse_than_the_click_rate_is_published_with_a_warning(gen_files, tmp_path):
    """A model that scores its test rows worse than their click rate alone (NE > 1: over-fitted,
    or labels that mean the opposite) was published without a word. It still is, and the log says
    so; a good model gets no such line."""
    lines = gen_files["test"].read_text().splitlines()
    flipped = tmp_path / "flipped.tsv"  # the same rows, each label the other way
    flipped.write_text("".join(("1" if ln[0] == "0" else "0") + ln[1:] + "\n" for ln in lines))
    worse = run_cli("train", "--data", gen_files["train"], "--test-data", flipped, "--model", "lr",
                    "--out", tmp_path / "m", *SMALL, check=True)
    good = run_cli("train", "--data", gen_files["train"], "--test-data", gen_files["test"], "--model", "lr",
                   "--out", tmp_path / "m", *SMALL, check=True)
    assert re.search(r"WARNING .*v000001: test NE \d+\.\d+: it scores the test rows no better than their click rate",
                     worse.stderr), worse.stderr
    assert "test NE" not in good.stderr, good.stderr


def test_a_batch_of_most_of_the_rows_is_said(gen_files, tmp_path):
    """--batch-size 1000000 on 30,000 rows trained one step an epoch (test logloss 1.25 where
    a constant scores 0.52) without a word. It is kept, and said; the auto batch is not."""
    big = run_cli("train", "--data", gen_files["train"], "--model", "lr", "--out", tmp_path / "m",
                  "--batch-size", "1000000", *SMALL, check=True)
    auto = run_cli("train", "--data", gen_files["train"], "--model", "lr", "--out", tmp_path / "m", *SMALL,
                   check=True)
    assert re.search(r"WARNING .*train.batch_size = 1,000,000 makes under one step an epoch of about [\d,]+ "
                     r"training rows: the model moves little from its start \('auto' would take [\d,]+\)",
                     big.stderr), big.stderr
    assert "moves little" not in auto.stderr
