"""Streams `SparseBatch`es from files, parsed and hashed on worker threads so
that parsing overlaps training (pyarrow, numpy and torch release the GIL for
their heavy work). At most `prefetch + workers` blocks are in flight, so
memory stays at a few blocks whatever the file size.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

from sparse.batch import SparseBatch
from sparse.encode import Encoder
from sparse.parse import BlockTask, ParseStats, Reader


class BatchStream:
    """Iterate encoded blocks of `paths` (or, with `batch_rows`, batches of that
    many rows with their unique ids found); `stats` holds the parse counts.
    With `slots`, every block comes as (batch or None when no row of it was valid,
    (data lines, each row's slot among them)): `BlockTask.row_slots`, for output
    that keeps one line per input line.

    A reader thread reads (and gunzips) blocks, `workers` threads parse, hash
    and dedupe them while the caller trains; blocks come out in file order.
    Iterating again re-reads the files (one epoch per iteration). An error on
    a worker (a wrong format) is raised in the caller where the failing block
    would have been.
    """

    def __init__(self, paths: list[str], encoder: Encoder, block_bytes: int = 8 << 20,
                 prefetch: int = 2, threads: bool = False, labeled: bool | None = True,
                 batch_rows: int | None = None, workers: int = 2, slots: bool = False):
        if slots and batch_rows:
            raise ValueError("slots come per block: no batch_rows with them")
        self.paths, self.encoder, self.batch_rows, self.slots = list(paths), encoder, batch_rows, slots
        self.block_bytes, self.prefetch, self.threads, self.labeled = block_bytes, prefetch, threads, labeled
        self.workers = max(1, workers)
        self.stats = ParseStats()

    def __iter__(self) -> Iterator[SparseBatch]:
        reader = Reader(self.paths, self.encoder.schema, self.block_bytes, self.labeled, self.threads)
        self.stats = ParseStats()
        # Futures in file order; the bound keeps memory at a few blocks.
        futures: queue.Queue = queue.Queue(maxsize=self.prefetch + self.workers)
        stop = threading.Event()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="mariana-parse") as pool:
            def feed() -> None:  # reading and gunzip happen here, off the training thread
                try:
                    for i, task in enumerate(reader.tasks()):
                        if not _put(futures, pool.submit(self._process, task, f"b{i}"), stop):
                            return
                    _put(futures, None, stop)
                except BaseException as e:  # raised in the consumer, in order
                    _put(futures, e, stop)

            feeder = threading.Thread(target=feed, name="mariana-read", daemon=True)
            feeder.start()
            try:
                while (item := futures.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield from self._collect(item)
            finally:
                stop.set()
                while not futures.empty():
                    item = futures.get_nowait()
                    if isinstance(item, Future):
                        item.cancel()
                feeder.join()

    def _collect(self, fut: Future) -> list:
        batches, stats, slots = fut.result()
        self.stats.merge(stats)
        if self.slots:
            return [(batches[0] if batches else None, slots)]
        return batches

    def _process(self, task: BlockTask, batch_id: str) -> tuple[list[SparseBatch], ParseStats, tuple | None]:
        chunk, stats = task.run()
        slots = task.row_slots(chunk) if self.slots else None
        if not chunk.num_rows:
            return [], stats, slots
        block = self.encoder.encode(chunk, batch_id=batch_id)
        if not self.batch_rows:
            return [block], stats, slots
        batches = block.split(self.batch_rows)
        for b in batches:
            b.unique()
        return batches, stats, slots


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless the consumer has stopped; False when it has."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
