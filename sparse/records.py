"""Rows given as field -> value mappings (the instances of a prediction
request) instead of text lines, checked by the rules a parsed text row meets,
so a row gets the same ids whichever way it arrives.

A value is what a JSON or msgpack decoder yields:

- categorical field: text (str or bytes, taken as its UTF-8 bytes) or an
  integer (taken as its decimal text); None, '' or an absent key is missing;
- numeric field: a number (int, float or Decimal, finite; not a bool) or number text
  as a file would hold it (`parse.NUMBER_RE`, no nan/inf); None, '', blanks
  alone or absent is missing;
- hour field (Avazu's YYMMDDHH): text or an integer of 8 digits naming a
  valid date and hour; it may not be missing (a file row without one is
  malformed too).

Keys outside the schema's columns are ignored and counted; the label and
ignored columns are known keys.

>>> from sparse.schema import criteo
>>> chunk, bad, unknown = parse_records(criteo(), [{"I1": 3, "C1": "68fd1e64", "x": 1}, {"I1": "a"}])
>>> chunk.num_rows, chunk.columns["C1"], float(chunk.columns["I1"][0]), bad, unknown
(1, [b'68fd1e64'], 3.0, [(1, 'I1 is not a number')], 1)
"""
from __future__ import annotations

import decimal
import math
import re
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mariana.sparse.parse import HOUR_RE, NUMBER_RE, WHOLE_LIMIT, Chunk, _as_text, _parse_hour, _split_hour
from mariana.sparse.schema import Schema

# The parser's patterns, anchored for re.fullmatch ('$' would also match before a final newline).
_NUMBER = re.compile(NUMBER_RE.removeprefix("^").removesuffix("$"))
_HOUR = re.compile(HOUR_RE.removeprefix("^").removesuffix("$"))
FEW_ROWS = 16  # a request this small takes plain-Python paths here and in `Encoder.encode_rows` (its id cache)
_BIG = 1 << 1000  # an int this large or larger: float() would overflow, the slow path names it


class _Bad(Exception):
    """One value that breaks its field's rule; the row is reported with `reason`."""

    def __init__(self, reason: str):
        self.reason = reason


def parse_records(schema: Schema, records: Sequence[Mapping]) -> tuple[Chunk, list[tuple[int, str]], int]:
    """(chunk of the good rows, [(index, reason)] of the bad ones, unknown keys seen).

    The chunk is unlabeled; its categorical columns are lists of bytes (what
    `Encoder.encode_rows` takes), numeric columns float64 (NaN = missing; arrays, or
    lists of floats for up to `FEW_ROWS` rows),
    hour fields int64. A bad row is reported with its first bad field, in the
    order categorical, numeric, hour.
    """
    known = set(schema.columns)
    index, bad, unknown = [], [], 0
    for i, rec in enumerate(records):
        if isinstance(rec, Mapping):
            index.append(i)
            unknown += sum(1 for k in rec if k not in known)  # a non-str key is unknown too
        else:
            bad.append((i, f"an instance must be an object of field values, got {_kind(rec)}"))
    rows = [records[i] for i in index]
    why: dict[int, str] = {}  # position in `rows` -> the first reason it is bad
    cols: dict[str, object] = _text_block(schema.categorical, rows, why)
    nums = _numeric_block(schema.numeric, rows, why)
    if isinstance(nums, list):  # a few rows' numbers, row-major
        cols.update({f: nums[j::len(schema.numeric)] for j, f in enumerate(schema.numeric)})
    else:
        cols.update({f: nums[:, j] for j, f in enumerate(schema.numeric)})
    hours = (_column(schema.hour, [r.get(schema.hour) for r in rows], _hour_text, None, why, b"")
             if schema.hour else [])
    if why:
        bad += [(index[j], reason) for j, reason in why.items()]
        keep = np.array([j not in why for j in range(len(rows))], bool)
        cols = {f: [v for v, k in zip(c, keep) if k] if isinstance(c, list) else c[keep] for f, c in cols.items()}
        hours = [h for h, k in zip(hours, keep) if k]
        index = [i for i, k in zip(index, keep) if k]
    chunk = Chunk(columns=cols, labels=None, num_rows=len(index))
    if schema.hour:
        chunk, bad = _split_hours(schema, chunk, hours, index, bad)
    return chunk, sorted(bad), unknown


