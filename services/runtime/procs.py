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


def start_time(pid: int) -> int | None:
    """When pid started (clock ticks after boot, from /proc); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the name in (...) may hold spaces
    return None if fields[0] == b"Z" else int(fields[19])


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
