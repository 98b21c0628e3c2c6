"""The wire envelope: every message type round-trips; bad frames are refused
with a `BadMessage` whose code names the failed check; buffers are not copied."""
from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from mariana.services import protocol
from mariana.services.protocol import BadMessage, decode, encode, pack, unpack
from mariana.services.sample_cache import pack_batch, unpack_batch
from mariana.sparse.batch import SparseBatch
from mariana.sparse.errors import DataFormatError

# One valid set of required fields per message type, written out by hand.
VALID = {
    "Hello": {"role": "worker", "index": 2},
    "Welcome": {},
    "Bye": {"role": "worker", "index": 0, "pid": 4321, "boot": 1.5},
    "Lease": {"worker": "w0"},
    "Work": {"job": "j1", "epoch": 2, "step": "e2/f0o0:3", "key": "mariana:j1:b:f0o0:3", "rows": 4096},
    "Wait": {},
    "Idle": {},
    "Done": {"worker": "w0", "reports": [{"job": "j1", "step": "e1/f0o0:0", "rows": 4, "loss_sum": 2.5,
                                          "stats": {"worker": "w0", "times": {"pull": 0.01}}}]},
    "Miss": {"job": "j1", "step": "e2/f0o0:1", "key": "mariana:j1:b:f0o0:1"},
    "GetJob": {"job": "j1"},
    "JobSpec": {"job": "j1", "spec": {"config": {"train": {"epochs": 2}}, "schema": {"name": "criteo"}}},
    "ChunkSent": {"job": "j1", "chunk": "f0o4096", "file": 0, "offset": 4096, "length": 1000,
                  "first_line": 17, "lines": 9, "seconds": 0.25},
    "SourceDone": {"job": "j1", "chunks": 3, "error": ""},
    "ReadSource": {"job": "j1", "files": ["/data/a.tsv", "/data/b.tsv"], "block_bytes": 4096},
    "Resend": {"job": "j1", "chunk": "f1o0", "file": 1, "offset": 0, "length": 512, "first_line": 0, "lines": 5},
    "Chunk": {"job": "j1", "chunk": "f1o0", "path": "/data/b.tsv", "first_line": 0, "lines": 5,
              "first_of_file": True},
    "Cached": {"job": "j1", "chunk": "f1o0", "batches": [[0, 4], [1, 1]], "stats": {"rows_ok": 5, "rows_bad": 0}},
    "Batch": {"job": "j1", "meta": {"rows": 2, "fixed": True}},
    "CheckJob": {"ticket": "t1", "body": {"data": ["/d/train.tsv"], "out": "/m"}},
    "JobChecked": {"ticket": "t1", "error": ""},
    "FetchInput": {"ticket": "t2", "job": "j1", "kind": "file", "path": "/d/test.tsv"},
    "InputPart": {"ticket": "t2", "seq": 0, "last": True, "error": ""},
    "StartJob": {"job": "j1", "spec": {"mode": "ps"}},
    "PullRows": {"job": "j1", "dense": False},
    "Rows": {},
    "PushGrads": {"job": "j1", "step": "e1/f0o0:0", "rows": 4},
    "Ack": {"applied": True},
    "ShardStats": {"job": "j1"},
    "Stats": {"rows": {"1": 4}},
    "Export": {"job": "j1"},
    "Exported": {"shard": 1},
    "EndJob": {"job": "j1"},
    "Ok": {},
    "Error": {"code": "field", "error": "Hello.index is missing"},
}


def sample_arrays() -> dict[str, np.ndarray]:
    """Several dtypes and shapes, including empty and 2-d arrays."""
    return {
        "ids": np.array([5, 0, 1 << 40, 7], np.int64),
        "inverse": np.array([[0, 1], [1, 3], [2, 2]], np.int32),
        "grad": np.array([[0.5, -1.0, 2.0], [0.0, 1.5, -0.25]], np.float32),
        "none": np.zeros(0, np.int64),
        "empty2d": np.zeros((0, 3), np.float32),
        "bytes": np.array([0, 255, 7], np.uint8),
        "u32": np.array([4294967295, 1], np.uint32),
        "f64": np.array([[1e300], [-2.5]], np.float64),
    }


def raw(header: dict, *buffers: bytes) -> list:
    """Frames with a hand-made header, bypassing `encode`'s checks."""
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def ok_header(**extra) -> dict:
    return {"v": 1, "type": "Ok", "msg_id": 0, "arrays": [], **extra}


