"""Streaming, vectorized parsers for delimited click logs.

A file (plain or gzip, told apart by its first bytes) is read in blocks of
about `block_bytes`, cut at line ends, and each block is parsed by pyarrow's
C++ CSV reader into binary columns. Rows are then checked column-wise:

- wrong field count -> malformed ("expected 40 fields, got 24");
- label other than 0/1 -> malformed;
- a numeric field that is neither empty nor a number -> malformed;
- an hour field that is not a valid YYMMDDHH -> malformed;
- a line longer than 16 MiB -> malformed (read past, never held whole).

Malformed rows are skipped and counted in `ParseStats`, which keeps the line
numbers and reasons of the first few. Memory is bounded by the block size,
never the file size. A file whose first block is mostly malformed is not in
this format: `DataFormatError`.

Parquet files (a `.parquet`/`.pq` name, or the magic bytes PAR1) are read by
the same `Reader` in blocks of about `block_bytes` of rows (pyarrow's
`iter_batches`), their columns looked up by the schema's column names and
checked against it once per file (`check_columns`): a missing column or one of
a type its role cannot take is one `DataFormatError` before any row is read.
Values become what a text block's would: numbers float64 (null = missing),
categories the bytes of their string form (integers in decimal, so a Parquet
file hashes like the CSV it was made from), labels 0/1 from integers, booleans
or floats. Rows are checked as text rows are (a label that is not 0 or 1 or is
null, an infinite number, a bad hour: malformed), numbered from 1 like lines.
For the cluster loader, `iter_spans` cuts a Parquet file into Arrow IPC blocks
that `BlockTask` parses wherever it runs (see `iter_spans`).
"""
from __future__ import annotations

import csv
import gzip
import os
import sys
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from mariana.sparse.errors import DataFormatError
from mariana.sparse.schema import Schema

# A pyarrow read on the main thread swaps in a SIGINT/SIGTERM handler of its own while it runs:
# a signal then cancels the read (ArrowCancelled, not KeyboardInterrupt: a traceback), or, just as
# it ends, is handed back through a background thread too late and lost (`mariana retrain` trained
# on and promoted after its SIGTERM). Python's own handler runs after the read: a text block takes
# milliseconds, a Parquet row group up to seconds. Process-wide, so a Python-API user's own pyarrow
# reads are not cancelled by Ctrl-C either (they end, then KeyboardInterrupt is raised).
pa.enable_signal_handlers(False)

GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"  # what some tools (Excel's "CSV UTF-8") write first; pyarrow skips it in data
# What pyarrow's float parser accepts, less nan/inf: the fast and checked paths agree.
NUMBER_RE = r"^[ \t]*(?:[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)?[ \t]*$"  # blanks alone: missing
HOUR_RE = r"^[0-9]{8}$"
MAX_LINE_BYTES = 16 << 20  # a longer line is a malformed row (`overlong_marker`); a file's first, not text
OVERLONG_LINE = b"\x00mariana-overlong-line\x00"
FIRST_BAD_KEPT = 10
PARQUET_MAGIC = b"PAR1"
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_BLOCK = b"\x00mariana-arrow-ipc\x00"  # a columnar block as bytes: this, then an Arrow IPC stream
WHOLE_LIMIT = 2.0 ** 63  # a whole float below this in a categorical column is hashed as its integer
ROWS_BITS = 20      # a Parquet span's offset is (first row << ROWS_BITS) | rows, not a byte offset
SAMPLE_ROWS = 1024  # rows whose in-memory size sets a Parquet file's rows per block


class BadRow(NamedTuple):
    line: int
    reason: str
    file: str = ""


@dataclass
class ParseStats:
    """Row counts of a parse, mergeable; keeps the first few malformed lines.

    `file` names the file that `add_bad` reports lines of.
    """

    rows_ok: int = 0
    rows_bad: int = 0
    first_bad: list[BadRow] = field(default_factory=list)
    file: str = ""
    clicks: int = 0  # valid rows labeled 1 (a job whose rows are all of one label learns nothing)

    def add_ok(self, chunk: "Chunk") -> None:
        """Count a chunk's valid rows, and its clicks."""
        self.rows_ok += chunk.num_rows
        if chunk.labels is not None:
            self.clicks += int(np.count_nonzero(chunk.labels))

    def add_bad(self, line: int, reason: str) -> None:
        self.rows_bad += 1
        if len(self.first_bad) < FIRST_BAD_KEPT:
            self.first_bad.append(BadRow(line, reason, self.file))

    def merge(self, other: "ParseStats") -> "ParseStats":
        self.rows_ok += other.rows_ok
        self.rows_bad += other.rows_bad
        self.clicks += other.clicks
        room = FIRST_BAD_KEPT - len(self.first_bad)
        self.first_bad.extend(other.first_bad[:max(room, 0)])
        return self

    def summary(self) -> str:
        head = f"{self.rows_ok} rows parsed, {self.rows_bad} malformed rows skipped"
        return f"{head} (first: {describe_bad(self.to_dict()['first_bad'])})" if self.first_bad else head

    def to_dict(self) -> dict:
        return {"rows_ok": self.rows_ok, "rows_bad": self.rows_bad, "clicks": self.clicks,
                "first_bad": [b._asdict() for b in self.first_bad]}


def describe_bad(first_bad: list[dict], most: int = 5) -> str:
    """'a.tsv:12: label is not 0 or 1; ...' from `ParseStats.to_dict()['first_bad']`."""
    return "; ".join(f"{os.path.basename(b['file']) + ':' if b['file'] else 'line '}{b['line']}: {b['reason']}"
                     for b in first_bad[:most])


@dataclass
class Chunk:
    """Validated rows of one block: raw columns by name, labels, row count.

    Categorical and hour columns are pyarrow binary arrays ('' = missing);
    numeric columns are float64 numpy arrays (NaN = missing); `labels` is
    float32 (None for unlabeled files).
    """

    columns: dict[str, object]
    labels: np.ndarray | None
    num_rows: int
    first_line: int = 1
    lines: np.ndarray | None = None  # (num_rows,) int64 line number of each row; None: the block's
                                      # data lines in order, none skipped


def preload() -> None:
    """Answer now, without importing pandas, what pyarrow asks on its first conversion of a
    Python value (the parser's fast path makes one): is pandas installed? Where it is, pyarrow
    imports it then: 0.3-0.5 s of CPU on a 2-core VM, inside the first block a process parses
    (a `mariana train` of 1M rows took ~7 s from start to exit). No code of this package hands
    pandas objects to pyarrow, so the commands that parse data and the preprocess service call
    this at start, before they start threads: pandas is hidden from `import` for that one call.
    `Table.to_pandas` still imports pandas when asked. Not done on import, so a library user's
    process keeps pyarrow's own answer; nor where pandas is loaded already."""
    if "pandas" in sys.modules:
        pa.scalar(b"0")
        return
    hide = _NoPandas()
    sys.meta_path.insert(0, hide)
    try:
        pa.scalar(b"0")
    finally:
        sys.meta_path.remove(hide)


