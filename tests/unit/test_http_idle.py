"""The runner every HTTP server here uses closes connections that never send a whole request,
whatever aiohttp's version. aiohttp >= 3.14.4 (this venv's) does that itself, so each test
first takes away the timer it arms at the connection's start: what aiohttp 3.9 to 3.14.3 do
(the GPU hosts' image had one: tests/integration/test_serving_hardening.py failed there)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from mariana.services.runtime.http_idle import IdleClosingRunner

SECONDS = 0.4


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def serve(runner_cls) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/", ok)
    runner = runner_cls(app, keepalive_timeout=SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def connect_as_before_3_14_4(runner: web.AppRunner, port: int, sent: bytes):
    """A connection that sends `sent`, with aiohttp's start-of-connection timer taken away."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(sent)
    await writer.drain()
    for _ in range(100):
        if runner.server.connections:
            break
        await asyncio.sleep(0.01)
    (handler,) = runner.server.connections
    if handler._keepalive_handle is not None:
        handler._keepalive_handle.cancel()
        handler._keepalive_handle = None
    return reader, writer


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), seconds) == b""
    except asyncio.TimeoutError:
        return False


async def test_a_connection_that_sends_nothing_or_half_a_head_is_closed():
    runner, port = await serve(IdleClosingRunner)
    try:
        for sent in (b"", b"GET / HTTP/1.1\r\nHost: x\r\n"):
            reader, writer = await connect_as_before_3_14_4(runner, port, sent)
            t0 = asyncio.get_running_loop().time()
            assert await closed_within(reader, SECONDS + 1.5), sent
            assert asyncio.get_running_loop().time() - t0 >= SECONDS * 0.5  # not at once
            writer.close()
    finally:
        await runner.cleanup()


async def test_aiohttp_before_3_14_4_alone_keeps_it_open():
    """The control: the same connection to a plain AppRunner stays open (what the sweep is for)."""
    runner, port = await serve(web.AppRunner)
    try:
        reader, writer = await connect_as_before_3_14_4(runner, port, b"")
        assert not await closed_within(reader, SECONDS + 1.5)
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_connection_that_had_an_answer_is_left_to_aiohttp_keep_alive():
    """Idle after an answer, a connection is aiohttp's to close (its own timer), however long
    ago it opened: five requests on one connection, the last 2.4 x SECONDS after it opened."""
    runner, port = await serve(IdleClosingRunner)
    try:
        reader, writer = await connect_as_before_3_14_4(runner, port, b"")
        for _ in range(5):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            assert await reader.readexactly(2) == b"ok"
            await asyncio.sleep(SECONDS * 0.6)  # under aiohttp's keep-alive, over the sweep's period
        assert await closed_within(reader, SECONDS + 1.5)  # aiohttp's keep-alive, after the answer
        writer.close()
    finally:
        await runner.cleanup()