def check_same(m: protocol.Message, type_: str, msg_id: int, fields: dict, arrays: dict) -> None:
    assert m.type == type_ and m.msg_id == msg_id
    assert m.fields == fields
    assert set(m.arrays) == set(arrays)
    for name, a in arrays.items():
        got = m.arrays[name]
        assert got.dtype == a.dtype and got.shape == a.shape, name
        assert np.array_equal(got, a), name


# ---- round trips ---------------------------------------------------------------------


def test_every_schema_has_a_case():
    assert set(VALID) == set(protocol.SCHEMAS)


@pytest.mark.parametrize("with_arrays", [False, True], ids=["no-arrays", "arrays"])
@pytest.mark.parametrize("type_", sorted(VALID))
def test_round_trip_frames(type_, with_arrays):
    arrays = sample_arrays() if with_arrays else {}
    m = decode(encode(type_, 41, arrays, **VALID[type_]))
    check_same(m, type_, 41, VALID[type_], arrays)


@pytest.mark.parametrize("with_arrays", [False, True], ids=["no-arrays", "arrays"])
@pytest.mark.parametrize("type_", sorted(VALID))
def test_round_trip_packed(type_, with_arrays):
    arrays = sample_arrays() if with_arrays else {}
    blob = pack(encode(type_, 9, arrays, **VALID[type_]))
    assert isinstance(blob, bytes)
    check_same(unpack(blob), type_, 9, VALID[type_], arrays)


def test_extra_fields_and_item_access_survive():
    m = decode(encode("Ok", 3, steps=12, note="x"))
    assert m["steps"] == 12 and m.get("note") == "x" and m.get("missing", -1) == -1


def test_non_contiguous_arrays_are_sent_by_value():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    m = decode(encode("Rows", 0, {"t": a.T, "s": a[:, ::2]}))
    assert m.arrays["t"].tolist() == [[0, 3], [1, 4], [2, 5]]
    assert m.arrays["s"].tolist() == [[0, 2], [3, 5]]


def test_zero_dim_array_keeps_its_shape():
    # decode accepts shape [] (prod(()) == 1 element); encode must send it as such.
    m = decode(encode("Rows", 0, {"scalar": np.array(7, np.int64)}))
    assert m.arrays["scalar"].shape == ()
    assert int(m.arrays["scalar"]) == 7


def test_encode_refuses_unknown_type_and_dtype():
    with pytest.raises(ValueError, match="unknown message type"):
        encode("Nope")
    with pytest.raises(ValueError, match="not sent on the wire"):
        encode("Rows", 0, {"o": np.array([None, 1], dtype=object)})
    with pytest.raises(ValueError, match="not sent on the wire"):
        encode("Rows", 0, {"b": np.array([True, False])})


# ---- no copies -----------------------------------------------------------------------


def test_encode_does_not_copy_contiguous_arrays():
    ids = np.array([3, 1, 4, 1, 5], np.int64)
    grad = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    frames = encode("PushGrads", 1, {"ids": ids, "g.emb": grad}, job="j", step="e1/a:0", rows=2)
    assert len(frames) == 3
    assert isinstance(frames[1], memoryview) and isinstance(frames[2], memoryview)
    assert frames[1].obj is ids and frames[2].obj is grad
    assert np.shares_memory(np.frombuffer(frames[1], np.int64), ids)
    assert np.shares_memory(np.frombuffer(frames[2], np.float32), grad)
    ids[0] = 99  # the frame is a view: a later write shows through
    assert np.frombuffer(frames[1], np.int64)[0] == 99


def test_decode_does_not_copy_buffers():
    ids = np.array([3, 1, 4], np.int64)
    frames = encode("PullRows", 1, {"ids": ids}, job="j", dense=True)
    m = decode(frames)
    assert np.shares_memory(m.arrays["ids"], ids)
    assert m.arrays["ids"].tolist() == [3, 1, 4]


# ---- refusals ------------------------------------------------------------------------


def code_of(frames: list, **kw) -> str:
    with pytest.raises(BadMessage) as e:
        decode(frames, **kw)
    return e.value.code


def test_no_frames():
    assert code_of([]) == "empty"