class _NoPandas:
    """An import finder under which `import pandas` fails as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            raise ModuleNotFoundError("hidden from pyarrow's first check (sparse.parse.preload)", name=name)
        return None


# ---- blocks of whole lines ------------------------------------------------

def open_binary(path: str | os.PathLike) -> BinaryIO:
    """Open a data file for reading, gunzipping when it starts with gzip's magic."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataFormatError(f"{path}: is a directory, not a data file")
    f = open(path, "rb")  # FileNotFoundError / PermissionError carry the path
    if f.peek(2)[:2] == GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")
    return f


def iter_blocks(stream: BinaryIO, block_bytes: int, name: str = "") -> Iterator[tuple[int, bytes, int]]:
    """Yield (first line number, bytes of whole lines, number of lines) blocks of ~block_bytes."""
    for _, first_line, block, lines in iter_spans(stream, block_bytes, name):
        yield first_line, block, lines


def iter_spans(stream: BinaryIO, block_bytes: int, name: str = "", offset: int = 0,
               line_no: int = 1) -> Iterator[tuple[int, int, bytes, int]]:
    """Yield (byte offset, first line number, bytes of whole lines, number of
    lines) from `stream` positioned at `offset` (of the decompressed bytes),
    whose first line is number `line_no`: a reader that recorded where it got
    to resumes there. The last line gains a newline if the file lacks one. A
    line longer than MAX_LINE_BYTES is read and dropped, a block at a time, and
    its span is `overlong_marker` (one malformed row to the parser; `span_end`
    says where the next span starts); a file's first line that long is an error.

    A span is the whole lines of the `block_bytes` (or the first multiple of it
    that holds a newline) from where it starts, whatever was read before it: a
    reader resumed at a span's offset cuts the same spans from there on as the
    first one did, so the loader's chunk ids (`f<file>o<offset>`) name the same
    lines after its restart.

    A Parquet file (PAR1 at the start of `stream`) yields columnar spans
    instead: Arrow IPC blocks (`to_arrow_block`) of about `block_bytes` of
    rows, numbered by row, from row `line_no`; a span's offset is its row
    address `first row << ROWS_BITS | rows` (what `read_span` reads again),
    and `offset` is not used (a resumed reader's byte count means nothing here).

    >>> import io
    >>> [(o, n, b) for o, n, b, _ in iter_spans(io.BytesIO(b"a\\nbb\\nc"), 3)]
    [(0, 1, b'a\\n'), (2, 2, b'bb\\n'), (5, 3, b'c\\n')]
    """
    if _is_parquet_stream(stream):
        yield from _parquet_spans(stream, block_bytes, name, line_no)
        return
    carry = b""
    while True:
        data = _read(stream, block_bytes - len(carry) % block_bytes, name, line_no)  # the span to a multiple of it
        if not data:
            break
        data = carry + data if carry else data
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if len(data) > MAX_LINE_BYTES:
                if line_no == 1:
                    raise DataFormatError(
                        f"{name}: line 1 is longer than {MAX_LINE_BYTES >> 20} MiB; not a line-oriented text file?")
                length, carry = _skip_line(stream, block_bytes, len(data), name, line_no)
                yield offset, line_no, overlong_marker(length), 1
                offset += length
                line_no += 1
                continue
            carry = data
            continue
        block, carry = data[:cut], data[cut:]
        lines = block.count(b"\n")
        yield offset, line_no, block, lines
        offset += cut
        line_no += lines
    if carry:  # the last line without its newline, or the lines read after an overlong one
        block = carry if carry.endswith(b"\n") else carry + b"\n"
        yield offset, line_no, block, block.count(b"\n")


def _read(stream: BinaryIO, size: int, name: str, line_no: int) -> bytes:
    try:
        return stream.read(size)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataFormatError(f"{name}: cannot read past line {line_no} (the {size:,} bytes read from there on "
                              f"hold the fault, not line {line_no} itself): {e}; is the file truncated or corrupt?") \
            from None


def _skip_line(stream: BinaryIO, block_bytes: int, seen: int, name: str, line_no: int) -> tuple[int, bytes]:
    """(the line's length with its newline, the bytes read after it) for a line of which
    `seen` bytes, none a newline, were read: the rest is read and dropped a block at a time,
    so what comes after it is less than a block, as a reader resumed after it would read."""
    while piece := _read(stream, block_bytes, name, line_no):
        end = piece.find(b"\n") + 1
        if end:
            return seen + end, piece[end:]
        seen += len(piece)
    return seen, b""


def longest_line(block) -> int:
    """The bytes of `block`'s longest line, its newline counted; 0 for a block no longer than
    MAX_LINE_BYTES, which holds no line too long (the common case: nothing is scanned). A line
    whose start was carried from reads before the one with its newline comes whole to the
    parser, and one of 16-20 MiB was scored, where longer ones were malformed rows.

    >>> longest_line(b"a\\nbb\\n"), longest_line(b"ab\\n" + b"x" * MAX_LINE_BYTES + b"\\nc\\n")
    (0, 16777217)
    """
    if len(block) <= MAX_LINE_BYTES:
        return 0
    ends = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
    return int(np.diff(ends, prepend=-1).max()) if len(ends) else len(block)


def overlong_marker(length: int) -> bytes:
    """The line a span holds in place of one longer than MAX_LINE_BYTES (`length` bytes with
    its newline): the parser counts it as a malformed row, and `span_end` knows its length.

    >>> overlong_marker(20 << 20)
    b'\\x00mariana-overlong-line\\x0020971520\\n'
    """
    return OVERLONG_LINE + b"%d\n" % length


def is_overlong(block) -> bool:
    """Whether a span is `overlong_marker`'s (it stands for a line too long to hold)."""
    return bytes(block[:len(OVERLONG_LINE)]) == OVERLONG_LINE


def span_end(offset: int, block: bytes) -> int:
    """The offset of the bytes after a span of `iter_spans`: where a reader resumes.

    >>> span_end(10, b"a\\nb\\n"), span_end(10, overlong_marker(20 << 20))
    (14, 20971530)
    """
    if is_overlong(block):
        return offset + int(bytes(block[len(OVERLONG_LINE):-1]))
    return offset + len(block)


