"""The model server when the machine runs short: a model directory it cannot write, a
full TMPDIR, no file descriptors left, a stop asked for while it starts. Each answers
with a clear message (a 503 over HTTP, one log line) and the server goes on.

Real `mariana serve` processes (tests/integration/serving.py). A read-only or full
filesystem is a mount in a mount namespace of the server's own (`unshare -m`, as in
test_disk_limits.py): those tests skip where that is not allowed."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.debian import can_unshare_mounts
from tests.integration.rankkill import running
from tests.integration.serving import Server

pytestmark = pytest.mark.slow
TOKEN = "resources-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def namespaced(script: str) -> list[str]:
    """A Server prefix: run `script` (mounts) in a mount namespace of its own, then the server there."""
    if not can_unshare_mounts():
        pytest.skip("unshare -m is not allowed here (needs root or CAP_SYS_ADMIN): no read-only or full filesystem")
    return ["unshare", "-m", "sh", "-c", f'set -e; {script}; exec "$@"', "sh"]


def seen_by(server: Server, path: Path) -> Path:
    """`path` as the server's mount namespace has it (the test's own does not hold its mounts)."""
    return Path(f"/proc/{server.proc.pid}/root{path}")


def fill(directory: Path) -> Path:
    """Write zeros to a file in `directory` until its filesystem is full."""
    target = directory / "fill"
    with open(target, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError as e:
            assert e.errno == 28, e  # ENOSPC
    return target


def wait_for_log(server: Server, text: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.logs():
        assert time.monotonic() < deadline, f"{text!r} not in the log after {timeout:g}s:\n{server.logs()}"
        time.sleep(0.1)


# ---- POST /v1/retrain on a model directory it cannot write -------------------------------------

def retrain_server(tmp_path: Path, model_dir: Path, prefix: list[str]) -> Server:
    return Server(tmp_path / "s", model_dir, serve={"token": TOKEN}, prefix=prefix,
                  retrain={"data": str(tmp_path / "logs" / "day*.tsv")})


def test_retrain_over_http_on_a_read_only_model_dir_is_a_503_naming_it(tmp_path):
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    ro = namespaced(f"mount --bind {model_dir} {model_dir}; mount -o remount,bind,ro {model_dir}")
    with retrain_server(tmp_path, model_dir, ro) as s:
        status, answer = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 503, answer
        assert f"cannot start a retrain of {model_dir}: {model_dir}/.retrain.lock: read-only file system" \
               in answer["error"] and "make the directory writable" in answer["error"], answer
        assert s.get("/healthz")[0] == 200
    assert "internal error" not in s.logs() and "Traceback" not in s.logs(), s.logs()


def test_retrain_over_http_on_a_full_model_dir_is_a_503_and_leaves_no_temp_file(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    model_dir = small / "models"
    full = namespaced(f"mount -t tmpfs -o size=256k none {small}; mkdir {model_dir}")
    with retrain_server(tmp_path, model_dir, full) as s:
        fill(seen_by(s, small))
        status, answer = s.post("/v1/retrain", b"", headers=AUTH)
        assert status == 503, answer
        assert f"cannot start a retrain of {model_dir}: " in answer["error"], answer
        assert "no space left on device" in answer["error"], answer
        runs = seen_by(s, model_dir / ".retrain")  # on a full disk even its mkdir may fail: then it is not there
        assert not runs.exists() or not list(runs.iterdir()), list(runs.iterdir())  # no .tmp, .toml, status
        status, answer = s.post("/v1/retrain", b"", headers=AUTH)  # the lock was let go: the same answer, no 409
        assert status == 503 and "no space left on device" in answer["error"], answer
    assert "internal error" not in s.logs() and "Traceback" not in s.logs(), s.logs()


# ---- accept() out of file descriptors --------------------------------------------------------

ACCEPT_ERROR = "ERROR asyncio: socket.accept() out of system resource"


def hold_connections(port: int, n: int) -> list[socket.socket]:
    """n keep-alive clients that each sent a request: far more than the server has descriptors for."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        socks.append(s)
    return socks


