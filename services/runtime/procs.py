"""Whether a process runs, from /proc: the launcher's records, the supervisor and chaos
(services/launcher.py), and the retrain lock of `mariana serve` (serving/retrain.py).

A zombie has exited: it is not running, though `kill(pid, 0)` still finds it until its
parent reaps it.

>>> import os
>>> running(os.getpid()), start_time(os.getpid()) == start_time(os.getpid()) is not None
(True, True)
"""
from __future__ import annotations

import os

from mariana.sparse.host import proc_stat

EX_CONFIG = 78  # sysexits.h: a service the coordinator refused exits so (systemd and the supervisor leave it)


def start_time(pid: int) -> int | None:
    """When pid started (clock ticks after boot, from /proc); None if it is gone or a zombie."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] == b"Z" else int(fields[19])


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has). Without /proc: what kill says."""
    if os.path.isdir("/proc/self"):
        return start_time(pid) is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def listening_on(port: int) -> list[int]:
    """The pids of this machine's processes that listen on TCP `port` (any address, IPv4 or
    IPv6), as far as /proc lets this user see: to name who holds a port a bind found taken.
    Empty when none is seen (another user's process, or no /proc)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = []
    if not inodes or not os.path.isdir("/proc/self"):
        return pids
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    pids.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(pids)


def holder_of(port: int) -> str:
    """" (held by pid N: its command line)" for a taken port, or "" when no holder is seen.

    >>> import socket
    >>> s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    >>> holder_of(s.getsockname()[1]).startswith(f" (held by pid {os.getpid()}: ")
    True
    >>> s.close()
    """
    pids = listening_on(port)
    if not pids:
        return ""
    said = []
    for pid in pids[:3]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            cmd = "?"
        said.append(f"pid {pid}: {cmd[:160]}")
    return " (held by " + "; ".join(said) + ")"
