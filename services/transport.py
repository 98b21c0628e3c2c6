"""ZeroMQ sockets for the services: a request/reply client matched by msg_id,
and a ROUTER server that decodes, dispatches and answers.

Every receive goes through `protocol.decode`; a bad message is answered with
an `Error` (when there is someone to answer) and counted, and the service goes
on. A request that gets no reply in time fails with `PeerTimeout`.

Sockets are read from the event loop's reader callback on the socket's file
descriptor, draining every message waiting, and written with non-blocking
sends: no future per message. The usual pyzmq asyncio pattern costs 1.3x the CPU
per round trip for a header-only request and 1.2x for a pull of 18k ids, both
sides together (`bench/transport.py`), and a training step makes one to three.
A server's synchronous handler answers from the callback itself; one that
returns an awaitable (a held lease) runs as a task.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import itertools
import logging
import time
from collections import Counter
from typing import Awaitable, Callable, Iterator

import zmq
import zmq.asyncio

from mariana.services import protocol
from mariana.services.protocol import BadMessage, Message
from mariana.services.runtime import procs
from mariana.sparse.errors import DataFormatError, MarianaError

log = logging.getLogger(__name__)
DRAIN_BATCH = 64  # messages read per reader callback before other callbacks get a turn


class PeerTimeout(MarianaError):
    """A peer did not answer in time (dead, restarting or overloaded)."""


class PeerRestarted(PeerTimeout):
    """A request failed at once because its peer restarted (`Client.fail_pending`): the one
    line saying so is the caller's who saw the restart, not one per request."""


