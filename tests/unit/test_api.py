"""The Python API (mariana/api.py): the CLI's numbers from a notebook, the CLI's
errors as exceptions, and an `import mariana` that loads no torch."""
from __future__ import annotations

import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mariana
from mariana import api
from mariana.sparse.errors import ConfigError, DataFormatError, MarianaError, ModelDirError
from mariana.sparse.inputs import NoDataFiles
from mariana.sparse.schema import CRITEO_CATEGORICAL, CRITEO_NUMERIC
from tests.conftest import run_cli

BITS = 18  # 2^18-row tables: a quick job, the same for the API and the CLI


@pytest.fixture(scope="module")
def trained(gen_files, tmp_path_factory):
    """(Result, Model) of one LR job on the generated pair."""
    out = tmp_path_factory.mktemp("api") / "m"
    result = mariana.train(gen_files["train"], model="lr", out=out, test_data=gen_files["test"], bits=BITS)
    return result, mariana.load(out)


@pytest.fixture(scope="module")
def rows_file(gen_files, tmp_path_factory):
    """300 test rows with a malformed line at index 100 and one with a bad number at 200."""
    lines = gen_files["test"].read_text().splitlines()[:300]
    lines[100] = "not\ta\tcriteo\trow"
    cells = lines[200].split("\t")
    cells[1] = "x7"  # I1
    lines[200] = "\t".join(cells)
    path = tmp_path_factory.mktemp("rows") / "rows.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def criteo_dicts(path, n: int) -> list[dict]:
    """The first n rows of a Criteo TSV as the instances the HTTP endpoint takes (no label;
    empty cells left out, integers as ints)."""
    out = []
    for line in path.read_text().splitlines()[:n]:
        cells = line.split("\t")[1:]
        row = {f: int(v) for f, v in zip(CRITEO_NUMERIC, cells) if v}
        row.update({f: v for f, v in zip(CRITEO_CATEGORICAL, cells[len(CRITEO_NUMERIC):]) if v})
        out.append(row)
    return out


class Frame:
    """What pandas hands over for these rows: a column per field, float64 with NaN where
    an integer column has gaps, None for a missing text cell, numpy scalars."""

    def __init__(self, dicts: list[dict]):
        self.columns = list(CRITEO_NUMERIC + CRITEO_CATEGORICAL)
        self.dicts = dicts

    def to_dict(self, orient: str) -> list[dict]:
        assert orient == "records"
        return [{**{f: np.float64(d.get(f, math.nan)) for f in CRITEO_NUMERIC},
                 **{f: d.get(f) for f in CRITEO_CATEGORICAL}} for d in self.dicts]


# ---- the CLI's numbers --------------------------------------------------------------

def test_train_gives_the_cli_record(trained, gen_files, tmp_path):
    result, _ = trained
    proc = run_cli("train", "--data", gen_files["train"], "--test-data", gen_files["test"], "--model", "lr",
                   "--bits", BITS, "--out", tmp_path / "m", "--json", check=True)
    cli = json.loads(proc.stdout)
    assert set(result.record) == set(cli)
    for key in ("auc", "logloss", "calibration", "ne", "ece", "train_rows", "test_rows", "epochs", "model",
                "model_version", "train_loss", "bad_rows"):
        assert result.record[key] == pytest.approx(cli[key], abs=1e-9), key
    assert (result.version, result.kind, result.rows, result.test_rows) == ("v000001", "lr", 30_000, 8_000)
    assert result.auc == result.record["auc"] and not result.temporary


def test_predict_on_a_file_prints_what_mariana_predict_prints(trained, rows_file):
    result, model = trained
    ours = model.predict(rows_file)
    proc = run_cli("predict", "--model", result.model_dir, "--data", rows_file, check=True)
    cli = np.array([float(x) for x in proc.stdout.split()])
    assert ours.dtype == np.float64 and ours.shape == cli.shape == (300,)
    assert np.isnan(ours[100]) and np.isnan(ours[200])
    np.testing.assert_allclose(ours, cli, rtol=0, atol=1e-6)  # nan where the CLI prints nan


