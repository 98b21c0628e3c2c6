"""Failpoints: a service process ends itself at a named point, as a SIGKILL landing there would.

A SIGKILL can hit a window of a few microseconds (a version written, not yet journaled)
but a test cannot aim it there. `MARIANA_FAILPOINTS="name[,name...]"` in a process's
environment arms those points; `reached(name)` at an armed one logs a line and ends the
process with `os._exit(EXIT_CODE)`: no cleanup, no atexit, no flush of anything but the
log, as with a kill. Unset (always, outside tests), a point costs one set lookup.

    reached("coordinator.version_written")   # after the version, before the journal

>>> sorted(parse("coordinator.version_written, ps.x,,"))
['coordinator.version_written', 'ps.x']
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "MARIANA_FAILPOINTS"
EXIT_CODE = 137  # what a shell reports for SIGKILL: supervisors treat both alike


def parse(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


ARMED = parse(os.environ.get(ENV, ""))


def reached(name: str) -> None:
    """End this process here if `name` is armed."""
    if name in ARMED:
        log.error("failpoint %s reached: exiting with code %d (%s)", name, EXIT_CODE, ENV)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_CODE)