def read_span(path: str, offset: int, length: int) -> bytes:
    """The `length` bytes of (decompressed) `path` at `offset`, as `iter_spans`
    yielded them: a chunk read again, e.g. to refill a cache. (A Parquet span is
    found by its row address; its bytes are made again, so `length` is not checked.)"""
    if _has_parquet_magic(path):
        return _parquet_span(path, offset)
    with open_binary(path) as f:
        f.seek(offset)
        data = f.read(length)
        if b"\n" not in data:  # perhaps a line too long to send: the marker that stood for it
            f.seek(offset)
            long, _ = _skip_line(f, 1 << 20, 0, path, 0)
            if long > MAX_LINE_BYTES:
                data = overlong_marker(long)
    if len(data) == length - 1 and not data.endswith(b"\n"):
        data += b"\n"  # the file's last line, without its newline
    if len(data) != length or not data.endswith(b"\n"):
        raise DataFormatError(f"{path}: has changed: the {length} bytes at offset {offset} are not whole lines")
    return data


def span_head(offset: int, block: bytes, lines: int) -> tuple[int, bytes]:
    """(offset, bytes) of the first `lines` lines (or rows) of a span of `iter_spans`: what
    `read_span` reads again from that offset (a Parquet span's row address says its rows).

    >>> span_head(7, b"a\\nbb\\nc\\n", 2)
    (7, b'a\\nbb\\n')
    """
    if is_arrow_block(block):
        first = offset >> ROWS_BITS
        return (first << ROWS_BITS) | lines, to_arrow_block(from_arrow_block(block).slice(0, lines))
    ends = np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))
    return offset, block[:ends[lines - 1] + 1]


# ---- one block -> validated columns ------------------------------------------

def count_fields(line: bytes, schema: Schema) -> int:
    """Fields on one line (without its line end), honoring quotes when the schema has them."""
    if not schema.quoted:
        return line.count(schema.delimiter.encode()) + 1
    return len(next(csv.reader([line.decode("latin-1")], delimiter=schema.delimiter), []))