def test_evaluate_gives_the_cli_record(trained, gen_files):
    result, model = trained
    ours = model.evaluate(gen_files["test"])
    cli = json.loads(run_cli("evaluate", "--model", result.model_dir, "--data", gen_files["test"], "--json",
                             check=True).stdout)
    assert set(ours) == set(cli)
    for key in ("auc", "logloss", "calibration", "ne", "ece", "rows", "bad_rows", "model_dir", "model_version"):
        assert ours[key] == pytest.approx(cli[key], abs=1e-12), key
    assert len(ours["reliability"]) == len(cli["reliability"]) > 1
    for a, b in zip(ours["reliability"], cli["reliability"]):
        assert a == pytest.approx(b)
    assert ours["auc"] == pytest.approx(result.auc, abs=1e-12)  # the test metrics of the job itself


def test_dicts_and_frames_score_as_the_file_does(trained, gen_files):
    _, model = trained
    dicts = criteo_dicts(gen_files["test"], 500)
    from_file = model.predict(gen_files["test"])[:500]
    np.testing.assert_allclose(model.predict(dicts), from_file, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.predict(Frame(dicts)), from_file, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.predict(iter(dicts[:3])), from_file[:3], rtol=0, atol=1e-6)
    assert model.predict([]).shape == (0,)


def test_a_real_dataframe_scores_as_the_file_does(trained, gen_files):
    pd = pytest.importorskip("pandas", reason="pandas is not a dependency; Frame above stands in for it")
    _, model = trained
    names = [model.schema.label, *model.schema.numeric, *model.schema.categorical]
    df = pd.read_csv(gen_files["test"], sep="\t", header=None, names=names, nrows=500,
                     dtype={c: "string" for c in model.schema.categorical})
    np.testing.assert_allclose(model.predict(df), model.predict(gen_files["test"])[:500], rtol=0, atol=1e-6)


def test_frames_with_duplicated_columns_float_ids_or_float_hours_and_numpy_overrides(tmp_path):
    """pandas keeps the last of two columns of one name (a warning, once): refused. An id
    or hour column with a gap is float64: its whole floats are the integers, as a Parquet
    file's are read (tests/unit/test_inputs.py). A sweep's numpy numbers are overrides like
    any other."""
    twice = Frame([{"I1": 1.0}])
    twice.columns = ["I1", "C1", "I1"]
    with pytest.raises(DataFormatError, match="the DataFrame has 1 duplicated column name.*: I1; a row would take"):
        api.frame_records(twice)
    floats = Frame([])
    floats.columns = ["hour", "C1"]
    floats.to_dict = lambda orient: [{"hour": np.float64(14102100.0), "C1": np.float64(30_000_000_017.0)},
                                     {"hour": math.nan, "C1": 1e20}]
    assert api.frame_records(floats, ["hour", "C1"]) == [{"hour": 14102100.0, "C1": 30_000_000_017.0}, {"C1": 1e20}]
    cfg = mariana.load_config(epochs=np.int64(2), **{"optim.lr": np.float32(0.05), "model.hidden": np.array([8, 4])})
    assert (cfg.train.epochs, cfg.optim.lr, cfg.model.hidden) == (2, 0.05, [8, 4])


def test_boolean_float_and_timestamp_ids_score_alike_from_parquet_a_dataframe_and_dicts(tmp_path):
    """A model trained on a Parquet file of boolean and float id columns (Arrow hashes
    them as text: true, 0.25) refused the same values from a DataFrame, from dicts and over
    HTTP ("must be text or an integer"); a float32 column's 0.1 is its own shortest text. A
    timestamp column is Arrow's text of it too (a DataFrame's was refused)."""
    pd = pytest.importorskip("pandas", reason="pandas is not a dependency; this test is about DataFrames")
    rng = np.random.default_rng(0)
    flag = rng.random(2000) < 0.5
    price = rng.choice([0.25, 1.5, 7.0, 2e20], 2000)
    size = rng.choice(np.float32([0.1, 0.3]), 2000)
    odds = np.where(flag, 0.5, 0.05) * np.where(price == 0.25, 1.6, 1) * np.where(size > 0.2, 1.5, 1)
    click = rng.random(2000) < odds
    day = pd.Series(pd.to_datetime(["2024-01-01 00:00:00", "2024-01-02 03:04:05"])[rng.integers(0, 2, 2000)])
    click &= rng.random(2000) < np.where(day.dt.day == 2, 1.0, 0.6)
    frame = pd.DataFrame({"y": click.astype(int), "flag": flag, "price": price, "size": size, "day": day})
    frame.loc[3, "price"] = np.nan
    frame.loc[5, "day"] = pd.NaT
    frame.to_parquet(tmp_path / "d.parquet")
    schema = {"format": "csv", "data.schema.columns": ["y", "flag", "price", "size", "day"], "data.schema.label": "y",
              "data.schema.numeric": [], "data.schema.categorical": ["flag", "price", "size", "day"]}
    model = mariana.train(str(tmp_path / "d.parquet"), out=str(tmp_path / "m"), bits=BITS, **schema).load()
    want = model.predict(str(tmp_path / "d.parquet"))
    assert np.ptp(want) > 0.2  # the ids were learned apart, not all one id
    np.testing.assert_allclose(model.predict(frame.drop(columns="y")), want, rtol=0, atol=1e-6)
    dicts = [{"flag": bool(f), "price": float(p), "size": float(str(z)), "day": f"{d:%Y-%m-%d %H:%M:%S}.000000"}
             for f, p, z, d in zip(flag, frame["price"], size, day)]  # JSON's 0.1, not float32's; Arrow's text
    del dicts[3]["price"], dicts[5]["day"]  # the NaN and the NaT: missing
    np.testing.assert_allclose(model.predict(dicts), want, rtol=0, atol=1e-6)


