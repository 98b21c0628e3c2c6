"""The services' ZeroMQ transport on real loopback sockets: a Client and a Server
in one event loop, answering at once or from a task, refusing bad requests with
the right codes, timing out, and never blocking the loop on a full queue."""
from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
import zmq
import zmq.asyncio

from mariana.services import protocol
from mariana.services.launcher import free_port
from mariana.services.protocol import BadMessage
from mariana.services.transport import DRAIN_BATCH, Client, PeerTimeout, RemoteError, Server, _Channel
from mariana.sparse.errors import DataFormatError, MarianaError


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def with_server(handler, body, **server_args):
    ctx = zmq.asyncio.Context()
    ep = endpoint()
    counters = Counter()
    server = Server(ctx, ep, handler, counters, name="test", **server_args)
    client = Client(ctx, ep, Counter(), timeout=5.0)
    try:
        return await body(client, server, counters)
    finally:
        client.close()
        server.close()
        ctx.destroy(linger=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_sync_and_async_handlers_answer_and_a_held_request_blocks_no_other():
    release = None

    def handler(peer, msg):
        if msg.type == "Lease":  # held until released: runs as a task
            async def held():
                await release.wait()
                return protocol.encode("Wait", msg.msg_id)
            return held()
        ids = msg.arrays["ids"]
        return protocol.encode("Rows", msg.msg_id, {"rows": (ids * 2).astype(np.float32)})

    async def body(client, server, counters):
        nonlocal release
        release = asyncio.Event()
        held = asyncio.create_task(client.call("Lease", worker="w"))
        # more requests at once than one reader callback takes: every one is answered, in any order
        n = 3 * DRAIN_BATCH
        replies = await asyncio.gather(*(client.call("PullRows", {"ids": np.arange(i, i + 5)}, job="j", dense=False)
                                         for i in range(n)))
        assert [r.arrays["rows"].tolist() for r in replies] == [[2.0 * (i + k) for k in range(5)] for i in range(n)]
        assert not held.done()
        release.set()
        assert (await held).type == "Wait"
        assert counters["bad_messages"] == 0 and counters["errors"] == 0

    run(with_server(handler, body))


def test_handler_errors_are_answered_with_their_code_and_counted():
    def handler(peer, msg):
        kind = msg["job"]
        if kind == "bad":
            raise BadMessage("shape", "ids must be 1-d")
        if kind == "data":
            raise DataFormatError("ids out of range")
        if kind == "refused":
            raise MarianaError("no job 'x'")
        if kind == "async-bad":
            async def later():
                raise BadMessage("field", "later")
            return later()
        raise RuntimeError("a bug")

    async def body(client, server, counters):
        for job, code in [("bad", "shape"), ("data", "bad_data"), ("refused", "MarianaError"),
                          ("async-bad", "field"), ("bug", "internal")]:
            with pytest.raises(RemoteError) as e:
                await client.call("GetJob", job=job)
            assert e.value.code == code, (job, e.value)
        # garbage frames: answered with an Error naming the check
        sock = client.channel.sock
        sock.send_multipart([b"\xc1 not msgpack"])
        for _ in range(100):
            if counters["bad_messages"] == 4:
                break
            await asyncio.sleep(0.02)
        assert (counters["bad_messages"], counters["errors"]) == (4, 2)
        assert client.counters["late_replies"] == 1  # the Error to the garbage: msg_id 0, no one waits for it
        with pytest.raises(RemoteError, match="no job"):  # still serving
            await client.call("GetJob", job="refused")

    run(with_server(handler, body))


def test_a_silent_peer_times_out_and_a_full_queue_does_not_block_the_loop():
    async def body():
        ctx = zmq.asyncio.Context()
        client = Client(ctx, endpoint(), Counter(), timeout=0.3)  # nobody listens there
        try:
            with pytest.raises(PeerTimeout, match="did not answer GetJob in 0.3s"):
                await client.call("GetJob", job="j")
            assert client.counters["rpc_timeouts"] == 1
            # DEALER queues up to its high-water mark (1000) for a peer that never comes ...
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            t = asyncio.create_task(ticker())
            sent = 0
            with pytest.raises(PeerTimeout, match="took no Ok"):
                for sent in range(5000):
                    await client.send("Ok")
            t.cancel()
            assert 900 <= sent < 5000  # ... then waits, with the loop free, and gives up
            assert ticks >= 10
        finally:
            client.close()
            ctx.destroy(linger=0)

    run(body())


def test_commands_reach_on_command_in_order_and_late_replies_are_counted():
    seen = []

    async def on_command(msg):
        seen.append(msg["job"])

    async def body():
        ctx = zmq.asyncio.Context()
        ep = endpoint()
        peers = []

        def handler(peer, msg):
            peers.append(peer)
            return protocol.encode("Ok", msg.msg_id)

        counters = Counter()
        server = Server(ctx, ep, handler, counters)
        client = Client(ctx, ep, Counter(), on_command=on_command)
        try:
            await client.call("GetJob", job="hello")
            for i in range(5):
                server.send(peers[0], protocol.encode("ReadSource", 0, job=f"c{i}", files=[], block_bytes=1))
            server.send(peers[0], protocol.encode("Ok", 987654))  # a reply nobody waits for
            server.send(b"no such peer", protocol.encode("Ok", 1))  # dropped: ROUTER never blocks
            for _ in range(100):
                if len(seen) == 5 and client.counters["late_replies"] == 1:
                    break
                await asyncio.sleep(0.02)
            assert seen == [f"c{i}" for i in range(5)]
            assert client.counters["late_replies"] == 1
        finally:
            client.close()
            server.close()
            ctx.destroy(linger=0)

    run(body())


def test_a_message_that_breaks_its_handler_does_not_stop_the_reading():
    """The descriptor is edge-triggered: a reader that stopped half-way would never be woken
    for the messages behind the bad one."""
    got = []

    def on_frames(frames):
        if frames[0].bytes == b"boom":
            raise RuntimeError("a bug in a handler")
        got.append(frames[0].bytes)

    async def body():
        ctx = zmq.asyncio.Context()
        ep = endpoint()
        counters = Counter()
        channel = _Channel(ctx, zmq.PULL, on_frames, counters, "test")
        channel.sock.bind(ep)
        channel.start_reading()
        push = ctx.socket(zmq.PUSH)
        push.connect(ep)
        try:
            for body_ in (b"a", b"boom", b"b", b"c"):
                await push.send(body_)
            for _ in range(100):
                if len(got) == 3:
                    break
                await asyncio.sleep(0.02)
            assert got == [b"a", b"b", b"c"] and counters["errors"] == 1
            channel.close()
            assert channel.send_now([b"x"]) is False  # closed: refused, not a use of a freed socket
            with pytest.raises(zmq.Again):
                await channel.send([b"x"], timeout=5.0)
        finally:
            push.close(linger=0)
            ctx.destroy(linger=0)

    run(body())


def test_a_closed_client_answers_at_once_and_lets_a_retry_loop_be_cancelled():
    """A call on a closed client (a service shutting down) fails with PeerTimeout naming the
    close, after yielding to the loop: a caller that retries on PeerTimeout must not spin
    where no cancellation can reach it (a loader once spun so, 1.2M log lines in 30 s, until
    it was killed)."""
    async def body():
        ctx = zmq.asyncio.Context()
        client = Client(ctx, endpoint(), Counter(), timeout=5.0)
        client.close()
        tries = 0

        async def retry() -> None:
            nonlocal tries
            while tries < 100_000:
                tries += 1
                try:
                    await client.call("Ping")
                except PeerTimeout as e:
                    assert "client closed" in str(e)

        task = asyncio.create_task(retry())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
        return task.cancelled(), tries

    cancelled, tries = run(body())
    assert cancelled and tries < 100_000, tries


def test_requests_failed_by_a_peer_restart_are_said_once_not_each(caplog):
    """fail_pending fails every request in flight with PeerRestarted (the caller that saw the
    restart says so); each caller's own line about it is DEBUG, and a real timeout or an Error
    answer stays a warning (or the caller's level): a worker warned once per cache miss and
    report in flight while its coordinator restarted."""
    import logging

    from mariana.services.transport import PeerRestarted, timeout_log

    async def body():
        ctx = zmq.asyncio.Context()
        ep = endpoint()
        silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
        silent.bind(ep)
        client = Client(ctx, ep, Counter(), timeout=5.0)
        calls = [asyncio.create_task(client.call("GetJob", job="j")) for _ in range(3)]
        await asyncio.sleep(0.2)
        failed = client.fail_pending("the peer restarted")
        errors = await asyncio.gather(*calls, return_exceptions=True)
        client.close()
        silent.close()
        ctx.destroy(linger=0)
        return failed, errors

    failed, errors = run(body())
    assert failed == 3 and all(isinstance(e, PeerRestarted) for e in errors), errors
    log = logging.getLogger("test-timeout-log")
    caplog.set_level(logging.DEBUG, logger="test-timeout-log")
    for e in errors:
        timeout_log(log, e)("could not report: %s", e)
    timeout_log(log, PeerTimeout("no answer in 5s"))("could not report: %s", "no answer")
    timeout_log(log, RemoteError("bad_request", "no such job"))("refused: %s", "no such job")
    timeout_log(log, PeerTimeout("no answer in 5s"), logging.INFO)("lease: %s", "no answer")
    assert [r.levelname for r in caplog.records] == ["DEBUG"] * 3 + ["WARNING", "WARNING", "INFO"]


def test_a_taken_port_says_who_holds_it():
    """Two clusters on one host's fixed ports: each service said "Address already in use" and
    nothing more (an exploratory run); the bind now names the process that listens there."""
    import os
    import socket

    from mariana.services.transport import bind
    from mariana.sparse.errors import MarianaError

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(MarianaError) as e:
            bind(sock, f"tcp://127.0.0.1:{port}")
        assert str(e.value).startswith(f"cannot bind tcp://127.0.0.1:{port}: address already in use "
                                       f"(held by pid {os.getpid()}: "), str(e.value)
    finally:
        sock.close(linger=0)
        ctx.term()
        held.close()


def test_one_failed_handshake_of_a_peer_that_then_goes_away_is_not_taken_for_a_key():
    """A coordinator that died in its start-up failed one handshake, then its port refused:
    the worker blamed a cluster.curve_key nobody had set and exited 78 for good. A peer that
    hangs up on every handshake (as one with another key does) still is taken for one."""
    import socket

    async def body(hangups: int):
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        ctx = zmq.asyncio.Context()
        client = Client(ctx, f"tcp://127.0.0.1:{port}", Counter(), timeout=1.0, watch=True)
        try:
            for _ in range(hangups):  # takes the connection, then hangs up mid-handshake
                conn, _ = await asyncio.to_thread(listener.accept)
                conn.close()
            if hangups == 1:
                listener.close()  # gone: its port refuses from now on
            await asyncio.sleep(1.0)
            return client.trouble(), client.watcher.handshake_failed
        finally:
            listener.close()
            client.close()
            ctx.destroy(linger=0)

    why, failed = run(body(1))
    assert not failed and "curve_key" not in why, why
    why, failed = run(body(5))
    assert failed and "it sets a cluster.curve_key and this host's config sets none" in why, why
