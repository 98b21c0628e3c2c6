import gzip
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from mariana.sparse.errors import DataFormatError
from mariana.sparse.parse import BlockParser, ParseStats, Reader
from mariana.sparse.records import parse_records
from mariana.sparse.schema import Schema, avazu, criteo

GOOD = "1\t5\t\t3\t" + "\t".join(["7"] * 10) + "\t" + "\t".join(f"{i:08x}" for i in range(26))
GOOD0 = "0" + GOOD[1:]


def write(tmp_path, name, text: str | bytes) -> str:
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(p)


def values(col) -> list[bytes]:
    """Python values of a categorical column, plain or dictionary-encoded, chunked or not."""
    if isinstance(col, pa.ChunkedArray):
        return [v for ch in col.chunks for v in values(ch)]
    if pa.types.is_dictionary(col.type):
        return col.dictionary.take(col.indices).to_pylist()
    return col.to_pylist()


def bad_rows(stats) -> list[tuple[int, str]]:
    return [(b.line, b.reason) for b in stats.first_bad]


def read_all(path, schema=None, **kw):
    r = Reader([path], schema or criteo(), **kw)
    chunks = list(r)
    return chunks, r.stats


def test_real_criteo_sample_parses_completely(criteo_sample):
    chunks, stats = read_all(str(criteo_sample))
    assert stats.rows_ok == 1000 and stats.rows_bad == 0
    labels = np.concatenate([c.labels for c in chunks])
    assert labels.sum() == 21  # the sample's README: 21 positives
    first = chunks[0]
    assert set(first.columns) == set(criteo().numeric + criteo().categorical)
    with gzip.open(criteo_sample, "rt") as f:
        line = f.readline().rstrip("\n").split("\t")
    i1 = first.columns["I1"][0]
    assert (np.isnan(i1) and line[1] == "") or i1 == float(line[1])
    assert values(first.columns["C1"])[0] == line[14].encode()


def test_malformed_rows_are_counted_with_line_numbers(tmp_path):
    lines = [
        GOOD,                                   # 1 ok
        "\t".join(GOOD.split("\t")[:24]),       # 2 too few fields
        GOOD.replace("\t3\t", "\tabc\t", 1),    # 3 I3 not a number
        "2" + GOOD[1:],                         # 4 label not 0/1
        "",                                     # 5 empty line
        GOOD + "\textra",                       # 6 too many fields
        GOOD0,                                  # 7 ok
        GOOD.replace("\t3\t", "\tnan\t", 1),    # 8 'nan' is not a number here
        GOOD0.replace("\t3\t", "\t-4.5e2\t", 1),  # 9 ok: signed float
    ] + [GOOD] * 10                             # (a mostly-bad first block would mean a wrong format)
    chunks, stats = read_all(write(tmp_path, "bad.tsv", "\n".join(lines) + "\n"))
    assert stats.rows_ok == 13 and stats.rows_bad == 6
    assert bad_rows(stats) == [
        (2, "expected 40 fields, got 24"),
        (3, "I3 is not a number"),
        (4, "label is not 0 or 1"),
        (5, "empty line"),
        (6, "expected 40 fields, got 41"),
        (8, "I3 is not a number"),
    ]
    assert np.concatenate([c.labels for c in chunks]).tolist()[:3] == [1.0, 0.0, 0.0]
    assert chunks[0].columns["I3"].tolist()[:3] == [3.0, 3.0, -450.0]
    assert "6 malformed rows skipped" in stats.summary()


def test_non_utf8_bytes_are_fine_in_categories_and_bad_in_numbers(tmp_path):
    good = GOOD.replace("00000000", "\xff\xfe0000", 1).encode("latin-1")
    bad = GOOD.replace("\t5\t", "\t\xff\t", 1).encode("latin-1")
    chunks, stats = read_all(write(tmp_path, "bytes.tsv", b"\n".join([good, bad, good]) + b"\n"))
    assert stats.rows_ok == 2 and bad_rows(stats) == [(2, "I1 is not a number")]
    assert values(chunks[0].columns["C1"])[0] == b"\xff\xfe0000"