def test_a_parquet_files_decimals_and_dates_score_alike_read_back_by_pandas(tmp_path, caplog):
    """pd.read_parquet gives a decimal128 column as Decimal objects and a date32 one as dates:
    every row was refused ("got Decimal") while the file itself was read. And a 64-bit id column
    with gaps comes back float64, its ids past 2**53 rounded: scored as other ids, unsaid."""
    import datetime
    import decimal

    pd = pytest.importorskip("pandas", reason="pandas is not a dependency; this test is about DataFrames")
    rng = np.random.default_rng(1)
    n = 2000
    price = [decimal.Decimal(str(x)) for x in rng.choice([1.5, 2.25, 3.0], n)]
    day = [datetime.date(2024, 1, int(d)) for d in rng.integers(1, 4, n)]
    odds = np.where(np.array([p == decimal.Decimal("1.5") for p in price]), 0.5, 0.1)
    table = pa.table({"y": (rng.random(n) < odds).astype(int), "price": pa.array(price, pa.decimal128(6, 2)),
                      "day": pa.array(day, pa.date32()), "amount": pa.array(price, pa.decimal128(6, 2)),
                      "user": pa.array([2**60 + i % 3 if i % 5 else None for i in range(n)], pa.int64())})
    pq.write_table(table, tmp_path / "d.parquet")
    schema = {"format": "csv", "data.schema.columns": ["y", "price", "day", "amount"], "data.schema.label": "y",
              "data.schema.numeric": ["amount"], "data.schema.categorical": ["price", "day"]}
    model = mariana.train(str(tmp_path / "d.parquet"), out=str(tmp_path / "m"), bits=BITS, **schema).load()
    frame = pd.read_parquet(tmp_path / "d.parquet")
    assert frame["price"].dtype == object and frame["user"].dtype == np.float64
    np.testing.assert_allclose(model.predict(frame.drop(columns=["y", "user"])),
                               model.predict(str(tmp_path / "d.parquet")), rtol=0, atol=1e-6)
    caplog.set_level("WARNING", logger="mariana.api")
    api.frame_records(frame[["user"]], ["user"])
    assert "DataFrame column user: float ids of 2**53 or more have lost their last digits" in caplog.text


# ---- loading, configs, warm start -----------------------------------------------------

def test_result_loads_its_own_version_and_out_none_is_a_kept_temp_dir(gen_files):
    result = mariana.train(str(gen_files["test"]), bits=BITS)  # lr: the config's kind
    try:
        assert result.temporary and result.model_dir.startswith(os.path.realpath(tempfile.gettempdir()))
        model = result.load()
        assert (model.version, model.kind, model.config.hashing.bits) == ("v000001", "lr", BITS)
        assert model.model_dir == result.model_dir and model.predict([{}]).shape == (1,)
        named = mariana.load(f"{result.model_dir}:v000001")  # as --model takes it: "no such model directory"
        assert (named.model_dir, named.version) == (result.model_dir, "v000001")
        with pytest.raises(ConfigError, match="model_dir names v000001 and version 'v000002': name the version once"):
            mariana.load(f"{result.model_dir}:v000001", "v000002")
        with pytest.raises(ModelDirError, match="'latest' is not a version name"):
            mariana.load(f"{result.model_dir}:latest")
    finally:
        shutil.rmtree(result.model_dir)


