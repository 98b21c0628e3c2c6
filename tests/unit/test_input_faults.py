"""Input faults an exploratory tester found: data read from a pipe lost its first rows,
malformed rows were counted in both parts of a train/validation split, a glob followed a
link loop round and round, a Parquet integer above 2^53 was a traceback, `mariana.train`
on a DataFrame was a TypeError, and a header's BOM, an unlabeled file and a gzipped Parquet
file were errors that did not say what was wrong."""
from __future__ import annotations

import gzip
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mariana.sparse.encode import Encoder
from mariana.sparse.errors import DataFormatError, MarianaError
from mariana.sparse.hashing import HashSpec
from mariana.sparse.inputs import NotAFile, expand_data_paths
from mariana.sparse.parse import Reader
from mariana.sparse.schema import avazu, criteo
from mariana.trainer.data import BatchStream, RowRange

LABELS = [1, 0, 0, 1, 0, 0]


def criteo_line(label, i: int = 0) -> str:
    """One Criteo row: label, I1..I13, C1..C26."""
    return "\t".join([str(label), *[str(i + k) for k in range(13)], *[f"{i * 31 + k:08x}" for k in range(26)]])


def write_rows(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def good_rows(n: int) -> list[str]:
    return [criteo_line(LABELS[i % len(LABELS)], i) for i in range(n)]


# ---- 1: a pipe is read more than once: refused, named, before any read -----------------------

def test_a_pipe_a_device_or_a_socket_is_refused_before_any_read(tmp_path):
    fifo = tmp_path / "logs" / "day1.tsv"
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # never opened here: an open for reading would wait for a writer
    says = f"{fifo} is a pipe, not a file: Mariana reads its data more than once (a probe, then the pass); " \
           "write it to a file first"
    for item in (str(fifo), str(tmp_path / "logs" / "*.tsv"), str(tmp_path / "logs")):
        with pytest.raises(NotAFile) as e:
            expand_data_paths([item])
        assert str(e.value) == says, item
    with pytest.raises(NotAFile, match="/dev/null is a character device, not a file"):
        expand_data_paths(["/dev/null"])


def test_the_python_api_refuses_a_pipe_too(tmp_path):
    from mariana.api import data_paths

    os.mkfifo(tmp_path / "rows.tsv")
    with pytest.raises(MarianaError, match="is a pipe, not a file"):
        data_paths(str(tmp_path / "rows.tsv"))


# ---- 2: malformed rows belong to the part of the split they are in ---------------------------

def split_stats(path: str, fraction: float):
    """(train stats, valid stats, train rows, valid rows) of BatchStreams over the two parts."""
    train, valid = RowRange.of_files([path], fraction, header=False)
    enc = Encoder(criteo(), HashSpec(bits=16))
    out = []
    for part in (train, valid):
        stream = BatchStream([path], enc, rows=part)
        rows = sum(b.num_rows for b in stream)
        out.append((stream.stats, rows))
    return out


def test_bad_rows_at_the_end_are_the_validation_parts_only(tmp_path):
    path = write_rows(tmp_path / "endbad.tsv", good_rows(95) + ["garbage"] * 5)
    (train, train_rows), (valid, valid_rows) = split_stats(path, 0.1)
    assert (train.rows_ok, train.rows_bad, train.first_bad, train_rows) == (90, 0, [], 90)
    assert (valid.rows_ok, valid.rows_bad, valid_rows) == (5, 5, 5)
    assert [b.line for b in valid.first_bad] == [96, 97, 98, 99, 100]


def test_bad_rows_are_counted_in_the_part_whose_range_holds_them(tmp_path):
    lines = good_rows(98)
    lines.insert(9, "garbage")    # line 10: training
    lines.insert(95, "2\tnope")   # line 96: validation (the last 10 of 100 lines)
    path = write_rows(tmp_path / "mixed.tsv", lines)
    (train, train_rows), (valid, valid_rows) = split_stats(path, 0.1)
    assert (train.rows_ok, train.rows_bad, [b.line for b in train.first_bad], train_rows) == (89, 1, [10], 89)
    assert (valid.rows_ok, valid.rows_bad, [b.line for b in valid.first_bad], valid_rows) == (9, 1, [96], 9)


# ---- 3: a glob reads a file once, whatever links lead back to it -----------------------------

def test_a_glob_through_a_link_to_a_parent_reads_each_file_once(tmp_path):
    loop = tmp_path / "loop"
    loop.mkdir()
    write_rows(loop / "a.tsv", good_rows(2))
    write_rows(tmp_path / "b.tsv", good_rows(2))
    os.symlink("..", loop / "up")
    got = expand_data_paths([f"{loop}/**/*.tsv"])
    assert got == [f"{loop}/a.tsv", f"{loop}/up/b.tsv"]  # up/loop/a.tsv is a.tsv again
    named_twice = expand_data_paths([f"{loop}/a.tsv", f"{loop}/up/loop/a.tsv"])
    assert len(named_twice) == 2  # named twice outright: read twice, as documented
    links = tmp_path / "links"
    links.mkdir()
    for name in ("x.tsv", "y.tsv"):
        os.symlink(loop / "a.tsv", links / name)
    assert expand_data_paths([str(links)]) == [f"{links}/x.tsv"]  # as its glob: a directory read a.tsv twice


@pytest.mark.timeout(20)
def test_two_links_to_a_parent_do_not_make_the_glob_walk_forever(tmp_path):
    loop = tmp_path / "loop"
    loop.mkdir()
    write_rows(loop / "a.tsv", good_rows(2))
    os.symlink("..", loop / "up1")
    os.symlink("..", loop / "up2")
    assert expand_data_paths([f"{loop}/**/*.tsv"]) == [f"{loop}/a.tsv"]


def test_a_link_loop_or_a_dangling_link_in_a_directory_is_skipped_not_fatal(tmp_path, caplog):
    d = tmp_path / "logs"
    d.mkdir()
    write_rows(d / "a.tsv", good_rows(2))
    os.symlink("self.tsv", d / "self.tsv")      # a loop: stat says "too many levels of symbolic links"
    os.symlink("missing.tsv", d / "gone.tsv")  # dangling
    for item in (str(d), f"{d}/*.tsv"):
        assert expand_data_paths([item]) == [f"{d}/a.tsv"], item
    assert "self.tsv: skipped" in caplog.text and "gone.tsv: skipped" in caplog.text


# ---- 4: Parquet integers above 2^53 convert as a text file's numbers do ----------------------

def test_parquet_integers_beyond_float_precision_are_numbers_and_a_huge_label_a_bad_row(tmp_path):
    s = criteo()
    n = 4
    cols = {"label": pa.array([1, 2 ** 60, 0, 1], pa.int64()),
            "I1": pa.array([2 ** 64 - 1, 3, None, 2 ** 63], pa.uint64()),
            "I2": pa.array([2 ** 60, -(2 ** 62), 5, 7], pa.int64()),
            **{c: pa.array([1.0] * n) for c in s.numeric[2:]},
            **{c: pa.array([f"{c}-{i}" for i in range(n)]) for c in s.categorical}}
    pq.write_table(pa.table(cols), tmp_path / "big.parquet")
    reader = Reader([str(tmp_path / "big.parquet")], s)
    chunks = list(reader)
    assert reader.stats.rows_ok == 3 and reader.stats.rows_bad == 1
    assert reader.stats.first_bad[0].line == 2 and reader.stats.first_bad[0].reason == "label is not 0 or 1"
    np.testing.assert_array_equal(chunks[0].columns["I1"], [2.0 ** 64, np.nan, 2.0 ** 63])
    np.testing.assert_array_equal(chunks[0].columns["I2"], [2.0 ** 60, 5.0, 7.0])
    np.testing.assert_array_equal(chunks[0].labels, [1, 0, 1])


# ---- 5: the Python API's train takes paths, and says so when handed rows ---------------------

def test_train_on_rows_instead_of_paths_is_a_clear_error(tmp_path):
    import mariana

    pd = pytest.importorskip("pandas")
    frames = [pd.DataFrame([[1, 2, "a"]]), pd.DataFrame({"label": [1], "I1": [2]})]
    for frame in frames:  # int column names were a TypeError, named ones "label: no such file"
        with pytest.raises(MarianaError, match=r"^data: a DataFrame is rows, not data paths: .*to_parquet"):
            mariana.train(frame, out=tmp_path / "m")
    with pytest.raises(MarianaError, match=r"^data: a list of dicts is rows, not data paths"):
        mariana.train([{"label": 1, "I1": 3}], out=tmp_path / "m")
    with pytest.raises(MarianaError, match=r"^test_data: expected data paths, got int"):
        mariana.train(write_rows(tmp_path / "d.tsv", good_rows(4)), test_data=7, out=tmp_path / "m")
    assert not (tmp_path / "m").exists()


# ---- 6: errors that say what is wrong ---------------------------------------------------------

def test_a_csv_header_after_a_utf8_bom_is_read(tmp_path):
    s = avazu()
    row = ["7", "1", "14102100", *[f"v{i}" for i in range(len(s.columns) - 3)]]
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (",".join(s.columns) + "\n" + ",".join(row) + "\n").encode())
    reader = Reader([str(path)], s)
    chunks = list(reader)
    assert reader.stats.rows_ok == 1 and chunks[0].labels.tolist() == [1.0]


