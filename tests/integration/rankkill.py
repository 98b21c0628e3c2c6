"""Kill one rank of a multi-process `mariana train ...` job and watch what the job does:
for the killed-rank tests of the speech and image modes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def kill_a_rank(argv: list[str], env: dict | None = None, rank: int = 1, after_s: float = 1.0,
                sig: int = signal.SIGKILL) -> dict:
    """Start `python -m mariana ARGV`, SIGKILL (or `sig`) its rank `rank` `after_s` seconds after that
    process appears; returns {"returncode", "stderr", "seconds" (from the kill to the job's
    exit), "children" (its processes left behind)}."""
    parent = subprocess.Popen([sys.executable, "-m", "mariana", *argv], cwd=ROOT, env=env or dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        victim = wait_for_rank(parent.pid, rank)
        time.sleep(after_s)  # into the steps
        ranks = children(parent.pid)  # before the kill: once the parent is gone, its leftovers are not its children
        os.kill(victim, sig)
        t0 = time.monotonic()
        _, err = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    time.sleep(0.5)
    left = [pid for pid in ranks if _alive(pid)]
    for pid in left:  # a failed test leaves no rank behind (a stopped one would stay for ever)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"returncode": parent.returncode, "stderr": err, "seconds": time.monotonic() - t0,
            "children": children(parent.pid) + left}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, reaped by no one yet, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_for_rank(parent: int, rank: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in children(parent):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under {parent}")


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a reparented one is reaped by whatever PID 1 is)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