def test_a_dnn_job_leaves_the_callers_torch_threads_and_seed_alone(gen_files, tmp_path):
    """train and load build the model from `model.seed` without reseeding torch's global
    generator, and the job's thread count is the job's only: a notebook's own
    `torch.manual_seed` and `torch.set_num_threads` still hold after them."""
    import torch

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        result = mariana.train(gen_files["test"], model="dnn", out=tmp_path / "m", bits=BITS,
                               **{"train.threads": 2})
        model = result.load()
        assert torch.get_num_threads() == 1
        assert torch.equal(torch.rand(3), expected)
        again = mariana.train(gen_files["test"], model="dnn", out=tmp_path / "m2", bits=BITS,
                              **{"train.threads": 2}).load()
        rows = criteo_dicts(gen_files["test"], 50)
        assert model.predict(rows).tolist() == again.predict(rows).tolist()  # still the seed's weights
    finally:
        torch.set_num_threads(threads)


def _answer(out):
    try:
        return out.get(timeout=60)
    except queue.Empty:
        return "no answer in 60 s"


def _predict_in_child(model, rows, out, data, model_dir):
    out.put(model.predict(rows).tolist())
    out.put(mariana.train(data, model="dnn", out=model_dir, bits=BITS).auc)  # its threads: 1, not the cores


def test_a_forked_child_predicts_with_a_dnn_its_parent_ran(gen_files, tmp_path):
    """torch's OpenMP threads do not survive fork: a child of multiprocessing's default
    start method that ran a DNN predict or training on more than one thread hung for good."""
    import multiprocessing
    import torch

    threads = torch.get_num_threads()
    model = mariana.train(gen_files["test"], model="dnn", out=tmp_path / "m", bits=BITS).load()
    rows = criteo_dicts(gen_files["test"], 4000)
    try:
        torch.set_num_threads(2)
        expected = model.predict(rows).tolist()  # the parent's pool runs, then the child forks
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_predict_in_child, args=(model, rows, out, gen_files["test"], tmp_path / "c"))
        child.start()
        got, trained = (_answer(out) for _ in range(2))  # before join: a child blocks until its answers are read
        child.join(10)
        if child.is_alive():
            child.kill()
        assert got == expected
        assert trained is None and mariana.load(tmp_path / "c").config.train.threads == 1
    finally:
        torch.set_num_threads(threads)


FORK_AFTER_OWN_TORCH = r"""
import multiprocessing, queue, sys
import torch
import mariana

torch.set_num_threads(2)
torch.relu(torch.randn(600, 600) @ torch.randn(600, 600))  # the notebook's own torch work: its OpenMP pool runs


def child(out):
    out.put((torch.get_num_threads(), mariana.load(sys.argv[1]).predict(sys.argv[2]).shape[0]))


ctx = multiprocessing.get_context("fork")
out = ctx.Queue()
p = ctx.Process(target=child, args=(out,))
p.start()
try:
    print(out.get(timeout=60))
except queue.Empty:
    print("no answer in 60 s")
p.kill()
"""


def test_a_child_forked_after_the_callers_own_torch_work_predicts_with_a_dnn(gen_files, tmp_path):
    """The fork hook was set by mariana's load or train only: a notebook that ran torch itself,
    then used mariana in forked workers, waited forever in the child's DNN predict."""
    mariana.train(gen_files["test"], model="dnn", out=tmp_path / "m", bits=BITS)
    proc = subprocess.run([sys.executable, "-c", FORK_AFTER_OWN_TORCH, str(tmp_path / "m"), str(gen_files["test"])],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1:] == ["(1, 8000)"], (proc.stdout, proc.stderr[-2000:])