def _column(field: str, values: list, one, many, why: dict[int, str], stand_in) -> list:
    """Values of one field converted by `many` (a fast path for a column of one plain
    type; None where it does not apply) or else `one` value at a time. A bad value
    is recorded in `why` (a row's first reason wins) and `stand_in` holds its place
    until the bad rows are dropped."""
    out = many(values) if many is not None else None
    if out is not None:
        return out
    out = []
    for j, v in enumerate(values):
        try:
            out.append(one(field, v))
        except _Bad as e:
            why.setdefault(j, e.reason)
            out.append(stand_in)
    return out


def _text_block(fields: tuple[str, ...], rows: list[Mapping], why: dict[int, str]) -> dict[str, list[bytes]]:
    """Every categorical field's values as bytes. Text and missing values only (the
    common case) go in one pass over the block; anything else field by field."""
    values = [r.get(f) for r in rows for f in fields]  # row-major
    if all(type(v) is str or v is None for v in values):
        try:
            encoded = [b"" if v is None else v.encode() for v in values]
        except UnicodeEncodeError:  # a lone surrogate: the slow path names it
            encoded = None
        if encoded is not None:
            n = len(fields)
            return {f: encoded[j::n] for j, f in enumerate(fields)}
    return {f: _column(f, [r.get(f) for r in rows], _text, None, why, b"") for f in fields}


def _numeric_block(fields: tuple[str, ...], rows: list[Mapping], why: dict[int, str]) -> np.ndarray | list[float]:
    """(rows, fields) float64 of every numeric field at once. Numbers and missing values
    only (the common case) take a few numpy calls for the whole block, or for up to
    `FEW_ROWS` rows none: a row-major list of floats (what `Encoder.encode_rows` looks up
    for so few rows). Anything else is checked field by field, value by value."""
    values = [r.get(f) for r in rows for f in fields]  # row-major
    if len(rows) <= FEW_ROWS and all(type(v) is float or (type(v) is int and -_BIG < v < _BIG) or v is None
                                     for v in values):
        x = [math.nan if v is None else float(v) for v in values]
        if all(math.isfinite(v) for v, given in zip(x, values) if given is not None):
            return x
    elif all(type(v) is float or type(v) is int or v is None for v in values):
        try:
            x = np.array([0.0 if v is None else v for v in values], np.float64).reshape(len(rows), len(fields))
        except OverflowError:  # an int past float's range: the slow path names it
            x = None
        if x is not None and np.isfinite(x).all():  # NaN or inf sent as a number is bad
            x[np.array([v is None for v in values], bool).reshape(x.shape)] = math.nan
            return x
    cols = [_column(f, [r.get(f) for r in rows], _number, None, why, math.nan) for f in fields]
    return np.array(cols, np.float64).reshape(len(fields), len(rows)).T


def concat_chunks(chunks: list[Chunk]) -> Chunk:
    """Rows of several `parse_records` chunks of one schema, in order (one model call
    for several requests).

    >>> from sparse.schema import criteo
    >>> a, b = (parse_records(criteo(), [{"C1": c}])[0] for c in ("x", "y"))
    >>> both = concat_chunks([a, b]); both.num_rows, both.columns["C1"]
    (2, [b'x', b'y'])
    """
    if len(chunks) == 1:
        return chunks[0]
    cols: dict[str, object] = {}
    for name, first in chunks[0].columns.items():
        parts = [c.columns[name] for c in chunks]
        cols[name] = [v for p in parts for v in p] if isinstance(first, list) else np.concatenate(parts)
    return Chunk(columns=cols, labels=None, num_rows=sum(c.num_rows for c in chunks))


def _split_hours(schema: Schema, chunk: Chunk, hours: list[bytes], index: list[int],
                 bad: list[tuple[int, str]]) -> tuple[Chunk, list[tuple[int, str]]]:
    """Hour of day and weekday by the parser's own functions (so an hour gets the
    verdict and the split it gets in a file); rows whose hour is no date go to `bad`."""
    col = pa.array(hours, pa.binary())
    valid = pc.is_valid(_parse_hour(col)).to_numpy(zero_copy_only=False).astype(bool)
    if not valid.all():
        bad = bad + [(index[j], f"{schema.hour} is not a valid date and hour") for j in np.flatnonzero(~valid)]
        col = pc.filter(col, pa.array(valid))
        chunk = Chunk(columns={k: ([v for v, ok in zip(c, valid) if ok] if isinstance(c, list) else c[valid])
                               for k, c in chunk.columns.items()}, labels=None, num_rows=int(valid.sum()))
    chunk.columns["hour_of_day"], chunk.columns["weekday"] = _split_hour(col)
    return chunk, bad