@pytest.mark.parametrize("frame0", [b"\xc1\xc1garbage", b"", b"\x85\xa1v"], ids=["reserved-byte", "empty", "cut-map"])
def test_garbage_header(frame0):
    assert code_of([frame0]) == "header"


@pytest.mark.parametrize("value", [[1, 2], "Ok", 7, None])
def test_header_that_is_not_a_map(value):
    assert code_of([msgpack.packb(value)]) == "header"


@pytest.mark.parametrize("v", [2, 0, "1", None])
def test_wrong_version(v):
    assert code_of(raw(ok_header(v=v))) == "version"


def test_missing_version():
    h = ok_header()
    del h["v"]
    assert code_of(raw(h)) == "version"


@pytest.mark.parametrize("type_", ["Nope", "ok", None, 3, [1], {"a": 1}])  # unhashable ones too
def test_unknown_type(type_):
    assert code_of(raw(ok_header(type=type_))) == "type"


@pytest.mark.parametrize("msg_id", ["1", 1.0, True, None])
def test_bad_msg_id(msg_id):
    assert code_of(raw(ok_header(msg_id=msg_id))) == "msg_id"


@pytest.mark.parametrize("fields", [
    {"role": "worker"},                    # index missing
    {"index": 2},                          # role missing
    {"role": "worker", "index": "2"},      # str for int
    {"role": "worker", "index": 2.0},      # float for int
    {"role": "worker", "index": True},     # bool for int
    {"role": "worker", "index": None},
    {"role": 5, "index": 2},               # int for str
], ids=["no-index", "no-role", "str-int", "float-int", "bool-int", "none-int", "int-str"])
def test_missing_or_ill_typed_field(fields):
    assert code_of(raw({"v": 1, "type": "Hello", "msg_id": 0, "arrays": [], **fields})) == "field"


@pytest.mark.parametrize("type_,fields", [
    ("PullRows", {"job": "j", "dense": 1}),                  # int for bool
    ("Cached", {"job": "j", "chunk": "c", "batches": {}, "stats": {}}),  # map for list
    ("Stats", {"rows": []}),                                 # list for map
    ("ChunkSent", {"job": "j", "chunk": "c", "file": 0, "offset": 0, "length": 1, "first_line": 0,
                   "lines": 1, "seconds": "0.5"}),           # str for number
])
def test_other_ill_typed_fields(type_, fields):
    assert code_of(raw({"v": 1, "type": type_, "msg_id": 0, "arrays": [], **fields})) == "field"


def test_bool_is_not_a_number():
    # As for integers, `True` where a number is required is a sender's mistake.
    fields = {**VALID["ChunkSent"], "seconds": True}
    assert code_of(raw({"v": 1, "type": "ChunkSent", "msg_id": 0, "arrays": [], **fields})) == "field"


def test_number_fields_take_ints_and_floats():
    for seconds in (3, 2.5):
        assert decode(encode("ChunkSent", 0, **{**VALID["ChunkSent"], "seconds": seconds}))["seconds"] == seconds


def test_records_in_lists_are_checked_like_headers():
    report = VALID["Done"]["reports"][0]
    assert protocol.check_record("Report", report, "Done.reports[0]") is report
    assert protocol.check_record("Report", {**report, "loss_sum": 3}, "r")["loss_sum"] == 3
    for bad, words in [({**report, "loss_sum": True}, "Done.reports[0].loss_sum is missing or not a number"),
                       ({k: v for k, v in report.items() if k != "step"}, "Done.reports[0].step is missing"),
                       ({**report, "rows": "4"}, "Done.reports[0].rows is missing or not an integer"),
                       ([report], "Done.reports[0] must be a map, got list")]:
        with pytest.raises(BadMessage, match=words.replace("[", r"\[").replace("]", r"\]")) as e:
            protocol.check_record("Report", bad, "Done.reports[0]")
        assert e.value.code == "field"
    work = VALID["Work"]
    assert protocol.check_record("Work", work, "Work.more[0]") is work
    with pytest.raises(BadMessage, match="Work.more.0..key"):
        protocol.check_record("Work", {**work, "key": None}, "Work.more[0]")


def test_arrays_must_be_a_list():
    assert code_of(raw(ok_header(arrays={"a": 1}))) == "arrays"


@pytest.mark.parametrize("spec", [["a", "<i8"], [1, "<i8", [1]], ["a", "<i8", 1], "a"],
                         ids=["two-items", "int-name", "int-shape", "string"])