def test_configs_load_as_the_cli_loads_them(tmp_path, monkeypatch):
    toml = tmp_path / "job.toml"
    toml.write_text("[train]\nepochs = 3\n[hashing]\nbits = 20\n")
    monkeypatch.setenv("MARIANA_OPTIM__LR", "0.05")
    cfg = mariana.load_config(toml, bits=19)  # file <- environment <- keyword
    assert (cfg.train.epochs, cfg.hashing.bits, cfg.optim.lr) == (3, 19, 0.05)
    assert isinstance(cfg, mariana.Config)
    base = mariana.Config()
    job = api.job_config(base, {"train.epochs": 2, "model": "dnn"})
    assert (job.train.epochs, job.model.kind) == (2, "dnn") and (base.train.epochs, base.model.kind) == (1, "lr")
    assert api.job_config({"train.epochs": 4}, {"bits": 16}).train.epochs == 4
    for spelling in ("epochs", "train__epochs", "train.epochs"):  # overrides go on top of a dict, as of a Config
        assert api.job_config({"train.epochs": 2}, {spelling: 3}).train.epochs == 3, spelling
    assert api.job_config({"model.kind": "dnn"}, {"model": "lr"}).model.kind == "lr"  # was "two overrides disagree"
    with pytest.raises(ConfigError, match="two overrides of train.epochs disagree"):  # within one of them: still
        api.job_config({"train.epochs": 2, "epochs": 3}, {})


def test_warm_start_goes_on_from_a_version(trained, gen_files, tmp_path):
    first, _ = trained
    result = mariana.train(gen_files["test"], out=tmp_path / "warm", bits=BITS, init_from=first.model_dir)
    parent = result.load().manifest["parent"]
    assert (parent["model_dir"], parent["version"]) == (first.model_dir, first.version)


# ---- errors ----------------------------------------------------------------------------

def cli_error(*args: str) -> str:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    return proc.stderr.strip().removeprefix("mariana: error: ")


def test_bad_input_raises_the_error_the_cli_prints(trained, gen_files, tmp_path):
    result, _ = trained
    missing = str(tmp_path / "nope.tsv")
    with pytest.raises(mariana.NoDataFiles) as e:  # (exported: the walk-through prints its name)
        mariana.train(missing, out=tmp_path / "m")
    assert mariana.NoDataFiles is NoDataFiles and issubclass(NoDataFiles, MarianaError)
    assert str(e.value) == cli_error("train", "--data", missing, "--out", tmp_path / "m")
    with pytest.raises(ModelDirError) as e:
        mariana.load(tmp_path / "none")
    assert str(e.value) == cli_error("predict", "--model", tmp_path / "none", "--data", __file__)
    with pytest.raises(ConfigError) as e:
        mariana.train(missing, out=tmp_path / "m", **{"train.epoch": 2})
    said = cli_error("train", "--data", missing, "--out", tmp_path / "m", "--set", "train.epoch=2")
    assert said.endswith("from an override (--set)")  # the API names its own way of overriding
    assert str(e.value) == said.replace("(--set)", "(a keyword argument)")
    afile = tmp_path / "afile"  # an --out that is a file: a raw NotADirectoryError here, outside MarianaError
    afile.write_text("x")
    with pytest.raises(MarianaError) as e:
        mariana.train(gen_files["test"], out=afile)
    assert str(e.value) == cli_error("train", "--data", gen_files["test"], "--out", afile) == \
        f"{afile}: exists and is not a directory"


@pytest.mark.parametrize("call,error,says", [
    (lambda: mariana.train(__file__, model="xgb"), ConfigError, "model.kind: unknown model 'xgb'"),
    (lambda: mariana.train(__file__, epochs_=2), ConfigError, "unknown override 'epochs_'"),
    (lambda: mariana.load_config(hashing__bits=99), ConfigError, "hashing.bits must be in 1..32"),
    (lambda: mariana.load_config("/no/such.toml"), ConfigError, "config file not found"),
    (lambda: mariana.load_config(epochs=1, **{"train.epochs": 2}), ConfigError,
     r"two overrides of train.epochs disagree: 1 and 2 \(train.epochs\); give one"),
    (lambda: mariana.load(None), ConfigError, r"model_dir: expected a path \(str or os.PathLike\), got None"),
    (lambda: mariana.train(__file__, out=123), ConfigError, r"out: expected a path \(str or os.PathLike\), got 123"),
    (lambda: mariana.load(__file__, 1), ConfigError, r"version: expected a version name such as 'v000001', got 1"),
    (lambda: mariana.load(__file__, 10 ** 5000), ConfigError, r"got an integer of more than 4,300 digits"),
    (lambda: mariana.train(np.zeros(3)), MarianaError, "data: expected data paths, got ndarray: training and"),
    (lambda: mariana.train((p for p in [{"I1": 1}])), MarianaError, "data: a list of dicts is rows, not data paths"),
])
def test_bad_arguments_name_what_is_wrong(call, error, says):
    with pytest.raises(error, match=says):
        call()


