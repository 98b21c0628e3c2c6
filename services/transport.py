"""ZeroMQ sockets for the services: a request/reply client matched by msg_id,
and a ROUTER server loop that decodes, dispatches and answers.

Every receive goes through `protocol.decode`; a bad message is answered with
an `Error` (when there is someone to answer) and counted, and the loop goes
on. A request that gets no reply in time fails with `PeerTimeout`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from services import protocol
from services.protocol import BadMessage, Message
from sparse.errors import DataFormatError, MarianaError

log = logging.getLogger(__name__)


class PeerTimeout(MarianaError):
    """A peer did not answer in time (dead, restarting or overloaded)."""


class RemoteError(MarianaError):
    """A peer answered with an `Error` message."""

    def __init__(self, code: str, error: str):
        super().__init__(f"{code}: {error}")
        self.code = code


def make_socket(ctx: zmq.asyncio.Context, kind: int, hwm: int = 1000) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class Client:
    """A DEALER to one peer: `await call(type, arrays, **fields)` -> reply `Message`.

    Requests are matched to replies by msg_id, so many may be in flight at
    once. Messages the peer sends on its own (commands; msg_id 0 or an id
    nobody waits for) go to `on_command`. Late replies are dropped and counted.
    """

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, counters: Counter, timeout: float = 10.0,
                 on_command: Callable[[Message], Awaitable[None]] | None = None, identity: bytes | None = None):
        self.endpoint, self.timeout, self.counters = endpoint, timeout, counters
        self.on_command = on_command
        self.sock = make_socket(ctx, zmq.DEALER)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)
        self.pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self._reader = asyncio.create_task(self._read(), name=f"client-{endpoint}")

    async def call(self, type_: str, arrays: dict | None = None, timeout: float | None = None,
                   **fields) -> Message:
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        try:
            await self.sock.send_multipart(protocol.encode(type_, msg_id, arrays, **fields), copy=False)
            reply = await asyncio.wait_for(fut, timeout or self.timeout)
        except asyncio.TimeoutError:
            self.counters["rpc_timeouts"] += 1
            raise PeerTimeout(f"{self.endpoint} did not answer {type_} in {timeout or self.timeout:.1f}s") from None
        finally:
            self.pending.pop(msg_id, None)
        if reply.type == "Error":
            raise RemoteError(reply["code"], reply["error"])
        return reply

    async def send(self, type_: str, arrays: dict | None = None, **fields) -> None:
        """A message that expects no reply."""
        await self.sock.send_multipart(protocol.encode(type_, 0, arrays, **fields), copy=False)

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames)
            except BadMessage as e:
                self.counters["bad_messages"] += 1
                log.warning("bad message from %s: %s", self.endpoint, e)
                continue
            fut = self.pending.get(msg.msg_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif self.on_command is not None and msg.msg_id == 0:
                try:
                    await self.on_command(msg)
                except BadMessage as e:
                    self.counters["bad_messages"] += 1
                    log.warning("bad command from %s: %s", self.endpoint, e)
                except Exception:  # a failed command must not stop this socket's reader
                    self.counters["errors"] += 1
                    log.exception("command %s from %s failed", msg.type, self.endpoint)
            else:
                self.counters["late_replies"] += 1

    def fail_pending(self, reason: str) -> int:
        """Fail every request in flight with PeerTimeout (the peer restarted: it will never
        answer them); their callers retry now instead of at their timeout."""
        n = 0
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(PeerTimeout(f"{self.endpoint}: {reason}"))
                n += 1
        return n

    def close(self) -> None:
        self.closed = True
        self._reader.cancel()
        self.fail_pending("client closed")
        self.sock.close(linger=0)


Handler = Callable[[bytes, Message], Awaitable[list | None]]


class Server:
    """A ROUTER that answers requests: `handler(peer, msg)` returns reply frames
    (or None to reply later with `reply`). Handlers run as tasks, so one may
    wait (a held lease) while others are served."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, handler: Handler, counters: Counter,
                 max_bytes: int = protocol.MAX_MESSAGE_BYTES, name: str = "server"):
        self.endpoint, self.handler, self.counters, self.max_bytes = endpoint, handler, counters, max_bytes
        self.name = name
        self.sock = make_socket(ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.bind(endpoint)
        self.tasks: set[asyncio.Task] = set()
        self._loop = asyncio.create_task(self._serve(), name=f"{name}-router")

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            peer, body = frames[0].bytes, frames[1:]
            try:
                msg = protocol.decode(body, self.max_bytes)
            except BadMessage as e:
                self.counters["bad_messages"] += 1
                log.warning("%s: bad message from peer %s: %s", self.name, peer.hex()[:8], e)
                await self.reply(peer, protocol.error_reply(_guess_msg_id(body), e.code, str(e)))
                continue
            task = asyncio.create_task(self._handle(peer, msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _handle(self, peer: bytes, msg: Message) -> None:
        try:
            reply = await self.handler(peer, msg)
        except (BadMessage, DataFormatError) as e:  # well-formed frames, wrong content (shapes, ids)
            self.counters["bad_messages"] += 1
            log.warning("%s: bad %s from peer %s: %s", self.name, msg.type, peer.hex()[:8], e)
            reply = protocol.error_reply(msg.msg_id, getattr(e, "code", "bad_data"), str(e))
        except MarianaError as e:
            self.counters["errors"] += 1
            log.warning("%s: cannot serve %s: %s", self.name, msg.type, e)
            reply = protocol.error_reply(msg.msg_id, type(e).__name__, str(e))
        except Exception as e:  # a bug must not kill the server; it answers and logs the trace
            self.counters["errors"] += 1
            log.exception("%s: %s failed", self.name, msg.type)
            reply = protocol.error_reply(msg.msg_id, "internal", f"{type(e).__name__}: {e}")
        if reply is not None:
            await self.reply(peer, reply)

    async def reply(self, peer: bytes, frames: list) -> None:
        try:
            await self.sock.send_multipart([peer, *frames], copy=False)
        except zmq.ZMQError as e:  # the peer went away
            self.counters["unsent_replies"] += 1
            log.debug("%s: reply to %s not sent: %s", self.name, peer.hex()[:8], e)

    async def drain(self, timeout: float) -> None:
        """Stop taking requests; let handlers in flight finish (up to `timeout`)."""
        self._loop.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout)

    def close(self) -> None:
        self._loop.cancel()
        for t in self.tasks:
            t.cancel()
        self.sock.close(linger=0)


def _guess_msg_id(frames: list) -> int:
    """The msg_id of a message that failed its checks, when frame 0 still says it."""
    try:
        import msgpack

        head = msgpack.unpackb(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0], raw=False)
        mid = head.get("msg_id", 0) if isinstance(head, dict) else 0
        return mid if isinstance(mid, int) and not isinstance(mid, bool) else 0
    except Exception:
        return 0
