"""Rows given as values (a prediction request) get exactly the ids, dense
values and verdicts that the same rows get as text lines of a file."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mariana.sparse.encode import Encoder
from mariana.sparse.hashing import HashSpec, token_id
from mariana.sparse.parse import BlockParser, ParseStats
from mariana.sparse.records import parse_records
from mariana.sparse.schema import Schema, avazu, criteo

SPECS = [HashSpec(bits=20, numeric="bucket"), HashSpec(bits=18, numeric="both", bucket_scale=2.5)]

# Text a file could hold in a numeric field: numbers in several spellings, empty, and junk.
number_text = st.one_of(
    st.integers(-10**12, 10**12).map(str),
    st.floats(allow_nan=False, allow_infinity=False, width=64).map(repr),
    st.sampled_from(["", " 3 ", "  -2.5", "+7", ".5", "5.", "1e3", "-1E-2", "0", "007", "1e999",
                     "nan", "inf", "-", "abc", "1,5", "0x10", "1_000", "١٢"]),
)
category_text = st.one_of(
    st.text(st.characters(blacklist_characters="\t\n\r,\"", blacklist_categories=("Cs",)), max_size=12),
    st.sampled_from(["68fd1e64", "", "a b", "ünï", "0"]),
)
hour_text = st.one_of(
    st.builds(lambda y, m, d, h: f"{y:02d}{m:02d}{d:02d}{h:02d}", st.integers(0, 99), st.integers(0, 13),
              st.integers(0, 32), st.integers(0, 25)),
    st.sampled_from(["", "1410210", "141021000", "14x02100", "68123123", "69010100"]),
)


def file_path(schema: Schema, rows: list[dict], spec: HashSpec):
    """(batch of the rows the parser keeps, indices of the rows it rejects) via text lines."""
    unlabeled = schema.without_label()
    cols = [c for c in unlabeled.columns]
    lines = [unlabeled.delimiter.join(r.get(c, "") for c in cols) for r in rows]
    block = ("\n".join(lines) + "\n").encode()
    stats = ParseStats()
    chunk = BlockParser(schema, labeled=False).parse(block, 1, stats)
    batch = Encoder(schema, spec).encode(chunk)
    return batch, sorted(b.line - 1 for b in stats.first_bad), stats.rows_bad


def records_path(schema: Schema, rows: list[dict], spec: HashSpec):
    chunk, bad, unknown = parse_records(schema.without_label(), rows)
    return Encoder(schema, spec).encode_rows(chunk), [i for i, _ in bad], unknown


def same_batches(a, b) -> None:
    assert a.num_rows == b.num_rows
    assert np.array_equal(a.ids, b.ids)
    assert np.array_equal(a.dense, b.dense)


def criteo_rows(n: int):
    row = st.fixed_dictionaries({**{f"I{i}": number_text for i in range(1, 14)},
                                 **{f"C{i}": category_text for i in range(1, 27)}})
    return st.lists(row, min_size=1, max_size=n)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=criteo_rows(6), spec=st.sampled_from(SPECS))
def test_criteo_rows_as_values_get_the_ids_of_the_same_rows_as_text(rows, spec):
    want, want_bad, nbad = file_path(criteo(), rows, spec)
    got, got_bad, unknown = records_path(criteo(), rows, spec)
    assert unknown == 0
    assert got_bad == want_bad and len(got_bad) == nbad
    same_batches(got, want)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.fixed_dictionaries({"hour": hour_text, "C1": category_text, "site_id": category_text,
                                            "device_ip": category_text}), min_size=1, max_size=5))
def test_avazu_hours_split_as_the_parser_splits_them(rows):
    full = [{c: r.get(c, "x") for c in avazu().without_label().columns} | r for r in rows]
    want, want_bad, _ = file_path(avazu(), full, SPECS[0])
    got, got_bad, _ = records_path(avazu(), full, SPECS[0])
    assert got_bad == want_bad
    same_batches(got, want)


@settings(max_examples=100, deadline=None)
@given(rows=criteo_rows(4), spec=st.sampled_from(SPECS))
def test_json_numbers_and_text_numbers_agree(rows, spec):
    """A numeric field sent as a JSON number is the number its text spells."""
    as_numbers = []
    for r in rows:
        out = dict(r)
        for i in range(1, 14):
            v = r[f"I{i}"]
            if re.fullmatch(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", v) and math.isfinite(float(v)):
                out[f"I{i}"] = int(v) if v.lstrip("+-").isdigit() else float(v)
        as_numbers.append(out)
    text, text_bad, _ = records_path(criteo(), rows, spec)
    nums, nums_bad, _ = records_path(criteo(), as_numbers, spec)
    assert nums_bad == text_bad
    same_batches(nums, text)


def test_ids_match_the_plain_python_reference():
    chunk, bad, _ = parse_records(criteo().without_label(), [{"C1": "68fd1e64", "C2": 12345, "C3": None}])
    batch = Encoder(criteo(), HashSpec(bits=20)).encode_rows(chunk)
    ids = dict(zip(Encoder(criteo(), HashSpec(bits=20)).sparse_fields, batch.ids.tolist()))
    assert not bad
    assert ids["C1"] == token_id("C1", b"68fd1e64", bits=20) == 652390
    assert ids["C2"] == token_id("C2", b"12345", bits=20)          # an integer is its decimal text
    assert ids["C3"] == token_id("C3", None, bits=20)               # null and absent are missing
    assert ids["C4"] == token_id("C4", b"", bits=20)


@pytest.mark.parametrize("value,reason", [
    ([1], "C1 must be text, a number or a boolean, got an array"),
    ({"a": 1}, "C1 must be text, a number or a boolean, got an object"),
    ("\ud800", "C1 is not valid UTF-8 text"),
])
def test_categorical_values_of_the_wrong_type_are_named(value, reason):
    _, bad, _ = parse_records(criteo(), [{"C1": value}])
    assert bad == [(0, reason)]


@pytest.mark.parametrize("value,reason", [
    (True, "I1 must be a number or number text, got a boolean"),
    (float("nan"), "I1 is NaN, not a number: leave a missing value out (or null)"),
    (np.float32("-inf"), "I1 is not a finite number (-inf)"),
    (10**400, "I1 is an integer beyond a float's range (1.8e308)"),
    ("1e999", "I1 is not a number"),
    ("3\n", "I1 is not a number"),
    ([3], "I1 must be a number or number text, got an array"),
    (__import__("decimal").Decimal("sNaN"), "I1 is NaN, not a number: leave a missing value out (or null)"),
])
def test_numeric_values_that_are_not_numbers_are_named(value, reason):
    _, bad, _ = parse_records(criteo(), [{"I1": value}])
    assert bad == [(0, reason)]


def test_a_long_double_category_is_the_id_of_the_float_it_rounds_to():
    """np.longdouble has no Arrow type: a row holding one raised ArrowNotImplementedError
    ("Unsupported numpy type 13") from the Python API, not a verdict."""
    (long, bad, _), (plain, _, _) = (records_path(criteo(), [{"C1": v}], SPECS[0]) for v in (np.longdouble(0.1), 0.1))
    assert not bad
    same_batches(long, plain)


def test_rows_that_are_not_objects_and_unknown_keys():
    chunk, bad, unknown = parse_records(criteo(), [[1, 2], {"I1": 1, "nope": 2, 7: 3, "label": 1}, "x"])
    assert bad == [(0, "an instance must be an object of field values, got an array"),
                   (2, "an instance must be an object of field values, got text")]
    assert chunk.num_rows == 1 and unknown == 2   # "label" is a known column, "nope" and 7 are not


def test_a_missing_hour_is_a_bad_row_as_in_a_file():
    _, bad, _ = parse_records(avazu().without_label(), [{"C1": "1005"}, {"hour": 14102100}, {"hour": "14023200"},
                                                        {"hour": "14020125"}, {"hour": 14102100.0},
                                                        {"hour": "141021"}, {"hour": float("nan")},
                                                        {"hour": "14043100"}, {"hour": 14022900}])
    assert bad == [(0, "hour is missing (YYMMDDHH, required)"), (2, "hour is not a valid date and hour"),
                   (3, "hour is not a valid date and hour"), (5, "hour is not YYMMDDHH"),
                   (6, "hour is missing (YYMMDDHH, required)"),  # 14102100.0: as 14102100
                   (7, "hour is not a valid date and hour"), (8, "hour is not a valid date and hour")]


def test_no_rows():
    chunk, bad, unknown = parse_records(criteo(), [])
    batch = Encoder(criteo(), SPECS[1]).encode_rows(chunk)
    assert (chunk.num_rows, bad, unknown, batch.num_rows, batch.dense.shape) == (0, [], 0, 0, (0, 13))


@pytest.mark.parametrize("few_missed", [0, 64, 10**6], ids=["vectorized", "mixed", "one by one"])
@pytest.mark.parametrize("schema", [criteo(), avazu()], ids=["criteo", "avazu"])
def test_the_id_cache_gives_the_ids_hashing_gives(schema, few_missed, monkeypatch):
    """A few rows take their ids from the encoder's cache (`_cached_ids`), filled as values are
    met and emptied when full; they must be the ids `_hashed_ids` computes, hit or miss, for
    missing numbers (NaN), missing text and values met before in another row or request; the
    values not met yet hashed one by one in Python ints (`_few_ids`) or vectorized."""
    import mariana.sparse.encode as encode

    rng = np.random.default_rng(5)
    numeric = [None, 0, 1, -3, 2.5, 10**6, "7", ""]
    text = [None, "", "a", "68fd1e64", "ünï", 12345]
    hour = [14102100, "14102123", 14102217]
    requests = [[{**{f: numeric[rng.integers(len(numeric))] for f in schema.numeric},
                  **{f: text[rng.integers(len(text))] for f in schema.categorical},
                  **({schema.hour: hour[rng.integers(len(hour))]} if schema.hour else {})}
                 for _ in range(rng.integers(1, encode.FEW_ROWS + 1))] for _ in range(30)]
    monkeypatch.setattr(encode, "ID_CACHE_ENTRIES", 200)  # full (and emptied) several times over
    monkeypatch.setattr(encode, "FEW_MISSED", few_missed)
    enc = Encoder(schema, SPECS[1])
    for rows in requests:
        chunk, bad, _ = parse_records(schema.without_label(), rows)
        assert not bad
        got, want = enc.encode_rows(chunk), enc._hashed_ids(chunk)
        assert np.array_equal(got.ids.reshape(want.shape), want)
        assert enc._memo.entries <= 200 and sum(map(len, enc._id_cache)) == enc._memo.entries
    assert enc._memo.entries > 0


def test_encoders_that_hash_alike_share_the_values_they_met():
    """A swapped-in version's encoder takes over its predecessor's id cache when the two hash
    alike (the same fields, kinds and spec): its first request is lookups only, with the ids
    its own hashing gives, and the two count one set of entries. An encoder that hashes
    otherwise (another table size, another bucket scale) shares nothing."""
    schema = criteo()
    inst = {**{f: f"v-{f}" for f in schema.categorical}, "I1": 7, "I2": -2.5, "I3": None}
    want = Encoder(schema, SPECS[0]).encode_instances([inst])[0]
    old, new = Encoder(schema, SPECS[0]), Encoder(schema, SPECS[0])
    old.encode_instances([inst])
    assert new.share_ids(old) and new._memo is old._memo
    missed: list = []
    assert new._instance_ids(inst, [], missed, []) and not missed
    assert np.array_equal(new.encode_instances([inst])[0], want)
    new.encode_instances([{**inst, "C1": "met by the new one"}])
    assert old._id_cache[old.sparse_fields.index("C1")].get("met by the new one") is not None
    assert old._memo.entries == new._memo.entries == sum(map(len, old._id_cache))
    for spec in (HashSpec(bits=21), HashSpec(bits=20, bucket_scale=3.0), SPECS[1]):
        other = Encoder(schema, spec)
        assert not other.hashes_like(old) and not other.share_ids(old) and other._memo is not old._memo


def test_plain_instances_take_one_pass_with_the_same_verdict_and_ids():
    """`Encoder.encode_instances` (a few rows of requests with plain values, met before or new)
    must give the ids and unknown-key counts of `parse_records` + `encode_rows`, take every row
    of plain values (new ones are hashed and remembered), and decline (None) every set of rows
    those would refuse, so the general path names it."""
    rng = np.random.default_rng(11)
    schema = criteo()
    enc = Encoder(schema, SPECS[0])
    plain_numbers = [None, 0, 1, 3, -7, 2.5, 1e12]
    plain_text = [None, "", "a", "68fd1e64", "ünï"]
    # True and False equal 1 and 0 (and hash alike), met before as numbers: still refused
    odd = [True, False, "7", 10**400, float("nan"), float("inf"), 12345, "\ud800", [1], {"a": 1}, b"x", b"a"]
    taken, plain_rows, rows = 0, 0, []
    for n in range(400):
        inst = {**{f: plain_numbers[rng.integers(len(plain_numbers))] for f in schema.numeric},
                **{f: plain_text[rng.integers(len(plain_text))] for f in schema.categorical}}
        if n % 3 == 0:  # an odd value somewhere: another type, a bad number, a surrogate
            inst[rng.choice(schema.numeric + schema.categorical)] = odd[rng.integers(len(odd))]
        if n % 5 == 0:
            inst["not_a_field"] = 1
        rows.append(inst)
        fast = enc.encode_instances([inst])
        chunk, bad, unknown = parse_records(schema, [inst])
        if bad:
            assert fast is None, (inst, bad)
            continue
        plain = (all(v is None or type(v) in (int, float) for f, v in inst.items() if f in schema.numeric)
                 and all(v is None or type(v) is str for f, v in inst.items() if f in schema.categorical))
        plain_rows += plain
        assert (fast is not None) == plain, inst
        want = enc.encode_rows(chunk)  # the general path
        if fast is not None:
            taken += 1
            assert np.array_equal(fast[0].reshape(-1), want.ids) and fast[1] == [unknown]
            assert fast[0].shape == (1, enc.num_fields) and want.fixed_width
        for _ in range(2):  # every value met now (text by its str the second time): unless it is odd, one pass
            again = enc.encode_instances([inst])
            if all(type(v) in (str, float, int) or v is None for v in inst.values()) and again is not None:
                assert np.array_equal(again[0].reshape(-1), want.ids) and again[1] == [unknown]
    assert taken == plain_rows > 100
    several = 0
    for start in range(0, len(rows) - 5, 3):  # several rows at once: all plain and met, or None
        group = rows[start:start + int(rng.integers(2, 6))]
        fast = enc.encode_instances(group)
        unknowns = [parse_records(schema, [r])[2] for r in group]
        chunk, bad, _ = parse_records(schema, group)
        if fast is None:
            continue
        several += 1
        assert not bad and fast[1] == unknowns and fast[0].shape == (len(group), enc.num_fields)
        assert np.array_equal(fast[0].reshape(-1), enc.encode_rows(chunk).ids)
    assert several > 3  # a third of the rows hold an odd value: few groups are all plain
    assert enc.encode_instances([rows[1], [1]]) is None                               # not an object
    assert Encoder(avazu(), SPECS[0]).encode_instances([{"C1": "1005"}]) is None  # hour fields: the general path
    assert Encoder(schema, SPECS[1]).encode_instances([{}]) is None                # a dense block too
    fresh = Encoder(schema, SPECS[0])  # a new text is remembered by its str too: its next request is lookups only
    inst = {**{f: f"t-{f}" for f in schema.categorical[:5]}, "I1": 3, "I2": 2.5, "C9": None}
    first = fresh.encode_instances([inst])
    assert all(fresh._id_cache[j].get(inst.get(f)) is not None for j, f in enumerate(fresh.sparse_fields))
    missed: list = []
    assert fresh._instance_ids(inst, [], missed, []) and not missed
    assert np.array_equal(fresh.encode_instances([inst])[0], first[0])
    fresh = Encoder(schema, SPECS[0])
    many_new = [{f: f"{k}-{f}" for f in schema.categorical} for k in range(3)]  # 78 new values, > FEW_MISSED
    assert fresh.encode_instances(many_new) is None and fresh.encode_instances(many_new[:1]) is not None
