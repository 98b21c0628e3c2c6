import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from mariana.sparse.errors import ConfigError
from mariana.sparse.hashing import (HashSpec, py_fnv1a64, binary_ids, bucket_codes, field_key, fmix64, fnv1a64, int_ids,
                            log_bucket, log_bucket_few, token_id)
from mariana.sparse.hashing import _BLOCK, _PY_MAX, _fnv1a64_positions, _fnv1a64_rest

SPEC20 = HashSpec(bits=20)


def test_primitives_match_published_vectors():
    # FNV-1a 64 of "a" and of "foobar" (the reference test vectors).
    data = np.frombuffer(b"afoobar", np.uint8)
    h = fnv1a64(np.array([0, 1, 7]), data)
    assert [int(x) for x in h] == [0xAF63DC4C8601EC8C, 0x85944171F73967E8]
    assert int(fmix64(np.array([1], np.uint64))[0]) == 12994781566227106604


def test_ids_are_pinned():
    """These ids are part of every saved model: changing them breaks old models."""
    assert token_id("C1", b"68fd1e64", bits=20) == 652390
    assert token_id("C1", b"", bits=20) == token_id("C1", None, bits=20) == 697551
    col = pa.array([b"68fd1e64", b"05db9164", b""], pa.binary())
    assert binary_ids(col, field_key("C1"), SPEC20).tolist() == [652390, 164340, 697551]
    assert int_ids(np.array([0, 3, -2]), field_key("I1"), SPEC20).tolist() == [5001, 40445, 421262]


def test_fields_are_namespaces():
    a = token_id("C1", b"abc", bits=30)
    b = token_id("C2", b"abc", bits=30)
    assert a != b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=20), min_size=1, max_size=200), st.integers(1, 30))
def test_vectorized_strings_equal_reference(values, bits):
    spec = HashSpec(bits=bits)
    ids = binary_ids(pa.array(values, pa.binary()), field_key("f"), spec)
    assert ids.tolist() == [token_id("f", v, bits) for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2 ** 62), 2 ** 62), min_size=1, max_size=100))
def test_vectorized_ints_equal_reference(values):
    ids = int_ids(np.array(values, np.int64), field_key("I3"), SPEC20)
    assert ids.tolist() == [token_id("I3", v, 20) for v in values]


def test_nulls_dictionaries_and_chunks_hash_like_plain_values():
    plain = pa.array([b"x", b"", b"y", b"x"] * 30, pa.binary())
    with_null = pa.array([b"x", None, b"y", b"x"] * 30, pa.binary())
    chunked = pa.chunked_array([plain.slice(0, 50), plain.slice(50)])
    key = field_key("C9")
    expect = binary_ids(plain, key, SPEC20)
    assert (binary_ids(with_null, key, SPEC20) == expect).all()
    assert (binary_ids(plain.dictionary_encode(), key, SPEC20) == expect).all()
    assert (binary_ids(chunked, key, SPEC20) == expect).all()
    assert (binary_ids(pa.array(["x", "", "y", "x"] * 30), key, SPEC20) == expect).all()


def test_numeric_buckets_and_missing():
    x = np.array([0, 1, 2, 3, 10, 1e6, -1, -3, np.nan])
    assert log_bucket(x, 4.0).tolist() == [0, 2, 4, 5, 9, 55, -2, -5, 0]
    table, index = bucket_codes(x, field_key("I1"), SPEC20)
    ids = table[index]
    assert ids[-1] == token_id("I1", None, 20)          # NaN -> missing token
    assert ids[0] == token_id("I1", 0, 20) != ids[-1]   # zero is not missing


@pytest.mark.parametrize("scale", [4.0, 1.0, 10.0])
def test_a_few_numbers_bucket_as_a_column_of_them_does(scale):
    """A request's few new numbers are bucketed in Python floats around one numpy log
    (`log_bucket_few`); a file's column with numpy's whole `log_bucket`. The two must agree
    everywhere, the bucket edges (log1p(|x|) * scale an integer) and their neighbours
    included, or a served row would get other ids than the same row in training."""
    rng = np.random.default_rng(3)
    edges = np.expm1(np.arange(0, int(690 * scale)) / scale)  # up to log1p(1e300), where both clip
    x = np.concatenate([edges, np.nextafter(edges, 0), np.nextafter(edges, np.inf),
                        rng.standard_normal(5000) * 10.0 ** rng.integers(-300, 300, 5000),
                        rng.integers(-10**6, 10**6, 5000), [0.0, -0.0, 5e-324, -5e-324, 1e300, 1e301, -1.7e308]])
    x = np.concatenate([x, -x])
    want = log_bucket(x, scale).tolist()
    assert log_bucket_few(x.tolist(), scale) == want
    for k in range(0, len(x), 997):  # one or two at a time, as a request brings them
        assert log_bucket_few(x[k:k + 2].tolist(), scale) == want[k:k + 2]


