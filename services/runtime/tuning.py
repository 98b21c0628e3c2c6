"""Process-wide settings for throughput, applied once at the entry point.

Measured on the 1M-row LR benchmark (perf record): Python's cyclic GC took
~8% of CPU (parsing allocates many short-lived container objects), freed
arrays were handed back to the OS and re-faulted block after block (page
zeroing ~7%), and OpenBLAS's idle threads spun beside ours.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


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
