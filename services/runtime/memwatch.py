"""A service near its memory limit says so in its log before the limit kills it.

Under systemd, `MemoryMax=` (a drop-in: `[Service] MemoryMax=4G`) sets the unit's cgroup
`memory.max`; past it the kernel's OOM killer ends the service with no word in its own log.
Each service reads that limit (or `cluster.memory_max_bytes` when set) and, every
CHECK_SECONDS, what counts against it: the cgroup's `memory.current` for a cgroup limit,
the process's RSS for a configured one. Above `cluster.memory_warn_fraction` of the limit
it logs one WARNING line naming both numbers (again only after it has been below the
fraction for a while) and counts `memory_warnings` (the limit file read by
`sparse.host.parse_limit`).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter

from mariana.sparse.host import cgroup_dirs, parse_limit

log = logging.getLogger(__name__)

CHECK_SECONDS = 5.0


def cgroup_files() -> tuple[str, str] | None:
    """(limit file, usage file) of this process's memory cgroup: v2's memory.max and
    memory.current, or v1's memory.limit_in_bytes and memory.usage_in_bytes."""
    found = cgroup_dirs("memory", "memory.limit_in_bytes")
    if found is None:
        return None
    version, dirs = found
    names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    return os.path.join(dirs[0], names[0]), os.path.join(dirs[0], names[1])


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def rss_bytes() -> int:
    text = _read("/proc/self/statm")
    return int(text.split()[1]) * os.sysconf("SC_PAGE_SIZE") if text else 0


def limit_and_usage(configured: int = 0):
    """(limit bytes, what it is, a callable giving the bytes that count against it), or None."""
    if configured > 0:
        return configured, "cluster.memory_max_bytes", rss_bytes
    files = cgroup_files()
    if files is not None:
        limit = parse_limit(_read(files[0]) or "")
        if limit:
            return limit, files[0], lambda: int((_read(files[1]) or "0").strip() or 0)
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


async def watch(name: str, counters: Counter, configured: int = 0, fraction: float = 0.9,
                period: float = CHECK_SECONDS) -> None:
    found = limit_and_usage(configured)
    if found is None:
        return
    limit, what, usage = found
    log.info("%s: memory limit %s (%s); a warning above %.0f%% of it", name, _gib(limit), what, 100 * fraction)
    warned = False
    while True:
        used = usage()
        if used > fraction * limit and not warned:
            counters["memory_warnings"] += 1
            log.warning("%s: memory %s is %.0f%% of its limit %s (%s): past the limit the kernel kills it "
                        "(systemd MemoryMax=); give it more memory, or less work (e.g. fewer batches in hand)",
                        name, _gib(used), 100 * used / limit, _gib(limit), what)
            warned = True
        elif used < 0.8 * fraction * limit:
            warned = False
        await asyncio.sleep(period)