def test_a_number_of_blanks_alone_is_missing_as_an_empty_one_is(tmp_path):
    """The model format's rule: a numeric field's text, blanks trimmed, is the number, and an
    empty one is missing (docs/model-format.md). A field of blanks alone was a malformed row,
    while the format's own scorer read it as missing; a dict's " " alike."""
    rows = [GOOD.replace("\t5\t", f"\t{blank}\t", 1) for blank in ("", " ", "  ", "   ", " 5 ")]
    chunks, stats = read_all(write(tmp_path, "blank.tsv", "\n".join(rows) + "\n"))
    assert stats.rows_ok == 5 and not bad_rows(stats)
    assert np.isnan(chunks[0].columns["I1"][:4]).all() and chunks[0].columns["I1"][4] == 5.0
    chunk, bad, _ = parse_records(criteo(), [{"I1": " "}, {"I1": "\t"}, {"I1": " -2.5 "}])
    assert not bad and np.isnan(chunk.columns["I1"][:2]).all() and chunk.columns["I1"][2] == -2.5


def test_fast_and_checked_paths_agree(criteo_sample):
    block = gzip.open(criteo_sample).read()
    parser = BlockParser(criteo())
    fast = parser._parse_fast(block, 1, 0, block.count(b"\n"))
    checked = parser._parse_checked(block, 1, ParseStats(), 0)
    assert fast is not None and fast.num_rows == checked.num_rows == 1000
    assert (fast.labels == checked.labels).all()
    for name in criteo().numeric:
        np.testing.assert_array_equal(fast.columns[name], checked.columns[name])
    for name in criteo().categorical:
        assert values(fast.columns[name]) == values(checked.columns[name])


def test_small_blocks_give_the_same_rows_and_lines(tmp_path):
    lines = [GOOD if i % 7 else GOOD0 for i in range(300)]
    lines[101] = "oops \xff\x80"
    lines[250] = "x" + GOOD
    path = write(tmp_path, "blocks.tsv", "\n".join(lines).encode("latin-1"))  # no final newline
    big, big_stats = read_all(path)
    small, small_stats = read_all(path, block_bytes=1024)
    assert len(small) > 10
    assert small_stats.rows_ok == big_stats.rows_ok == 298
    assert bad_rows(small_stats) == bad_rows(big_stats) == [
        (102, "expected 40 fields, got 1"), (251, "label is not 0 or 1")]
    assert np.concatenate([c.labels for c in small]).tolist() == np.concatenate([c.labels for c in big]).tolist()


def test_crlf_and_gzip_without_extension(tmp_path):
    raw = ("\r\n".join([GOOD, GOOD0]) + "\r\n").encode()
    path = write(tmp_path, "data.bin", gzip.compress(raw))
    chunks, stats = read_all(path)
    assert stats.rows_ok == 2 and stats.rows_bad == 0
    assert values(chunks[0].columns["C26"]) == [b"00000019"] * 2  # no stray \r


def test_wrong_format_is_an_error(tmp_path):
    csv = "a,b,c\n1,2,3\n4,5,6\n"
    with pytest.raises(DataFormatError, match="not in criteo format: 3 of the first 3 rows"):
        read_all(write(tmp_path, "x.csv", csv))
    with pytest.raises(DataFormatError, match="header does not match the avazu schema: column 1 is 'a', "
                                              "expected 'id'") as e:
        read_all(write(tmp_path, "y.csv", csv), avazu())
    assert "expected the 24 columns id,click,hour," in str(e.value) and str(e.value).endswith(",C20,C21")
    with pytest.raises(DataFormatError, match="header does not match the avazu schema: column 1 is 'a'"):
        read_all(write(tmp_path, "y.csv", csv), avazu(), labeled=None)  # predict's: a label read, not "without" one
    with pytest.raises(DataFormatError):
        read_all(write(tmp_path, "z.bin", bytes(range(256)) * 50))