@pytest.mark.timeout(60)
def test_accept_errors_out_of_descriptors_are_logged_once_per_10s_with_a_count(tmp_path):
    """With 64 descriptors and 200 clients, accept() fails; Python 3.11's asyncio tried it again
    `backlog` times a pass, each scheduling a retry and logging a traceback: 170,000 of them in
    15 s, growing. Now it is one failure a second, logged as one traceback, then one line each
    10 s saying how many were left out."""
    (tmp_path / "models").mkdir()
    s = Server(tmp_path / "s", tmp_path / "models", prefix=["sh", "-c", 'ulimit -n 64 && exec "$@"', "sh"])
    with s:
        socks = hold_connections(s.port, 200)
        try:
            deadline = time.monotonic() + 20
            while s.logs().count(ACCEPT_ERROR) < 2:  # the first, then one 10 s later
                assert time.monotonic() < deadline, s.logs()
                time.sleep(0.2)
        finally:
            for c in socks:
                c.close()
        deadline = time.monotonic() + 20
        while s.get("/healthz")[0] != 200:  # its descriptors back: it serves again
            assert time.monotonic() < deadline, s.logs()
            time.sleep(0.2)
    log = s.log.read_text()
    lines = [line for line in log.splitlines() if ACCEPT_ERROR in line]
    assert len(lines) == 2 and log.count("in _accept_connection") == 1, log[-4000:]  # one traceback
    assert "raise its open-file limit" in log and "(said at most once per 10s)" in log, log[-4000:]
    left_out = re.search(r": \[Errno 24\] Too many open files \((\d+) more in the last 1\ds, not logged\)", lines[1])
    assert left_out, lines
    # one failed accept a second (a retry each), not thousands: services/runtime/accept_loop.MendedLoop
    assert 5 <= int(left_out[1]) <= 15, lines
    assert "Exception in callback" not in log, log[-4000:]  # no retry left over to fail once it stopped
    assert s.log.stat().st_size < 20_000, s.log.stat().st_size


# ---- metrics snapshots on a full TMPDIR ------------------------------------------------------

def test_a_metrics_snapshot_that_cannot_be_written_is_said_once_and_counted(tmp_path):
    """The worker writes its metrics to <TMPDIR>/mariana-serve-*/metrics-0.json each second;
    on a full TMPDIR it says so once (not every second, not at DEBUG), counts the failures,
    leaves no temp file, and says once more when it can write again."""
    (tmp_path / "models").mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = Server(tmp_path / "s", tmp_path / "models",
               prefix=namespaced(f"mount -t tmpfs -o size=256k none {tmp}; export TMPDIR={tmp}"))
    with s:
        filled = fill(seen_by(s, tmp))
        wait_for_log(s, "cannot write its metrics snapshot")
        time.sleep(2.5)  # more snapshots fail meanwhile: still said once
        assert s.logs().count("cannot write its metrics snapshot") == 1, s.logs()
        assert "no space left on device" in s.logs() and "free space in" in s.logs(), s.logs()
        assert s.metric("mariana_serve_snapshot_failures_total") >= 2
        run_dir, = seen_by(s, tmp).glob("mariana-serve-*")
        assert not list(run_dir.glob("*.tmp")), list(run_dir.iterdir())
        filled.unlink()
        wait_for_log(s, "its metrics snapshot is written again")
        assert s.logs().count("its metrics snapshot is written again") == 1
    assert s.returncode == 0, s.logs()


# ---- a stop asked for while the workers start --------------------------------------------------