def test_an_unlabeled_file_read_as_labeled_says_it_looks_unlabeled(tmp_path):
    path = write_rows(tmp_path / "unlabeled.tsv", [line.split("\t", 1)[1] for line in good_rows(20)])
    with pytest.raises(DataFormatError, match=r"expected 40 fields, got 39\)\. The rows look unlabeled "
                                              r"\(every column but 'label'\): .*`mariana predict` takes unlabeled"):
        Reader([path], criteo()).probe()
    reader = Reader([path], criteo(), labeled=None)  # what predict reads: fine
    assert sum(c.num_rows for c in reader) == 20 and reader.stats.rows_bad == 0
    wrong = write_rows(tmp_path / "short.tsv", ["\t".join(["1"] * 20)] * 20)  # not one field short: no hint
    with pytest.raises(DataFormatError) as e:
        Reader([wrong], criteo()).probe()
    assert "look unlabeled" not in str(e.value)


def test_a_gzipped_parquet_file_is_named_as_one(tmp_path):
    s = criteo()
    pq.write_table(pa.table({c: pa.array([1.0]) for c in s.columns}), tmp_path / "x.parquet")
    with open(tmp_path / "x.parquet", "rb") as src, gzip.open(tmp_path / "x.parquet.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    for labeled in (True, None):
        with pytest.raises(DataFormatError, match=r"x\.parquet\.gz: a compressed Parquet file: .*"
                                                  r"their own compression is inside them"):
            Reader([str(tmp_path / "x.parquet.gz")], s, labeled=labeled).probe()