def test_bad_rows_past_the_probe_or_in_parquet_are_rows_never_a_refused_file(tmp_path):
    """The format's verdict is the probe's (the first 256 KiB, before any work): a text file good
    there and bad further on was refused by its first whole block ("not in criteo format"), after
    training had begun; a Parquet file (typed columns) whose first rows hold null labels was
    refused as a whole. Both are counted bad rows now."""
    import pyarrow.parquet as pq

    from mariana.sparse.parse import PROBE_BYTES

    lines = [GOOD] * 2000 + [GOOD.replace("\t5\t", "\tabc\t", 1)] * 3000
    assert len("\n".join(lines[:2000])) > PROBE_BYTES
    path = write(tmp_path, "late.tsv", "\n".join(lines) + "\n")
    Reader([path], criteo()).probe()
    _, stats = read_all(path)
    assert (stats.rows_ok, stats.rows_bad) == (2000, 3000)
    schema = criteo()
    table = pa.table({c: [float(v) if v else None] * 10 if c in schema.numeric else [v] * 10
                      for c, v in zip(schema.columns, GOOD.split("\t"))})
    table = table.set_column(0, "label", pa.array([None] * 6 + [1] * 4, pa.int64()))
    pq.write_table(table, tmp_path / "nulls.parquet")
    Reader([str(tmp_path / "nulls.parquet")], criteo()).probe()
    _, stats = read_all(str(tmp_path / "nulls.parquet"))
    assert (stats.rows_ok, stats.rows_bad) == (4, 6) and bad_rows(stats)[0] == (1, "label is not 0 or 1")


