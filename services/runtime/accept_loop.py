"""asyncio's event loop with its accept loop mended (CPython gh-151615), for every process
here that listens for HTTP: `mariana serve`'s workers and the pipeline's services."""
from __future__ import annotations

import asyncio
import errno


class MendedLoop(asyncio.SelectorEventLoop):
    """asyncio's loop with its accept loop mended (CPython gh-151615, in 3.11): when accept()
    fails for want of descriptors or memory, the loop stops listening, schedules a retry in a
    second, and then -- the bug -- tries accept() again `backlog` (1024) times in the same pass,
    each failure scheduling one more retry. The retries pile up: a worker held at 64 descriptors
    went from 1,000 to 12,000 failed accepts a second, and from 17% to 83% of a core, in 12 s;
    and each retry still pending when the server stops logs a traceback. Here a pass ends at
    its first such failure, as upstream's fix makes it; the backlog stays 1024 for bursts.
    Every HTTP server here runs on it: the model server's workers, and the coordinator's API
    and the services' metrics ports (lifecycle)."""

    def _accept_connection(self, protocol_factory, sock, *args, **kwargs):
        super()._accept_connection(protocol_factory, _OnePass(sock), *args, **kwargs)

    def _start_serving(self, protocol_factory, sock, *args, **kwargs):
        if sock.fileno() != -1:  # the retry of a server that stopped meanwhile: nothing to listen on
            super()._start_serving(protocol_factory, sock, *args, **kwargs)


class _OnePass:
    """A listening socket for one pass of the accept loop: once an accept() failed for want
    of resources, the next ones find the queue empty (BlockingIOError), which ends the pass."""

    OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

    def __init__(self, sock):
        self.sock = sock.sock if isinstance(sock, _OnePass) else sock  # a retry hands back the last pass's
        self.out_of_resources = False

    def accept(self):
        if self.out_of_resources:
            raise BlockingIOError(errno.EAGAIN, "this pass of the accept loop ended at a resource error")
        try:
            return self.sock.accept()
        except OSError as e:
            self.out_of_resources = e.errno in self.OUT_OF
            raise

    def __getattr__(self, name):  # fileno, family, getsockname, ...: the socket's own
        return getattr(self.sock, name)
