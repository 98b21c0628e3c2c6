"""Failpoints: a service process ends itself at a named point, as a SIGKILL landing there would.

A SIGKILL can hit a window of a few microseconds (a version written, not yet journaled)
but a test cannot aim it there. `MARIANA_FAILPOINTS="name[@N][,name...]"` in a process's
environment arms those points; `reached(name)` at an armed one (the N-th time it gets
there; the first by default) logs a line and ends the process with `os._exit(EXIT_CODE)`:
no cleanup, no atexit, no flush of anything but the log (and what `flush` sends), as with
a kill. Unset (always, outside tests), a point costs one dict lookup.

    reached("coordinator.version_written")   # after the version, before the journal

>>> sorted(parse("coordinator.version_written, loader.chunk_sent@3,,").items())
[('coordinator.version_written', 1), ('loader.chunk_sent', 3)]
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

ENV = "MARIANA_FAILPOINTS"
EXIT_CODE = 137  # what a shell reports for SIGKILL: supervisors treat both alike


def parse(text: str) -> dict[str, int]:
    """name -> the time it is reached at which the process ends (1: the first)."""
    points = {}
    for item in (n.strip() for n in text.split(",")):
        if item:
            name, _, at = item.partition("@")
            if at.strip() and not at.strip().isdigit():
                raise ValueError(f"{ENV}: {item!r}: the N of name@N must be a whole number")
            points[name.strip()] = int(at) if at.strip() else 1
    return points


ARMED = parse(os.environ.get(ENV, ""))
_REACHED: dict[str, int] = {}


def reached(name: str, flush: Callable[[], None] | None = None) -> None:
    """End this process here if `name` is armed and reached for the armed time; `flush`
    first sends what a kill would let go out (a ZeroMQ message queued, not yet on the wire)."""
    at = ARMED.get(name)
    if at is None:
        return
    _REACHED[name] = seen = _REACHED.get(name, 0) + 1
    if seen < at:
        return
    log.error("failpoint %s reached (time %d): exiting with code %d (%s)", name, seen, EXIT_CODE, ENV)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if flush is not None:
        flush()
    os._exit(EXIT_CODE)