def test_a_damaged_parquet_file_is_a_data_format_error_naming_it(tmp_path):
    """Its first rows unreadable (the column chunks garbled, the footer whole): a raw OSError
    ("Corrupt snappy compressed data") in a notebook, and a CLI line naming no file."""
    import pyarrow.parquet as pq

    schema = criteo()
    n = 3000
    table = pa.table({c: [float(i % 7) for i in range(n)] if c in schema.numeric or c == "label"
                      else [f"{i:08x}" for i in range(n)] for c in schema.columns})
    table = table.set_column(0, "label", pa.array([i % 2 for i in range(n)], pa.int64()))
    pq.write_table(table, tmp_path / "ok.parquet", compression="snappy")
    raw = bytearray((tmp_path / "ok.parquet").read_bytes())
    for i in range(8, len(raw) // 2):
        raw[i] ^= 0x5A
    (tmp_path / "bad.parquet").write_bytes(bytes(raw))
    with pytest.raises(DataFormatError, match=r"bad.parquet: cannot read its first rows \(a damaged file\?\)"):
        Reader([str(tmp_path / "bad.parquet")], schema).probe()


def test_a_file_compressed_by_another_tool_is_named_so(tmp_path):
    """A .bz2 (or xz, zstd, zip) file was read as text: "not in criteo format: 243 of the first
    243 rows are malformed". A text file that starts with "BZh" and no level digit is text."""
    import bz2
    import lzma

    text = (GOOD + "\n") * 50
    for name, data, tool in (("a.bz2", bz2.compress(text.encode()), "bzip2"),
                             ("a.xz", lzma.compress(text.encode()), "xz")):
        with pytest.raises(DataFormatError, match=f"{name}: compressed with {tool}: Mariana reads plain text, gzip "
                                                  "and Parquet files"):
            read_all(write(tmp_path, name, data))
    chunks, stats = read_all(write(tmp_path, "bzh.tsv", "BZhx\n" + text), block_bytes=1 << 16)
    assert sum(c.num_rows for c in chunks) == 50 and stats.rows_bad == 1


def test_a_file_whose_first_line_is_overlong_is_not_text(tmp_path, monkeypatch):
    monkeypatch.setattr("mariana.sparse.parse.MAX_LINE_BYTES", 4096)
    with pytest.raises(DataFormatError, match="line 1 is longer than 0 MiB; not a line-oriented text file"):
        read_all(write(tmp_path, "long.tsv", "1" * 10000 + "\n" + GOOD + "\n"), block_bytes=1024)


@pytest.mark.parametrize("extra", [1, 1000])
def test_a_line_just_over_the_limit_is_malformed_wherever_its_newline_falls(tmp_path, monkeypatch, extra):
    """A long line whose newline came in the read after the limit was passed reached the
    parser whole, and was scored: lines of 16-20 MiB were rows, longer ones malformed."""
    monkeypatch.setattr("mariana.sparse.parse.MAX_LINE_BYTES", 4096)
    fields = GOOD.split("\t")
    fields[20] = "x" * (4096 + extra - 1 - len(GOOD) + len(fields[20]))  # the line and its newline: 4096 + extra
    long = "\t".join(fields)
    assert len(long) + 1 == 4096 + extra
    for block in (1024, 3000, 8192):  # the newline in the read after the one that passed the limit, or in the same
        chunks, stats = read_all(write(tmp_path, "f.tsv", "\n".join([GOOD, long, GOOD0]) + "\n"), block_bytes=block)
        assert [(b.line, b.reason) for b in stats.first_bad] == [
            (2, f"line of {4096 + extra:,} bytes, longer than the 0 MiB a row may have")], block
        assert [int(x) for c in chunks for x in c.labels] == [1, 0]


@pytest.mark.parametrize("gz", [False, True])
def test_an_overlong_line_later_is_one_malformed_row(tmp_path, monkeypatch, gz):
    """A line over MAX_LINE_BYTES after the first is counted and skipped like any malformed
    row (it stopped the job), read a block at a time, never held whole; the rows after it keep
    their line numbers, a reader resumed after it cuts the same spans, and the loader's
    re-read of its span (read_span) gives back what the first read gave."""
    from mariana.sparse.parse import iter_spans, open_binary, read_span, span_end

    monkeypatch.setattr("mariana.sparse.parse.MAX_LINE_BYTES", 4096)
    long = "\t".join(["1"] + ["x" * 400] * 39)  # 16 kB, the right number of fields
    text = "\n".join([GOOD, GOOD0, long, GOOD, "bad", GOOD0]) + "\n"
    path = write(tmp_path, "f.tsv", gzip.compress(text.encode()) if gz else text)
    chunks, stats = read_all(path, block_bytes=1024)
    assert sum(c.num_rows for c in chunks) == 4 and stats.rows_bad == 2
    assert [(b.line, b.reason) for b in stats.first_bad] == [
        (3, f"line of {len(long) + 1:,} bytes, longer than the 0 MiB a row may have"), (5, "expected 40 fields, got 1")]
    assert [int(x) for c in chunks for x in c.labels] == [1, 0, 1, 0]
    with open_binary(path) as f:
        spans = list(iter_spans(f, 1024))
    marker = next(s for s in spans if s[1] == 3)
    assert marker[3] == 1 and len(marker[2]) < 64
    assert span_end(marker[0], marker[2]) == len(GOOD) + len(GOOD0) + len(long) + 3 == spans[spans.index(marker) + 1][0]
    assert read_span(path, marker[0], len(marker[2])) == marker[2]
    for i, (offset, line, block, _) in enumerate(spans):
        assert read_span(path, offset, len(block)) == block
        with open_binary(path) as f:
            f.seek(offset)
            assert list(iter_spans(f, 1024, offset=offset, line_no=line)) == spans[i:]


AVAZU_HEADER = ",".join(avazu().columns)


def avazu_row(i, click="1", hour="14102100"):
    return ",".join([str(i), click, hour] + [f"v{j}" for j in range(21)])


def test_avazu_hour_becomes_hour_of_day_and_weekday(tmp_path):
    text = "\n".join([AVAZU_HEADER, avazu_row(1), avazu_row(2, "0", "14102523"),
                      avazu_row(3, hour="14133100"), avazu_row(4, hour="1410"),
                      # days past their month's end were read as the next month's first (weekday too)
                      avazu_row(5, hour="14022900"), avazu_row(6, hour="14043100"), avazu_row(7, hour="16022923")]
                     + [avazu_row(i) for i in range(8, 12)]) + "\n"
    chunks, stats = read_all(write(tmp_path, "avazu.csv", text), avazu())
    assert stats.rows_ok == 7
    assert bad_rows(stats) == [(4, "hour is not a valid date and hour"), (5, "hour is not YYMMDDHH"),
                               (6, "hour is not a valid date and hour"), (7, "hour is not a valid date and hour")]
    c = chunks[0]
    assert c.columns["hour_of_day"].tolist()[:3] == [0, 23, 23]
    assert c.columns["weekday"].tolist()[:3] == [1, 5, 0]  # 2014-10-21 Tuesday, 2014-10-25 Saturday, 2016-02-29
    assert c.labels.tolist()[:2] == [1.0, 0.0]


def test_generic_csv_schema_with_quotes(tmp_path):
    schema = Schema.from_dict({"name": "ads", "columns": ["y", "age", "city", "note"], "label": "y",
                               "numeric": ["age"], "categorical": ["city"], "ignore": ["note"],
                               "delimiter": ",", "header": True, "quoted": True})
    text = 'y,age,city,note\n1,31,"New York, NY",x\n0,,Paris,"a ""q"""\n1,abc,Rome,z\n'
    chunks, stats = read_all(write(tmp_path, "ads.csv", text), schema)
    assert stats.rows_ok == 2 and bad_rows(stats) == [(4, "age is not a number")]
    assert values(chunks[0].columns["city"]) == [b"New York, NY", b"Paris"]
    assert np.isnan(chunks[0].columns["age"][1])


def test_unlabeled_files_are_detected_for_prediction(tmp_path):
    unlabeled = "\n".join(line.split("\t", 1)[1] for line in [GOOD, GOOD0]) + "\n"
    chunks, stats = read_all(write(tmp_path, "u.tsv", unlabeled), labeled=None)
    assert stats.rows_ok == 2 and chunks[0].labels is None
    chunks, stats = read_all(write(tmp_path, "l.tsv", GOOD + "\n"), labeled=None)
    assert stats.rows_ok == 1 and chunks[0].labels is None  # its label is read past, not used


TRICKY = [" 5", "5 ", "+5", "-5", ".5", "5.", "1e5", "1E+5", "0x10", "1_0", "inf", "nan", "NaN",
          "Infinity", "-", ".", "e5", "5e", "00012", "1.5.2", "\uff11", "  ", "12"]


@pytest.mark.parametrize("value", TRICKY)
def test_both_paths_agree_on_number_like_text(value):
    row = GOOD.replace("\t3\t", f"\t{value}\t", 1)
    block = (row + "\n" + GOOD + "\n").encode()
    parser = BlockParser(criteo())
    checked = parser._parse_checked(block, 1, ParseStats(), 0)
    fast = parser._parse_fast(block, 1, 0, 2)
    if fast is not None:  # the fast path may give up, but must not disagree
        assert fast.num_rows == checked.num_rows == 2
        np.testing.assert_array_equal(fast.columns["I3"], checked.columns["I3"])
    if checked.num_rows == 2:
        x = checked.columns["I3"][0]
        assert np.isnan(x) if value.strip() == "" else float(value) == x


@pytest.mark.parametrize("label", ["01", "+1", "1.0", " 1", "true"])
def test_labels_must_be_exactly_0_or_1(tmp_path, label):
    path = write(tmp_path, "l.tsv", "\n".join([label + GOOD[1:]] + [GOOD] * 3) + "\n")
    _, stats = read_all(path)
    assert stats.rows_ok == 3 and bad_rows(stats) == [(1, "label is not 0 or 1")]


def test_bad_rows_name_their_file_and_large_exponents_are_not_numbers(tmp_path):
    a = write(tmp_path, "a.tsv", "\n".join([GOOD] * 4) + "\n")
    b = write(tmp_path, "b.tsv", "\n".join([GOOD] * 3 + [GOOD.replace("\t3\t", "\t1e400\t", 1)]) + "\n")
    r = Reader([a, b], criteo())
    list(r)
    assert r.stats.first_bad == [(4, "I3 is not a number", b)]
    assert r.stats.to_dict()["first_bad"] == [{"line": 4, "reason": "I3 is not a number", "file": b}]
    assert "b.tsv:4: I3 is not a number" in r.stats.summary()


def test_corrupt_gzip_is_a_data_error(tmp_path):
    raw = bytearray(gzip.compress(("\n".join([GOOD] * 2000) + "\n").encode(), compresslevel=1))
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)
    with pytest.raises(DataFormatError, match="cannot read past line 1 .the [0-9,]+ bytes read from there on hold "
                                              "the fault, not line 1 itself.: .*; is the file truncated or corrupt"):
        read_all(write(tmp_path, "c.tsv.gz", bytes(raw)))  # a small file: read whole, so "line 1"


