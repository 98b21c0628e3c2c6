"""What this process may use of its host: its cgroups, and the CPUs it may run on.

`available_cpus()` is what thread counts default to (training, data-parallel ranks, cluster
workers, serve workers): the CPUs of this process's affinity mask (taskset, cpusets), capped
by its cgroup's CPU quota (`docker --cpus`, a Kubernetes CPU limit, systemd's `CPUQuota=`),
rounded up. `os.cpu_count()` is the host's count: a job in a 2-CPU container on a 64-core host
would start 64 torch threads, and each of 12 test processes on a lent 16-core GPU host ran 16.
"""
from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_lines(proc_file: str = "/proc/self/cgroup") -> list[tuple[str, list[str], str]]:
    """(hierarchy id, controllers, path) of each line of /proc/self/cgroup; [] if unreadable.
    cgroup v2's line is ("0", [""], path)."""
    try:
        with open(proc_file) as f:
            parts = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return []
    return [(hier, controllers.split(","), path) for hier, controllers, path in parts]


def cgroup_dirs(controller: str, v1_file: str, root: str = CGROUP_ROOT,
                proc_file: str = "/proc/self/cgroup") -> tuple[int, list[str]] | None:
    """(cgroup version, this process's cgroup directory for `controller` and then each of its
    ancestors up to the hierarchy's root) -- v2's unified directories, or the v1 controller's
    directories, found by `v1_file` in them (a container sees its own cgroup as the root);
    None without a cgroup filesystem."""
    for hier, controllers, path in cgroup_lines(proc_file):
        if hier == "0" and os.path.exists(os.path.join(root, "cgroup.controllers")):
            dirs = _up(root, path)
            return 2, dirs if os.path.exists(os.path.join(dirs[0], "cgroup.controllers")) else [root]
        if controller in controllers:
            for base in (os.path.join(root, ",".join(controllers)), os.path.join(root, controller)):
                for dirs in (_up(base, path), [base]):
                    if os.path.exists(os.path.join(dirs[0], v1_file)):
                        return 1, dirs
    return None


def _up(base: str, path: str) -> list[str]:
    """base+path, then each ancestor of it up to base."""
    parts = [p for p in path.split("/") if p]
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


def cpu_quota(root: str = CGROUP_ROOT, proc_file: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup (or an ancestor's, the lowest) allows it, as a number
    (1.5: 150 ms of CPU time per 100 ms); None where no quota is set or there are no cgroups."""
    found = cgroup_dirs("cpu", "cpu.cfs_quota_us", root, proc_file)
    if found is None:
        return None
    version, dirs = found
    quotas = []
    for d in dirs:
        if version == 2:
            fields = (_read(os.path.join(d, "cpu.max")) or "max").split()
            quota, period = fields[0], fields[1] if len(fields) > 1 else "100000"
        else:
            quota, period = (_read(os.path.join(d, "cpu.cfs_quota_us")) or "-1"), \
                (_read(os.path.join(d, "cpu.cfs_period_us")) or "100000")
        try:
            q, p = float(quota), float(period)
        except ValueError:  # "max": no quota at this level
            continue
        if q > 0 and p > 0:
            quotas.append(q / p)
    return min(quotas) if quotas else None


NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number


def parse_limit(text: str) -> int | None:
    """A memory cgroup's limit file's bytes; None for none ("max", v1's huge number, nothing).

    >>> parse_limit("max\\n"), parse_limit("2147483648\\n"), parse_limit("9223372036854771712")
    (None, 2147483648, None)
    """
    text = text.strip()
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= NO_LIMIT else value


def memory_limit(root: str = CGROUP_ROOT, proc_file: str = "/proc/self/cgroup") -> int | None:
    """The bytes this process's cgroup (or an ancestor's, the lowest) allows it (systemd's
    `MemoryMax=`, `docker --memory`, a Kubernetes limit); None where none is set or there are
    no cgroups."""
    found = cgroup_dirs("memory", "memory.limit_in_bytes", root, proc_file)
    if found is None:
        return None
    version, dirs = found
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    limits = [n for d in dirs if (n := parse_limit(_read(os.path.join(d, name)) or ""))]
    return min(limits) if limits else None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask's, capped by its cgroup CPU quota
    (rounded up: 1.5 CPUs make 2), at least 1.

        available_cpus()  # 2 on this project's 2-core VM; 4 in `docker run --cpus 4` on any host
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and
    parentheses): [state, ppid, ...], so start time is index 19; None when the process is gone.

    >>> proc_stat(os.getpid())[0] in (b"R", b"S")
    True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()
