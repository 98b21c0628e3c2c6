"""Streams `SparseBatch`es from files, parsed and hashed on worker threads so
that parsing overlaps training (pyarrow, numpy and torch release the GIL for
their heavy work). At most `prefetch + workers` blocks are in flight, so
memory stays at a few blocks whatever the file size.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

from sparse.batch import SparseBatch
from sparse.encode import Encoder
from sparse.parse import BlockTask, ParseStats, Reader


class BatchStream:
    """Iterate encoded blocks of `paths` (or, with `batch_rows`, batches of that
    many rows with their unique ids found); `stats` holds the parse counts.

    `workers` threads parse, hash and dedupe blocks while the caller trains;
    blocks come out in file order. Iterating again re-reads the files (one
    epoch per iteration). An error on a worker (a wrong format) is raised in
    the caller where the failing block would have been.
    """

    def __init__(self, paths: list[str], encoder: Encoder, block_bytes: int = 8 << 20,
                 prefetch: int = 2, threads: bool = False, labeled: bool | None = True,
                 batch_rows: int | None = None, workers: int = 2):
        self.paths, self.encoder, self.batch_rows = list(paths), encoder, batch_rows
        self.block_bytes, self.prefetch, self.threads, self.labeled = block_bytes, prefetch, threads, labeled
        self.workers = max(1, workers)
        self.stats = ParseStats()

    def __iter__(self) -> Iterator[SparseBatch]:
        reader = Reader(self.paths, self.encoder.schema, self.block_bytes, self.labeled, self.threads)
        self.stats = ParseStats()
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="mariana-parse") as pool:
            try:
                for i, task in enumerate(reader.tasks()):
                    pending.append(pool.submit(self._process, task, f"b{i}"))
                    while len(pending) > self.prefetch + self.workers - 1:
                        yield from self._collect(pending.popleft())
                while pending:
                    yield from self._collect(pending.popleft())
            finally:
                for fut in pending:
                    fut.cancel()

    def _collect(self, fut: Future) -> list[SparseBatch]:
        batches, stats = fut.result()
        self.stats.merge(stats)
        return batches

    def _process(self, task: BlockTask, batch_id: str) -> tuple[list[SparseBatch], ParseStats]:
        chunk, stats = task.run()
        if not chunk.num_rows:
            return [], stats
        block = self.encoder.encode(chunk, batch_id=batch_id)
        if not self.batch_rows:
            return [block], stats
        batches = block.split(self.batch_rows)
        for b in batches:
            b.unique()
        return batches, stats
