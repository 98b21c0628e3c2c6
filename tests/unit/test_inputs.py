"""What users hand `--data`: files, directories and globs (sparse/inputs.py), and
Parquet files read like the CSV/TSV they were made from (sparse/parse.py)."""
import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from mariana.sparse.encode import Encoder
from mariana.sparse.errors import ConfigError, DataFormatError
from mariana.sparse.hashing import HashSpec
from mariana.sparse.inputs import NoDataFiles, expand_data_paths, split_spec
from mariana.sparse.parse import BlockParser, BlockTask, Reader, iter_spans, read_span, to_arrow_block
from mariana.sparse.schema import Schema, avazu, criteo
from mariana.sparse.synth import generate_criteo


def touch(path, text="x\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def names(paths, root):
    return [os.path.relpath(p, root) for p in paths]


# ---- files, directories, globs ------------------------------------------------------------

def test_a_directory_is_its_visible_files_by_name_not_its_subdirectories(tmp_path):
    d = tmp_path / "logs"
    for name in ("day10.tsv", "day02.tsv", "day01.tsv.gz", ".day00.tsv", "_SUCCESS", "sub/day03.tsv"):
        touch(d / name)
    assert names(expand_data_paths([str(d)]), tmp_path) == ["logs/day01.tsv.gz", "logs/day02.tsv", "logs/day10.tsv"]
    assert names(expand_data_paths([str(d) + "/"]), tmp_path)[0] == "logs/day01.tsv.gz"


def test_a_glob_is_its_matches_sorted_and_a_matched_directory_its_files(tmp_path):
    for name in ("a/p-2.tsv", "a/p-1.tsv", "b/p-3.tsv", "b/_SUCCESS", "c/deep/p-4.tsv", "p-0.tsv"):
        touch(tmp_path / name)
    root = str(tmp_path)
    assert names(expand_data_paths([f"{root}/*/p-*.tsv"]), tmp_path) == ["a/p-1.tsv", "a/p-2.tsv", "b/p-3.tsv"]
    assert names(expand_data_paths([f"{root}/[ab]"]), tmp_path) == ["a/p-1.tsv", "a/p-2.tsv", "b/p-3.tsv"]
    assert names(expand_data_paths([f"{root}/**/p-*.tsv"]), tmp_path) == [
        "a/p-1.tsv", "a/p-2.tsv", "b/p-3.tsv", "c/deep/p-4.tsv", "p-0.tsv"]
    assert names(expand_data_paths([f"{root}/b/_*"]), tmp_path) == ["b/_SUCCESS"]  # asked for by name


def test_items_keep_their_order_and_expand_in_place(tmp_path):
    for name in ("d/b.tsv", "d/a.tsv", "z.tsv"):
        touch(tmp_path / name)
    got = expand_data_paths([str(tmp_path / "z.tsv"), str(tmp_path / "d"), str(tmp_path / "d/a.tsv")])
    assert names(got, tmp_path) == ["z.tsv", "d/a.tsv", "d/b.tsv", "d/a.tsv"]  # named twice: read twice, as before


def test_an_existing_name_with_glob_characters_is_taken_literally(tmp_path):
    odd = touch(tmp_path / "day[1].tsv")
    touch(tmp_path / "day1.tsv")
    assert expand_data_paths([str(odd)]) == [str(odd)]


def test_a_comma_in_a_file_name_stays_in_it(tmp_path):
    """`--data` is comma-separated; a file whose name holds a comma is still one item (the API's
    string and the CLI's take the same path), and a missing one is named whole."""
    from mariana.api import data_paths

    odd, b, c = touch(tmp_path / "day,1.tsv"), touch(tmp_path / "b.tsv"), touch(tmp_path / "c,d")
    spec = f"{b},{odd},{tmp_path / 'c,d'},"
    assert split_spec(spec) == [str(b), str(odd), str(c)]
    assert data_paths(spec) == [str(b), str(odd), str(c)]
    assert split_spec(f"{tmp_path / 'day'},{b}") == [str(tmp_path / "day"), str(b)]  # no such file: split
    with pytest.raises(NoDataFiles, match="/day: no such file"):
        data_paths(f"{tmp_path / 'day'},{b}")


@pytest.mark.parametrize("item,says", [
    ("missing.tsv", "missing.tsv: no such file or directory"),
    ("logs/nothing-*.tsv", "logs/nothing-*.tsv: the pattern matches no files"),
    ("empty", "empty: the directory holds no data files (names starting with '.' or '_' are not data)"),
    ("nested", "nested: the directory holds no data files (1 subdirectories are not read: name them, "
               "or use a glob such as nested/*/*)"),
    ("only_empty_*", "only_empty_*: the pattern matches only directories without data files"),
])
def test_an_item_that_names_no_file_is_an_error_naming_it(tmp_path, monkeypatch, item, says):
    monkeypatch.chdir(tmp_path)
    touch(tmp_path / "logs/day1.tsv")
    touch(tmp_path / "empty/_SUCCESS")
    touch(tmp_path / "nested/day=1/part-0.parquet")
    (tmp_path / "only_empty_1").mkdir()
    with pytest.raises(NoDataFiles) as e:
        expand_data_paths(["logs", item])
    assert str(e.value) == says


def test_retrain_windows_take_directories_and_globs(tmp_path):
    from mariana.serving.config import load_serve_config
    from mariana.serving.retrain import windows

    for day in ("day1", "day2", "day3"):
        touch(tmp_path / "logs" / f"{day}.tsv")
    cfg_path = tmp_path / "serve.toml"
    cfg_path.write_text('[serve]\nmodel_dir = "m"\n[retrain]\ndata = "logs"\ntrain_files = 2\neval_files = 1\n')
    train, evals = windows(load_serve_config(str(cfg_path), env={}))
    assert [os.path.basename(p) for p in train + evals] == ["day1.tsv", "day2.tsv", "day3.tsv"]
    cfg_path.write_text('[serve]\nmodel_dir = "m"\n[retrain]\ntrain_data = ["logs/day[12].tsv"]\n'
                        'eval_data = ["logs/day9*"]\n')
    with pytest.raises(ConfigError, match=r"retrain.eval_data: .*logs/day9\*: the pattern matches no files"):
        windows(load_serve_config(str(cfg_path), env={}))


# ---- Parquet ------------------------------------------------------------------------------

SPEC = HashSpec(bits=18, numeric="both")


def csv_to_parquet(src, out, schema: Schema, types: dict | None = None, nulls: bool = True,
                   row_group_size: int | None = None) -> str:
    """The Parquet file a user would make of `src`: columns named by the schema, numbers
    typed, categories strings (empty -> null with `nulls`), or the given `types`."""
    col_types = {schema.label: pa.int64(), **{c: pa.float64() for c in schema.numeric},
                 **{c: pa.string() for c in schema.categorical}, **(types or {})}
    table = pa_csv.read_csv(
        src, read_options=pa_csv.ReadOptions(column_names=None if schema.header else list(schema.columns)),
        parse_options=pa_csv.ParseOptions(delimiter=schema.delimiter),
        convert_options=pa_csv.ConvertOptions(column_types=col_types, strings_can_be_null=nulls))
    pq.write_table(table, out, row_group_size=row_group_size)
    return str(out)


def encoded(paths, schema: Schema, block_bytes: int = 64 << 20, **kw):
    """Every row of `paths`, encoded: ((B, F) ids, dense, labels) and the parse stats."""
    reader = Reader([str(p) for p in paths], schema, block_bytes, **kw)
    enc = Encoder(schema, SPEC)
    batches = [enc.encode(c) for c in reader]
    ids = np.concatenate([b.ids.reshape(b.num_rows, -1) for b in batches])
    dense = np.concatenate([b.dense for b in batches])
    labels = np.concatenate([b.labels for b in batches]) if batches[0].labels is not None else None
    return (ids, dense, labels), reader.stats


def assert_same_batches(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


ROWS = [  # label, I1..I13, C1..C26: missing numbers and categories, decimal-looking categories
    "1\t5\t\t3\t" + "\t".join(["7"] * 10) + "\t" + "\t".join(f"{i:08x}" for i in range(26)),
    "0\t\t-2\t0\t" + "\t".join(["12"] * 10) + "\t" + "\t".join([""] * 3 + ["1234"] * 23),
    "1\t8\t1000\t\t" + "\t".join([""] * 10) + "\t" + "\t".join(["abc", ""] * 13),
]


def test_a_parquet_file_encodes_exactly_like_the_csv_it_was_made_from(tmp_path):
    """Train equivalence: the same ids, dense values and labels, row for row, whatever the
    block sizes (CSV empties and Parquet nulls both mean missing)."""
    tsv = tmp_path / "train.tsv"
    generate_criteo(tsv, 3000, seed=3)
    with open(tsv, "a") as f:
        f.write("\n".join(ROWS) + "\n")
    parquet = csv_to_parquet(tsv, tmp_path / "train.parquet", criteo(), row_group_size=700)
    want, want_stats = encoded([tsv], criteo())
    got, got_stats = encoded([parquet], criteo(), block_bytes=1 << 16)  # ~160 rows a block, across row groups
    assert got_stats.rows_ok == want_stats.rows_ok == 3003 and got_stats.rows_bad == 0
    assert_same_batches(got, want)
    assert pq.read_table(parquet).column("C1").null_count == 1  # the empties are nulls there
    as_ints = csv_to_parquet(tsv, tmp_path / "ints.parquet", criteo(),
                             types={c: pa.int64() for c in criteo().numeric})
    assert_same_batches(encoded([as_ints], criteo())[0], want)


def test_integer_categories_hash_as_their_decimal_text(tmp_path):
    tsv = tmp_path / "d.tsv"
    tsv.write_text("\n".join("\t".join(["1"] + ["2"] * 13 + [str(7 * j + k) for j in range(26)])
                             for k in (0, 100, 123456789)) + "\n")
    types = {c: pa.int64() for c in criteo().categorical} | {"label": pa.bool_()}
    parquet = csv_to_parquet(tsv, tmp_path / "d.parquet", criteo(), types=types)
    assert pq.read_schema(parquet).field("C5").type == pa.int64()
    assert_same_batches(encoded([parquet], criteo())[0], encoded([tsv], criteo())[0])


def test_float_categories_hash_as_the_integers_and_nan_as_missing(tmp_path):
    """An id column with gaps is float64 in the Parquet file pandas writes, its gaps NaN or
    null: 30000000017.0 hashes as the TSV's 30000000017 (Arrow's own text was
    '3.0000000017e+10'), and a NaN is missing as a null is (it was the id 'nan')."""
    tsv = tmp_path / "d.tsv"
    tsv.write_text("\n".join("\t".join(["1"] + ["2"] * 13 + ["" if (j + k) % 4 == 0 else str(30_000_000_017 * j + k)
                                                            for j in range(26)])
                             for k in range(8)) + "\n")
    floats = {c: pa.float64() for c in criteo().categorical}
    parquet = csv_to_parquet(tsv, tmp_path / "d.parquet", criteo(), types=floats)
    table = pq.read_table(parquet)
    for c in ("C1", "C2"):  # NaN where pandas' writer leaves NaN, not null
        values = [float("nan") if v is None else v for v in table.column(c).to_pylist()]
        table = table.set_column(table.schema.get_field_index(c), c, pa.array(values, pa.float64(), from_pandas=False))
    pq.write_table(table, tmp_path / "nan.parquet")
    assert pq.read_table(tmp_path / "nan.parquet").column("C1").null_count == 0
    want = encoded([tsv], criteo())[0]
    assert_same_batches(encoded([parquet], criteo())[0], want)
    assert_same_batches(encoded([tmp_path / "nan.parquet"], criteo())[0], want)


def test_avazu_parquet_with_an_integer_hour_and_extra_columns(tmp_path):
    header = ",".join(avazu().columns)
    rows = [",".join([str(i), str(i % 2), f"141021{i % 24:02d}"] + [f"v{i % 3}{j}" for j in range(21)])
            for i in range(50)]
    csv = tmp_path / "a.csv"
    csv.write_text(header + "\n" + "\n".join(rows) + "\n")
    table = pa_csv.read_csv(csv, convert_options=pa_csv.ConvertOptions(
        column_types={"hour": pa.int64(), "click": pa.int8(), "id": pa.string()}))
    table = table.append_column("extra", pa.array([[1]] * 50))  # not the schema's: not read
    table = table.select(list(reversed(table.column_names)))     # looked up by name, not position
    pq.write_table(table, tmp_path / "a.parquet")
    got, stats = encoded([tmp_path / "a.parquet"], avazu())
    assert stats.rows_ok == 50
    assert_same_batches(got, encoded([csv], avazu())[0])


def replaced(table: pa.Table, name: str, values: list) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, pa.array(values))


@pytest.mark.parametrize("change,says", [
    (lambda t: t.drop_columns(["C7"]), "missing column 'C7'"),
    (lambda t: t.drop_columns(["C7", "C8", "C9", "C10", "C11"]), "missing columns 'C7', ..., 'C11'"),
    (lambda t: replaced(t, "label", ["1"] * 4),
     "column 'label' is string, expected 0/1 as integers, booleans or floats"),
    (lambda t: replaced(t, "I1", ["3"] * 4),
     "column 'I1' is string, expected numbers (integers or floats; null = missing)"),
    (lambda t: replaced(t, "C6", [["a"]] * 4), "column 'C6' is list<element: string>, expected scalar values"),
])
def test_a_missing_or_mistyped_column_is_one_error_before_any_row(tmp_path, change, says):
    table = change(pa.table({c: pa.array([1] * 4) for c in criteo().columns}))
    pq.write_table(table, tmp_path / "bad.parquet")
    path = str(tmp_path / "bad.parquet")
    with pytest.raises(DataFormatError) as e:
        Reader([str(write_tsv(tmp_path)), path], criteo()).probe()  # mixed inputs: the text file is fine
    assert str(e.value).startswith(f"{path}: not in the criteo schema's columns: ") and says in str(e.value)
    assert "the file's columns: label, I1" in str(e.value)


def test_a_column_named_in_another_case_is_said_so(tmp_path):
    """`Label` for `label`: the error said the rows looked unlabeled and predict takes those."""
    names = list(criteo().columns)
    table = pa.table({c: pa.array([1] * 4) for c in names}).rename_columns(["Label", *names[1:]])
    pq.write_table(table, tmp_path / "cased.parquet")
    with pytest.raises(DataFormatError) as e:
        Reader([str(tmp_path / "cased.parquet")], criteo()).probe()
    assert "missing column 'label'; the file has 'Label' for 'label': column names are matched with their case" \
        in str(e.value), str(e.value)
    assert "unlabeled" not in str(e.value)


def write_tsv(tmp_path, rows=ROWS):
    path = tmp_path / "ok.tsv"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_file_that_only_looks_like_parquet_is_a_data_error(tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_text("\n".join(ROWS) + "\n")
    with pytest.raises(DataFormatError, match="fake.parquet: not a readable Parquet file"):
        Reader([str(fake)], criteo()).probe()


def test_bad_values_are_malformed_rows_numbered_from_one(tmp_path):
    n = 10
    table = pa.table({"label": pa.array([1, 0, 2, None, 1, 0, 1, 0, 1, 0], pa.float64()),
                      **{c: pa.array([1.5] * n) for c in criteo().numeric},
                      **{c: pa.array([f"v{i}" for i in range(n)]) for c in criteo().categorical}})
    table = table.set_column(1, "I1", pa.array([1.0, 2.0, 3.0, 4.0, float("inf"), None, float("nan"), 0, 1, 2]))
    pq.write_table(table, tmp_path / "v.parquet")
    reader = Reader([str(tmp_path / "v.parquet")], criteo())
    chunks = list(reader)
    assert [(b.line, b.reason) for b in reader.stats.first_bad] == [
        (3, "label is not 0 or 1"), (4, "label is not 0 or 1"), (5, "I1 is infinite")]
    assert reader.stats.rows_ok == 7 and chunks[0].lines.tolist() == [1, 2, 6, 7, 8, 9, 10]
    i1 = chunks[0].columns["I1"]
    assert np.isnan(i1[2:4]).all() and chunks[0].labels.tolist() == [1, 0, 0, 1, 0, 1, 0]  # null, NaN: missing


def test_parquet_blocks_stay_near_block_bytes(tmp_path):
    tsv = tmp_path / "t.tsv"
    generate_criteo(tsv, 20_000, seed=4)
    parquet = csv_to_parquet(tsv, tmp_path / "t.parquet", criteo())  # one row group of 20,000 rows
    tasks = list(Reader([parquet], criteo(), block_bytes=256 << 10).tasks())
    sizes = [t.block.nbytes for t in tasks]
    assert len(tasks) > 10 and sum(t.num_lines for t in tasks) == 20_000
    assert max(sizes) < 2 * (256 << 10), sizes
    assert [t.first_line for t in tasks[:2]] == [1, tasks[0].num_lines + 1]


def test_unlabeled_parquet_for_prediction_keeps_one_slot_per_row(tmp_path):
    table = pq.read_table(csv_to_parquet(write_tsv(tmp_path), tmp_path / "l.parquet", criteo()))
    pq.write_table(table.drop_columns(["label"]), tmp_path / "u.parquet")
    task = next(Reader([str(tmp_path / "u.parquet")], criteo(), labeled=None).tasks())
    chunk, _ = task.run()
    assert chunk.labels is None and task.row_slots(chunk)[0] == 3 and task.row_slots(chunk)[1].tolist() == [0, 1, 2]
    labeled = next(Reader([str(tmp_path / "l.parquet")], criteo(), labeled=None).tasks()).run()[0]
    assert labeled.labels is None and labeled.num_rows == 3  # prediction does not read a label column


def test_prediction_scores_rows_whose_label_is_bad_or_missing(tmp_path):
    """A label is not needed to predict: `mariana predict` printed nan for a row whose label was
    'x', while the same row without its label column was scored. Training still refuses it."""
    tsv = tmp_path / "p.tsv"
    generate_criteo(str(tsv), 300, seed=6)
    lines = tsv.read_text().splitlines()
    bad = [("x" if i == 1 else "" if i == 2 else "0.5" if i == 3 else ln.split("\t", 1)[0])
           + "\t" + ln.split("\t", 1)[1] for i, ln in enumerate(lines)]
    (tmp_path / "bad.tsv").write_text("\n".join(bad) + "\n")
    (tmp_path / "unl.tsv").write_text("\n".join(ln.split("\t", 1)[1] for ln in lines) + "\n")

    def read(name, labeled):
        reader = Reader([str(tmp_path / name)], criteo(), labeled=labeled)
        return list(reader), reader.stats

    (chunk, *_), stats = read("bad.tsv", None)
    (plain, *_), _ = read("unl.tsv", None)
    assert stats.rows_bad == 0 and chunk.num_rows == 300 and chunk.labels is None
    for c, want in plain.columns.items():
        got = chunk.columns[c]
        assert got.equals(want) if hasattr(got, "equals") else np.array_equal(got, want, equal_nan=True), c
    _, stats = read("bad.tsv", True)
    assert stats.rows_bad == 3 and (stats.first_bad[0].line, stats.first_bad[0].reason) == (2, "label is not 0 or 1")


def test_the_cluster_loader_sends_parquet_as_arrow_blocks_that_preprocess_parses(tmp_path):
    """What services/loader.py and services/preprocess.py do with a Parquet source: spans
    from iter_spans (addressed by row), parsed from the received frame by a BlockTask, read
    again by read_span (a chunk evicted from the cache) and resumed from a line number."""
    tsv = tmp_path / "c.tsv"
    generate_criteo(tsv, 2000, seed=5)
    parquet = csv_to_parquet(tsv, tmp_path / "c.parquet", criteo(), row_group_size=300)
    with open(parquet, "rb") as f:  # what open_binary gives the loader
        spans = list(iter_spans(f, 1 << 16, name=parquet))
    assert len(spans) > 3 and sum(s[3] for s in spans) == 2000
    # chunk ids are f<file>o<offset>: distinct; and no offset is 0 (the loader's first_of_file)
    assert len({s[0] for s in spans}) == len(spans) and all(s[0] != 0 for s in spans)
    parser = BlockParser(criteo())
    enc = Encoder(criteo(), SPEC)
    got = []
    for offset, first_line, block, lines in spans:
        frame = memoryview(np.frombuffer(block, np.uint8))  # as preprocess receives it
        task = BlockTask(parser, parquet, first_line, frame, lines, skip_rows=1, first_of_file=False)
        chunk, stats = task.run()
        assert stats.rows_ok == lines and task.skip_rows == 0
        got.append(enc.encode(chunk).ids.reshape(lines, -1))
        assert read_span(parquet, offset, len(block)) == block
    np.testing.assert_array_equal(np.concatenate(got), encoded([tsv], criteo())[0][0])
    with open(parquet, "rb") as f:  # a restarted loader: it seeks to its (meaningless) byte offset first
        f.seek(spans[2][0] + len(spans[2][2]))
        resumed = list(iter_spans(f, 1 << 16, name=parquet, offset=f.tell(), line_no=spans[3][1]))
    assert [s[:2] for s in resumed] == [s[:2] for s in spans[3:]]
    assert list(iter_spans(io.BytesIO(b"PAR"), 4)) == [(0, 1, b"PAR\n", 1)]  # too short to be Parquet: text


def test_a_changed_parquet_file_is_an_error_on_reread(tmp_path):
    pq.write_table(pa.table({"a": list(range(10))}), tmp_path / "s.parquet")
    block = to_arrow_block(pa.table({"a": list(range(4))}))
    assert read_span(str(tmp_path / "s.parquet"), (0 << 20) | 4, len(block)) == block
    with pytest.raises(DataFormatError, match="has changed: rows 9 to 12 are not all there"):
        read_span(str(tmp_path / "s.parquet"), (8 << 20) | 4, 100)


def test_row_estimates_of_gzip_files_of_one_member_several_or_cut_short(tmp_path):
    """A gzip trailer's size is its last member's: taken alone, a `cat` of two gzip files
    (or a bgzip file) read as tens of millions of rows, and the auto batch size with it
    (16x too large, a worse model). The estimate is now within a few percent for each."""
    import gzip

    from mariana.trainer.data import estimate_rows

    plain = tmp_path / "rows.tsv"
    generate_criteo(str(plain), 20_000, seed=1)
    data = plain.read_bytes()
    lines = data.splitlines(keepends=True)
    one = tmp_path / "one.gz"
    one.write_bytes(gzip.compress(data))
    cat = tmp_path / "cat.gz"
    cat.write_bytes(gzip.compress(data) + gzip.compress(b"".join(lines[:10])))  # 20,010 rows
    blocks = tmp_path / "blocks.gz"  # bgzip-like: a member per 1,000 rows
    blocks.write_bytes(b"".join(gzip.compress(b"".join(lines[i:i + 1000])) for i in range(0, len(lines), 1000)))
    cut = tmp_path / "cut.gz"
    cut.write_bytes(one.read_bytes()[:len(one.read_bytes()) // 2])  # about 10,000 rows readable
    for path, rows in ((plain, 20_000), (one, 20_000), (cat, 20_010), (blocks, 20_000), (cut, 10_000)):
        assert abs(estimate_rows([str(path)], criteo(), block_bytes=1 << 16) / rows - 1) < 0.1, path.name