def test_unlabeled_file_with_header(tmp_path):
    header = ",".join(c for c in avazu().columns if c != "click")
    row = ",".join(["1", "14102100"] + [f"v{j}" for j in range(21)])
    chunks, stats = read_all(write(tmp_path, "t.csv", f"{header}\n{row}\n"), avazu(), labeled=None)
    assert stats.rows_ok == 1 and chunks[0].labels is None


def test_row_slots_line_rows_up_with_input_lines_when_rows_are_skipped(tmp_path):
    """What `mariana predict` aligns its output by: each parsed row's place among the
    block's data lines (a header is not one), on the fast and the checked path."""
    good = "0\t" + "\t".join(["1"] * 13 + ["a"] * 26)
    path = write(tmp_path, "s.tsv", "\n".join([good, "1\tx", "", good, good]) + "\n")
    task = next(Reader([str(path)], criteo()).tasks())
    chunk, stats = task.run()
    lines, slots = task.row_slots(chunk)
    assert (lines, slots.tolist(), stats.rows_bad) == (5, [0, 3, 4], 2)
    fast = next(Reader([str(write(tmp_path, "f.tsv", f"{good}\n{good}\n"))], criteo()).tasks())
    assert [x.tolist() if hasattr(x, "tolist") else x for x in fast.row_slots(fast.run()[0])] == [2, [0, 1]]