def test_malformed_array_spec(spec):
    assert code_of(raw(ok_header(arrays=[spec]), b"\0" * 8)) == "arrays"


def test_frame_count_must_match_specs():
    one = [["a", "<i8", [1]]]
    assert code_of(raw(ok_header(arrays=one))) == "frame_count"                   # spec, no frame
    assert code_of(raw(ok_header(), b"\0" * 8)) == "frame_count"                 # frame, no spec
    assert code_of(raw(ok_header(arrays=one), b"\0" * 8, b"\0" * 8)) == "frame_count"


@pytest.mark.parametrize("dtype", ["|O", "<c16", "|b1", "<f2", ">i8", "int64", "<U1", ["<i8"], None])
def test_disallowed_dtype(dtype):
    assert code_of(raw(ok_header(arrays=[["a", dtype, [1]]]), b"\0" * 16)) == "dtype"


@pytest.mark.parametrize("shape", [[-1], [2, -2], [True], [1.0], ["1"], [None], [1, 1, 1, 1, 1]],
                         ids=["neg", "neg2d", "bool", "float", "str", "none", "5d"])
def test_bad_shape(shape):
    assert code_of(raw(ok_header(arrays=[["a", "<i8", shape]]), b"\0" * 8)) == "shape"


@pytest.mark.parametrize("shape,nbytes", [([2], 8), ([2], 24), ([2, 3], 40), ([0], 8), ([], 0)])
def test_frame_size_must_match_shape(shape, nbytes):
    assert code_of(raw(ok_header(arrays=[["a", "<i8", shape]]), b"\0" * nbytes)) == "array_size"


def test_exact_frame_size_is_accepted():
    m = decode(raw(ok_header(arrays=[["a", "<i4", [2, 2]]]), struct.pack("<4i", 1, 2, 3, 4)))
    assert m.arrays["a"].tolist() == [[1, 2], [3, 4]]


def test_too_large():
    frames = encode("Rows", 0, {"a": np.zeros(100, np.float64)})
    total = sum(memoryview(f).nbytes for f in frames)
    assert code_of(frames, max_bytes=total - 1) == "too_large"
    assert decode(frames, max_bytes=total).arrays["a"].shape == (100,)


def test_too_many_frames():
    frames = raw(ok_header(arrays=[["a", "<i8", [0]]] * protocol.MAX_FRAMES), *[b""] * protocol.MAX_FRAMES)
    assert len(frames) == protocol.MAX_FRAMES + 1
    assert code_of(frames) == "too_many_frames"
    at_limit = raw(ok_header(arrays=[["a%d" % i, "<i8", [0]] for i in range(protocol.MAX_FRAMES - 1)]),
                   *[b""] * (protocol.MAX_FRAMES - 1))
    assert len(decode(at_limit).arrays) == protocol.MAX_FRAMES - 1


def test_frame_of_wrong_type():
    assert code_of([12345]) == "frame_type"


def test_header_too_large():
    big = msgpack.packb(ok_header(pad="x" * protocol.MAX_HEADER_BYTES))
    assert code_of([big]) == "header_too_large"


def test_error_reply():
    m = decode(protocol.error_reply(5, "field", "Hello.index is missing"))
    assert (m.type, m.msg_id, m["code"], m["error"]) == ("Error", 5, "field", "Hello.index is missing")


def test_bad_message_carries_code_and_detail():
    e = BadMessage("shape", "array 'a': bad shape")
    assert e.code == "shape" and e.detail == "array 'a': bad shape" and str(e) == "shape: array 'a': bad shape"


# ---- packed values (the sample cache) ---------------------------------------------------


def unpack_code(blob: bytes) -> str:
    with pytest.raises(BadMessage) as e:
        unpack(blob)
    return e.value.code


def good_blob() -> bytes:
    return pack(encode("Rows", 2, {"a": np.array([1, 2, 3], np.int64), "b": np.array([[0.5]], np.float32)}))


def test_pack_layout():
    frames = encode("Rows", 2, {"a": np.array([1, 2], np.int64)})
    blob = pack(frames)
    head = bytes(frames[0])
    assert blob[:4] == struct.pack("<I", len(head))
    assert blob[4:4 + len(head)] == head
    assert blob[4 + len(head):] == struct.pack("<2q", 1, 2)


