"""Bad messages sent straight at each service's sockets, over real ZeroMQ on
loopback: garbage frames, a wrong version, an unknown type, arrays whose bytes
do not match their shape, oversized messages, requests a service does not
take, and well-formed requests with wrong content. Each is answered with an
`Error` matched to its msg_id (or, on PUSH/PULL, counted), and the service
goes on serving.

The coordinator, the ps shard and preprocess are tested in a real cluster. The
worker and the loader bind nothing (they connect to the coordinator), so the
test plays their coordinator: a ROUTER of its own that answers `Hello` with
`Welcome` and the rest with whatever the case needs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import zmq

from mariana.services import protocol
from mariana.services.assemble import check_request
from mariana.services.launcher import free_port
from mariana.services.protocol import Message
from mariana.services.runtime.config import load_cluster_config, to_toml
from mariana.services.runtime.lifecycle import DRAIN_SECONDS
from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

MAX_BYTES = 8 << 20  # cluster.max_message_bytes here: above a 4 MiB chunk, small enough to exceed in a test
# AdaGrad moves every row a push touches (FTRL's L1 keeps small ones at 0), which the checks below see
JOB = {"hashing": {"bits": 16}, "train": {"batch_size": 1024, "epochs": 2}, "optim": {"linear": "adagrad"}}


# ---- frames -------------------------------------------------------------------------

def head(**fields) -> bytes:
    """A msgpack header frame with exactly these fields (no defaults filled in)."""
    return msgpack.packb(fields, use_bin_type=True)


def envelope_cases(request_type: str, fields: dict) -> list[tuple[str, list, int, str]]:
    """(case, frames, msg_id to expect in the reply, Error code) for what every ROUTER must refuse.
    `request_type` with `fields` is a request the service takes, so only the broken part is wrong."""
    ok = {"v": protocol.VERSION, "type": request_type, **fields}
    return [
        ("garbage frame", [b"\xc1\x00 this is not msgpack \xff"], 0, "header"),
        ("wrong version", [head(**{**ok, "v": 99, "msg_id": 101})], 101, "version"),
        ("unknown type", [head(**{**ok, "type": "Teleport", "msg_id": 102})], 102, "type"),
        ("missing field", [head(v=protocol.VERSION, type=request_type, msg_id=103)], 103, "field"),
        ("shape [10] int64, 3 bytes", [head(**ok, msg_id=104, arrays=[["ids", "<i8", [10]]]), b"abc"], 104,
         "array_size"),
        ("frames not listed", [head(**ok, msg_id=105), b"\0" * 8], 105, "frame_count"),
        ("too many frames", [head(**ok, msg_id=106)] + [b""] * protocol.MAX_FRAMES, 106, "too_many_frames"),
        ("oversized", [head(**ok, msg_id=107, arrays=[["data", "|u1", [MAX_BYTES]]]), b"\0" * MAX_BYTES], 107,
         "too_large"),
    ]


# ---- sockets ------------------------------------------------------------------------

@contextmanager
def zmq_context():
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, timeout: float = 10.0) -> Message:
    assert sock.poll(timeout * 1000), f"no reply in {timeout}s"
    return protocol.decode(sock.recv_multipart())


def ask(sock: zmq.Socket, frames: list, timeout: float = 10.0) -> Message:
    sock.send_multipart(frames)
    return receive(sock, timeout)


def call(sock: zmq.Socket, type_: str, msg_id: int, arrays: dict | None = None, **fields) -> Message:
    reply = ask(sock, protocol.encode(type_, msg_id, arrays, **fields))
    assert reply.msg_id == msg_id, (type_, reply)
    return reply


def applied_steps(stats: Message) -> set[str]:
    """A shard's applied step ids: one newline-separated uint8 frame."""
    return set(protocol.array_names(stats.arrays["applied"]))


def assert_error(reply: Message, msg_id: int, code: str, case: str = "") -> None:
    assert (reply.type, reply.msg_id, reply.get("code")) == ("Error", msg_id, code), (case, reply)
    assert reply["error"], (case, reply)


def refuse_all(sock: zmq.Socket, cases: list) -> None:
    for case, frames, msg_id, code in cases:
        assert_error(ask(sock, frames), msg_id, code, case)


# ---- the cluster and its counters -------------------------------------------------------

