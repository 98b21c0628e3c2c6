"""Logging, configured once by the CLI; modules use logging.getLogger(__name__)."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

# What asyncio logs, with a traceback, each time a listening socket's accept() fails for want
# of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM). Python 3.11's loop does not stop
# its accept loop after one (CPython gh-151615): it tries `backlog` times more, logging each try,
# and again once a second while it lasts -- thousands of tracebacks a second, gigabytes an hour.
ACCEPT_ERROR = "socket.accept() out of system resource"
ACCEPT_HINT = ("this process cannot take more connections now: raise its open-file limit (ulimit -n, "
               "systemd's LimitNOFILE=) or spread the load over more processes")


class OncePer(logging.Filter):
    """Lets the records of logger `name` whose message starts with `prefix` through at most
    once per `seconds` (per process); the others pass untouched. Only the first keeps its
    traceback; each later one is one line with the error, saying how many were left out.

    >>> now = [0.0]
    >>> f = OncePer("asyncio", "accept failed", 10.0, hint="add workers", clock=lambda: now[0])
    >>> def rec(msg):
    ...     return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), None)
    >>> [f.filter(rec("accept failed\\nsocket: ...")) for now[0] in (0.0, 1.0, 2.0)]
    [True, False, False]
    >>> now[0] = 12.5
    >>> r = rec("accept failed\\nsocket: ...")
    >>> f.filter(r), r.getMessage()
    (True, 'accept failed (2 more in the last 12s, not logged): add workers')
    >>> f.filter(rec("something else")), f.left_out
    (True, 0)
    """

    def __init__(self, name: str, prefix: str, seconds: float = 10.0, hint: str = "", clock=time.monotonic):
        super().__init__(name)
        self.prefix, self.seconds, self.hint, self.clock = prefix, seconds, hint, clock
        self.lock = threading.Lock()  # a handler's thread and the loop's may log at once
        self.last: float | None = None  # when one was last let through
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != self.name or not str(record.msg).startswith(self.prefix):
            return True
        with self.lock:
            now = self.clock()
            if self.last is not None and now - self.last < self.seconds:
                self.left_out += 1
                return False
            first, n = self.last is None, self.left_out
            since = 0.0 if first else now - self.last
            self.last, self.left_out = now, 0
        if first:
            record.msg = f"{record.getMessage()}\n{self.hint} (said at most once per {self.seconds:g}s)"
        else:
            record.msg = self._one_line(record, n, since)
        record.args = ()
        return True

    def _one_line(self, record: logging.LogRecord, n: int, since: float) -> str:
        """The message's first line, the error the traceback ended with, the count; no traceback."""
        error = record.exc_info[1] if record.exc_info else None
        line = str(record.msg).splitlines()[0] + (f": {error}" if error is not None else "")
        record.exc_info = record.exc_text = record.stack_info = None
        if n:
            line += f" ({n} more in the last {since:.0f}s, not logged)"
        return f"{line}: {self.hint}" if self.hint else line


ACCEPT_FLOOD = OncePer("asyncio", ACCEPT_ERROR, 10.0, hint=ACCEPT_HINT)


def setup_logging(verbosity: int = 0) -> None:
    """INFO by default, DEBUG with -v, WARNING with -q; MARIANA_LOG_LEVEL overrides."""
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    named = os.environ.get("MARIANA_LOG_LEVEL", "").upper()
    if named in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        level = getattr(logging, named)
    logging.basicConfig(
        level=level, stream=sys.stderr, force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # On the logger asyncio logs with, not on the handler: it holds for every handler, and a
    # second setup_logging (force=True replaces the handler) keeps its count.
    logging.getLogger("asyncio").addFilter(ACCEPT_FLOOD)