@pytest.mark.parametrize("blob", [b"", b"\x05", b"\x05\x00\x00"], ids=["empty", "1-byte", "3-bytes"])
def test_unpack_shorter_than_length(blob):
    assert unpack_code(blob) == "truncated"


def test_unpack_header_cut_short():
    blob = good_blob()
    (n,) = struct.unpack_from("<I", blob)
    assert unpack_code(blob[:4 + n - 1]) == "truncated"
    assert unpack_code(struct.pack("<I", 100) + b"abc") == "truncated"
    assert unpack_code(struct.pack("<I", protocol.MAX_HEADER_BYTES + 1) + b"\0" * 8) == "truncated"


def test_unpack_arrays_cut_short():
    # The header is whole; the buffers after it are not: the sizes do not add up.
    blob = good_blob()
    assert unpack_code(blob[:-1]) == "array_size"
    assert unpack_code(blob[:-4]) == "array_size"


def test_unpack_trailing_bytes():
    assert unpack_code(good_blob() + b"\0") == "array_size"


def test_unpack_checks_like_decode():
    head = msgpack.packb({"v": 2, "type": "Ok", "msg_id": 0, "arrays": []})
    assert unpack_code(struct.pack("<I", len(head)) + head) == "version"
    head = msgpack.packb(ok_header(arrays=[["a", "|O", [1]]]))
    assert unpack_code(struct.pack("<I", len(head)) + head + b"\0" * 8) == "dtype"
    with pytest.raises(BadMessage) as e:
        unpack(good_blob(), max_bytes=10)
    assert e.value.code == "too_large"


# ---- SparseBatch through the sample cache's packing -----------------------------------------


def check_batch(got: SparseBatch, want: SparseBatch) -> None:
    assert got.ids.tolist() == want.ids.tolist()
    assert got.indptr.tolist() == want.indptr.tolist()
    assert got.fields.tolist() == want.fields.tolist()
    assert (got.num_fields, got.num_ids, got.batch_id) == (want.num_fields, want.num_ids, want.batch_id)
    assert np.array_equal(got.labels, want.labels) and got.labels.dtype == np.float32
    assert np.array_equal(got.dense, want.dense) and got.dense.shape == want.dense.shape
    if want.values is None:
        assert got.values is None
    else:
        assert np.array_equal(got.values, want.values) and got.values.dtype == np.float32


def test_fixed_width_batch_round_trip():
    b = SparseBatch.from_fixed(np.array([[3, 7, 1], [3, 9, 15]]), num_ids=16,
                               labels=np.array([1, 0], np.float32),
                               dense=np.array([[0.5, -1.0], [2.0, 0.0]], np.float32),
                               values=np.array([[1, 2, 3], [4, 5, 6]], np.float32), batch_id="f0o0:3")
    meta, arrays = b.to_arrays()
    assert "indptr" not in arrays and "fields" not in arrays and meta["fixed"] is True
    got = unpack_batch(pack_batch("j1", b))
    check_batch(got, b)
    assert got.ids.tolist() == [3, 7, 1, 3, 9, 15]
    assert got.indptr.tolist() == [0, 3, 6] and got.fields.tolist() == [0, 1, 2, 0, 1, 2]
    assert got.fixed_width
    uniq, inverse = got.unique()
    assert np.array_equal(uniq[inverse], got.ids) and sorted(uniq.tolist()) == [1, 3, 7, 9, 15]


def test_uneven_batch_round_trip():
    # row 0: one entry; row 1: none; row 2: three (field 1 twice)
    b = SparseBatch(ids=np.array([5, 2, 5, 11], np.int64), indptr=np.array([0, 1, 1, 4], np.int64),
                    fields=np.array([0, 0, 1, 1], np.int32), num_fields=3, num_ids=16,
                    values=np.array([1.0, 0.5, 2.0, -1.0], np.float32),
                    dense=np.array([[1.0], [2.0], [3.0]], np.float32),
                    labels=np.array([0, 1, 1], np.float32), batch_id="f2o8:0")
    meta, arrays = b.to_arrays()
    assert meta["fixed"] is False and "indptr" in arrays and "fields" in arrays
    got = unpack_batch(pack_batch("j1", b))
    check_batch(got, b)
    assert got.ids.tolist() == [5, 2, 5, 11] and got.indptr.tolist() == [0, 1, 1, 4]
    assert got.fields.tolist() == [0, 0, 1, 1] and got.values.tolist() == [1.0, 0.5, 2.0, -1.0]
    assert not got.fixed_width and got.num_rows == 3


