"""Validation-driven training, warm starts and tuning (issue 15): early stopping stops
and keeps the best epoch, a held-out tail is never trained on, a warm start with zero
rates reproduces its parent exactly, a mismatched one is refused, and a tiny tuning
budget finishes within it and publishes a valid version."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from mariana.sparse.errors import ConfigError, MarianaError, ModelDirError
from mariana.sparse.metrics import BinaryMetrics
from mariana.trainer.bundle import ModelBundle
from mariana.trainer.config import load_config
from mariana.trainer.data import BatchStream, RowRange, count_data_lines
from mariana.trainer.job import run_local_job, run_tune_job
from mariana.trainer.strategies.local import evaluate


def config(**overrides):
    return load_config(overrides={"hashing.bits": 18, **overrides}, env={})


def predictions(bundle: ModelBundle, path) -> np.ndarray:
    stream = BatchStream([str(path)], bundle.encoder, labeled=True)
    return np.concatenate([bundle.predict(b) for b in stream])


def test_early_stopping_stops_after_patience_and_keeps_the_best_epoch(gen_files, tmp_path):
    # Small batches and a high rate overfit 27k rows within a few epochs.
    cfg = config(**{"train.epochs": "auto", "train.valid_fraction": 0.1, "train.batch_size": 256,
                    "train.patience": 2, "train.max_epochs": 8, "optim.lr": 0.3})
    record = run_local_job(cfg, [str(gen_files["train"])], [], str(tmp_path / "m"))
    valid = record["valid"]
    losses = [e["logloss"] for e in valid["epochs"]]
    best = int(np.argmin(losses)) + 1
    assert valid["best_epoch"] == best and valid["kept"] == "best"
    assert record["epochs"] == len(losses) < 8, "it should stop before max_epochs"
    assert len(losses) - best == 2, "it stops exactly `patience` epochs after the best one"
    assert valid["stopped"].startswith("no better valid logloss")
    # The saved version is the best epoch's model: its logloss on the held-out rows is the best one.
    bundle = ModelBundle.load(str(tmp_path / "m"))
    _, rows = RowRange.of_files([str(gen_files["train"])], 0.1, header=False)
    metrics, _ = evaluate(bundle, [str(gen_files["train"])], rows)
    assert metrics["logloss"] == pytest.approx(losses[best - 1], rel=1e-6)
    assert metrics["logloss"] < losses[-1]
    assert bundle.manifest["valid"]["best_epoch"] == best


def test_the_validation_tail_is_held_out_of_training(gen_files, tmp_path):
    lines = count_data_lines(str(gen_files["train"]), header=False)
    cfg = config(**{"train.epochs": 2, "train.valid_fraction": 0.25})
    record = run_local_job(cfg, [str(gen_files["train"])], [], str(tmp_path / "m"))
    held = round(lines * 0.25)
    assert record["rows_per_epoch"] == [lines - held] * 2
    assert record["valid"]["rows"] == held and record["valid"]["kept"] == "last"
    assert [e["epoch"] for e in record["valid"]["epochs"]] == [1, 2]


def test_row_ranges_split_several_files_in_order(gen_files, tmp_path):
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    text = gen_files["test"].read_text().splitlines(keepends=True)
    a.write_text("".join(text[:5000]))
    b.write_text("".join(text[5000:]))
    train, valid = RowRange.of_files([str(a), str(b)], 0.5, header=False)
    assert (train.start, train.stop, valid.start, valid.stop) == (0, 4000, 4000, 8000)
    bundle = ModelBundle(config(), load_config(env={}).data.resolve_schema())
    seen = {}
    for name, rows in (("train", train), ("valid", valid)):
        stream = BatchStream([str(a), str(b)], bundle.encoder, block_bytes=64 << 10, rows=rows)
        seen[name] = np.concatenate([batch.labels for batch in stream])
    labels = np.array([float(line.split("\t", 1)[0]) for line in text])
    assert np.array_equal(seen["train"], labels[:4000]) and np.array_equal(seen["valid"], labels[4000:])


def test_validation_is_given_one_way_and_must_leave_rows(gen_files, tmp_path):
    with pytest.raises(MarianaError, match="one way"):
        run_local_job(config(**{"train.valid_fraction": 0.1}), [str(gen_files["train"])], [],
                      str(tmp_path / "m"), valid_paths=[str(gen_files["test"])])
    tiny = tmp_path / "tiny.tsv"
    tiny.write_text(gen_files["test"].read_text().splitlines(keepends=True)[0])
    with pytest.raises(MarianaError, match="leaves no rows"):
        run_local_job(config(**{"train.valid_fraction": 0.3}), [str(tiny)], [], str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="'auto'"):
        config(**{"train.epochs": "often"})
    # the validation rows trained on: by a link to a training file (its tail was in the other name's
    # rows), or as --valid-data naming a training file; tune picked the trial that memorised them (AUC 1.0)
    (tmp_path / "link.tsv").symlink_to(gen_files["test"])
    with pytest.raises(ConfigError, match="a training file is named twice \\(or by a link to it\\)"):
        RowRange.of_files([str(gen_files["test"]), str(tmp_path / "link.tsv")], 0.1, header=False)
    with pytest.raises(MarianaError, match="link.tsv is a training file too .*: validation rows must be rows"):
        run_local_job(config(), [str(gen_files["test"])], [], str(tmp_path / "m"),
                      valid_paths=[str(tmp_path / "link.tsv")])


@pytest.mark.parametrize("kind", ["lr", "dnn"])
def test_a_warm_start_with_zero_rates_reproduces_its_parent_exactly(kind, gen_files, tmp_path):
    # AdaGrad: a zero rate freezes a weight (FTRL recomputes its weights from its state each step)
    out = str(tmp_path / "m")
    run_local_job(config(**{"model.kind": kind, "optim.linear": "adagrad"}), [str(gen_files["train"])], [], out)
    parent = ModelBundle.load(out)
    frozen = config(**{"model.kind": kind, "optim.linear": "adagrad", "optim.lr": 0.0, "optim.embed_lr": 0.0,
                       "optim.dense_lr": 0.0})
    record = run_local_job(frozen, [str(gen_files["test"])], [], out, init_from=out + ":v000001")
    child = ModelBundle.load(out)
    assert record["model_version"] == "v000002"
    assert child.manifest["parent"] == {"model_dir": out, "version": "v000001",
                                        "rows_trained": parent.rows_trained, "learned": [str(gen_files["train"])]}
    assert child.rows_trained == parent.rows_trained + record["train_rows"]
    assert np.array_equal(predictions(child, gen_files["test"]), predictions(parent, gen_files["test"]))
    # With its rates, the warm start moves on from the parent (the optimizer state came along).
    run_local_job(config(**{"model.kind": kind, "optim.linear": "adagrad"}), [str(gen_files["test"])], [], out,
                  init_from=out)
    assert not np.array_equal(predictions(ModelBundle.load(out), gen_files["test"]),
                              predictions(parent, gen_files["test"]))


def test_a_warm_start_keeps_the_optimizer_state(gen_files, tmp_path):
    out = str(tmp_path / "m")
    run_local_job(config(), [str(gen_files["train"])], [], out)
    run_local_job(config(**{"optim.ftrl_alpha": 1e-9}), [str(gen_files["test"])], [], out, init_from=out)
    parent, child = ModelBundle.load(out, "v000001", with_optimizer=True), ModelBundle.load(out, with_optimizer=True)
    (name, p), c = next(iter(parent.tables.items())), child.tables[next(iter(parent.tables))]
    rows = p.touched_rows()
    assert np.all(c.state["n"][rows] >= p.state["n"][rows])  # FTRL's sum of squared gradients
    assert np.any(c.state["n"][rows] > p.state["n"][rows]), "the accumulators went on growing"


def test_a_mismatched_warm_start_is_refused_naming_the_difference(gen_files, tmp_path):
    out = str(tmp_path / "m")
    run_local_job(config(), [str(gen_files["train"])], [], out)
    with pytest.raises(ConfigError, match="hashing.bits: the version has 18, this job 20"):
        run_local_job(config(**{"hashing.bits": 20}), [str(gen_files["test"])], [], out, init_from=out)
    with pytest.raises(ConfigError, match="model.kind: the version has 'lr', this job 'dnn'"):
        run_local_job(config(**{"model.kind": "dnn"}), [str(gen_files["test"])], [], out, init_from=out)
    with pytest.raises(ConfigError, match="optim.linear: the version has 'ftrl', this job 'adagrad'"):
        run_local_job(config(**{"optim.linear": "adagrad"}), [str(gen_files["test"])], [], out, init_from=out)
    assert (tmp_path / "m" / "CURRENT").read_text().strip() == "v000001"
    with pytest.raises(ConfigError, match=r"give this job the version's settings \(--set hashing.bits=18\b"):
        run_local_job(config(**{"hashing.bits": 20}), [str(gen_files["test"])], [], out, init_from=out)


def test_a_warm_start_from_a_version_without_its_optimizer_state_is_refused(gen_files, tmp_path):
    """Without FTRL's z and n the first step overwrote the parent's weights: the warm start
    scored 0.685 against 0.749 with the state (a cold start 0.663), and said nothing."""
    out = str(tmp_path / "m")
    run_local_job(config(), [str(gen_files["train"])], [], out)
    (tmp_path / "m" / "v000001" / "optimizer.safetensors").unlink()
    with pytest.raises(ModelDirError, match="no optimizer.safetensors"):
        run_local_job(config(), [str(gen_files["test"])], [], out, init_from=out)
    assert not (tmp_path / "m" / "v000002").exists()
    ModelBundle.load(out)  # serving it needs no optimizer state


def test_tuning_with_a_tiny_budget_finishes_within_it_and_publishes_a_valid_version(gen_files, tmp_path):
    out = tmp_path / "m"
    budget = 6.0
    t0 = time.perf_counter()
    record = run_tune_job(config(), [str(gen_files["train"])], [str(gen_files["test"])], str(out), budget,
                          refit=False)  # the best trial's own model is published (its validation record)
    spent = record["tune"]["seconds"]
    # the trial under way at the deadline stops after its (partial) epoch and one validation pass
    assert spent < budget + 3.0 and time.perf_counter() - t0 < budget + 8.0
    trials = record["trials"]
    assert trials[0]["number"] == 0 and len(trials) >= 2
    best = min((t for t in trials if t["value"] is not None), key=lambda t: t["value"])
    assert record["tune"]["best_trial"] == best["number"]
    assert record["valid"]["epochs"][record["valid"]["best_epoch"] - 1]["logloss"] == pytest.approx(best["value"])
    bundle = ModelBundle.load(str(out))
    assert bundle.manifest["tune"]["best_params"] == best["params"]
    for key, value in best["params"].items():
        section, name = key.split(".", 1)
        assert getattr(getattr(bundle.config, section), name) == value
    m = BinaryMetrics()
    for batch in BatchStream([str(gen_files["test"])], bundle.encoder, labeled=True):
        m.update(batch.labels, bundle.predict(batch))
    assert m.result()["auc"] == pytest.approx(record["auc"]) and record["auc"] > 0.7
    with open(record["tune"]["trials_file"]) as f:
        saved = json.load(f)
    assert [t["number"] for t in saved["trials"]] == [t["number"] for t in trials]


def test_tuning_refits_the_best_config_on_every_row_for_its_best_epoch_count(gen_files, tmp_path):
    """With a held-out tail, the published model is the best trial's config trained on all
    the rows (the tail too) for its best epoch count: exactly what `mariana train` with that
    config makes."""
    train, test = [str(gen_files["train"])], [str(gen_files["test"])]
    record = run_tune_job(config(), train, test, str(tmp_path / "m"), 120.0, max_trials=3)
    refit, trials = record["tune"]["refit"], record["trials"]
    best = next(t for t in trials if t["number"] == record["tune"]["best_trial"])
    lines = count_data_lines(train[0], header=False)
    assert refit["done"] and refit["epochs"] == best["best_epoch"] >= 1 and refit["rows"] == lines * best["best_epoch"]
    assert record["rows_per_epoch"] == [lines] * best["best_epoch"] and "valid" not in record
    bundle = ModelBundle.load(str(tmp_path / "m"))
    assert bundle.config.train.epochs == best["best_epoch"] and bundle.config.train.valid_fraction == 0.0
    assert bundle.manifest["tune"]["refit"] == refit and bundle.manifest["tune"]["best_params"] == best["params"]
    same = run_local_job(bundle.config, train, test, str(tmp_path / "again"))
    assert np.array_equal(predictions(bundle, gen_files["test"]),
                          predictions(ModelBundle.load(str(tmp_path / "again")), gen_files["test"]))
    assert same["auc"] == record["auc"]


def test_a_search_bound_by_its_budget_leaves_time_for_the_refit(gen_files, tmp_path):
    """The search stops early enough (the refit estimate of every finished trial, with
    slack) that the refit still ends inside the budget. The budget is a few times what the
    first trial (the defaults, two epochs) takes on this machine, so a slow host gets more."""
    t0 = time.perf_counter()
    run_local_job(config(**{"train.epochs": 2, "train.valid_fraction": 0.1}), [str(gen_files["train"])], [],
                  str(tmp_path / "calibrate"))
    budget = max(8.0, 6.0 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    record = run_tune_job(config(), [str(gen_files["train"])], [], str(tmp_path / "m"), budget)
    refit = record["tune"]["refit"]
    assert refit["done"], refit
    assert record["tune"]["seconds"] + refit["seconds"] < budget and time.perf_counter() - t0 < budget + 3.0


def test_a_validation_tail_of_parquet_and_headered_csv_files(gen_files, tmp_path):
    """Rows count from each file's first data row: a Parquet file has no header line, an
    avazu CSV has one; the split lands on the same rows either way."""
    from mariana.sparse.schema import builtin
    from tests.unit.test_inputs import csv_to_parquet

    schema = builtin("criteo")
    text = gen_files["test"].read_text().splitlines(keepends=True)
    (tmp_path / "a.tsv").write_text("".join(text[:3000]))
    (tmp_path / "b.tsv").write_text("".join(text[3000:]))
    csv_to_parquet(tmp_path / "b.tsv", tmp_path / "b.parquet", schema, row_group_size=1000)
    paths = [str(tmp_path / "a.tsv"), str(tmp_path / "b.parquet")]
    train, valid = RowRange.of_files(paths, 0.25, header=True)  # a header= schema: the Parquet file has none
    assert (train.stop, valid.rows) == (5999, 2000)  # 2,999 + 5,000 rows: a.tsv's first line is its header
    bundle = ModelBundle(config(), schema)
    stream = BatchStream(paths, bundle.encoder, block_bytes=32 << 10, rows=valid)
    got = np.concatenate([b.labels for b in stream])
    labels = np.array([float(line.split("\t", 1)[0]) for line in text])
    assert np.array_equal(got, labels[-2000:])


def test_the_first_trial_is_the_jobs_own_config_even_outside_the_search_ranges(gen_files, tmp_path):
    odd = config(**{"model.kind": "dnn", "model.embed_dim": 5, "model.hidden": [24, 24, 8], "optim.embed_lr": 0.9,
                    "optim.ftrl_l1": 0.0, "hashing.bucket_scale": 3.0, "train.batch_size": 700})
    # a budget far over one trial (it ends the search): a trial the budget cuts in its first epoch
    # counts as none (a 3 s budget did that on a loaded 16-core GPU host)
    record = run_tune_job(odd, [str(gen_files["test"])], [], str(tmp_path / "m"), 60.0, "dnn", max_trials=1)
    params = record["trials"][0]["params"]
    assert params["model.embed_dim"] == 5 and params["model.hidden"] == [24, 24, 8]  # was [24, 12]
    assert params["optim.embed_lr"] == 0.9 and params["hashing.bucket_scale"] == 3.0
    assert params["train.batch_size"] == 700 and params["optim.ftrl_l1"] == 1e-3  # log scale: 0 -> its floor


def test_an_epoch_cut_by_the_deadline_is_recorded_as_the_budgets_stop(gen_files, tmp_path, monkeypatch):
    """A trial's epoch cut short by tune's deadline was recorded as a patience stop ("no better
    valid logloss for 1 epoch(s)", state complete) when patience would have stopped there too:
    the patience check came first. The deadline cut it; the record says so."""
    from mariana.trainer.strategies.local import EarlyStop, Validation, train_local

    monkeypatch.setattr(EarlyStop, "should_stop", lambda self: True)  # patience met at this epoch as well
    cfg = config(**{"train.epochs": "auto", "train.batch_size": 256})
    bundle = ModelBundle(cfg, cfg.data.resolve_schema())
    train, valid = RowRange.of_files([str(gen_files["train"])], 0.1, header=False)
    result = train_local(bundle, [str(gen_files["train"])], rows=train, deadline=time.perf_counter() - 1,
                         valid=Validation([str(gen_files["train"])], valid, source="the tail"))
    assert result.valid["stopped"] == "time budget" and result.rows_per_epoch[0] < train.rows, result.valid


def test_a_dead_cluster_searchs_scratch_dir_is_removed_by_the_next_and_no_other(tmp_path):
    """A `tune --mode cluster` killed with SIGKILL left its trials' versions for good."""
    import os
    import subprocess
    import sys

    from mariana.services.cluster_tune import _host_tag, sweep_dead_scratch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tune = tmp_path / "m" / "tune"
    names = {"dead": f"20261129T000000Z-{gone.pid}-{_host_tag()}-trials",
             "alive": f"20261129T000000Z-{os.getppid()}-{_host_tag()}-trials",
             "elsewhere": f"20261129T000000Z-{gone.pid}-another-host-trials",
             "older": f"20261129T000000Z-{gone.pid}-trials"}  # before the host was in the name: not known dead
    for name in names.values():
        (tune / name / "v000001").mkdir(parents=True)
    sweep_dead_scratch(str(tmp_path / "m"))
    assert sorted(p.name for p in tune.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