def _text(field: str, v) -> bytes:
    if v is None:
        return b""
    if isinstance(v, str):
        try:
            return v.encode()
        except UnicodeEncodeError:  # a lone surrogate from "\ud800" in JSON
            raise _Bad(f"{field} is not valid UTF-8 text") from None
    if isinstance(v, bytes):
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):  # a numpy integer: as the int it holds
        try:
            return str(int(v)).encode()
        except ValueError:  # past Python's int -> text limit (4,300 digits)
            raise _Bad(f"{field} is an integer of more than 4,300 digits") from None
    if isinstance(v, np.longdouble) and not isinstance(v, np.float64):  # Arrow has no column of them
        v = float(v)  # (the id of the float64 it rounds to, as float(v) is scored as a number)
    if isinstance(v, (bool, float, np.bool_, np.floating)):
        return typed_text(v)
    raise _Bad(f"{field} must be text, a number or a boolean, got {_kind(v)}")


def typed_text(v) -> bytes:
    """A boolean or float id as a Parquet column of them is hashed (`parse._as_text`, the
    same function): true/false, a whole float as its integer, NaN missing (b""), any other
    float its shortest text. The same value is the same id from a file, a DataFrame and JSON.

    >>> [typed_text(v) for v in (True, 7.0, 0.25, float("nan"), np.float32(0.1), 3e10 + 17)]
    [b'true', b'7', b'0.25', b'', b'0.1', b'30000000017']
    """
    text = _as_text(pa.array([v])).to_pylist()[0]
    return b"" if text is None else text


def _number(field: str, v) -> float:
    if v is None:
        return math.nan
    if isinstance(v, (int, float, np.integer, np.floating, decimal.Decimal)) and not isinstance(v, bool):
        # numpy's scalars too, and a Decimal (pandas' reading of a Parquet decimal column, which the file's path takes)
        try:
            x = float(v)
        except OverflowError:  # an int past float's range
            raise _Bad(f"{field} is an integer beyond a float's range (1.8e308)") from None
        except ValueError:  # Decimal("sNaN"): "cannot convert signaling NaN to float"
            raise _Bad(f"{field} is NaN, not a number: leave a missing value out (or null)") from None
        if math.isnan(x):
            raise _Bad(f"{field} is NaN, not a number: leave a missing value out (or null)")
        if not math.isfinite(x):
            raise _Bad(f"{field} is not a finite number ({x})")
        return x
    if isinstance(v, (str, bytes)):
        text = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        if text == "":
            return math.nan
        if _NUMBER.fullmatch(text):
            text = text.strip(" \t")
            if not text:  # blanks alone: missing, as in a file
                return math.nan
            x = float(text)
            if math.isfinite(x):  # '1e999' matches the pattern but is no finite number
                return x
        raise _Bad(f"{field} is not a number")
    raise _Bad(f"{field} must be a number or number text, got {_kind(v)}")


def _hour_text(field: str, v) -> bytes:
    """YYMMDDHH as 8 digits; whether it names a date is checked for the batch at once."""
    if isinstance(v, (float, np.floating)) and (math.isnan(v) or float(v).is_integer() and abs(v) < WHOLE_LIMIT):
        v = None if math.isnan(v) else int(v)  # an hour column with gaps is float64, as a Parquet file's is read
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = str(int(v))
    elif isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if v is None:
        raise _Bad(f"{field} is missing (YYMMDDHH, required)")
    if not isinstance(v, str):
        raise _Bad(f"{field} must be YYMMDDHH as text or an integer, got {_kind(v)}")
    if not _HOUR.fullmatch(v):
        raise _Bad(f"{field} is not YYMMDDHH")
    return v.encode()


def _kind(v) -> str:
    return {dict: "an object", list: "an array", bool: "a boolean", int: "an integer", float: "a float",
            str: "text", type(None): "null"}.get(type(v), type(v).__name__)
