"""`mariana serve` against clients that misbehave below the JSON: a body not in the
Content-Encoding it names, one that never all arrives, a connection that sends nothing,
`Expect: 100-continue` for a body over the limit, credentials that are not UTF-8, field
names packed as msgpack bin; and a model directory whose CURRENT or newest version is
bad. Each gets a 4xx or is refused with a log line, counted, and the server goes on."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from mariana.trainer import checkpoint
from tests.conftest import reseal, run_cli
from tests.integration.serving import Server

pytestmark = pytest.mark.slow
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def model(gen_files, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "lr"
    run_cli("-q", "train", "--data", gen_files["train"], "--model", "lr", "--out", d, check=True)
    return d


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with Server(tmp_path_factory.mktemp("serve"), model, workers=1,
                serve={"token": TOKEN, "keepalive_seconds": 1.0, "body_seconds": 1.0, "max_body_bytes": 100_000}) as s:
        s.wait_for("/readyz")
        yield s


def raw(server: Server, data: bytes, wait: float = 10.0) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection; (all it answered, whether the server closed it)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        sock.sendall(data)
        got, closed = b"", False
        try:
            while chunk := sock.recv(65536):
                got += chunk
            closed = True
        except TimeoutError:
            pass
        return got, closed


def post_head(length: int, extra: str = "") -> bytes:
    return (f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


BODY = b'{"instances": [{"I1": 3, "C1": "68fd1e64"}]}'


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_not_in_its_content_encoding_is_400_and_the_connection_closes(server, encoding):
    """Its stream cannot be read past it: the answer says so, and the connection is closed
    (a request pipelined behind it is not mistaken for part of it)."""
    before = server.metric("mariana_serve_requests_total")
    got, closed = raw(server, post_head(len(BODY), f"Content-Encoding: {encoding}\r\n") + BODY
                      + post_head(len(BODY)) + BODY)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"Connection: close" in head, got
    assert "the body cannot be read" in json.loads(body)["error"]
    assert closed and got.count(b"HTTP/1.1") == 1
    assert server.metric("mariana_serve_requests_total") >= before + 1  # counted, as a 400
    assert "Traceback" not in server.logs()
    good = zlib.compress(BODY) if encoding == "deflate" else __import__("gzip").compress(BODY)
    got, _ = raw(server, post_head(len(good), f"Content-Encoding: {encoding}\r\nConnection: close\r\n") + good)
    assert got.startswith(b"HTTP/1.1 200"), got  # the encodings themselves work


def test_a_body_that_never_all_arrives_is_408_after_body_seconds(server):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(post_head(len(BODY)) + BODY[:10])
        got = b""
        while b"}" not in got:
            got += sock.recv(65536)
    assert got.startswith(b"HTTP/1.1 408") and b"Connection: close" in got, got
    assert b"serve.body_seconds" in got and time.monotonic() - t0 < 8
    deadline = time.monotonic() + 5
    while server.metric("mariana_serve_in_flight") != 0:  # nothing left hanging (a scrape is not counted)
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/predict HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half a head"])
def test_a_connection_that_sends_no_whole_request_is_closed_after_keepalive_seconds(server, sent):
    t0 = time.monotonic()
    got, closed = raw(server, sent)
    assert closed and got == b"" and time.monotonic() - t0 < 8


def test_a_keep_alive_connection_idle_after_its_answer_is_closed_after_keepalive_seconds(server):
    t0 = time.monotonic()
    got, closed = raw(server, post_head(len(BODY)) + BODY)
    assert got.startswith(b"HTTP/1.1 200") and closed and time.monotonic() - t0 < 8, got


def test_a_client_that_leaves_mid_body_is_no_error_in_the_log(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post_head(len(BODY)) + BODY[:10])
        time.sleep(0.3)
    time.sleep(0.5)
    assert server.predict([{"I1": 1}])[0] == 200
    assert "Error handling request" not in server.logs() and "Traceback" not in server.logs()
    assert 'mariana_serve_requests_total{code="499",route="/v1/predict"}' in server.get("/metrics")[1]["text"]


def test_expect_continue_for_a_body_over_the_limit_is_answered_413_at_once(server):
    """The body is not asked for: 413 instead of 100 Continue. Within the limit: 100, then 200."""
    got, _ = raw(server, post_head(5_000_000, "Expect: 100-continue\r\n"), wait=3)
    assert got.startswith(b"HTTP/1.1 413") and b"100 Continue" not in got, got
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(post_head(len(BODY), "Expect: 100-continue\r\nConnection: close\r\n"))
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(BODY)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer


@pytest.mark.parametrize("auth, answer", [("", b"401"), (f"Authorization: Bearer {TOKEN}\r\n", b"400")],
                         ids=["no-token", "token"])
def test_expect_continue_on_retrain_asks_for_no_body(server, auth, answer):
    """It takes none: the answer comes at once, never 100 Continue (which came before the
    token was looked at)."""
    head = (f"POST /v1/retrain HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n"
            f"Expect: 100-continue\r\n{auth}\r\n").encode()
    got, _ = raw(server, head, wait=3)
    assert got.startswith(b"HTTP/1.1 " + answer) and b"100 Continue" not in got, got


@pytest.mark.parametrize("tail", [b"5\r\n" + BODY + b"\r\n0\r\n\r\n", b"zz\r\n{}\r\n0\r\n\r\n"],
                         ids=["chunk-size-lies", "chunk-size-not-hex"])
def test_a_broken_chunked_stream_after_the_head_is_400_at_once(server, tail):
    """Sent a moment after the head, the parser's error was queued as the next request and
    never reached the body being read: 60 s of nothing, then a false 408."""
    head = (b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.3)
        sock.sendall(tail)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 400") and b"the body cannot be read" in got, got  # not the 408 of body_seconds
    assert "Traceback" not in server.logs()


def test_requests_the_parser_refuses_are_counted_and_no_traceback_is_logged(server):
    """aiohttp answers these itself, before any route: each logged an 11-line ERROR traceback
    (any client could fill the log) and none was counted."""
    before = server.metric("mariana_serve_bad_http_total")
    for bad in (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                post_head(4, "Transfer-Encoding: chunked\r\n") + b"body"):
        got, closed = raw(server, bad, wait=3)
        assert got.startswith(b"HTTP/1.") and b" 400 " in got.split(b"\r\n")[0], got
    assert server.metric("mariana_serve_bad_http_total") == before + 2
    assert "Traceback" not in server.logs() and "Error handling request" not in server.logs()


def test_an_expect_other_than_100_continue_is_a_counted_json_417(server):
    timed = 'mariana_serve_request_seconds_count{route="/v1/predict"}'
    before = server.metric(timed)
    got, _ = raw(server, post_head(len(BODY), "Expect: bogus\r\nConnection: close\r\n"), wait=3)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 417") and b"application/json" in head, got
    assert b"X-Model-Version: v000001" in head, got  # every answer of /v1/predict names the version
    assert "Expect: bogus is not one this server meets" in json.loads(body)["error"]
    assert 'mariana_serve_requests_total{code="417",route="/v1/predict"} 1' in server.get("/metrics")[1]["text"]
    assert server.metric(timed) == before + 1  # timed as every answer is (it was in requests_total only)


def test_a_transfer_encoding_other_than_chunked_is_refused_naming_it(server):
    """aiohttp de-chunks `gzip, chunked` and drops the gzip: the answer said "not UTF-8 text"."""
    gzipped = __import__("gzip").compress(BODY)
    got, closed = raw(server, b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Transfer-Encoding: gzip, chunked\r\n\r\n" + b"%x\r\n" % len(gzipped) + gzipped
                      + b"\r\n0\r\n\r\n", wait=5)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), got
    assert "Transfer-Encoding 'gzip, chunked' is not one this server reads (chunked only" in json.loads(body)["error"]
    assert closed


def test_a_client_that_reads_none_of_its_pipelined_answers_is_cut_off(server):
    """80 pipelined requests of 10,000 instances (200 KB answers) from a client that reads
    nothing: aiohttp answers what the socket's buffers take and stops, but the connection
    stayed open for good, holding its requests (an exploratory run's six such clients were
    all still there after 105 s). Now a connection whose unsent bytes do not move for
    keepalive_seconds is aborted, and the server goes on answering the others."""
    body = json.dumps({"instances": [{}] * 10_000}).encode()
    before = server.metric("mariana_serve_predictions_total")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(5)
    try:
        with contextlib.suppress(TimeoutError):  # (it may stop reading requests too)
            sock.sendall((post_head(len(body)) + body) * 80)
        answered, deadline = None, time.monotonic() + 10
        while time.monotonic() < deadline:  # until the count stops moving
            time.sleep(0.5)
            now = server.metric("mariana_serve_predictions_total") - before
            if now == answered:
                break
            answered = now
        assert 0 < answered <= 40 * 10_000, answered  # what the kernel's buffers take (4 MB a side), not all 80
        deadline = time.monotonic() + 10
        while "closed a connection whose client read none of" not in server.logs() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "closed a connection whose client read none of" in server.logs(), server.logs()
    finally:
        sock.close()
    assert server.predict([{"I1": 3, "C1": "68fd1e64"}])[0] == 200


GZIPPED = __import__("gzip").compress(BODY, mtime=0)  # the same bytes in every pytest worker (its ids are)
_raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
RAW_DEFLATE = _raw.compress(BODY) + _raw.flush()


@pytest.mark.parametrize("encoding,body,status,says", [
    ("x-gzip", GZIPPED, 200, None),  # gzip's old name: was "not UTF-8 text (byte 1)"
    ("gzip, identity", GZIPPED, 415, "Content-Encoding 'gzip, identity' is not one"),
    ("bogus", BODY, 415, "Content-Encoding 'bogus' is not one this server reads"),  # was read as none: 200
    ("x-gzip", GZIPPED[:-12], 400, "its gzip stream ends before it is complete"),
    ("", b"\xef\xbb\xbf" + BODY, 200, None),  # a BOM: "Expecting value: line 1 column 1"
    ("br", BODY, 415, "Content-Encoding 'br' is not one this server reads"),  # aiohttp's text 400: "install Brotli"
    ("zstd", BODY, 415, "Content-Encoding 'zstd' is not one this server reads"),
    ("deflate", RAW_DEFLATE, 200, None),  # deflate without its zlib wrapper, as some clients send it
    ("deflate", zlib.compress(BODY)[:-6], 400, "its deflate stream ends before it is complete"),
], ids=["x-gzip", "stacked", "unknown", "x-gzip-cut", "bom", "br", "zstd", "raw-deflate", "deflate-cut"])
def test_content_encodings_it_does_not_read_are_refused_and_gzips_old_name_is_read(server, encoding, body, status,
                                                                                   says):
    extra = (f"Content-Encoding: {encoding}\r\n" if encoding else "") + "Connection: close\r\n"
    got, _ = raw(server, post_head(len(body), extra) + body)
    head, _, answer = got.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), got
    if says:
        assert says in json.loads(answer)["error"]
    else:
        assert json.loads(answer)["pctr"][0] == server.predict([{"I1": 3, "C1": "68fd1e64"}])[1]["pctr"][0]


def test_a_msgpack_count_larger_than_its_body_is_said_so():
    from mariana.serving.codec import MSGPACK, decode
    from mariana.serving.errors import ServeError

    with pytest.raises(ServeError, match="a count in it is larger than its bytes could hold"):
        decode(b"\xdd\xff\xff\xff\xff" + b"\x00" * 11, MSGPACK, 10)  # was "exceeds max_array_len(16)"


def test_a_413_before_the_body_closes_the_connection(server):
    """With Expect: 100-continue the body never comes: what the client sent next on the
    connection was read as that body (a GET behind it never answered)."""
    t0 = time.monotonic()
    got, closed = raw(server, post_head(5_000_000, "Expect: 100-continue\r\n") + b"GET /healthz HTTP/1.1\r\n"
                      b"Host: x\r\n\r\n", wait=8)
    assert got.startswith(b"HTTP/1.1 413") and b"Connection: close" in got.split(b"\r\n\r\n")[0], got
    assert closed and time.monotonic() - t0 < 5


@pytest.mark.parametrize("value,status", [(b"Bearer s3cr\xe9t", 401), (b"Bearer \xff\xfe", 401),
                                          (b"bearer s3cret", 403), (b"BEARER  s3cret ", 403)],
                         ids=["latin-1", "not text", "lower-case scheme", "spaces"])
def test_credentials_in_any_bytes_are_checked_never_a_500(server, value, status):
    """Bytes that are no UTF-8 are a wrong token (401); the scheme's name is case-insensitive,
    so the right token passes (and this server, with no [retrain] section, answers 403)."""
    got, _ = raw(server, b"POST /v1/retrain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n"
                         b"Authorization: " + value + b"\r\n\r\n")
    assert got.startswith(f"HTTP/1.1 {status}".encode()), got
    if status == 403:
        assert b"retrain is not configured" in got


def test_field_names_packed_as_msgpack_bin_are_field_names(server):
    row = {"I1": 3, "I2": 7, "C1": "68fd1e64", "C2": "80e26c9b"}
    status, as_text = server.post("/v1/predict", msgpack.packb({"instances": [row]}), fmt="msgpack")
    binary = msgpack.packb({"instances": [{k.encode(): v for k, v in row.items()}]}, use_bin_type=True)
    before = server.metric("mariana_serve_unknown_fields_total")
    status2, as_bin = server.post("/v1/predict", binary, fmt="msgpack")
    assert status == status2 == 200 and as_bin["pctr"] == as_text["pctr"]
    every = msgpack.packb({b"instances": [{k.encode(): v.encode() if isinstance(v, str) else v
                                           for k, v in row.items()}]}, use_bin_type=True)
    status3, all_bin = server.post("/v1/predict", every, fmt="msgpack")  # "instances" too: it had "no 'instances'"
    assert status3 == 200 and all_bin["pctr"] == as_text["pctr"], all_bin
    _, empty = server.predict([{}])
    assert as_bin["pctr"] != empty["pctr"]  # its fields were read, not ignored
    assert server.metric("mariana_serve_unknown_fields_total") == before
    bad = msgpack.packb({"instances": [{b"\xff": 1}]}, use_bin_type=True)
    status, answer = server.post("/v1/predict", bad, fmt="msgpack")
    assert status == 400 and "instances[0]: a field name is not UTF-8 text" in answer["error"]


def test_a_method_an_endpoint_does_not_take_is_counted_under_its_path(server):
    status, headers, _ = server.request("GET", "/v1/predict")
    assert status == 405 and headers.get("X-Model-Version") == "v000001", headers
    status, body = server.get("/metrics")
    assert 'mariana_serve_requests_total{code="405",route="/v1/predict"}' in body["text"]


# ---- bad versions -----------------------------------------------------------------------

def wait_for_metric(s: Server, name: str, want: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while s.metric(name) < want:
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.1)


def test_a_version_with_nan_weights_is_refused_and_the_old_one_serves(model, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "models"
    shutil.copytree(model, d)
    with Server(tmp_path / "s", d, serve={"watch_seconds": 0.2}) as s:
        s.wait_for("/readyz")
        shutil.copytree(d / "v000001", d / "v000002")
        weights = load_file(str(d / "v000002" / checkpoint.WEIGHTS))
        name = next(k for k, a in weights.items() if a.dtype.kind == "f" and a.size > 1)
        weights[name][:] = np.nan
        save_file(weights, str(d / "v000002" / checkpoint.WEIGHTS))
        reseal(d / "v000002")  # as a writer that sealed them would leave it: past the digests, to the values
        checkpoint.set_current(d, "v000002", reason="promoted")
        wait_for_metric(s, "mariana_serve_model_load_failures_total", 1)
        status, answer = s.predict([{"I1": 3}])
        assert status == 200 and answer["model_version"] == "v000001" and np.isfinite(answer["pctr"]).all()
        assert f"NaN or infinite values (in {name}" in s.logs() and "serving v000001 still" in s.logs()


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_worker_that_starts_after_its_version_was_damaged_serves_the_one_before(model, tmp_path, damage):
    """A worker (re)started after the version in service was damaged on disk answered 503,
    while the workers that had it in memory served it: 29 of 60 requests 503 with one of two
    workers restarted, all of them once both were. The version deleted by hand: the same,
    though the version before it was on disk."""
    d = tmp_path / "models"
    shutil.copytree(model, d)
    shutil.copytree(d / "v000001", d / "v000002")
    checkpoint.set_current(d, "v000002", reason="promoted")
    good = (d / "v000002" / checkpoint.WEIGHTS).read_bytes()
    if damage == "deleted":
        shutil.rmtree(d / "v000002")
    else:
        with open(d / "v000002" / checkpoint.WEIGHTS, "r+b") as f:
            f.truncate(100)
    with Server(tmp_path / "s", d, serve={"watch_seconds": 0.2}) as s:
        s.wait_for("/readyz")
        status, answer = s.predict([{"I1": 3}])
        assert status == 200 and answer["model_version"] == "v000001", answer
        assert "serving v000001, the version served before v000002, until CURRENT names a version that loads" \
            in s.logs()
        if damage == "deleted":
            return
        assert s.metric("mariana_serve_model_load_failures_total") == 1
        (d / ".mended").write_bytes(good)  # its weights put back (whole: a poll never sees half of them); the
        os.replace(d / ".mended", d / "v000002" / checkpoint.WEIGHTS)  # manifest untouched, it was never retried
        wait_for_metric(s, "mariana_serve_model_swaps_total", 1)
        assert s.predict([{"I1": 3}])[1]["model_version"] == "v000002"


def test_a_worker_that_starts_while_current_is_damaged_serves_the_version_last_moved_to(model, tmp_path):
    """A worker restarted while CURRENT held NUL bytes (what a power loss leaves) answered 503,
    while its siblings served the version from memory: it now serves the version
    promotions.jsonl says CURRENT was moved to last."""
    d = tmp_path / "models"
    shutil.copytree(model, d)
    (d / "CURRENT").write_bytes(b"\0" * 8)
    with Server(tmp_path / "s", d, serve={"watch_seconds": 0.2}) as s:
        s.wait_for("/readyz")
        status, answer = s.predict([{"I1": 3}])
        assert status == 200 and answer["model_version"] == "v000001", answer
        assert "serving v000001, the version CURRENT was last moved to (promotions.jsonl)" in s.logs()


def test_a_current_naming_no_version_is_said_once_and_counted(model, tmp_path):
    d = tmp_path / "models"
    shutil.copytree(model, d)
    with Server(tmp_path / "s", d, serve={"watch_seconds": 0.2}) as s:
        s.wait_for("/readyz")
        for n, bad in enumerate(("v999999", "../lr/v000001"), 1):
            (d / "CURRENT.tmp").write_text(bad + "\n")
            (d / "CURRENT.tmp").rename(d / "CURRENT")
            wait_for_metric(s, "mariana_serve_model_load_failures_total", n)
            time.sleep(1.0)  # five more polls: said once, not five times
            assert s.metric("mariana_serve_model_load_failures_total") == n
            assert s.logs().count(f"CURRENT names {bad!r}, which is not a version here") == 1
            assert s.predict([{"I1": 3}])[1]["model_version"] == "v000001"
        checkpoint.set_current(d, "v000001")  # mended: quiet again, still the same version
        time.sleep(0.6)
        assert s.metric("mariana_serve_model_load_failures_total") == 2
