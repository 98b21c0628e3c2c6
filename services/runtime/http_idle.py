"""An aiohttp AppRunner that also closes connections which never send a whole request.

aiohttp closes a connection left idle after an answer once its `keepalive_timeout` passes,
but before 3.14.4 it arms that timer only when a first answer is sent: a connection that
sends nothing, or half a request head, stays open for good, holding a descriptor (170 such
sockets once kept a restarted worker under a 64-descriptor limit from registering). This
project allows aiohttp >= 3.9, and the GPU hosts' image has an older one than 3.14.4; so
every HTTP server here (the model server, the coordinator, the metrics ports) runs on this
runner, which gives any version 3.14.4's rule: a connection still waiting for its first
request `keepalive_timeout` seconds after it opened is closed.

Nor does aiohttp end a connection whose client reads nothing: it stops answering the
client's pipelined requests once the socket takes no more, and the connection stays open for
good (its close would wait for the unsent bytes). The sweep also aborts a connection whose
unsent bytes have not moved for `keepalive_timeout` seconds.
"""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web

log = logging.getLogger(__name__)


class IdleClosingRunner(web.AppRunner):
    """web.AppRunner(app, keepalive_timeout=S, ...) plus a sweep, every S/4 seconds (at most
    one), that closes each connection open S seconds or more that has not sent a whole
    request yet, and aborts each whose unsent answer bytes stayed the same for S seconds. A
    connection in a request, or idle after an answer, is left to aiohttp."""

    def __init__(self, app: web.Application, *, keepalive_timeout: float, **kwargs) -> None:
        super().__init__(app, keepalive_timeout=keepalive_timeout, **kwargs)
        self.idle_seconds = keepalive_timeout
        self._sweeper: asyncio.Task | None = None

    async def setup(self) -> None:
        await super().setup()
        if self.idle_seconds > 0:
            self._sweeper = asyncio.create_task(close_unrequested(self.server, self.idle_seconds),
                                                name="http-idle-sweep")

    async def cleanup(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await super().cleanup()


def waits_for_first_request(handler) -> bool:
    """True when aiohttp's handler reads, with no request in hand, and aiohttp has armed no
    keep-alive timer on it: before 3.14.4 that is a connection that never had an answer.
    (aiohttp's private fields, alike in 3.9 to 3.14; without them, False: nothing is closed.)"""
    waiter = getattr(handler, "_waiter", None)
    return (getattr(handler, "transport", None) is not None and not getattr(handler, "_force_close", True)
            and getattr(handler, "_keepalive_handle", True) is None and waiter is not None and not waiter.done())


def unsent_bytes(handler) -> int:
    """Bytes of answers `handler`'s transport holds, not yet taken by the socket (0: none, or
    no transport)."""
    transport = getattr(handler, "transport", None)
    try:
        return transport.get_write_buffer_size() if transport is not None else 0
    except (AttributeError, RuntimeError):  # a transport of another kind, or one being torn down
        return 0


async def close_unrequested(server: web.Server, seconds: float) -> None:
    """Until cancelled: close `server`'s connections first seen waiting for their first
    request `seconds` ago or more, and abort those first seen with the same number of unsent
    bytes (more than none) `seconds` ago or more: a client that reads nothing (its unsent
    answers are dropped; a close would wait for them for good). A connection is seen up to one
    sweep after it opened, so it is closed `seconds` to `seconds` + min(1, seconds / 4) after."""
    loop = asyncio.get_running_loop()
    period = min(1.0, seconds / 4)
    seen: dict[int, tuple[object, float]] = {}  # id(handler) -> (handler, first seen waiting)
    stuck: dict[int, tuple[object, int, float]] = {}  # id(handler) -> (handler, unsent bytes, first seen so)
    while True:
        await asyncio.sleep(period)
        now, waiting, still = loop.time(), {}, {}
        for handler in list(server.connections):
            key = id(handler)
            if waits_for_first_request(handler):
                first = seen[key][1] if key in seen and seen[key][0] is handler else now
                if now - first >= seconds:
                    handler.force_close()
                    log.debug("closed a connection that sent no whole request in %.0fs", seconds)
                else:
                    waiting[key] = (handler, first)
            unsent = unsent_bytes(handler)
            if unsent:
                was = stuck.get(key)
                first = was[2] if was is not None and was[0] is handler and was[1] == unsent else now
                if now - first >= seconds:
                    log.info("closed a connection whose client read none of %d bytes of answers in %.0fs",
                             unsent, seconds)
                    handler.transport.abort()
                else:
                    still[key] = (handler, unsent, first)
        seen, stuck = waiting, still