def test_the_head_of_a_parquet_span_is_what_reading_its_address_again_gives(gen_files, tmp_path):
    """A cluster job that holds a tail out sends the head of the span the cut falls in: a
    Parquet span's first rows, under a row address that `read_span` (a refill) reads again."""
    from mariana.sparse.parse import from_arrow_block, iter_spans, read_span, span_head
    from tests.unit.test_inputs import csv_to_parquet

    path = csv_to_parquet(gen_files["test"], tmp_path / "t.parquet", criteo(), row_group_size=1000)
    with open(path, "rb") as f:
        offset, first, block, rows = list(iter_spans(f, 64 << 10, name=path))[1]
    address, head = span_head(offset, block, 7)
    table = from_arrow_block(head)
    assert table.num_rows == 7 and table.equals(from_arrow_block(block).slice(0, 7))
    assert (address >> 20, address & ((1 << 20) - 1)) == (first - 1, 7) and rows > 7
    assert from_arrow_block(read_span(path, address, len(head))).equals(table)


def test_preload_answers_pyarrows_pandas_check_without_importing_pandas():
    """pyarrow imports pandas (when installed, 0.3-0.5 s) on its first conversion of a Python
    value, which the parser's fast path makes: a process paid it inside its first block.
    `preload` answers pyarrow's check without pandas: parsing and hashing a first block then
    import nothing, pandas is never loaded, and `to_pandas` still loads it when asked. Without
    the hiding, pandas is in sys.modules after `preload`."""
    pytest.importorskip("pandas", reason="without pandas pyarrow has nothing to import lazily")
    code = (
        "import sys\n"
        "from mariana.sparse.encode import Encoder\n"
        "from mariana.sparse.hashing import HashSpec\n"
        "from mariana.sparse.parse import BlockParser, BlockTask, preload\n"
        "from mariana.sparse.schema import criteo\n"
        "preload()\n"
        "print('pandas' in sys.modules, any(type(f).__name__ == '_NoPandas' for f in sys.meta_path))\n"
        f"block = {(GOOD + chr(10) + GOOD0 + chr(10)).encode()!r}\n"
        "before = set(sys.modules)\n"
        "rows, stats = BlockTask(BlockParser(criteo()), 'x', 1, block, 2).run()\n"
        "Encoder(criteo(), HashSpec()).encode(rows, batch_id='b0')\n"
        "print(rows.num_rows, sorted(set(sys.modules) - before))\n"
        "import pyarrow as pa\n"
        "print(type(pa.table({'a': [1]}).to_pandas()).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the hiding finder is gone again (imports may add finders of their own, as on the GPU hosts)
    assert out.split() == ["False", "False", "2", "[]", "DataFrame"]


@pytest.mark.parametrize("block_bytes", [7, 64, 1000])
@pytest.mark.parametrize("gz", [False, True])
def test_a_reader_resumed_at_a_span_cuts_the_same_spans_as_the_first(tmp_path, block_bytes, gz):
    """A restarted loader resumes at the offset after the last chunk it sent, and names chunks by
    their offsets: from there it must cut the same spans, or a chunk the first loader sent (and
    the coordinator counted) overlaps the next one's lines: a row trained twice an epoch (a
    16-core host's SIGTERM test found rows_in_data 150,001 of 150,000). Lines of 1-40 bytes,
    some longer than a block; with and without gzip; the file ends without a newline."""
    from mariana.sparse.parse import iter_spans, open_binary

    rng = np.random.default_rng(5)
    text = b"\n".join(b"x" * int(n) for n in rng.integers(1, 40, 300))
    path = write(tmp_path, "f", gzip.compress(text) if gz else text)
    with open_binary(path) as f:
        spans = list(iter_spans(f, block_bytes))
    assert b"".join(s[2] for s in spans) == text + b"\n" and len(spans) > 3
    for i, (offset, line, _, _) in enumerate(spans):
        with open_binary(path) as f:
            f.seek(offset)
            assert list(iter_spans(f, block_bytes, offset=offset, line_no=line)) == spans[i:], (block_bytes, i)


def test_a_signal_during_a_read_on_the_main_thread_reaches_python_s_handler():
    """pyarrow's reads on the main thread put a SIGINT/SIGTERM handler of their own in place
    while they run: a SIGTERM then cancelled the read (ArrowCancelled, a traceback in the
    CLI) or, just as it ended, was lost (a retrain stopped by systemd trained on and promoted
    its model). 200 SIGTERMs sent one at a time while the main thread parses blocks: each
    reaches the Python handler, no read is cancelled. Without the fix a read is cancelled within the
    first few signals (the snippet ends in ArrowCancelled's traceback)."""
    code = (
        "import os, signal, threading, time\n"
        "from mariana.sparse.parse import BlockParser, ParseStats\n"
        "from mariana.sparse.schema import criteo\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
        f"block = {(GOOD + chr(10)).encode()!r} * 500\n"
        "parser, lost, done = BlockParser(criteo()), [], threading.Event()\n"
        "def send():\n"
        "    for _ in range(200):\n"
        "        n = len(got)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        deadline = time.monotonic() + 5.0\n"
        "        while len(got) == n and time.monotonic() < deadline:\n"
        "            time.sleep(0.001)\n"
        "        lost.append(len(got) == n)\n"
        "    done.set()\n"
        "threading.Thread(target=send, daemon=True).start()\n"
        "rows = 0\n"
        "while not done.is_set():\n"
        "    rows += parser.parse(block, 1, ParseStats()).num_rows\n"
        "print(len(got), sum(lost), rows > 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["200", "0", "True"], (proc.stdout, proc.stderr[-2000:])
