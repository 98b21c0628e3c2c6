"""Process-wide settings for throughput, applied once at the entry point.

Measured on the 1M-row LR benchmark (perf record): Python's cyclic GC took
~8% of CPU (parsing allocates many short-lived container objects), freed
arrays were handed back to the OS and re-faulted block after block (page
zeroing ~7%), and OpenBLAS's idle threads spun beside ours.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_UNPINNED: set[int] | None = None  # the CPUs this process could use before `pin_to_cpu`


def tune_process() -> None:
    # Before numpy loads: the trainer never calls numpy's BLAS, so keep its pool at one thread.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # Young-generation collections every 50k allocations instead of 700.
    gc.set_threshold(50_000, 20, 20)
    _keep_freed_memory()


def freeze_imports() -> None:
    """Move everything imported so far (torch, pyarrow: ~170k objects) out of
    the collector's sight; call after the heavy imports, before the work."""
    gc.collect()
    gc.freeze()


def exiting() -> None:
    """Call when the process's work is done and it exits next. The interpreter's last
    collections walk every object left (torch's alone: 0.35-0.5 s on a 2-core VM, paid
    by every command and every service stop); frozen objects are skipped. Objects are
    still freed by reference count and atexit handlers run; only garbage in reference
    cycles goes unfinalized, as it would under os._exit."""
    gc.freeze()


def pin_to_cpu(index: int) -> int | None:
    """Bind this process to one of the CPUs it may use: the `index`-th, round robin. Threads
    started afterwards inherit it (call it before starting any). Returns the CPU, or None
    where affinity is not available or there is one CPU only. A process that stays on its
    core keeps its caches warm: two serve workers on 2 cores used ~21% less CPU per request
    pinned (loadgen.c at 2,000/s; the aiohttp floor's cost did not move)."""
    global _UNPINNED
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cpu = cpus[index % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    _UNPINNED = set(cpus)
    return cpu


def unpin(pid: int) -> None:
    """Give a child process every CPU this process could use before `pin_to_cpu` (a child
    inherits the pin; a retrain must not run on one core). Call right after starting it:
    threads it starts later inherit its affinity."""
    if _UNPINNED is None:
        return
    try:
        os.sched_setaffinity(pid, _UNPINNED)
    except OSError:  # it has ended already
        pass


def release_freed_memory() -> None:
    """Hand the memory freed since back to the OS (glibc's malloc_trim, after a collection):
    `_keep_freed_memory` keeps up to 1 GiB of it for the next allocations, which suits a
    step loop but left a coordinator at its high-water mark between jobs (0.6-1 GB after DNN
    jobs in an exploratory soak, idle). For the end of a unit of work, not its loop."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, looked up once (find_library runs `ldconfig -p`); None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def _keep_freed_memory() -> None:
    """glibc: serve blocks up to 256 MiB from the heap and keep up to 1 GiB
    freed, so the next block reuses pages instead of faulting fresh ones."""
    name = ctypes.util.find_library("c")
    if not name or os.environ.get("MARIANA_NO_MALLOPT"):
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc
        pass
