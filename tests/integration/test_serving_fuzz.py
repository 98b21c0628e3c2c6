"""Property-based fuzzing of POST /v1/predict on a real server over real HTTP:
whatever the body, the answer is a 2xx or a 4xx (never a 5xx, never a dropped
connection), and a 200 holds one pCTR in [0, 1] per instance."""
from __future__ import annotations

import http.client
import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mariana.sparse.schema import avazu, criteo
from tests.conftest import run_cli
from tests.integration.serving import Server

pytestmark = pytest.mark.slow
FIELDS = list(criteo().columns) + list(avazu().columns)  # names the model knows, and some it does not
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])

text = st.text(st.characters(), max_size=12)                       # lone surrogates included
clean_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
numbers = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(st.none(), st.booleans(), numbers, text, st.sampled_from(["", "68fd1e64", "3", "1e999", " 7 "]))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
                      max_leaves=6)
instance = st.dictionaries(st.one_of(st.sampled_from(FIELDS), text), values, max_size=8)
# msgpack takes no lone surrogates and no integers past 64 bits
mp_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 64 - 1),
                       st.floats(allow_nan=True, allow_infinity=True), clean_text, st.binary(max_size=8))
mp_values = st.recursive(mp_scalars, lambda kids: st.lists(kids, max_size=3)
                         | st.dictionaries(clean_text, kids, max_size=3), max_leaves=6)
mp_instance = st.dictionaries(st.one_of(st.sampled_from(FIELDS), clean_text), mp_values, max_size=8)


@pytest.fixture(scope="module")
def server(gen_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    run_cli("-q", "train", "--data", gen_files["test"], "--model", "dnn", "--out", d / "m", check=True)
    with Server(d / "s", d / "m", workers=2, serve={"max_instances": 20, "max_body_bytes": 100_000}) as s:
        s.wait_for("/readyz")
        s.conn = s.connect()
        yield s
        s.conn.close()
        assert s.metric("mariana_serve_requests_total") > 0
    assert s.returncode == 0 and "Traceback" not in s.logs(), s.logs()


def send(s: Server, body: bytes, ctype: str) -> tuple[int, dict, bytes]:
    """One request on the kept connection; a dropped connection fails the test."""
    try:
        return s.request("POST", "/v1/predict", body, {"Content-Type": ctype}, conn=s.conn)
    except (http.client.HTTPException, OSError):
        s.conn = s.connect()
        raise AssertionError(f"the connection dropped on a {len(body)}-byte {ctype} body:\n{s.logs()}")


def check(status: int, headers: dict, raw: bytes, instances=None) -> None:
    assert status < 500, (status, raw[:300])
    answer = msgpack.unpackb(raw) if headers.get("Content-Type", "").startswith("application/msgpack") \
        else json.loads(raw)
    if status == 200:
        assert isinstance(instances, list) and len(answer["pctr"]) == len(instances), answer
        assert all(0.0 <= p <= 1.0 for p in answer["pctr"]) and answer["model_version"]
    else:
        assert 400 <= status < 500 and answer["error"], answer


@FUZZ
@given(instances=st.lists(instance, max_size=25), extra=st.dictionaries(text, scalars, max_size=2))
def test_json_bodies(server, instances, extra):
    body = json.dumps({**extra, "instances": instances}).encode()  # NaN and Infinity included, as Python writes them
    check(*send(server, body, "application/json"), instances)


@FUZZ
@given(instances=st.lists(mp_instance, max_size=25))
def test_msgpack_bodies(server, instances):
    check(*send(server, msgpack.packb({"instances": instances}), "application/msgpack"), instances)


@FUZZ
@given(body=values)
def test_any_json_value_as_the_body(server, body):
    check(*send(server, json.dumps(body).encode(), "application/json"), body.get("instances")
          if isinstance(body, dict) else None)


@FUZZ
@given(body=st.binary(max_size=300), ctype=st.sampled_from(["application/json", "application/msgpack", "text/plain",
                                                            "", "multipart/form-data; boundary=x"]))
def test_raw_bytes(server, body, ctype):
    status, headers, raw = send(server, body, ctype)
    assert status < 500, (status, raw[:300])


@FUZZ
@given(instances=st.lists(st.fixed_dictionaries({"I1": st.integers(0, 9), "C1": st.just("68fd1e64")}), min_size=1,
                          max_size=3),
       cut=st.integers(0, 200), flip=st.integers(0, 255), where=st.integers(0, 200),
       fmt=st.sampled_from(["application/json", "application/msgpack"]))
def test_damaged_valid_bodies(server, instances, cut, flip, where, fmt):
    good = (msgpack.packb if fmt.endswith("msgpack") else lambda o: json.dumps(o).encode())({"instances": instances})
    damaged = bytearray(good[:max(1, len(good) - cut)])
    damaged[where % len(damaged)] ^= flip
    status, headers, raw = send(server, bytes(damaged), fmt)
    assert status < 500, (status, raw[:300])