def test_unlabeled_batch_without_values_round_trip():
    b = SparseBatch.from_fixed(np.array([[1, 2]]), num_ids=4)
    got = unpack_batch(pack_batch("j1", b))
    assert got.labels is None and got.values is None and got.dense.shape == (1, 0)
    assert got.ids.tolist() == [1, 2]


def batch_blob(meta: dict, arrays: dict) -> bytes:
    return pack(encode("Batch", 0, arrays, job="j1", meta=meta))


@pytest.mark.parametrize("inverse", [[0, 2], [0, -1], [5, 0]], ids=["past-end", "negative", "far"])
def test_unpack_batch_inverse_outside_uniq(inverse):
    meta = {"rows": 1, "num_fields": 2, "num_ids": 16, "fixed": True, "batch_id": ""}
    arrays = {"uniq": np.array([1, 2], np.int64), "inverse": np.array(inverse, np.int32),
              "dense": np.zeros((1, 0), np.float32)}
    with pytest.raises(DataFormatError, match="inverse"):
        unpack_batch(batch_blob(meta, arrays))


def test_unpack_batch_good_hand_made_blob():
    meta = {"rows": 1, "num_fields": 2, "num_ids": 16, "fixed": True, "batch_id": "x"}
    arrays = {"uniq": np.array([1, 2], np.int64), "inverse": np.array([1, 0], np.int32),
              "dense": np.zeros((1, 0), np.float32)}
    assert unpack_batch(batch_blob(meta, arrays)).ids.tolist() == [2, 1]


def test_unpack_batch_of_another_type():
    with pytest.raises(BadMessage) as e:
        unpack_batch(pack(encode("Ok", 0)))
    assert e.value.code == "type"


# ---- arbitrary input (hypothesis) -----------------------------------------------------
# Whatever arrives on a socket or sits in the cache, decoding it gives a Message or a
# BadMessage (DataFormatError for a cached batch whose arrays disagree): never another
# exception, which would take the service's loop down instead of answering an Error.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SCALARS = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20) \
    | st.binary(max_size=20)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8) | st.integers(-9, 9), inner, max_size=4), max_leaves=12)
_FIELD = st.sampled_from(sorted({k for fields in VALID.values() for k in fields}
                                | {"v", "type", "msg_id", "arrays"}))
# Headers near a real one: the right version, a known type with its fields, some of them
# replaced or added with arbitrary values, and arbitrary arrays.
_NEAR = st.builds(lambda type_, fields, arrays: {"v": protocol.VERSION, "type": type_, "msg_id": 1,
                                                 **VALID[type_], **fields,
                                                 **({"arrays": arrays} if arrays is not None else {})},
                  st.sampled_from(sorted(VALID)), st.dictionaries(_FIELD, _VALUES, max_size=2),
                  st.none() | _VALUES | st.lists(st.lists(_SCALARS | st.lists(st.integers(-2, 2**40), max_size=5),
                                                          max_size=4), max_size=3))


def _decodes_or_refuses(call) -> None:
    try:
        call()
    except BadMessage as e:
        assert e.code and str(e)
    except DataFormatError as e:
        assert str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_decode_or_are_refused(frames):
    _decodes_or_refuses(lambda: decode(frames))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_VALUES | _NEAR, st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_msgpack_headers_decode_or_are_refused(header, buffers):
    frame0 = msgpack.packb(header, use_bin_type=True)
    _decodes_or_refuses(lambda: decode([frame0, *buffers]))
    _decodes_or_refuses(lambda: unpack(pack([frame0, *buffers])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(VALID)), st.data())
def test_damaged_real_messages_decode_or_are_refused(type_, data):
    """A real message of each type with bytes flipped, cut or appended, as frames and packed."""
    arrays = {"x": np.arange(6, dtype=np.int32)} if type_ == "Batch" else None
    frames = [bytes(f) for f in encode(type_, 7, arrays, **VALID[type_])]
    blob = bytearray(pack(frames))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    blob = bytes(blob[:cut]) + data.draw(st.binary(max_size=8))
    _decodes_or_refuses(lambda: unpack(blob))
    _decodes_or_refuses(lambda: unpack_batch(blob))
    frames[0] = blob[4:4 + len(frames[0])]
    _decodes_or_refuses(lambda: decode(frames))