class Throttled:
    """A logger's warnings about what peers send, at most `burst` lines a `seconds` window: a
    flood of bad messages (60,000 in an exploratory run) was as many log lines. What is left
    out is said as one line when the next window opens; every message is counted all the same
    (bad_messages, errors).

    >>> import logging; said = []
    >>> t = Throttled(logging.getLogger("x"), burst=2, seconds=60.0); t.say = lambda *a: said.append(a)
    >>> for i in range(5): t.warning("bad %d", i)
    >>> t.window -= 61; t.warning("bad %d", 5); [a[0] % a[1:] for a in said]
    ['bad 0', 'bad 1', '3 more like these in 60s not logged (each is counted)', 'bad 5']
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, seconds: float = 10.0) -> None:
        self.say, self.burst, self.seconds = logger.warning, burst, seconds
        self.window, self.lines, self.left_out = time.monotonic(), 0, 0

    def warning(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now - self.window >= self.seconds:
            if self.left_out:
                self.say("%d more like these in %gs not logged (each is counted)", self.left_out, self.seconds)
            self.window, self.lines, self.left_out = now, 0, 0
        if self.lines < self.burst:
            self.lines += 1
            self.say(fmt, *args)
        else:
            self.left_out += 1


PEER_LOG = Throttled(log)  # this process's lines about bad messages and requests it cannot serve


def timeout_log(logger: logging.Logger, e: BaseException, level: int = logging.WARNING):
    """How `logger` says a request that `e` ended: at DEBUG when its peer restarted (the caller
    that saw the restart said so, once, and every request in flight failed with it), else at
    `level`."""
    return logger.debug if isinstance(e, PeerRestarted) else functools.partial(logger.log, level)


class RemoteError(MarianaError):
    """A peer answered with an `Error` message."""

    def __init__(self, code: str, error: str, fields: dict | None = None):
        super().__init__(f"{code}: {error}")
        self.code, self.detail, self.fields = code, error, fields or {}


_CURVE: tuple[bytes, bytes] | None = None  # (public, secret) of this process's cluster (`use_curve`)


def use_curve(secret: str) -> None:
    """Every socket this process binds or connects from now on speaks CURVE with the cluster's
    one key pair (`cluster.curve_key`): its traffic is encrypted, and a peer that does not hold
    the key never completes the handshake (its messages never reach a service). Empty: off."""
    global _CURVE
    _CURVE = (zmq.curve_public(secret.encode()), secret.encode()) if secret else None


def as_server(sock: zmq.Socket) -> zmq.Socket:
    """Before a bind: the CURVE server side, when the cluster has a key."""
    if _CURVE is not None:
        sock.curve_publickey, sock.curve_secretkey = _CURVE
        sock.curve_server = True
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> None:
    """`as_server` and bind; a port taken says by whom, where this machine shows it (an
    exploratory run: two clusters on one host's fixed ports, each service "Address already in use")."""
    try:
        as_server(sock).bind(endpoint)
    except zmq.ZMQError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        port = endpoint.rsplit(":", 1)[-1]
        who = procs.holder_of(int(port)) if port.isdigit() else ""
        raise MarianaError(f"cannot bind {endpoint}: address already in use{who}") from None


def as_client(sock: zmq.Socket) -> zmq.Socket:
    """Before a connect: the CURVE client side (the server's key is the cluster's), when it has one."""
    if _CURVE is not None:
        sock.curve_serverkey = _CURVE[0]
        sock.curve_publickey, sock.curve_secretkey = _CURVE
    return sock


def make_socket(ctx: zmq.asyncio.Context, kind: int, hwm: int = 1000) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class _Channel:
    """A socket of the service's context (closed with it) used through a synchronous view:
    `on_frames(frames)` is called from the loop for each message; `send` never blocks
    the loop."""

    def __init__(self, ctx: zmq.asyncio.Context, kind: int, on_frames: Callable[[list], None],
                 counters: Counter, name: str):
        self.owner = make_socket(ctx, kind)  # never used for I/O: its own reader would replace ours
        self.sock = zmq.Socket.shadow(self.owner.underlying)
        self.on_frames, self.counters, self.name = on_frames, counters, name
        self.loop = asyncio.get_running_loop()
        self.fd = self.sock.getsockopt(zmq.FD)
        self.reading = False
        self.closed = False

    def start_reading(self) -> None:
        self.reading = True
        self.loop.add_reader(self.fd, self._readable)
        self.loop.call_soon(self._readable)  # the descriptor is edge-triggered: look now

    def stop_reading(self) -> None:
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.fd)

    def _readable(self) -> None:
        for _ in range(DRAIN_BATCH):
            if not self.reading:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us
                self.stop_reading()
                return
            try:
                self.on_frames(frames)
            except Exception:  # a bug: the queue must still be drained, or the edge is lost for good
                self.counters["errors"] += 1
                log.exception("%s: a received message could not be handled", self.name)
        self.loop.call_soon(self._readable)  # more waiting: after the other callbacks

    def send_now(self, frames: list) -> bool:
        """Send without waiting; False when the socket's queue is full or it is closed."""
        if self.closed:
            return False
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            # Any operation may consume the descriptor's edge for messages already queued to read.
            if self.reading and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self.loop.call_soon(self._readable)
        return True

    async def send(self, frames: list, timeout: float) -> None:
        """Send, waiting (up to `timeout`) while the peer's queue is full; zmq.Again when it
        stays full, or at once when the socket is closed."""
        if self.send_now(frames):
            return
        if self.closed:
            raise zmq.Again()
        give_up, delay = time.monotonic() + timeout, 0.001
        while not self.send_now(frames):
            if time.monotonic() > give_up:
                raise zmq.Again()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def close(self) -> None:
        self.stop_reading()
        self.closed = True
        self.owner.close(linger=0)


