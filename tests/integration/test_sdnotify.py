"""Real service processes under a stand-in for systemd: a unix datagram socket
bound here is their $NOTIFY_SOCKET, with a short $WATCHDOG_USEC. They must say
READY=1 once started, WATCHDOG=1 while they run, STOPPING=1 on SIGTERM, and
exit 0."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mariana.services.launcher import resolve
from mariana.services.runtime.config import load_cluster_config, to_toml
from tests.conftest import ROOT
from tests.integration.serving import Server

WATCHDOG_USEC = 400_000  # pings every 0.2 s


class Notifications:
    """What processes sent to the socket, in order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.seen: list[str] = []

    def env(self) -> dict:
        return {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def wait_for(self, line: str, timeout: float, proc: subprocess.Popen, log, times: int = 1) -> int:
        """Index in `seen` of the `times`-th message holding `line` (read until it comes)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [i for i, msg in enumerate(self.seen) if line in msg.splitlines()]
            if len(found) >= times:
                return found[times - 1]
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} of {times} {line} within {timeout}s; got {len(self.seen)}, the last: {self.seen[-3:]}\n{log()}")
            try:
                self.seen.append(self.sock.recv(4096).decode())
            except TimeoutError:
                if proc.poll() is not None and line != "STOPPING=1":
                    raise AssertionError(f"exited with {proc.returncode} before {line}\n{log()}") from None

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notifications(tmp_path):
    n = Notifications(str(tmp_path / "notify.sock"))
    yield n
    n.close()


def lifecycle(n: Notifications, proc: subprocess.Popen, log, stop) -> None:
    """READY=1, then WATCHDOG=1 pings, then STOPPING=1 on SIGTERM and exit 0."""
    ready = n.wait_for("READY=1", 60, proc, log)
    assert not any("WATCHDOG=1" in m for m in n.seen[:ready]), n.seen  # the watchdog starts once ready
    assert n.wait_for("WATCHDOG=1", 5, proc, log) > ready
    n.wait_for("WATCHDOG=1", 3, proc, log, times=3)  # it keeps pinging: 3 pings take ~0.4 s
    stop()
    n.wait_for("STOPPING=1", 30, proc, log)
    assert proc.wait(60) == 0, log()


@pytest.mark.timeout(120)
def test_a_cluster_service_notifies_ready_watchdog_and_stopping(notifications, tmp_path):
    cfg = resolve(load_cluster_config(overrides={"cluster.dir": str(tmp_path / "c")}, env={}))
    path = tmp_path / "cluster.toml"
    path.write_text(to_toml(cfg))
    log_path = tmp_path / "coordinator.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mariana.services.cli", "run", "coordinator", "--config", str(path)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **notifications.env()})
    try:
        lifecycle(notifications, proc, log_path.read_text, lambda: proc.send_signal(signal.SIGTERM))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "STATUS=coordinator-0: running" in "\n".join(notifications.seen)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [1, 2])  # 1: the worker is the main process; 2: the supervisor is
def test_mariana_serve_notifies_ready_watchdog_and_stopping(notifications, tmp_path, monkeypatch, workers):
    (tmp_path / "models").mkdir()  # empty: it serves what is published there later
    for k, v in notifications.env().items():
        monkeypatch.setenv(k, v)  # the Server helper's process inherits them
    server = Server(tmp_path / "serve", tmp_path / "models", workers=workers)
    server.start()
    try:
        lifecycle(notifications, server.proc, server.logs, server.stop)
    finally:
        server.stop()
    ready = next(m for m in notifications.seen if "READY=1" in m)
    assert f"STATUS=serving on 127.0.0.1:{server.port}" in ready, ready
    # only the main process speaks: one READY=1, though `workers` processes listen
    assert sum("READY=1" in m for m in notifications.seen) == 1, notifications.seen
