"""sd_notify over a real unix datagram socket bound here, as systemd binds
$NOTIFY_SOCKET, and the watchdog task on a real event loop."""
from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time

import pytest

from mariana.services.runtime import sdnotify


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(2.0)
    yield sock, str(tmp_path / "notify.sock")
    sock.close()


def drain(sock: socket.socket) -> list[str]:
    """Every datagram waiting on sock, without blocking."""
    sock.setblocking(False)
    out = []
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.setblocking(True)


def test_notify_sends_one_datagram_of_lines_to_a_path(listener):
    sock, path = listener
    assert sdnotify.notify("READY=1", "STATUS=up", env={"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_notify_reaches_an_abstract_socket():
    name = f"mariana-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        assert sdnotify.notify("STOPPING=1", env={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_is_a_no_op_without_a_socket_and_never_raises(tmp_path):
    assert not sdnotify.notify("READY=1", env={})
    assert not sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})


@pytest.mark.parametrize("env,period", [
    ({}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "junk"}, None),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "self"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "other"}, None),
])
def test_watchdog_period_is_half_the_timeout_and_only_for_our_pid(env, period):
    pids = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}
    env = {k: pids.get(v, v) for k, v in env.items()}
    assert sdnotify.watchdog_period(env) == period


def test_child_env_drops_the_notify_variables():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    assert sdnotify.child_env(env) == {"PATH": "/bin"}


async def test_watchdog_pings_from_the_loop_and_a_blocked_loop_stops_them(listener, monkeypatch):
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    task = asyncio.create_task(sdnotify.watchdog(0.05, lambda: "busy=1"))
    await asyncio.sleep(0.3)
    pings = drain(sock)
    assert len(pings) >= 3 and pings[0] == "WATCHDOG=1\nSTATUS=busy=1", pings
    time.sleep(0.5)  # the loop is blocked: no ping may leave during it
    assert drain(sock) == []
    await asyncio.sleep(0.2)  # the loop runs again: so do the pings
    assert drain(sock), "no ping after the loop was unblocked"
    task.cancel()
