"""sd_notify(3) in the standard library: tell systemd that a service is ready,
alive, or stopping, over the datagram socket it names in $NOTIFY_SOCKET.

With `Type=notify` systemd counts a unit as started only once READY=1
arrives (so `After=` waits for a service that really listens), shows the
last STATUS= line in `systemctl status`, and with `WatchdogSec=` restarts a
service that has not sent WATCHDOG=1 for that long. Outside systemd (no
$NOTIFY_SOCKET) every call is a no-op, so code calls these unconditionally.

    notify("READY=1", "STATUS=serving")
    period = watchdog_period()          # None: no watchdog asked for
    notify("STOPPING=1")

>>> notify("READY=1", env={})
False
>>> watchdog_period({"WATCHDOG_USEC": "30000000"})
15.0
>>> watchdog_period({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None  # meant for another pid
True
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable, Mapping

log = logging.getLogger(__name__)

# Variables systemd sets for the main process only; a child started with them would
# answer for its parent (NotifyAccess=main drops its messages anyway).
NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def notify(*states: str, env: Mapping[str, str] | None = None) -> bool:
    """Send KEY=VALUE lines in one datagram; True if one was sent. Never raises:
    a service must not fail because its supervisor went away."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr or not states:
        return False
    if addr[0] == "@":  # an abstract socket name: a leading NUL byte on the wire
        addr = "\0" + addr[1:]
    elif addr[0] != "/":
        log.debug("NOTIFY_SOCKET=%s: only unix socket paths and @names are supported", addr)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(states).encode(), addr)
        return True
    except OSError as e:
        log.debug("sd_notify %s: %s", states, e)
        return False


def watchdog_period(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
    advises; None when systemd asked for no watchdog, or asked another process."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID") or os.getpid())
    except ValueError:
        return None
    if usec <= 0 or pid != os.getpid():
        return None
    return usec / 2e6


async def watchdog(period: float, status: Callable[[], str] | None = None) -> None:
    """Ping WATCHDOG=1 every `period` seconds from the event loop, with a STATUS= line
    when `status` is given. Run as a task: a loop that blocks stops the pings, and
    systemd restarts the service — which is the point."""
    while True:
        notify("WATCHDOG=1", *([f"STATUS={status()}"] if status else []))
        await asyncio.sleep(period)


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: ours without systemd's notify variables."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in NOTIFY_VARS}