def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_sigterm_while_the_workers_start_stops_them_and_exits_0(tmp_path):
    (tmp_path / "models").mkdir()
    s = Server(tmp_path / "s", tmp_path / "models", workers=2)
    with open(s.log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mariana", "serve", "--config", str(s.config)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(workers := children(proc.pid)) < 2:  # its signal handlers are in place by then
            assert proc.poll() is None and time.monotonic() < deadline, s.logs()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # well before they listen: each imports torch first
        assert proc.wait(30) == 0, s.logs()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = s.logs()
    assert "asked to stop before the workers were ready" in log and "did not all start" not in log, log
    assert "listening on" not in log, log  # it was a stop during the start-up indeed
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "its workers outlived it"


def test_sighup_stops_the_server_and_its_workers(tmp_path):
    """SIGHUP (the terminal closed) killed the supervisor by its default action and left its
    workers serving with no supervisor: one killed then was never restarted, /readyz still
    counted it, and the run dir stayed behind."""
    (tmp_path / "models").mkdir()
    s = Server(tmp_path / "s", tmp_path / "models", workers=2)
    s.start()
    try:
        workers = children(s.proc.pid)
        assert len(workers) == 2
        s.proc.send_signal(signal.SIGHUP)
        assert s.proc.wait(30) == 0, s.logs()
    finally:
        s.stop()
    log = s.logs()  # (the supervisor may not have seen its workers ready yet: a stop during its start)
    assert "serve: SIGHUP: stopping the workers" in log or "before the workers were ready (SIGHUP)" in log, log
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "its workers outlived it"


def test_workers_stop_when_their_supervisor_is_killed(tmp_path):
    """SIGKILL to the supervisor (the OOM killer, `kill -9`) left its workers serving for ever
    with nobody to restart them, /readyz saying 2 of 2, the port taken from the next `mariana
    serve` ("Address already in use") and the run dir left in TMPDIR. Each worker now gets
    SIGTERM when its supervisor dies, stops as on any SIGTERM, and the last removes the run dir."""
    (tmp_path / "models").mkdir()
    (tmp_path / "tmp").mkdir()
    s = Server(tmp_path / "s", tmp_path / "models", workers=2, prefix=["env", f"TMPDIR={tmp_path / 'tmp'}"])
    s.start()
    try:
        workers = children(s.proc.pid)
        assert len(workers) == 2 and len(list((tmp_path / "tmp").iterdir())) == 1
        s.proc.kill()
        s.proc.wait(10)
        deadline = time.monotonic() + 30
        while [pid for pid in workers if running(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if running(pid)]
    finally:
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        s.stop()
    assert not left, s.logs()
    assert list((tmp_path / "tmp").iterdir()) == [], s.logs()
    assert s.logs().count("stopped: its supervisor is gone") == 2, s.logs()
    with socket.socket() as free:
        free.bind(("127.0.0.1", s.port))  # the next server can listen


def read_answer(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_request_whose_body_is_still_arriving_at_sigterm_is_answered(tmp_path):
    """aiohttp's shutdown marks every connection closing first, and a closing connection drops
    what it receives: a request mid-body at SIGTERM was never answered (20 of 20 in an
    exploratory run), and the stop took all of serve.drain_seconds."""
    body = b'{"instances": [{"I1": 3, "C1": "68fd1e64"}]}'
    head = (f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    (tmp_path / "models").mkdir()  # no model: each is answered 503, after its body is read
    s = Server(tmp_path / "s", tmp_path / "models", workers=2, serve={"drain_seconds": 20.0})
    s.start()
    socks = []
    try:
        for _ in range(4):
            socks.append(socket.create_connection(("127.0.0.1", s.port), timeout=15))
            socks[-1].sendall(head + body[:10])
        time.sleep(0.5)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        for sock in socks:
            sock.sendall(body[10:])
        answers = [read_answer(sock) for sock in socks]
        assert s.proc.wait(15) == 0, s.logs()
        stopped = time.monotonic() - t0
    finally:
        for sock in socks:
            sock.close()
        s.stop()
    for got in answers:
        assert got.startswith(b"HTTP/1.1 503") and b"no model is loaded yet" in got, got
        assert b"Connection: close" in got.split(b"\r\n\r\n")[0], got
    assert stopped < 10, s.logs()
