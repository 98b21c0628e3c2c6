"""`--data` as users give it, end to end: a directory, a glob, Parquet files, and the
one-line errors when an item names nothing or a Parquet file lacks a column."""
import json
import shutil

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from mariana.sparse.schema import criteo
from mariana.sparse.synth import generate_criteo
from tests.conftest import run_cli

SMALL = ("--bits", "16", "--model", "lr")


def last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_line_error(proc, *needles) -> None:
    """Exit 2, no traceback, and the last stderr line is the error, naming what was wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mariana: error: "), proc.stderr
    for n in needles:
        assert n in last, proc.stderr


def to_parquet(tsv, out, drop: tuple[str, ...] = ()) -> str:
    """`tsv` as Parquet: the criteo schema's column names, numbers int64, categories strings."""
    s = criteo()
    types = {"label": pa.int8(), **{c: pa.int64() for c in s.numeric}, **{c: pa.string() for c in s.categorical}}
    table = pa_csv.read_csv(tsv, read_options=pa_csv.ReadOptions(column_names=list(s.columns)),
                            parse_options=pa_csv.ParseOptions(delimiter="\t"),
                            convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=True))
    pq.write_table(table.drop_columns(list(drop)), out, row_group_size=1500)
    return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    parts = d / "parts"
    parts.mkdir()
    generate_criteo(parts / "part-1.tsv", 3000, seed=21)
    generate_criteo(parts / "part-0.tsv.gz", 2000, seed=22)
    (parts / "_SUCCESS").write_text("")
    (parts / ".part-0.tsv.crc").write_bytes(b"\x00\x01 not data \xff")  # read, it would fail the job
    generate_criteo(d / "test.tsv", 2000, seed=23)
    return {"dir": d, "parts": parts, "test": d / "test.tsv",
            "test_parquet": to_parquet(d / "test.tsv", d / "test.parquet"),
            "train_parquet": to_parquet(parts / "part-1.tsv", d / "train.parquet")}


def test_train_on_a_directory_and_on_a_glob(files, tmp_path):
    by_dir = last_json(run_cli("train", "--data", files["parts"], "--out", tmp_path / "m", "--json", *SMALL))
    assert by_dir["train_rows"] == 5000 and by_dir["bad_rows"] == 0
    manifest = json.loads((tmp_path / "m" / by_dir["model_version"] / "manifest.json").read_text())
    assert [p.rsplit("/", 1)[1] for p in manifest["train"]["data"]] == ["part-0.tsv.gz", "part-1.tsv"]
    by_glob = last_json(run_cli("train", "--data", f"{files['parts']}/part-*", "--test-data", files["test"],
                                "--out", tmp_path / "m", "--json", *SMALL))
    assert by_glob["train_rows"] == 5000 and by_glob["test_rows"] == 2000
    assert by_glob["train_loss"] == pytest.approx(by_dir["train_loss"], rel=1e-9)  # the same files, the same order


def test_parquet_trains_evaluates_and_predicts_like_its_tsv(files, tmp_path):
    rec = last_json(run_cli("train", "--data", files["train_parquet"], "--test-data", files["test_parquet"],
                            "--out", tmp_path / "m", "--json", *SMALL))
    tsv = last_json(run_cli("train", "--data", files["parts"] / "part-1.tsv", "--test-data", files["test"],
                            "--out", tmp_path / "t", "--json", *SMALL))
    assert rec["train_rows"] == 3000 and rec["test_rows"] == 2000 and rec["auc"] > 0.5
    assert (rec["auc"], rec["train_loss"]) == pytest.approx((tsv["auc"], tsv["train_loss"]), rel=1e-9)
    ev = last_json(run_cli("evaluate", "--model", tmp_path / "m", "--data", files["test_parquet"], "--json"))
    mixed = last_json(run_cli("evaluate", "--model", tmp_path / "m", "--data",
                              f"{files['test_parquet']},{files['test']}", "--json"))
    assert ev["rows"] == 2000 and ev["auc"] == pytest.approx(rec["auc"], abs=1e-12)
    assert mixed["rows"] == 4000 and mixed["auc"] == pytest.approx(rec["auc"], abs=1e-9)
    got = run_cli("predict", "--model", tmp_path / "m", "--data", files["test_parquet"])
    want = run_cli("predict", "--model", tmp_path / "m", "--data", files["test"])
    assert got.returncode == 0 and len(got.stdout.splitlines()) == 2000 and got.stdout == want.stdout


def test_a_parquet_file_missing_a_column_fails_before_training(files, tmp_path):
    bad = to_parquet(files["test"], tmp_path / "no_c7.parquet", drop=("C7",))
    proc = run_cli("train", "--data", f"{files['train_parquet']},{bad}", "--out", tmp_path / "m", *SMALL)
    one_line_error(proc, "no_c7.parquet: not in the criteo schema's columns: missing column 'C7'")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("item,says", [
    ("nothing-*.tsv", "nothing-*.tsv: the pattern matches no files"),
    ("missing.tsv", "missing.tsv: no such file or directory"),
    ("empty", "empty: the directory holds no data files"),
])
def test_data_that_names_no_file_is_one_error(files, tmp_path, item, says):
    (tmp_path / "empty").mkdir()
    proc = run_cli("train", "--data", f"{files['train_parquet']},{item}", "--out", tmp_path / "m", *SMALL,
                   cwd=tmp_path)
    one_line_error(proc, says)
    proc = run_cli("evaluate", "--model", tmp_path / "m", "--data", item, cwd=tmp_path)
    one_line_error(proc, says)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cluster_mode_reads_a_directory_of_parquet_and_text(files, tmp_path):
    """The loader streams a Parquet file as Arrow blocks addressed by row; preprocess parses
    them with local mode's code: every row once per epoch, nothing lost."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(files["train_parquet"], mixed / "a.parquet")
    shutil.copy(files["test"], mixed / "b.tsv")
    rec = last_json(run_cli("train", "--mode", "cluster", "--workers", "1", "--ps", "1", "--preprocess", "1",
                            "--data", mixed, "--test-data", files["test_parquet"], "--epochs", "2",
                            "--set", "data.block_bytes=65536", "--out", tmp_path / "m", "--json", *SMALL))
    assert rec["rows_in_data"] == 5000 and rec["rows_applied"] == 10_000 and rec["rows_lost"] == 0
    assert rec["test_rows"] == 2000 and rec["bad_rows"] == 0