def test_ids_are_stable_across_processes():
    """Hashing must not depend on Python's salted hash() or the process."""
    code = ("from sparse.hashing import token_id; "
            "print(token_id('C7', b'3b08e48b', 24), token_id('I2', 5, 24))")
    outs = set()
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        outs.add(out)
    assert outs == {f"{token_id('C7', b'3b08e48b', 24)} {token_id('I2', 5, 24)}\n"}


def test_hash_spec_rejects_bad_values():
    with pytest.raises(ConfigError, match="bits"):
        HashSpec(bits=0)
    with pytest.raises(ConfigError, match="numeric"):
        HashSpec(numeric="log")


@pytest.mark.parametrize("widths", [[8] * 50, [3, 8, 1, 0, 12, 8] * 10, [8, 0, 8, 8, 0], [3, 8, 1, 0, 12, 8],
                                    [0, 0], [5]])
def test_fnv1a64_same_width_and_mixed_width_paths_match_the_reference(widths):
    """Many strings all of one width (hex ids) take a matrix path; many of mixed widths the
    gather path; a few strings a loop each: all are the plain-Python FNV-1a of each string."""
    rng = np.random.default_rng(len(widths))
    values = [bytes(rng.integers(0, 256, w, dtype=np.uint8)) for w in widths]
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])])
    data = np.frombuffer(b"".join(values), np.uint8)
    got = fnv1a64(offsets, data).tolist()
    assert got == [py_fnv1a64(v) for v in values]


def _packed(values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int64)
    return offsets, np.frombuffer(b"".join(values), np.uint8)


# Long values, and their FNV-1a as the code before long values were finished one by one gave it:
# saved models hold ids made from these hashes.
LONG_VALUES = {b"ab" * 150: 0xC3A75328E60159B1,
               bytes(range(256)) * 20: 0xA6EF0828AF1F9F25,
               b"\xff" * 100_000: 0x945223F8E9767705,
               "Größe naïve 東京 café ☕".encode() * 40: 0xA94C17A142C0E225,
               b"": 0xCBF29CE484222325}


def test_long_values_among_short_ones_hash_as_before():
    """A batch of short values with a few long ones (300 B to 100 kB, non-ASCII, empty) hashes
    every value as the reference does, and the long ones to the ids they always had."""
    rng = np.random.default_rng(11)
    short = [bytes(rng.integers(0, 256, rng.integers(0, 33), dtype=np.uint8)) for _ in range(500)]
    values = short[:200] + list(LONG_VALUES) + short[200:] + [b"x" * 5000]
    got = fnv1a64(*_packed(values)).tolist()
    assert got == [py_fnv1a64(v) for v in values]
    assert got[200:205] == list(LONG_VALUES.values())
    key = field_key("C7")
    assert binary_ids(pa.array(values, pa.binary()), key, SPEC20).tolist() == [token_id("C7", v, 20) for v in values]
    assert fnv1a64(*_packed(list(LONG_VALUES))).tolist() == list(LONG_VALUES.values())  # a few alone


def test_a_long_value_takes_no_numpy_step_per_byte():
    """Byte positions are stepped in numpy (a step of ~5 us each, over the batch) only while
    many strings are that long; longer strings are finished one by one. Before, one 100 kB
    value among short ones took 100,000 steps; now the steps stop at the short values' end."""
    rng = np.random.default_rng(5)
    short = [bytes(rng.integers(0, 256, rng.integers(8, 33), dtype=np.uint8)) for _ in range(4096)]
    values = short[:100] + [b"y" * 300, b"z" * 5000] + short[100:] + [b"w" * 100_000]
    offsets, data = _packed(values)
    rest, done = _fnv1a64_positions(np.zeros(len(values), np.uint64), offsets, data)
    assert done <= 32 and rest.tolist() == [100, 101, len(values) - 1]
    rest, done = _fnv1a64_positions(np.zeros(len(short), np.uint64), *_packed(short))
    assert rest.size == 0 and done == 32  # a batch of short values: all in numpy, as before
    rest, done = _fnv1a64_positions(np.zeros(1, np.uint64), *_packed([b"v" * (2 << 20)]))
    assert rest.tolist() == [0] and done == 0


@pytest.mark.parametrize("n", [1, 2, 255, _PY_MAX, _PY_MAX + 1, _BLOCK - 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK + 7])
def test_one_string_carries_any_state_over_any_length(n):
    """`_fnv1a64_rest` goes on from the state a prefix left, in a Python loop or in numpy
    blocks (past `_PY_MAX` bytes), across block ends, for any bytes: the reference's hash of
    prefix + rest."""
    rng = np.random.default_rng(n)
    for rest in (bytes(n), b"\xff" * n, bytes(rng.integers(0, 256, n, dtype=np.uint8))):
        for prefix in (b"", b"C7", bytes(rng.integers(0, 256, 13, dtype=np.uint8))):
            got = _fnv1a64_rest(py_fnv1a64(prefix), np.frombuffer(rest, np.uint8))
            assert got == py_fnv1a64(prefix + rest)