def test_bad_rows_and_versions_are_named(trained, tmp_path):
    result, model = trained
    with pytest.raises(DataFormatError, match=r"1 of 2 rows cannot be scored: rows\[1\]: I1 is not a number"):
        model.predict([{"I1": 1}, {"I1": "x"}])
    with pytest.raises(ModelDirError, match=r"no version 'v000009' \(versions: v000001; "):
        mariana.load(result.model_dir, "v000009")
    with pytest.raises(TypeError, match="pass a list of them"):
        model.predict({"I1": 1})
    with pytest.raises(MarianaError, match="wrong.tsv"):
        model.evaluate(tmp_path / "wrong.tsv")
    unlabeled = tmp_path / "u.tsv"
    unlabeled.write_text("1\t2\n")
    with pytest.raises(DataFormatError):
        model.evaluate(unlabeled)
    with pytest.raises(DataFormatError, match=r"rows\[0\]: C1 is an integer of more than 4,300 digits"):
        model.predict([{"C1": 10 ** 5000}])


def test_rows_of_no_field_the_model_knows_are_an_error_and_numpy_scalars_are_numbers(trained, caplog):
    """Columns numbered 0..39 (a DataFrame read without a header) or names in another case
    would all score as an empty row: refused, naming the fields. Unknown fields beside known
    ones are ignored with a warning. numpy scalars in dicts are the numbers they hold."""
    _, model = trained
    with pytest.raises(DataFormatError, match="no row has a field of the model's .*: its rows' fields are 0, 1, 2"):
        model.predict([{0: 1, 1: 5, 2: "x"}] * 3)
    with pytest.raises(DataFormatError, match="its rows' fields are c1, i1"):
        model.predict([{"i1": 1, "c1": "68fd1e64"}])
    with pytest.raises(DataFormatError, match="its rows' fields are c1, i1"):  # a label is no feature
        model.predict([{"label": 1, "i1": 1, "c1": "68fd1e64"}] * 2)
    plain = model.predict([{"I1": 3, "I2": 0.5, "C1": 7}])
    with caplog.at_level("WARNING"):
        assert model.predict([{"I1": 3, "I2": 0.5, "C1": 7, "colour": "red"}]).tolist() == plain.tolist()
    assert "1 values of fields the model does not know were ignored (colour)" in caplog.text
    scalars = model.predict([{"I1": np.int64(3), "I2": np.float32(0.5), "C1": np.int16(7)}])
    assert scalars.tolist() == plain.tolist()


# ---- the package -----------------------------------------------------------------------

def test_import_mariana_loads_no_torch():
    code = ("import sys, mariana; assert mariana.__version__; mariana.load_config; "
            "print(sorted(m for m in ('torch', 'numpy', 'mariana.api') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["['mariana.api',", "'numpy']"]  # load_config needs numpy (hashing), never torch
    bare = subprocess.run([sys.executable, "-c", "import sys, mariana; print('torch' in sys.modules, "
                           "'numpy' in sys.modules)"], capture_output=True, text=True, check=True).stdout
    assert bare.split() == ["False", "False"]



def test_a_local_training_whose_tables_outgrow_the_machine_says_so_first(gen_files, tmp_path, monkeypatch, caplog):
    """The tables-against-memory warning is said by a local job before it trains (here on a
    machine of 512 KiB: bits 16 with FTRL's z and n take 2^16 x 13 bytes), and not by loading
    the version it published (a serve worker cannot lower hashing.bits)."""
    from mariana.trainer import bundle as bundle_module

    monkeypatch.setattr(bundle_module, "machine_memory", lambda: 1 << 19)
    with caplog.at_level("WARNING"):
        result = mariana.train(gen_files["test"], model="lr", out=tmp_path / "m", bits=16)
    said = [r.getMessage() for r in caplog.records if "the model's tables take up to" in r.getMessage()]
    assert len(said) == 1 and "more than this machine's 0.5 MiB of memory" in said[0], caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        mariana.load(result.model_dir)
    assert "the model's tables" not in caplog.text