class Client:
    """A DEALER to one peer: `await call(type, arrays, **fields)` -> reply `Message`.

    Requests are matched to replies by msg_id, so many may be in flight at
    once. Messages the peer sends on its own (commands, msg_id 0) go to
    `on_command`, each as a task started in arrival order. Replies nobody waits
    for any more are dropped and counted (`late_replies`).
    """

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, counters: Counter, timeout: float = 10.0,
                 on_command: Callable[[Message], Awaitable[None]] | None = None, identity: bytes | None = None,
                 watch: bool = False):
        self.endpoint, self.timeout, self.counters = endpoint, timeout, counters
        self.on_command = on_command
        self.channel = _Channel(ctx, zmq.DEALER, self._received, counters, f"client of {endpoint}")
        if identity:
            self.channel.sock.setsockopt(zmq.IDENTITY, identity)
        self.watcher = ConnectionWatch(ctx, self.channel.sock) if watch else None  # before the connect
        as_client(self.channel.sock).connect(endpoint)
        self.pending: dict[int, asyncio.Future] = {}
        self.commands: set[asyncio.Task] = set()
        self.closed = False
        self.channel.start_reading()

    async def call(self, type_: str, arrays: dict | None = None, timeout: float | None = None,
                   **fields) -> Message:
        if self.closed:  # shut down: no reply can come. Yield first: a caller retrying on PeerTimeout
            await asyncio.sleep(0)  # must not spin without the loop, where no cancellation reaches it
            raise PeerTimeout(f"{self.endpoint}: client closed")
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        timeout = timeout or self.timeout
        try:
            await self.channel.send(protocol.encode(type_, msg_id, arrays, **fields), timeout)
            reply = await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, zmq.Again):
            self.counters["rpc_timeouts"] += 1
            raise PeerTimeout(f"{self.endpoint} did not answer {type_} in {timeout:.1f}s") from None
        finally:
            self.pending.pop(msg_id, None)
        if reply.type == "Error":
            raise RemoteError(reply["code"], reply["error"], reply.fields)
        return reply

    async def send(self, type_: str, arrays: dict | None = None, **fields) -> None:
        """A message that expects no reply."""
        try:
            await self.channel.send(protocol.encode(type_, 0, arrays, **fields), self.timeout)
        except zmq.Again:
            raise PeerTimeout(f"{self.endpoint} took no {type_} in {self.timeout:.1f}s") from None

    def _received(self, frames: list) -> None:
        try:
            msg = protocol.decode(frames)
        except BadMessage as e:
            self.counters["bad_messages"] += 1
            PEER_LOG.warning("bad message from %s: %s", self.endpoint, e)
            return
        fut = self.pending.get(msg.msg_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif self.on_command is not None and msg.msg_id == 0:
            task = asyncio.create_task(self._command(msg))
            self.commands.add(task)
            task.add_done_callback(self.commands.discard)
        else:
            self.counters["late_replies"] += 1

    async def _command(self, msg: Message) -> None:
        try:
            await self.on_command(msg)
        except BadMessage as e:
            self.counters["bad_messages"] += 1
            PEER_LOG.warning("bad command from %s: %s", self.endpoint, e)
        except Exception:  # counted and logged; the service goes on
            self.counters["errors"] += 1
            log.exception("command %s from %s failed", msg.type, self.endpoint)

    def fail_pending(self, reason: str) -> int:
        """Fail every request in flight with PeerRestarted (the peer restarted: it will never
        answer them); their callers retry now instead of at their timeout, and say so at DEBUG
        (`timeout_log`): the caller that saw the restart said it once."""
        n = 0
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(PeerRestarted(f"{self.endpoint}: {reason}"))
                n += 1
        return n

    def trouble(self) -> str | None:
        """Why no answer came, as far as the connection shows (`ConnectionWatch.trouble`);
        None when it is not watched or looks fine."""
        return self.watcher.trouble() if self.watcher else None

    def close(self) -> None:
        self.closed = True
        for task in self.commands:
            task.cancel()
        self.fail_pending("client closed")
        if self.watcher:
            self.watcher.close()
        self.channel.close()


class _Monitor:
    """ZeroMQ's events of one socket (`sock.monitor`), read without waiting (`events`). The
    reading socket is owned by the service's context (its destroy() closes it; one it does not
    know of would hold up its term for ever), used through a synchronous view."""

    def __init__(self, ctx: zmq.asyncio.Context, sock: zmq.Socket, events: int):
        self.sock = sock
        addr = f"inproc://mariana-monitor-{id(self):x}"
        sock.monitor(addr, events)
        self.owner = ctx.socket(zmq.PAIR)
        self.owner.linger = 0
        self.reader = zmq.Socket.shadow(self.owner.underlying)
        self.reader.connect(addr)

    def events(self) -> Iterator[dict]:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                yield recv_monitor_message(self.reader, zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.owner.close(linger=0)


class ConnectionWatch(_Monitor):
    """ZeroMQ's events of one socket's connection, to tell a peer that is not there from one
    whose handshake fails: a CURVE key that differs fails the handshake without a word to
    either side, and a request just times out. The last handshakes count: a peer restarted
    with another key fails them after earlier ones succeeded. A NO_DETAIL failure is taken for
    a key only when FAILURES of them come in a row, each on a connection its port took: a peer
    that dies in its start-up fails one handshake, and then its port refuses connections (that
    was blamed on a curve_key nobody had set, and the service exited for good, 78)."""

    EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    FAILURES = 3

    def __init__(self, ctx: zmq.asyncio.Context, sock: zmq.Socket):
        super().__init__(ctx, sock, self.EVENTS)
        self.connected, self.last, self.failures, self.retried = False, "", 0, False

    def _read(self) -> None:
        for event in self.events():
            name = zmq.Event(event["event"]).name
            if name == "CONNECT_RETRIED":  # after each failed handshake too; twice in a row: its port refuses
                if self.retried:
                    self.connected, self.last, self.failures = False, "", 0
                self.retried = True
                continue
            self.retried = False
            if name == "CONNECTED":
                self.connected = True
            else:
                self.last = name
                self.failures = self.failures + 1 if name.startswith("HANDSHAKE_FAILED") else 0

    @property
    def handshake_failed(self) -> bool:
        """The handshake fails for good (as of the last `trouble`): a PROTOCOL or AUTH failure
        (one side without a key: ZeroMQ does not try again), or FAILURES in a row of
        NO_DETAIL (a key that differs: the peer just hangs up, each time)."""
        return self.last in ("HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_AUTH") or self.failures >= self.FAILURES

    def trouble(self) -> str | None:
        self._read()
        if self.handshake_failed:
            times = "once" if self.failures == 1 else f"{self.failures} times in a row"
            return (f"the ZeroMQ handshake with it fails ({self.last}, {times}): "
                    + ("cluster.curve_key differs between this host's config and its, or it sets none"
                       if _CURVE is not None else "it sets a cluster.curve_key and this host's config sets none")
                    + ", or it is no Mariana service")
        if self.last.startswith("HANDSHAKE_FAILED"):
            return f"a ZeroMQ handshake with it failed ({self.last}): it may be starting or stopping"
        if self.last == "HANDSHAKE_SUCCEEDED":
            return None
        if self.connected:
            return ("its port takes the connection but the ZeroMQ handshake does not complete: a cluster.curve_key "
                    "that differs, or something else listens there")
        return "no connection to it opens (refused, or the address is not reachable from this host)"


Handler = Callable[[bytes, Message], "list | None | Awaitable[list | None]"]


class Server:
    """A ROUTER that answers requests: `handler(peer, msg)` returns reply frames (or
    None to reply later with `reply`), or an awaitable of them. A synchronous answer
    goes out at once; an awaitable runs as a task, so one may wait (a held lease)
    while others are served."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, handler: Handler, counters: Counter,
                 max_bytes: int = protocol.MAX_MESSAGE_BYTES, name: str = "server"):
        self.endpoint, self.handler, self.counters, self.max_bytes = endpoint, handler, counters, max_bytes
        self.name = name
        self.channel = _Channel(ctx, zmq.ROUTER, self._received, counters, name)
        self.channel.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.handshakes = HandshakeCounter(ctx, self.channel.sock, counters, name)  # before the bind
        bind(self.channel.sock, endpoint)
        self.tasks: set[asyncio.Task] = set()
        self.channel.start_reading()

    def _received(self, frames: list) -> None:
        peer, body = frames[0].bytes, frames[1:]
        try:
            msg = protocol.decode(body, self.max_bytes)
        except BadMessage as e:
            self.counters["bad_messages"] += 1
            PEER_LOG.warning("%s: bad message from peer %s: %s", self.name, peer.hex()[:8], e)
            self.send(peer, protocol.error_reply(_guess_msg_id(body), e.code, e.detail))
            return
        try:
            reply = self.handler(peer, msg)
        except Exception as e:
            reply = self._failed(peer, msg, e)
        if inspect.isawaitable(reply):
            task = asyncio.create_task(self._finish(peer, msg, reply))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif reply is not None:
            self.send(peer, reply)

    async def _finish(self, peer: bytes, msg: Message, pending: Awaitable) -> None:
        try:
            reply = await pending
        except Exception as e:
            reply = self._failed(peer, msg, e)
        if reply is not None:
            self.send(peer, reply)

    def _failed(self, peer: bytes, msg: Message, e: Exception) -> list:
        """The `Error` answer to a request whose handler raised (counted and logged)."""
        if isinstance(e, (BadMessage, DataFormatError)):  # well-formed frames, wrong content (shapes, ids)
            self.counters["bad_messages"] += 1
            PEER_LOG.warning("%s: bad %s from peer %s: %s", self.name, msg.type, peer.hex()[:8], e)
            # the code travels on its own: the text is the detail (RemoteError puts "code: " before it)
            return protocol.error_reply(msg.msg_id, getattr(e, "code", "bad_data"), getattr(e, "detail", str(e)))
        if isinstance(e, MarianaError):
            self.counters["errors"] += 1
            if not getattr(e, "said", False):  # (a refused Hello is said by the coordinator, once: coord_hello)
                PEER_LOG.warning("%s: cannot serve %s: %s", self.name, msg.type, e)
            return protocol.encode("Error", msg.msg_id, code=type(e).__name__, error=str(e),
                                   **getattr(e, "fields", {}))  # what else the error names (NameTaken's holder)
        # a bug must not kill the server; it answers and logs the trace
        self.counters["errors"] += 1
        log.error("%s: %s failed", self.name, msg.type, exc_info=e)
        return protocol.error_reply(msg.msg_id, "internal", f"{type(e).__name__}: {e}")

    def send(self, peer: bytes, frames: list) -> None:
        """A reply or command to a peer; dropped (and counted) when the peer has gone away
        or is not reading (a ROUTER never blocks)."""
        try:
            sent = self.channel.send_now([peer, *frames])
        except zmq.ZMQError as e:
            sent = False
            log.debug("%s: message to %s not sent: %s", self.name, peer.hex()[:8], e)
        if not sent:
            self.counters["unsent_replies"] += 1

    async def drain(self, timeout: float) -> None:
        """Stop taking requests; let handlers in flight finish (up to `timeout`)."""
        self.channel.stop_reading()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.handshakes.close()
        self.channel.close()


class HandshakeCounter(_Monitor):
    """A server's failed ZeroMQ handshakes, counted (`handshake_failures`) and logged at most
    once per LOG_SECONDS: a host whose cluster.curve_key differs, or a stranger, is otherwise
    invisible on this side (its messages never arrive). ZeroMQ does not say which peer failed."""

    LOG_SECONDS = 10.0

    def __init__(self, ctx: zmq.asyncio.Context, sock: zmq.Socket, counters: Counter, name: str):
        super().__init__(ctx, sock, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                         | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.counters, self.name = counters, name
        self.unsaid, self.said_at = 0, float("-inf")
        self.loop = asyncio.get_running_loop()
        self.fd = self.reader.getsockopt(zmq.FD)
        self.loop.add_reader(self.fd, self._read)
        self.loop.call_soon(self._read)  # edge-triggered: look now

    def _read(self) -> None:
        for event in self.events():
            self.counters["handshake_failures"] += 1
            self.unsaid += 1
            now = time.monotonic()
            if now - self.said_at >= self.LOG_SECONDS:
                # (the event names this socket's endpoint, not the peer's: ZeroMQ does not say who)
                kind = zmq.Event(event["event"]).name
                PEER_LOG.warning("%s: %d failed ZeroMQ handshakes at %s, the last %s: %s", self.name, self.unsaid,
                                 event.get("endpoint", b"").decode("utf-8", "replace") or "?", kind,
                                 handshake_blame(kind))
                self.unsaid, self.said_at = 0, now

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        super().close()


def handshake_blame(kind: str) -> str:
    """Who a server's failed handshake of this kind points at. A peer that closed its
    connection in the handshake (it stopped, or is no ZeroMQ peer: a port scan) fails with
    NO_DETAIL, which a key that differs can give too; PROTOCOL and AUTH are a key that differs
    or none (the log used to blame the key for every kind).

    >>> handshake_blame("HANDSHAKE_FAILED_PROTOCOL")
    "a peer whose cluster.curve_key differs from this host's, or that has none"
    >>> handshake_blame("HANDSHAKE_FAILED_NO_DETAIL")
    "a peer that closed its connection in the handshake (it stopped, or is not a ZeroMQ peer), or whose ..."
    """
    key = "cluster.curve_key differs from this host's, or that has none"
    if kind == "HANDSHAKE_FAILED_NO_DETAIL":
        return ("a peer that closed its connection in the handshake (it stopped, or is not a ZeroMQ peer), "
                f"or whose {key}")
    return f"a peer whose {key}"


def _guess_msg_id(frames: list) -> int:
    """The msg_id of a message that failed its checks, when frame 0 still says it."""
    try:
        import msgpack

        head = msgpack.unpackb(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0], raw=False)
        mid = head.get("msg_id", 0) if isinstance(head, dict) else 0
        return mid if isinstance(mid, int) and not isinstance(mid, bool) else 0
    except Exception:
        return 0
