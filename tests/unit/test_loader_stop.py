"""The loader's stop: every read of a source ends in the drain, even one whose
cancellation was lost, and no new read starts once the loader is stopping."""
from __future__ import annotations

import asyncio

from mariana.services.loader import Loader
from mariana.services.protocol import Message
from mariana.services.runtime.config import ClusterConfig


def test_the_drain_ends_a_read_whose_first_cancellation_was_lost():
    """asyncio.wait_for (Python 3.11) can lose a cancellation that meets the reply it waited
    for; a read left running outlived the coordinator client and spun. The drain cancels
    until every read has ended."""
    async def body():
        loader = Loader(ClusterConfig())
        ended = asyncio.Event()

        async def stubborn() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # lost, as wait_for can lose it
            try:
                await asyncio.sleep(30)
            finally:
                ended.set()

        loader.reading["j1"] = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(loader.drain(), 5)
        return ended.is_set(), loader.reading["j1"].cancelled()

    assert asyncio.run(body()) == (True, True)


def test_a_stopping_loader_starts_no_read():
    async def body():
        loader = Loader(ClusterConfig())
        loader.stopping = asyncio.Event()
        loader.stopping.set()
        await loader.on_command(Message("ReadSource", 0, {"job": "j1", "files": ["x.tsv"], "block_bytes": 1024}, {}))
        return loader.reading

    assert asyncio.run(body()) == {}