@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad-messages") / "train.tsv"
    generate_criteo(path, 20_000, seed=21)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster") / "c", workers=1, ps=1, preprocess=1,
                 **{"cluster.max_message_bytes": MAX_BYTES}) as c:
        yield c


def http_status(c: Cluster) -> dict:
    with urllib.request.urlopen(c.info["http"] + "/v1/status", timeout=10) as r:
        assert r.status == 200
        return json.loads(r.read())


def service_counter(c: Cluster, name: str, key: str) -> int:
    """A service's counter as its last heartbeat reported it (the coordinator's own: live)."""
    st = http_status(c)
    if name.startswith("coordinator"):
        return int(st["counters"].get(key, 0))
    return int(st["services"][name]["status"].get(key, 0))


def wait_counter(c: Cluster, name: str, key: str, want: int, timeout: float = 10.0) -> None:
    """Heartbeats come every heartbeat_seconds / 3: poll until the counter gets there, then it must be exact."""
    deadline = time.monotonic() + timeout
    while (got := service_counter(c, name, key)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got == want, f"{name} {key} = {got}, expected {want}\n{c.logs()}"


# ---- coordinator ------------------------------------------------------------------------

def test_coordinator_answers_bad_messages_and_keeps_serving(cluster):
    before = service_counter(cluster, "coordinator-0", "bad_messages")
    cases = envelope_cases("GetJob", {"job": "nope"})
    with zmq_context() as ctx:
        sock = dealer(ctx, cluster.cfg.coordinator.endpoint)
        refuse_all(sock, cases)
        reply = call(sock, "PullRows", 201, {"ids": np.arange(3)}, job="nope", dense=False)
        assert_error(reply, 201, "unexpected")  # a ps request: not the coordinator's
        reply = call(sock, "Cached", 202, job="nope", chunk="f0o0", batches=[[0, 5]], stats={})
        assert_error(reply, 202, "MarianaError")  # well-formed but about no job: answered, not a bad message
        assert "no job 'nope'" in reply["error"]
        # still serving: a request of every kind it takes answers as it should
        reply = call(sock, "GetJob", 203, job="nope")
        assert_error(reply, 203, "MarianaError")
        reply = call(sock, "Lease", 204, worker="nobody")
        assert reply.type == "Idle"
        # batched leases and reports: each list and record is checked, and named in the error
        report = {"job": "nope", "step": "e1/f0o0:0", "rows": 4, "loss_sum": 1.0, "stats": {}}
        late = service_counter(cluster, "coordinator-0", "late_reports")
        refused = [
            (call(sock, "Lease", 205, worker="w", want=0), "Lease.want must be an integer in [1, 64]"),
            (call(sock, "Lease", 206, worker="w", want=True), "Lease.want must be an integer"),
            (call(sock, "Lease", 207, worker="w", done="x"), "Lease.done must be a list"),
            (call(sock, "Done", 208, worker="w", reports=[report, {"job": "nope"}]),
             "Done.reports[1].step is missing or not a string"),
            (call(sock, "Done", 209, worker="w", reports=[], released="e1/f0o0:0"), "Done.released must be a list"),
        ]
        for reply, words in refused:
            assert reply.type == "Error" and reply["code"] == "field" and words in reply["error"], reply.fields
        assert call(sock, "Done", 210, worker="w", reports=[report], released=["e1/f0o0:0"]).type == "Ok"
        assert call(sock, "Lease", 211, worker="w", want=64, done=[report]).type == "Idle"
        sock.close()
    assert http_status(cluster)["services"]["coordinator-0"]["alive"]
    # reports of no running job are counted and change nothing (the one before the bad record too)
    wait_counter(cluster, "coordinator-0", "late_reports", late + 3)
    assert service_counter(cluster, "coordinator-0", "bad_messages") == before + len(cases) + 1 + len(refused)
    log = (cluster.root / "logs" / "coordinator-0.log").read_text()
    assert "bad message from peer" in log and "frame 0 is not msgpack" in log


# ---- ps shard ---------------------------------------------------------------------------

@pytest.fixture
def ps_job(cluster, train_file, tmp_path):
    """A job started on shard 0 with the spec the coordinator would send; ended afterwards."""
    spec = check_request({"data": [str(train_file)], "out": str(tmp_path / "m"), "config": JOB})[1].to_dict()
    job = f"probe-{os.getpid()}-{time.monotonic_ns()}"
    with zmq_context() as ctx:
        sock = dealer(ctx, cluster.cfg.ps.endpoints[0])
        assert call(sock, "StartJob", 1, job=job, spec=spec).type == "Ok"
        yield job, sock
        assert call(sock, "EndJob", 2, job=job).type == "Ok"
        sock.close()


def grads(ids: np.ndarray, rows: int | None = None, dim: int = 1, dtype=np.float32) -> dict:
    return {"ids": ids, "g.linear": np.full((len(ids) if rows is None else rows, dim), 0.01, dtype),
            "dense": np.zeros(1, np.float32)}


def test_ps_answers_bad_messages_and_keeps_serving(cluster, ps_job):
    job, sock = ps_job
    before = service_counter(cluster, "ps-0", "bad_messages")
    cases = envelope_cases("PullRows", {"job": job, "dense": False})
    refuse_all(sock, cases)
    assert_error(call(sock, "Lease", 301, worker="w"), 301, "unexpected")  # the coordinator's, not a shard's
    assert_error(call(sock, "StartJob", 302, job="x", spec={}), 302, "spec")
    assert_error(call(sock, "PullRows", 303, {"ids": np.arange(3, dtype=np.int32)}, job=job, dense=False),
                 303, "arrays")
    assert_error(call(sock, "PullRows", 304, {"ids": np.array([-1, 1 << 16])}, job=job, dense=False),
                 304, "bad_data")
    assert_error(call(sock, "PullRows", 306, {"ids": np.array([1])}, job=job, dense=False, step=7), 306, "field")
    reply = call(sock, "PullRows", 305, {"ids": np.array([1, 5, 9])}, job=job, dense=True)
    assert reply.type == "Rows" and reply.arrays["linear"].shape == (3, 1) and reply.arrays["dense"].shape == (1,)
    wait_counter(cluster, "ps-0", "bad_messages", before + len(cases) + 5)


def test_ps_refuses_bad_pushes_without_applying_them(cluster, ps_job):
    job, sock = ps_job
    before = service_counter(cluster, "ps-0", "bad_messages")
    ids = np.array([1, 5, 9])
    bad = [
        ("grads of the wrong shape", grads(ids, rows=2), "e1/f0o0:0", "bad_data"),
        ("grads one column too wide", grads(ids, dim=2), "e1/f0o0:0", "bad_data"),
        ("float64 grads", grads(ids, dtype=np.float64), "e1/f0o0:0", "arrays"),
        ("ids outside the table", grads(np.array([1, 5, 1 << 16])), "e1/f0o0:0", "bad_data"),
        ("no such table", {"ids": ids, "g.nope": np.zeros((3, 1), np.float32)}, "e1/f0o0:0", "bad_data"),
        ("dense grads of the wrong size", {**grads(ids), "dense": np.zeros(7, np.float32)}, "e1/f0o0:0", "bad_data"),
        ("not a step id", grads(ids), "step-one", "bad_data"),
        ("next ids outside the table", {**grads(ids), "next_ids": np.array([2, 1 << 16])}, "e1/f0o0:0", "bad_data"),
        ("int32 next ids", {**grads(ids), "next_ids": np.array([2], np.int32)}, "e1/f0o0:0", "arrays"),
    ]
    for i, (case, arrays, step, code) in enumerate(bad):
        assert_error(call(sock, "PushGrads", 400 + i, arrays, job=job, step=step, rows=3), 400 + i, code, case)
    reply = call(sock, "PushGrads", 419, {**grads(ids), "next_ids": ids}, job=job, step="e1/f0o0:0", rows=3,
                 next_dense="yes")
    assert_error(reply, 419, "field", "next_dense not a boolean")
    bad.append(reply)
    reply = call(sock, "PushGrads", 418, {**grads(ids), "next_ids": ids}, job=job, step="e1/f0o0:0", rows=3,
                 next_step=["e1/f0o0:1"])
    assert_error(reply, 418, "field", "next_step not a string")
    bad.append(reply)
    reply = call(sock, "PushGrads", 420, grads(ids), job="no-such-job", step="e1/f0o0:0", rows=3)
    assert_error(reply, 420, "UnknownJob")  # answered; the worker retries it while a shard restarts
    stats = call(sock, "ShardStats", 421, job=job)
    assert applied_steps(stats) == set() and stats["rows"] == {}, "a refused push changed the shard"
    # the same step, now well-formed, is applied once: the refusals did not mark it done
    before_rows = call(sock, "PullRows", 425, {"ids": ids}, job=job, dense=True)
    ack = call(sock, "PushGrads", 422, {**grads(ids), "next_ids": ids[::-1]}, job=job, step="e1/f0o0:0", rows=3,
               next_dense=True)
    assert ack["applied"] is True
    # the rows of next_ids come back with the Ack, read after this update (as a PullRows right after it)
    after = call(sock, "PullRows", 426, {"ids": ids}, job=job, dense=True)
    assert np.array_equal(ack.arrays["linear"], after.arrays["linear"][::-1])
    assert np.array_equal(ack.arrays["dense"], after.arrays["dense"])
    assert not np.array_equal(after.arrays["linear"], before_rows.arrays["linear"])
    assert call(sock, "PushGrads", 423, grads(ids), job=job, step="e1/f0o0:0", rows=3)["applied"] is False
    stats = call(sock, "ShardStats", 424, job=job)
    assert applied_steps(stats) == {"e1/f0o0:0"} and stats["rows"] == {"1": 3}
    wait_counter(cluster, "ps-0", "bad_messages", before + len(bad))


def test_ps_admits_nothing_new_for_a_step_it_applied_before(cluster, train_file, tmp_path):
    """hashing.min_count = 3 over the wire: a pull names its step (a pull riding on a push,
    its next_step); a step issued again after its push was applied must not give an id seen
    twice a row on the strength of occurrences that push counted already."""
    config = {**JOB, "hashing": {"bits": 16, "min_count": 3}}
    spec = check_request({"data": [str(train_file)], "out": str(tmp_path / "m"), "config": config})[1].to_dict()
    job, x, two = f"admit-{os.getpid()}", np.array([6]), np.array([2], np.uint32)
    with zmq_context() as ctx:
        sock = dealer(ctx, cluster.cfg.ps.endpoints[0])
        assert call(sock, "StartJob", 1, job=job, spec=spec).type == "Ok"
        try:
            pull = {"ids": x, "occ": two}

            def admitted(reply: Message) -> list[int]:
                return reply.arrays["admitted"].tolist()
            assert admitted(call(sock, "PullRows", 2, pull, job=job, dense=False, step="e1/c:0")) == [0]
            push = {"ids": np.zeros(0, np.int64), "dense": np.zeros(1, np.float32), "seen": x, "seen_n": two}
            assert call(sock, "PushGrads", 3, push, job=job, step="e1/c:0", rows=2)["applied"] is True
            # the same step again, its pull on its own and riding on another step's push
            assert admitted(call(sock, "PullRows", 4, pull, job=job, dense=False, step="e1/c:0")) == [0]
            other = {**push, "seen": x[:0], "seen_n": two[:0], "next_ids": x, "next_occ": two}
            ack = call(sock, "PushGrads", 5, other, job=job, step="e1/c:1", rows=1, next_step="e1/c:0")
            assert ack["applied"] is True and admitted(ack) == [0]
            assert call(sock, "PushGrads", 6, push, job=job, step="e1/c:0", rows=2)["applied"] is False
            # a new step with one more occurrence admits x (2 + 1 = 3)
            reply = call(sock, "PullRows", 7, {"ids": x, "occ": np.ones(1, np.uint32)}, job=job, dense=False,
                         step="e1/c:2")
            assert admitted(reply) == [1]
        finally:
            assert call(sock, "EndJob", 8, job=job).type == "Ok"
            sock.close()


# ---- preprocess -------------------------------------------------------------------------

def test_preprocess_counts_what_it_cannot_answer_and_still_trains(cluster, train_file, tmp_path):
    before = service_counter(cluster, "preprocess-0", "bad_messages")
    unknown_before = service_counter(cluster, "preprocess-0", "unknown_jobs")
    chunk = {"job": "nope", "chunk": "f0o0", "path": str(train_file), "first_line": 1, "lines": 1,
             "first_of_file": True}
    line = b"0" + b"\t" * 39 + b"\n"
    bad = [
        [b"\xc1\x00 this is not msgpack \xff"],
        protocol.encode("Chunk", 0, {"data": np.zeros(4, np.float32)}, **chunk),  # data must be uint8
        [head(v=99, type="Chunk", msg_id=0, arrays=[["data", "|u1", [len(line)]]], **chunk), line],
        protocol.encode("Ok", 0),  # not a Chunk
        [head(v=protocol.VERSION, type="Chunk", msg_id=0, arrays=[["data", "|u1", [MAX_BYTES]]], **chunk),
         b"\0" * MAX_BYTES],
    ]
    with zmq_context() as ctx:
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(cluster.cfg.preprocess.endpoints[0])
        for frames in bad:
            push.send_multipart(frames)
        push.send_multipart(protocol.encode("Chunk", 0, {"data": np.frombuffer(line, np.uint8)}, **chunk))
        # PUSH/PULL has no one to answer: counted (and logged); wait for it before closing the socket,
        # which would drop what is still queued in it
        wait_counter(cluster, "preprocess-0", "bad_messages", before + len(bad))
        wait_counter(cluster, "preprocess-0", "unknown_jobs", unknown_before + 1)  # a Chunk of no job: dropped
        push.close()
    log = (cluster.root / "logs" / "preprocess-0.log").read_text()
    assert "bad message dropped" in log and "too_large" in log and "got Ok" in log

    job = cluster.submit([train_file], tmp_path / "m", config=JOB)
    summary = cluster.wait(job, 90)
    assert summary["state"] == "done", f"{summary}\n{cluster.logs()}"
    record = summary["record"]
    assert record["rows_in_data"] == 20_000
    assert record["rows_applied"] == record["rows_in_data"] * JOB["train"]["epochs"], record
    assert record["rows_lost"] == 0, record


def test_a_finished_job_is_not_read_again_on_a_stray_miss(cluster, train_file, tmp_path):
    """A `Miss` about a job that is over (a late worker, or anyone) must not send its loader back to
    the source: the batches it would cache again under the job's keys outlive the job's cleanup."""
    job = cluster.submit([train_file], tmp_path / "m", config={**JOB, "train": {"epochs": 1}})
    assert cluster.wait(job, 90)["state"] == "done"
    with redis.Redis.from_url(cluster.cfg.redis.url) as r, zmq_context() as ctx:
        assert r.keys(f"mariana:{job}:*") == []  # the job's cleanup dropped them
        sock = dealer(ctx, cluster.cfg.coordinator.endpoint)
        reply = call(sock, "Miss", 501, job=job, step="e1/f0o0:0", key=f"mariana:{job}:b:f0o0:0")
        sock.close()
        assert reply.type in ("Ok", "Error"), reply
        time.sleep(2.0)  # a resend takes well under a second: loader -> preprocess -> redis
        leaked = r.keys(f"mariana:{job}:*")
    assert leaked == [], f"{len(leaked)} keys cached again for job {job} after it ended: {sorted(leaked)[:3]}"


def test_batches_cached_after_their_job_ended_are_dropped(cluster, train_file, tmp_path):
    """A preprocess still at work when its job was cancelled in epoch 1 cached chunks after the
    job's cleanup had run: their batches stayed in Redis for cache.ttl_seconds (a week) and
    filled a bounded Redis for the jobs after (an exploratory run: 216 keys left by one cancel).
    A Cached about an ended job now drops what it announces; the loader's offset key expires."""
    job = cluster.submit([train_file], tmp_path / "m", config={**JOB, "train": {"epochs": 1}})
    assert cluster.wait(job, 90)["state"] == "done"
    with redis.Redis.from_url(cluster.cfg.redis.url) as r, zmq_context() as ctx:
        assert r.keys(f"mariana:{job}:*") == []
        late = [f"mariana:{job}:b:f0o999:{k}" for k in range(3)] + [f"mariana:{job}:bytes", f"mariana:{job}:loader"]
        for key in late:  # what the late preprocess and loader wrote
            r.set(key, b"x", ex=604800)
        sock = dealer(ctx, cluster.cfg.coordinator.endpoint)
        reply = call(sock, "Cached", 502, job=job, chunk="f0o999", batches=[[0, 10], [1, 10], [2, 5]],
                     stats={"rows_ok": 25})
        sock.close()
        left = r.keys(f"mariana:{job}:*")
    assert_error(reply, 502, reply.get("code", ""), "a report about an ended job is refused")
    assert left == [], sorted(left)


# ---- worker and loader: the test is their coordinator ---------------------------------------

class FakeCoordinator:
    """A ROUTER where a service expects the coordinator: it answers `Hello` with `Welcome` and
    keeps the heartbeats' `status`; `expect` hands the test every other message, in order."""

    def __init__(self, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer: bytes | None = None
        self.statuses: list[dict] = []
        self.queue: list[Message] = []

    def _pump(self, timeout: float) -> None:
        if not self.sock.poll(timeout * 1000):
            return
        peer, *frames = self.sock.recv_multipart()
        msg = protocol.decode(frames)  # the services under test send good messages
        self.peer = peer
        if msg.type == "Hello":
            self.statuses.append(msg.get("status") or {})
            self.send(protocol.encode("Welcome", msg.msg_id))
        else:
            self.queue.append(msg)

    def next(self, timeout: float = 30.0) -> Message:
        deadline = time.monotonic() + timeout
        while not self.queue and time.monotonic() < deadline:
            self._pump(deadline - time.monotonic())
        assert self.queue, f"nothing but heartbeats from the service in {timeout}s"
        return self.queue.pop(0)

    def expect(self, type_: str, timeout: float = 30.0) -> Message:
        msg = self.next(timeout)
        assert msg.type == type_, msg
        return msg

    def wait_status(self, key: str, want: int, timeout: float = 10.0, less: str = "") -> None:
        """Until a heartbeat reports `key` (minus counter `less`) == want (more would be a miscount)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.statuses[-1].get(key, 0) - self.statuses[-1].get(less, 0) if self.statuses else None
            if got == want:
                return
            assert got is None or got < want, f"{key} = {got}, expected {want}: {self.statuses[-1]}"
            self._pump(0.1)
        raise AssertionError(f"no heartbeat with {key} = {want} in {timeout}s: {self.statuses[-1:]}")

    def send(self, frames: list) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def reply(self, to: Message, type_: str, **fields) -> None:
        self.send(protocol.encode(type_, to.msg_id, **fields))



def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def service_config(path: Path, coordinator: str, redis_url: str, preprocess: str | None = None,
                   **overrides) -> Path:
    """A cluster config whose coordinator is the test's ROUTER (nothing listens on the other endpoints)."""
    cfg = load_cluster_config(env={}, overrides={
        "cluster.dir": str(path.parent), "cluster.base_port": 0, "coordinator.endpoint": coordinator,
        "coordinator.http_port": free_port(), "coordinator.heartbeat_seconds": 0.6, "redis.url": redis_url,
        "redis.retry_seconds": 5.0, "ps.endpoints": [free_endpoint()],
        "preprocess.endpoints": [preprocess or free_endpoint()], **overrides,
    })
    path.write_text(to_toml(cfg))
    return path


@contextmanager
def service(role: str, config: Path, log: Path, index: int = 0):
    """`mariana run ROLE --config FILE` as its own process; killed if the test leaves it running."""
    cmd = [sys.executable, "-m", "mariana.services.cli", "run", role, "--config", str(config), "--index", str(index)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def sigterm(proc: subprocess.Popen, log: Path) -> int:
    assert proc.poll() is None, f"exited early with {proc.returncode}:\n{log.read_text()[-3000:]}"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(DRAIN_SECONDS + 10)
    assert time.monotonic() - t0 < DRAIN_SECONDS, log.read_text()[-3000:]
    return code


def handed_back(coord: FakeCoordinator, step: str) -> Message:
    """A worker given a step of a job it has no model for sends a GetJob and a Done handing
    the step back, in either order: the Done checked and answered, the GetJob returned."""
    first, second = coord.next(), coord.next()
    get, done = (first, second) if first.type == "GetJob" else (second, first)
    assert (get.type, done.type) == ("GetJob", "Done"), (first, second)
    assert done["released"] == [step] and done["reports"] == [], done
    coord.reply(done, "Ok")
    return get


def lr_spec(tmp_path: Path) -> dict:
    """The spec of an LR job, as a coordinator's GetJob answers it."""
    data = tmp_path / "spec.tsv"
    generate_criteo(data, 10, seed=3)
    return check_request({"data": [str(data)], "out": str(tmp_path / "m"), "config": JOB})[1].to_dict()


def test_worker_survives_bad_replies_from_its_coordinator(redis_server, tmp_path):
    log = tmp_path / "worker.log"
    with zmq_context() as ctx, redis.Redis.from_url(redis_server.url) as r:
        coord = FakeCoordinator(ctx)
        config = service_config(tmp_path / "cluster.toml", coord.endpoint, redis_server.url)
        with service("worker", config, log) as proc:
            lease = coord.expect("Lease", timeout=60)  # after Hello / Welcome
            coord.send([b"\xc1\x00 garbage"])                                    # bad 1
            coord.send([head(v=99, type="Work", msg_id=lease.msg_id)])            # bad 2
            coord.send([head(v=1, type="Work", msg_id=lease.msg_id, job="j")])    # bad 3: no step, key, ...
            coord.reply(lease, "Wait")                                            # the real answer
            lease = coord.expect("Lease")
            coord.reply(lease, "Error", code="test", error="refused on purpose")  # answered, not bad
            # a job the coordinator will not describe: its steps handed back at once, and the
            # worker goes on leasing (it must not wait for room that never comes)
            lease = coord.expect("Lease")
            coord.reply(lease, "Work", job="other", epoch=1, step="e1/f0o0:9", key="mariana:other:b:f0o0:9", rows=2)
            get = handed_back(coord, "e1/f0o0:9")
            coord.reply(get, "Error", code="MarianaError", error="no job 'other'")
            lease = coord.expect("Lease")
            # a job it describes: the steps leased before its model is built go back too (a first DNN
            # job imports torch, which may outlast a lease); then the batches are read
            key = "mariana:fake:b:f0o0:0"
            r.set(key, b"\x00\x00\x00\x05garbage")  # a header length, then no msgpack
            coord.reply(lease, "Work", job="fake", epoch=1, step="e1/f0o0:0", key=key, rows=10)
            get = handed_back(coord, "e1/f0o0:0")
            coord.reply(get, "JobSpec", job="fake", spec=lr_spec(tmp_path))
            lease = coord.expect("Lease")
            coord.reply(lease, "Work", job="fake", epoch=1, step="e1/f0o0:0", key=key, rows=10)  # bad 4
            miss = coord.expect("Miss")
            assert (miss["job"], miss["step"], miss["key"]) == ("fake", "e1/f0o0:0", key)
            coord.reply(miss, "Ok")
            lease = coord.expect("Lease")
            coord.reply(lease, "Work", job="fake", epoch=1, step="e1/f0o0:1", key=key + "-absent", rows=10)
            miss = coord.expect("Miss")
            assert miss["key"] == key + "-absent"  # a plain miss: not a bad message
            coord.reply(miss, "Ok")
            lease = coord.expect("Lease")
            coord.reply(lease, "Wait")
            coord.send(protocol.encode("ReadSource", 0, job="j", files=[], block_bytes=1))  # a worker takes no commands
            coord.wait_status("bad_messages", 4)
            coord.wait_status("cache_misses", 1)
            # the command: well-formed, unasked for, dropped. A heartbeat this thread answered after the
            # service's 2 s (it pumps only while it waits: a loaded CI host) is a late reply too
            coord.wait_status("late_replies", 1, less="rpc_timeouts")
            coord.expect("Lease")  # still asking for work
            assert sigterm(proc, log) == 0
        coord.sock.close()
    text = log.read_text()
    assert "is corrupt" in text and "stopped after" in text, text[-3000:]
    assert "Traceback" not in text, text


def test_loader_survives_bad_commands(redis_server, tmp_path):
    log = tmp_path / "loader.log"
    data = tmp_path / "small.tsv"
    generate_criteo(data, 300, seed=5)
    with zmq_context() as ctx:
        pull = ctx.socket(zmq.PULL)  # where preprocess would be
        pull.linger = 0
        pull_endpoint = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
        coord = FakeCoordinator(ctx)
        config = service_config(tmp_path / "cluster.toml", coord.endpoint, redis_server.url, pull_endpoint)
        with service("loader", config, log) as proc:
            coord.wait_status("bad_messages", 0, timeout=60)  # registered
            coord.send([b"\xc1\x00 garbage"])
            coord.send([head(v=99, type="ReadSource", msg_id=0, job="j", files=[str(data)], block_bytes=4096)])
            coord.send([head(v=1, type="ReadSource", msg_id=0, job="j", files=str(data), block_bytes=4096)])
            coord.send(protocol.encode("Lease", 0, worker="w"))  # a command a loader does not take
            coord.send(protocol.encode("Error", 0, code="x", error="an error as a command"))
            coord.send(protocol.encode("ReadSource", 0, job="j", files=[str(data)], block_bytes=4096, until=[0]))
            coord.wait_status("bad_messages", 6)
            # commands it takes but cannot carry out are reported, not fatal
            coord.send(protocol.encode("ReadSource", 0, job="j1", files=[str(tmp_path / "missing.tsv")],
                                       block_bytes=4096))
            done = coord.expect("SourceDone")
            assert done["job"] == "j1" and "missing.tsv" in done["error"], done
            coord.reply(done, "Ok")
            coord.send(protocol.encode("Resend", 0, job="j1", chunk="f7o0", file=7, offset=0, length=10,
                                       first_line=1, lines=1))
            done = coord.expect("SourceDone")
            assert done["chunks"] == -1 and "f7o0" in done["error"], done
            coord.reply(done, "Ok")
            # and it still streams a source
            coord.send(protocol.encode("ReadSource", 0, job="j2", files=[str(data)], block_bytes=4096))
            sent = []
            while True:
                msg = coord.next()
                coord.reply(msg, "Ok")
                if msg.type == "SourceDone":
                    break
                assert msg.type == "ChunkSent", msg
                sent.append(msg)
            assert msg["error"] == "" and msg["chunks"] == len(sent) > 1, msg
            chunks = [protocol.decode(pull.recv_multipart()) for _ in sent]
            assert sum(c["lines"] for c in chunks) == 300
            assert b"".join(bytes(c.arrays["data"]) for c in chunks) == data.read_bytes()
            # a job holding a tail out: nothing past `until` (file 0, 123 lines), the last chunk cut
            coord.send(protocol.encode("ReadSource", 0, job="j3", files=[str(data)], block_bytes=4096,
                                       until=[0, 123]))
            sent = []
            while (msg := coord.next()).type == "ChunkSent":
                coord.reply(msg, "Ok")
                sent.append(msg)
            coord.reply(msg, "Ok")
            chunks = [protocol.decode(pull.recv_multipart()) for _ in sent]
            assert msg["error"] == "" and sum(c["lines"] for c in chunks) == sum(c["lines"] for c in sent) == 123
            first_lines = b"".join(data.read_bytes().splitlines(keepends=True)[:123])
            assert b"".join(bytes(c.arrays["data"]) for c in chunks) == first_lines
            assert sigterm(proc, log) == 0
        coord.sock.close()
        pull.close()
    text = log.read_text()
    assert "stopped after" in text and "Traceback" not in text, text[-3000:]



def test_ps_shard_of_two_refuses_ids_of_the_other_shard(redis_server, train_file, tmp_path):
    """Shard 1 of 2 owns the odd ids: even ones are refused, and what it applied is checkpointed on SIGTERM."""
    log = tmp_path / "ps-1.log"
    spec = check_request({"data": [str(train_file)], "out": str(tmp_path / "m"), "config": JOB})[1].to_dict()
    with zmq_context() as ctx:
        coord = FakeCoordinator(ctx)
        endpoints = [free_endpoint(), free_endpoint()]
        config = service_config(tmp_path / "cluster.toml", coord.endpoint, redis_server.url,
                                **{"ps.count": 2, "ps.endpoints": endpoints, "ps.checkpoint_seconds": 0})
        with service("ps", config, log, index=1) as proc:
            coord.wait_status("bad_messages", 0, timeout=60)  # registered: it serves
            sock = dealer(ctx, endpoints[1])
            assert call(sock, "StartJob", 1, job="j", spec=spec).type == "Ok"
            odd, mixed = np.array([1, 3, 5]), np.array([1, 4])
            assert call(sock, "PullRows", 2, {"ids": odd}, job="j", dense=False).arrays["linear"].shape == (3, 1)
            reply = call(sock, "PullRows", 3, {"ids": mixed}, job="j", dense=False)
            assert_error(reply, 3, "bad_data")
            assert "another shard" in reply["error"]
            reply = call(sock, "PushGrads", 4, {"ids": mixed, "g.linear": np.zeros((2, 1), np.float32)}, job="j",
                         step="e1/f0o0:0", rows=2)
            assert_error(reply, 4, "bad_data")
            reply = call(sock, "PushGrads", 5, {"ids": odd, "g.linear": np.zeros((3, 1), np.float32)}, job="j",
                         step="e1/f0o0:0", rows=3)
            assert reply["applied"] is True
            coord.wait_status("bad_messages", 2)
            sock.close()
            assert sigterm(proc, log) == 0
        coord.sock.close()
    manifest = json.loads((tmp_path / "ps" / "shard-1" / "j" / "v000001" / "manifest.json").read_text())
    assert (manifest["shard"], manifest["num_shards"], manifest["applied"]) == (1, 2, {"e1/f0o0:0": 3})