class BlockParser:
    """Parses blocks of one schema; `labeled=False` reads files without a label.

    Each block first takes a fast path: pyarrow parses numbers and
    dictionary-encodes categories in C++ (`threads` may use several cores).
    Any malformed row (or an empty line) makes that path give up, and the
    block takes the checked path: lines are split and their fields counted
    here, the well-formed ones parsed as raw bytes and checked column-wise, so
    every bad row is named by line and reason. Both paths yield the same rows.
    Quoted fields must not span lines.
    """

    def __init__(self, schema: Schema, labeled: bool = True, threads: bool = False):
        self.schema = schema if labeled else schema.without_label()
        s = self.schema
        self.threads = threads
        self.needed = [c for c in s.columns if c not in s.ignore]
        types = {c: pa.binary() for c in s.columns}
        self._checked_convert = pa_csv.ConvertOptions(
            column_types=types, include_columns=self.needed, strings_can_be_null=False,
            quoted_strings_can_be_null=False)
        fast = dict(types)
        fast.update({c: pa.float64() for c in s.numeric})
        fast.update({c: pa.dictionary(pa.int32(), pa.binary()) for c in s.categorical})
        self._fast_convert = pa_csv.ConvertOptions(
            column_types=fast, include_columns=self.needed, null_values=[""],
            strings_can_be_null=False, quoted_strings_can_be_null=False)

    def parse(self, block: bytes, first_line: int, stats: ParseStats, skip_rows: int = 0,
              num_lines: int | None = None) -> Chunk:
        """Rows of `block` (whole lines; `num_lines` of them if the caller counted).

        `block` may be any buffer (a received frame, unsliced): the fast path
        reads it in place; only a block with bad rows is copied to bytes.
        """
        if num_lines is None:
            num_lines = bytes(block).count(b"\n")
        if is_overlong(block) or longest_line(block) > MAX_LINE_BYTES:  # (iter_spans' marker for a line too long;
            return self._parse_checked(bytes(block), first_line, stats, skip_rows)  # a long line ending in a block)
        chunk = self._parse_fast(block, first_line, skip_rows, num_lines)
        if chunk is not None:
            stats.add_ok(chunk)
            return chunk
        return self._parse_checked(bytes(block), first_line, stats, skip_rows)

    def _read(self, block: bytes, convert, threads: bool, skip_rows: int) -> pa.Table:
        # No invalid-row handler: with one, pyarrow parses about 3x slower, and
        # it fails on rows that are not UTF-8. Malformed rows raise instead.
        # Empty lines are skipped here and noticed by the callers' line counts.
        parse_opts = pa_csv.ParseOptions(
            delimiter=self.schema.delimiter, quote_char='"' if self.schema.quoted else False,
            ignore_empty_lines=True)
        read_opts = pa_csv.ReadOptions(
            column_names=list(self.schema.columns), use_threads=threads, skip_rows=skip_rows,
            block_size=(max(len(block) // 2, 1 << 16) if threads else max(len(block), 1 << 16) + 1))
        return pa_csv.read_csv(pa.BufferReader(block), read_options=read_opts,
                               parse_options=parse_opts, convert_options=convert)

    def _parse_fast(self, block: bytes, first_line: int, skip_rows: int, num_lines: int) -> Chunk | None:
        try:
            table = self._read(block, self._fast_convert, self.threads, skip_rows)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        if table.num_rows != num_lines - skip_rows:
            return None  # empty lines (skipped by pyarrow), or a quoted field across lines
        s = self.schema
        labels = None
        if s.label:
            lab = table.column(s.label).combine_chunks()
            if not pc.all(_label_ok(lab)).as_py():
                return None
            labels = _labels(lab)
        cols: dict[str, object] = {c: table.column(c) for c in s.categorical}
        for c in s.numeric:
            col = table.column(c)
            x = col.to_numpy()
            if np.isnan(x).sum() != col.null_count or np.isinf(x).any():  # 'nan'/'inf' text
                return None
            cols[c] = x
        if s.hour:
            hour = table.column(s.hour).combine_chunks()
            if not pc.all(pc.match_substring_regex(hour, HOUR_RE)).as_py() \
                    or not pc.all(pc.is_valid(_parse_hour(hour))).as_py():
                return None
            cols["hour_of_day"], cols["weekday"] = _split_hour(hour)
        return Chunk(columns=cols, labels=labels, num_rows=table.num_rows, first_line=first_line)

    def _parse_checked(self, block: bytes, first_line: int, stats: ParseStats, skip_rows: int) -> Chunk:
        bad: list[tuple[int, str]] = []
        good, lines = self._split_lines(block, first_line, skip_rows, bad)
        table, lines = self._read_lines(good, lines, bad)
        chunk = self._validate(table, np.asarray(lines, np.int64), bad, first_line)
        for line, why in sorted(bad):
            stats.add_bad(line, why)
        stats.add_ok(chunk)
        return chunk

    def _split_lines(self, block: bytes, first_line: int, skip_rows: int,
                     bad: list[tuple[int, str]]) -> tuple[list[bytes], list[int]]:
        """Well-formed lines and their numbers; the others go to `bad`."""
        ncols = len(self.schema.columns)
        pieces = block.split(b"\n")
        if pieces and pieces[-1] == b"":
            pieces.pop()
        good, numbers = [], []
        for i in range(skip_rows, len(pieces)):
            text = pieces[i][:-1] if pieces[i].endswith(b"\r") else pieces[i]
            if text.startswith(OVERLONG_LINE):
                bad.append((first_line + i, f"line of {int(text[len(OVERLONG_LINE):]):,} bytes, longer than the "
                                            f"{MAX_LINE_BYTES >> 20} MiB a row may have"))
                continue
            if len(pieces[i]) >= MAX_LINE_BYTES:  # (its newline makes it longer than the limit)
                bad.append((first_line + i, f"line of {len(pieces[i]) + 1:,} bytes, longer than the "
                                            f"{MAX_LINE_BYTES >> 20} MiB a row may have"))
                continue
            n = count_fields(text, self.schema)
            if not text:
                bad.append((first_line + i, "empty line"))
            elif n != ncols:
                bad.append((first_line + i, f"expected {ncols} fields, got {n}"))
            else:
                good.append(text)
                numbers.append(first_line + i)
        return good, numbers

    def _read_lines(self, good: list[bytes], lines: list[int],
                    bad: list[tuple[int, str]]) -> tuple[pa.Table, list[int]]:
        """(table of well-formed lines as raw bytes, their line numbers); a line
        pyarrow still rejects (a stray quote) is found by parsing lines one by one."""
        empty = pa.table({c: pa.array([], pa.binary()) for c in self.needed})
        if not good:
            return empty, []
        try:
            return self._read(b"\n".join(good) + b"\n", self._checked_convert, False, 0), lines
        except pa.ArrowInvalid:
            pass
        tables, keep = [], []
        for text, line in zip(good, lines):
            try:
                tables.append(self._read(text + b"\n", self._checked_convert, False, 0))
                keep.append(line)
            except pa.ArrowInvalid as e:
                bad.append((line, f"cannot parse: {str(e).splitlines()[0][:80]}"))
        return (pa.concat_tables(tables) if tables else empty), keep

    def _validate(self, table: pa.Table, lines: np.ndarray, bad: list[tuple[int, str]],
                  first_line: int) -> Chunk:
        """Column-wise value checks; `lines[i]` is the line number of table row i."""
        s = self.schema
        cols = {c: table.column(c).combine_chunks() for c in self.needed}
        cols, kept_lines = _drop_rejected(cols, self._checks(cols), lines, bad)
        n = len(kept_lines)
        out: dict[str, object] = {c: cols[c] for c in s.categorical}
        out.update({c: _to_float(cols[c]) for c in s.numeric})
        if s.hour:
            out["hour_of_day"], out["weekday"] = _split_hour(cols[s.hour])
        labels = _labels(cols[s.label]) if s.label else None
        return Chunk(columns=out, labels=labels, num_rows=n, first_line=first_line, lines=kept_lines)

    def _checks(self, cols: dict) -> list[tuple[np.ndarray, str]]:
        """(bad-row mask, reason) per failed check, on the unfiltered columns."""
        s = self.schema
        checks: list = []

        def check(ok: pa.Array, why: str) -> None:
            _check(checks, ok, why)

        if s.label:
            check(_label_ok(cols[s.label]), f"{s.label} is not 0 or 1")
        for c in s.numeric:
            col = cols[c]
            number = pc.match_substring_regex(col, NUMBER_RE)  # (or nothing but blanks: missing, as '' is)
            text = _trimmed(pc.if_else(number, col, pa.scalar(b"0")))
            text = pc.if_else(pc.equal(pc.utf8_length(text), 0), pa.scalar("0"), text)
            check(pc.and_(number, pc.is_finite(pc.cast(text, pa.float64()))), f"{c} is not a number")
        if s.hour:
            checks += _hour_checks(cols[s.hour], s.hour)
        return checks

    def parse_table(self, table: pa.Table, first_line: int, stats: ParseStats, name: str = "") -> Chunk:
        """Rows of a columnar block (a Parquet file's): the schema's columns by name, of
        the types `check_columns` allows; row i is numbered `first_line + i` in reports.

        Values become a text block's: numbers float64 (null -> NaN, missing), categories
        the bytes of their string form (null -> missing), hour fields from YYMMDDHH text
        or integers. A label that is null or not 0/1, an infinite number or a bad hour
        makes its row malformed, counted in `stats` like a bad line.
        """
        check_columns(name, table.schema, self.schema)
        s = self.schema
        raw = {c: _plain(table.column(c)) for c in self.needed}
        cols: dict[str, pa.Array] = {c: _as_text(raw[c]) for c in s.categorical}
        cols.update({c: _to_float64(raw[c]) for c in s.numeric})
        checks: list = []
        if s.label:
            cols[s.label] = _to_float64(raw[s.label])
            _check(checks, pc.or_(pc.equal(cols[s.label], 0.0), pc.equal(cols[s.label], 1.0)),
                   f"{s.label} is not 0 or 1")
        for c in s.numeric:
            _check(checks, pc.invert(pc.fill_null(pc.is_inf(cols[c]), False)), f"{c} is infinite")
        if s.hour:
            cols[s.hour] = _as_text(raw[s.hour])
            checks += _hour_checks(cols[s.hour], s.hour)
        lines = np.arange(first_line, first_line + table.num_rows, dtype=np.int64)
        bad: list[tuple[int, str]] = []
        cols, kept = _drop_rejected(cols, checks, lines, bad)
        for line, why in bad:
            stats.add_bad(line, why)
        n = len(kept)
        out: dict[str, object] = {c: cols[c] for c in s.categorical}
        out.update({c: cols[c].to_numpy(zero_copy_only=False) for c in s.numeric})
        if s.hour:
            out["hour_of_day"], out["weekday"] = _split_hour(cols[s.hour])
        labels = cols[s.label].to_numpy(zero_copy_only=False).astype(np.float32) if s.label else None
        chunk = Chunk(columns=out, labels=labels, num_rows=n, first_line=first_line, lines=kept if bad else None)
        stats.add_ok(chunk)
        return chunk


def _to_float64(col: pa.Array) -> pa.Array:
    """Numbers (integers, floats, decimals, booleans) as float64, as a text file's become: an
    integer beyond 2^53 loses precision there too, and is not an error here either.

    >>> _to_float64(pa.array([2**64 - 1, None], pa.uint64())).to_pylist()
    [1.8446744073709552e+19, None]
    """
    return pc.cast(col, pa.float64(), safe=False)


def _check(checks: list, ok: pa.Array, why: str) -> None:
    """Add (bad-row mask, why) to `checks` when some row fails `ok` (null fails)."""
    not_ok = ~np.asarray(pc.fill_null(ok, False).to_numpy(zero_copy_only=False), dtype=bool)
    if not_ok.any():
        checks.append((not_ok, why))


def _hour_checks(col: pa.Array, name: str) -> list:
    checks: list = []
    digits = pc.match_substring_regex(col, HOUR_RE)
    _check(checks, digits, f"{name} is not YYMMDDHH")
    safe = pc.if_else(pc.fill_null(digits, False), col, pa.scalar(b"70010100", pa.binary()))
    _check(checks, pc.is_valid(_parse_hour(safe)), f"{name} is not a valid date and hour")
    return checks


def _drop_rejected(cols: dict, checks: list, lines: np.ndarray,
                   bad: list[tuple[int, str]]) -> tuple[dict, np.ndarray]:
    """(the columns without the rows some check rejected, the kept rows' line numbers);
    each rejected row goes to `bad` with the first reason that rejected it."""
    rejected = np.zeros(len(lines), dtype=bool)
    for not_ok, _ in checks:
        rejected |= not_ok
    if not rejected.any():
        return cols, lines
    for r in np.flatnonzero(rejected):
        bad.append((int(lines[r]), next(why for not_ok, why in checks if not_ok[r])))
    keep = pa.array(~rejected)
    return {c: pc.filter(a, keep) for c, a in cols.items()}, lines[~rejected]


def _label_ok(col: pa.Array) -> pa.Array:
    return pc.or_(pc.equal(col, b"0"), pc.equal(col, b"1"))


def _labels(col: pa.Array) -> np.ndarray:
    return pc.equal(col, b"1").to_numpy(zero_copy_only=False).astype(np.float32)


def _trimmed(col: pa.Array) -> pa.Array:
    """ASCII text (numbers that passed NUMBER_RE) as strings without surrounding blanks."""
    return pc.utf8_trim(col.cast(pa.string()), characters=" \t")


def _to_float(col: pa.Array) -> np.ndarray:
    """Checked numbers (NUMBER_RE) -> float64, empty (or blanks) -> NaN."""
    text = _trimmed(col)
    empty = pc.equal(pc.utf8_length(text), 0)
    return pc.cast(pc.if_else(empty, pa.scalar(None, pa.string()), text), pa.float64()).to_numpy(
        zero_copy_only=False)


def _parse_hour(col: pa.Array) -> pa.Array:
    """YYMMDDHH text -> timestamps; null where it names no date and hour. Arrow's strptime
    carries a day past its month's end into the next month (14022900 read as 1 March 2014,
    14043100 as 1 May), so a date whose day is not the text's is refused.

    >>> _parse_hour(pa.array([b"14102123", b"14022900", b"14043100", b"16022900", b"14102124"])).to_pylist()
    [datetime.datetime(2014, 10, 21, 23, 0), None, None, datetime.datetime(2016, 2, 29, 0, 0), None]
    """
    ts = pc.strptime(col.cast(pa.string()), format="%y%m%d%H", unit="s", error_is_null=True)
    digits = pc.if_else(pc.is_valid(ts), pc.binary_slice(col.cast(pa.binary()), 4, 6), b"0")  # (parsed: digits)
    day = pc.cast(digits.cast(pa.string()), pa.int64())
    return pc.if_else(pc.equal(pc.day(ts), day), ts, pa.scalar(None, ts.type))


def _split_hour(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Valid YYMMDDHH -> (hour of day, weekday with Monday=0), int64."""
    ts = _parse_hour(col)
    return (pc.hour(ts).to_numpy(zero_copy_only=False).astype(np.int64),
            pc.day_of_week(ts).to_numpy(zero_copy_only=False).astype(np.int64))


# ---- Parquet: columnar blocks ------------------------------------------------

_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view",
               "fixed_size_binary")


def _is_text(t: pa.DataType) -> bool:
    return any(getattr(pa.types, f"is_{name}", lambda _: False)(t) for name in _TEXT_TYPES)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _is_scalar(t: pa.DataType) -> bool:
    """A type whose values have a string form (not a list, struct, map or union)."""
    if pa.types.is_nested(t):
        return False
    try:
        pc.cast(pa.array([], t), pa.string())
        return True
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return False


# What each role takes: (a test of the Arrow type, the words for it in an error).
ROLE_TYPES = {
    "label": (lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t),
              "0/1 as integers, booleans or floats"),
    "numeric": (lambda t: _is_number(t) or pa.types.is_null(t), "numbers (integers or floats; null = missing)"),
    "categorical": (_is_scalar, "scalar values (strings, integers, ...; null = missing)"),
    "hour": (lambda t: _is_text(t) or pa.types.is_integer(t), "YYMMDDHH as strings or integers"),
}


def _role(schema: Schema, column: str) -> str:
    if column == schema.label:
        return "label"
    if column == schema.hour:
        return "hour"
    return "numeric" if column in schema.numeric else "categorical"


def check_columns(name: str, columns: pa.Schema, schema: Schema) -> None:
    """One DataFormatError naming file `name` and every column of `schema` that `columns`
    (a Parquet file's) lacks or holds in a type its role cannot take. Columns are found by
    name; extra columns, and the schema's ignored ones, are not read.

    >>> s = Schema("ads", ("clicked", "price", "ad"), "clicked", numeric=("price",), categorical=("ad",))
    >>> try:
    ...     check_columns("a.pq", pa.schema([("clicked", pa.string()), ("ad", pa.int64())]), s)
    ... except DataFormatError as e:
    ...     for part in str(e).split("; "):
    ...         print(part)
    a.pq: not in the ads schema's columns: missing column 'price'
    column 'clicked' is string, expected 0/1 as integers, booleans or floats (the file's columns: clicked, ad)
    """
    names = columns.names
    missing, wrong = [], []
    for c in schema.columns:
        if c in schema.ignore:
            continue
        if c not in names:
            missing.append(c)
            continue
        if names.count(c) > 1:
            wrong.append(f"column {c!r} appears {names.count(c)} times")
            continue
        t = columns.field(c).type
        ok, expected = ROLE_TYPES[_role(schema, c)]
        if not ok(t.value_type if pa.types.is_dictionary(t) else t):
            wrong.append(f"column {c!r} is {t}, expected {expected}")
    if not missing and not wrong:
        return
    problems = []
    if missing:
        shown = [repr(c) for c in missing] if len(missing) <= 4 else [repr(missing[0]), "...", repr(missing[-1])]
        problems.append(f"missing column{'s' if len(missing) > 1 else ''} {', '.join(shown)}")
    found = ", ".join(names[:12]) + (f", ... ({len(names)} columns)" if len(names) > 12 else "")
    kind = f"the {schema.name} schema's"  # predict's schema reads a label it ignores: no "unlabeled" here
    lower = {n.lower(): n for n in names}
    cased = [f"{lower[c.lower()]!r} for {c!r}" for c in missing if c.lower() in lower]
    if cased:  # `Label` for `label`: the hint was that the rows look unlabeled
        problems.append(f"the file has {', '.join(cased[:4])}{', ...' if len(cased) > 4 else ''}: column names are "
                        "matched with their case")
    unlabeled = unlabeled_hint(schema) if missing == [schema.label] and not wrong and not cased else ""
    raise DataFormatError(f"{name}: not in {kind} columns: {'; '.join(problems + wrong)} "
                          f"(the file's columns: {found or 'none'}){unlabeled}")


def _plain(col: pa.ChunkedArray) -> pa.Array:
    """One array of the column's values (a dictionary-encoded column decoded)."""
    if pa.types.is_dictionary(col.type):
        col = pc.cast(col, col.type.value_type)
    return col.combine_chunks()


def _as_text(col: pa.Array) -> pa.Array:
    """A scalar column as binary, the bytes a text file would hold: strings as they are,
    integers in decimal, null stays null (missing). A float column is an integer column
    with gaps as pandas writes one: a whole float is its integer in decimal (Arrow's own
    text would give 3e+10 for 30000000000.0), NaN is missing as null is (as in a
    DataFrame: `mariana.api.frame_records`), any other float its shortest form.

    >>> _as_text(pa.array([7, None, -12])).to_pylist()
    [b'7', None, b'-12']
    >>> _as_text(pa.array([30000000017.0, float("nan"), None, 7.5, -0.0, 1e20])).to_pylist()
    [b'30000000017', None, None, b'7.5', b'0', b'1e+20']
    """
    if _is_text(col.type):
        return pc.cast(col, pa.binary())
    if pa.types.is_floating(col.type):
        if pa.types.is_float16(col.type):  # Arrow's kernels take float32 and float64
            col = pc.cast(col, pa.float32())
        x = pc.cast(col, pa.float64())  # the checks; a float32's text stays its own shortest form
        whole = pc.and_(pc.equal(pc.floor(x), x), pc.less(pc.abs(x), WHOLE_LIMIT))
        text = pc.if_else(whole, pc.cast(pc.cast(pc.if_else(whole, x, 0.0), pa.int64()), pa.string()),
                          pc.cast(col, pa.string()))
        return pc.cast(pc.if_else(pc.is_nan(x), pa.scalar(None, pa.string()), text), pa.binary())
    return pc.cast(pc.cast(col, pa.string()), pa.binary())


def is_parquet(path: str | os.PathLike) -> bool:
    """A file to read as Parquet: named .parquet or .pq, or starting with PAR1."""
    return os.fspath(path).lower().endswith(PARQUET_SUFFIXES) or _has_parquet_magic(path)


def _has_parquet_magic(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == PARQUET_MAGIC
    except OSError:  # missing, a directory: the text path's open says so
        return False


def _is_parquet_stream(stream: BinaryIO) -> bool:
    """Whether `stream` (at any position) is a Parquet file; it is left where it was."""
    if isinstance(stream, gzip.GzipFile) or not stream.seekable():
        return False
    at = stream.tell()
    stream.seek(0)
    head = stream.read(4)
    stream.seek(at)
    return head == PARQUET_MAGIC


def open_parquet(source, name: str = "") -> pq.ParquetFile:
    """A Parquet file (a path or a seekable binary stream), read through a 1 MiB buffer so
    that a big row group is not read whole; DataFormatError when it is not one."""
    try:
        return pq.ParquetFile(source, buffer_size=1 << 20)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise DataFormatError(f"{name or source}: not a readable Parquet file: {e}") from None


def rows_per_block(pf: pq.ParquetFile, block_bytes: int, columns: list[str] | None = None,
                   name: str = "") -> int:
    """Rows of about `block_bytes` in memory, sized by the first rows: the same file and
    block size are always cut the same way. DataFormatError naming `name` when those rows
    cannot be read (a damaged file: a raw OSError, "Corrupt snappy compressed data", was
    all a notebook got, and the CLI's line named no file)."""
    total = pf.metadata.num_rows
    if total == 0:
        return 1
    try:
        first = next(pf.iter_batches(batch_size=min(SAMPLE_ROWS, total), columns=columns, use_threads=False))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise DataFormatError(f"{name or 'a Parquet file'}: cannot read its first rows (a damaged file?): "
                              f"{e}") from None
    per_row = max(first.nbytes / max(first.num_rows, 1), 1.0)
    return int(min(max(block_bytes // per_row, 1), (1 << ROWS_BITS) - 1))


def table_blocks(pf: pq.ParquetFile, rows: int, columns: list[str] | None = None, start: int = 0,
                 name: str = "", threads: bool = False) -> Iterator[tuple[int, pa.Table]]:
    """(first row, table) blocks of `rows` rows (the last may be shorter) from row `start`
    (0-based), reading only the row groups from the one holding it."""
    meta = pf.metadata
    group, group_start = 0, 0
    while group < meta.num_row_groups and group_start + meta.row_group(group).num_rows <= start:
        group_start += meta.row_group(group).num_rows
        group += 1
    skip, row, pending, have = start - group_start, start, [], 0
    try:
        for batch in pf.iter_batches(batch_size=rows, row_groups=range(group, meta.num_row_groups),
                                     columns=columns, use_threads=threads):
            if skip:  # rows of the first row group before `start`
                cut = min(skip, batch.num_rows)
                batch, skip = batch.slice(cut), skip - cut
            if batch.num_rows:
                pending.append(batch)
                have += batch.num_rows
            while have >= rows:
                table = pa.Table.from_batches(pending)
                yield row, table.slice(0, rows)
                pending, have, row = table.slice(rows).to_batches(), have - rows, row + rows
    except (pa.ArrowInvalid, OSError) as e:
        raise DataFormatError(f"{name}: cannot read rows from {row + 1} on: {e}") from None
    if have:
        yield row, pa.Table.from_batches(pending)


def to_arrow_block(table: pa.Table) -> bytes:
    """A columnar block as bytes for the wire (ARROW_BLOCK, then an Arrow IPC stream)."""
    sink = pa.BufferOutputStream()
    sink.write(ARROW_BLOCK)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return sink.getvalue().to_pybytes()


def is_arrow_block(block) -> bool:
    return len(block) >= len(ARROW_BLOCK) and bytes(block[:len(ARROW_BLOCK)]) == ARROW_BLOCK


def from_arrow_block(block) -> pa.Table:
    """The table of `to_arrow_block`'s bytes (any buffer: a received frame is read in place)."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(block).slice(len(ARROW_BLOCK))).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataFormatError(f"a columnar block that cannot be read: {e}") from None


def _parquet_spans(stream: BinaryIO, block_bytes: int, name: str,
                   line_no: int) -> Iterator[tuple[int, int, bytes, int]]:
    source = stream.name if isinstance(getattr(stream, "name", None), str) else stream  # native reads
    with open_parquet(source, name) as pf:
        rows = rows_per_block(pf, block_bytes, name=name)
        for row, table in table_blocks(pf, rows, start=line_no - 1, name=name):
            yield (row << ROWS_BITS) | table.num_rows, row + 1, to_arrow_block(table), table.num_rows


def _parquet_span(path: str, address: int) -> bytes:
    row, rows = address >> ROWS_BITS, address & ((1 << ROWS_BITS) - 1)
    with open_parquet(path) as pf:
        _, table = next(table_blocks(pf, max(rows, 1), start=row, name=path), (row, None))
    if table is None or table.num_rows != rows:
        raise DataFormatError(f"{path}: has changed: rows {row + 1} to {row + rows} are not all there")
    return to_arrow_block(table)


# ---- whole files -------------------------------------------------------------

@dataclass
class BlockTask:
    """One block of one file, ready to parse on any thread: whole lines of text, or a
    columnar block (a Parquet file's rows: a table, or its `to_arrow_block` bytes as the
    loader sends them), whose rows are numbered like lines and which has no header."""

    parser: BlockParser
    path: str
    first_line: int
    block: bytes | pa.Table
    num_lines: int
    skip_rows: int = 0
    first_of_file: bool = False

    def __post_init__(self) -> None:
        self.columnar = isinstance(self.block, pa.Table) or is_arrow_block(self.block)
        if self.columnar:
            self.skip_rows = 0

    def run(self) -> tuple[Chunk, ParseStats]:
        stats = ParseStats(file=self.path)
        if self.columnar:
            table = self.block if isinstance(self.block, pa.Table) else from_arrow_block(self.block)
            chunk = self.parser.parse_table(table, self.first_line, stats, self.path)
        else:
            if self.first_of_file:
                _check_not_gzipped_parquet(self.path, self.block)
            chunk = self.parser.parse(self.block, self.first_line, stats, self.skip_rows, self.num_lines)
        if self.first_of_file and not self.columnar and len(self.block) <= PROBE_BYTES:
            # the verdict on a text file's format is its first PROBE_BYTES' (`Reader.probe`, before
            # any work): a bigger first block, read later, refused a file mid-training for bad rows
            # past the probe's. A Parquet file's columns are typed: its bad values are bad rows.
            _check_first_block(self.path, self.parser.schema, stats)
        return chunk, stats

    def row_slots(self, chunk: Chunk) -> tuple[int, np.ndarray]:
        """(data lines in the block (a header is not one), the slot of each of `chunk`'s rows
        among them): what lines up one output per input line when rows were skipped.

        >>> from sparse.schema import builtin
        >>> task = BlockTask(BlockParser(builtin("avazu")), "a.csv", 1, b"", 4, skip_rows=1)
        >>> task.row_slots(Chunk({}, None, 2, lines=np.array([2, 4])))
        (3, array([0, 2]))
        """
        first = self.first_line + self.skip_rows
        lines = chunk.lines if chunk.lines is not None else np.arange(first, first + chunk.num_rows)
        return self.num_lines - self.skip_rows, np.asarray(lines, np.int64) - first


PROBE_BYTES = 256 << 10  # `Reader.probe` parses this much of each file (~700 Criteo rows)


class Reader:
    """Streams validated `Chunk`s from one or more files, text or Parquet, mixed.

    `labeled=None` (prediction) accepts files with or without the label
    column, decided by the first data block of each text file; a label there is
    read but neither used nor checked (a Parquet file's is not read). `tasks()`
    yields the blocks unparsed, for callers that
    parse them on several threads.
    """

    def __init__(self, paths: list[str], schema: Schema, block_bytes: int = 8 << 20,
                 labeled: bool | None = True, threads: bool = False):
        self.paths = list(paths)
        self.threads = threads
        self.schema = schema
        self.block_bytes = block_bytes
        self.labeled = labeled
        self.stats = ParseStats()

    def __iter__(self) -> Iterator[Chunk]:
        for task in self.tasks():
            chunk, stats = task.run()
            self.stats.merge(stats)
            if chunk.num_rows:
                yield chunk

    def probe(self) -> None:
        """Parse the first rows of every file (a block of at most `PROBE_BYTES`): a missing
        file, a wrong format, a bad header or a Parquet file's missing or mistyped column
        fails here, before any long work starts. The parser is chosen on the first 64 KiB
        whatever the block size, so a small block decides what a whole one would (two whole
        8 MiB blocks cost a 1M-row job ~0.09 s before its training began, 256 KiB ~0.005 s)."""
        for path in self.paths:
            first = next(Reader([path], self.schema, min(self.block_bytes, PROBE_BYTES), self.labeled).tasks(), None)
            if first is not None:
                first.run()

    def tasks(self) -> Iterator[BlockTask]:
        for path in self.paths:
            if is_parquet(path):
                yield from self._parquet_tasks(path)
                continue
            with open_binary(path) as f:
                parser: BlockParser | None = None
                for first_line, block, lines in iter_blocks(f, self.block_bytes, name=path):
                    if parser is None:
                        _check_not_gzipped_parquet(path, block)
                        _check_quotes(path, self.schema, block)
                        parser = self._pick_parser(block)
                        skip = 0
                        if self.schema.header:
                            _check_header(path, parser.schema, block)
                            skip = 1
                        yield BlockTask(parser, path, first_line, block, lines, skip, first_of_file=True)
                    else:
                        yield BlockTask(parser, path, first_line, block, lines)

    def _parquet_tasks(self, path: str) -> Iterator[BlockTask]:
        with open_parquet(path) as pf:
            columns = pf.schema_arrow
            # prediction (labeled=None) reads the feature columns only: a label column there is not used
            parser = BlockParser(self.schema, labeled=bool(self.labeled), threads=self.threads)
            check_columns(path, columns, parser.schema)
            rows = rows_per_block(pf, self.block_bytes, parser.needed, name=path)
            for row, table in table_blocks(pf, rows, parser.needed, name=path, threads=self.threads):
                yield BlockTask(parser, path, row + 1, table, table.num_rows, first_of_file=row == 0)

    def _pick_parser(self, block: bytes) -> BlockParser:
        if self.labeled is not None:
            return BlockParser(self.schema, labeled=self.labeled, threads=self.threads)
        sample = block[:1 << 16].split(b"\n")[self.schema.header:][:50]
        counts = [count_fields(ln.rstrip(b"\r"), self.schema) for ln in sample if ln]
        unlabeled = len(self.schema.columns) - 1
        if counts and sum(c == unlabeled for c in counts) > len(counts) // 2:
            return BlockParser(self.schema, labeled=False, threads=self.threads)
        return BlockParser(self.schema.label_ignored(), labeled=True, threads=self.threads)  # read, not checked


def _check_header(path: str, schema: Schema, block: bytes) -> None:
    line = block.split(b"\n", 1)[0].rstrip(b"\r").removeprefix(UTF8_BOM).decode("utf-8", "replace")
    got = [c.strip('"') for c in line.split(schema.delimiter)]
    if got != list(schema.columns):
        kind = f"the {schema.name} schema"  # the columns expected are listed: a label among them or not
        unlabeled = unlabeled_hint(schema) if schema.label and got == list(schema.without_label().columns) else ""
        raise DataFormatError(f"{path}: header does not match {kind}: {header_difference(schema.columns, got)}; "
                              f"expected the {len(schema.columns)} columns {schema.delimiter.join(schema.columns)}"
                              f"{unlabeled}")


def _check_quotes(path: str, schema: Schema, block: bytes) -> None:
    r"""A file whose fields come in double quotes ("a","b",... as many CSV writers make them),
    read by a schema that reads quotes as part of a value: refused, naming the setting. Its
    values were hashed with their quotes, every one unseen in training, and `predict` gave
    every row the same pCTR, the bias's (an exploratory run on quoted Criteo attribution rows).

    >>> from mariana.sparse.schema import Schema
    >>> s = Schema("ads", ("click", "site"), "click", categorical=("site",), delimiter=",")
    >>> _check_quotes("a.csv", s, b'click,site\n0,x\n1,"a quoted value"\n')
    >>> try:
    ...     _check_quotes("a.csv", s, b'"click","site"\n"0","x"\n')
    ... except DataFormatError as e:
    ...     print(str(e)[:60])
    a.csv: line 1 holds fields in double quotes ("click"); the a
    """
    if schema.quoted:
        return
    for number, line in enumerate(bytes(block[:1 << 16]).split(b"\n")[:6], 1):
        fields = line.rstrip(b"\r").removeprefix(UTF8_BOM).split(schema.delimiter.encode())
        # every field quoted: a CSV writer's quoting (one quoted value in a row is a value, read as it is)
        if len(fields) > 1 and all(len(f) >= 2 and f[:1] == f[-1:] == b'"' for f in fields):
            quoted = fields[0]
            raise DataFormatError(
                f"{path}: line {number} holds fields in double quotes ({quoted.decode('utf-8', 'replace')[:40]}); "
                f"the {schema.name} schema reads quotes as part of a value, so every value would be one the model "
                "never met: set data.schema.quoted = true (a CSV file's quoting) or write the file without quotes")


def unlabeled_hint(schema: Schema) -> str:
    """What to say of rows that hold every column of `schema` but its label."""
    return (f". The rows look unlabeled (every column but {schema.label!r}): training and evaluation need "
            "the label; `mariana predict` takes unlabeled rows")


COMPRESSED = {**{b"BZh%d" % level: "bzip2" for level in range(1, 10)}, b"\xfd7zXZ\x00": "xz",
              b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip",
              b"\x04\x22\x4d\x18": "lz4"}  # magic bytes of what is read as text otherwise: "malformed rows"


def _check_not_gzipped_parquet(path: str, block: bytes) -> None:
    """A text file's first block that is a Parquet file's start (gzip's output), or a file
    compressed by a tool Mariana does not read: say so, not 'malformed rows'.

    >>> try:
    ...     _check_not_gzipped_parquet("a.bz2", b"BZh91AY&SY...")
    ... except DataFormatError as e:
    ...     print(str(e)[:46])
    a.bz2: compressed with bzip2: Mariana reads pl
    """
    head = bytes(block[:8])
    for magic, tool in COMPRESSED.items():
        if head.startswith(magic):
            raise DataFormatError(f"{path}: compressed with {tool}: Mariana reads plain text, gzip and Parquet "
                                  "files; decompress it (or recompress it with gzip)")
    if bytes(block[:len(PARQUET_MAGIC)]) == PARQUET_MAGIC:
        raise DataFormatError(f"{path}: a compressed Parquet file: Parquet files are read as they are, not "
                              "compressed at file level (their own compression is inside them); decompress it, "
                              "e.g. gunzip, and name the .parquet file")


def header_difference(expected: tuple[str, ...] | list[str], got: list[str]) -> str:
    """Where a header first differs from the expected one, in words.

    >>> header_difference(["id", "click", "hour"], ["id", "clicks", "hour"])
    "column 2 is 'clicks', expected 'click'"
    >>> header_difference(["id", "click", "hour"], ["id", "click"])
    "2 columns, expected 3: 'hour' is missing"
    """
    for i, (want, have) in enumerate(zip(expected, got), 1):
        if want != have:
            return f"column {i} is {have[:40]!r}, expected {want!r}"
    if len(got) < len(expected):
        return f"{len(got)} columns, expected {len(expected)}: {expected[len(got)]!r} is missing"
    return f"{len(got)} columns, expected {len(expected)}: {got[len(expected)][:40]!r} is extra"


def _check_first_block(path: str, schema: Schema, st: ParseStats) -> None:
    """A file whose first block is mostly malformed is in another format; one whose rows
    mostly lack one field, where a label is expected, is unlabeled (said so)."""
    total = st.rows_ok + st.rows_bad
    if total and st.rows_bad * 2 > total:
        first = f" (line {st.first_bad[0][0]}: {st.first_bad[0][1]})" if st.first_bad else ""
        short = f"expected {len(schema.columns)} fields, got {len(schema.columns) - 1}"
        unlabeled = schema.label and sum(b.reason == short for b in st.first_bad) * 2 > len(st.first_bad)
        raise DataFormatError(
            f"{path}: not in {schema.name} format: {st.rows_bad} of the first {total} rows "
            f"are malformed{first}{unlabeled_hint(schema) if unlabeled else ''}")
