"""Streams `SparseBatch`es from files, parsed and hashed on worker threads so
that parsing overlaps training (pyarrow, numpy and torch release the GIL for
their heavy work). At most `prefetch + workers` blocks are in flight, so
memory stays at a few blocks whatever the file size.
"""
from __future__ import annotations

import functools
import os
import queue
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from mariana.sparse.batch import SparseBatch
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import ConfigError
from mariana.sparse.parse import BlockTask, Chunk, ParseStats, Reader, is_parquet, open_binary, open_parquet


def count_data_lines(path: str, header: bool) -> int:
    """Data rows of a file: the lines of a text file (gzip or plain) less its header line
    (a last line without a newline counts), or a Parquet file's rows (it has no header).
    A text file is read once per process while its size and mtime stay the same: a
    coordinator checks every job of a search (`mariana tune --mode cluster`) on the same files."""
    if is_parquet(path):
        with open_parquet(path) as pf:
            return pf.metadata.num_rows
    st = os.stat(path)
    return max(_text_lines(os.path.abspath(path), st.st_size, st.st_mtime_ns) - int(header), 0)


@functools.lru_cache(maxsize=256)
def _text_lines(path: str, size: int, mtime_ns: int) -> int:
    """Lines of a text file (gzip or plain); `size` and `mtime_ns` key the cache."""
    lines, last = 0, b"\n"
    with open_binary(path) as f:
        while chunk := f.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


def estimate_rows(paths: list[str], schema, block_bytes: int = 4 << 20) -> int:
    """About how many data rows `paths` hold, without reading them: a Parquet file's row
    count; for a text file its uncompressed size (a gzip file's trailer) over the mean line
    length of its first block."""
    total = 0
    for path in paths:
        if is_parquet(path):
            total += count_data_lines(path, False)
            continue
        task = next(Reader([path], schema, block_bytes).tasks(), None)
        if task is None or not task.num_lines:
            continue
        size = uncompressed_size(path)
        total += task.num_lines if size <= len(task.block) else round(size / (len(task.block) / task.num_lines))
    return total


def uncompressed_size(path: str) -> int:
    """A file's size; for gzip, about what it holds. The trailer's size (mod 2^32) is of the
    last member only: right for one member (taken at the multiple of 2^32 nearest to the
    ratio of the first MiB), nowhere near for `cat`-ed or bgzip files, or a truncated one,
    where the first MiB's ratio times the file's size is the answer."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b" or size < 18:
            return size
        f.seek(0)
        head = f.read(GZIP_SAMPLE)
        f.seek(-4, os.SEEK_END)
        isize = int.from_bytes(f.read(4), "little")
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = len(d.decompress(head, 64 * GZIP_SAMPLE))
    except zlib.error:
        return size
    used = len(head) - len(d.unused_data) - len(d.unconsumed_tail)
    estimate = round(size * out / used) if used and out else size
    isize += max(0, round((estimate - isize) / (1 << 32))) << 32  # the candidate nearest the estimate
    return isize if estimate / 2 <= isize <= estimate * 2 else estimate


GZIP_SAMPLE = 1 << 20  # compressed bytes read to estimate a gzip file's ratio


@dataclass(frozen=True)
class RowRange:
    """Rows [start, stop) of files read in order, counted in data rows (a header line is not
    one; a malformed line still takes its place): `split` cuts a validation tail off.

    >>> train, valid = RowRange.split({"a.tsv": 80, "b.tsv": 20}, 0.25, {"a.tsv": 0, "b.tsv": 0})
    >>> (train.start, train.stop), (valid.start, valid.stop), valid.index("b.tsv", 1)
    ((0, 75), (75, 100), 80)
    """

    offsets: dict[str, int]   # path -> data rows of the files before it
    start: int
    stop: int
    headers: dict[str, int]   # path -> its header lines (0 or 1; a Parquet file has none)

    @classmethod
    def split(cls, rows: dict[str, int], fraction: float,
              headers: dict[str, int]) -> tuple["RowRange", "RowRange"]:
        offsets, total = {}, 0
        for path, n in rows.items():
            offsets[path], total = total, total + n
        cut = total - int(round(total * fraction))
        return cls(offsets, 0, cut, headers), cls(offsets, cut, total, headers)

    @classmethod
    def of_files(cls, paths: list[str], fraction: float, header: bool) -> tuple["RowRange", "RowRange"]:
        """Train and validation ranges of `paths`: the last `fraction` of their data rows."""
        if len({os.path.realpath(p) for p in paths}) != len(paths):  # by a link too: its tail was trained on
            raise ConfigError("train.valid_fraction: a training file is named twice (or by a link to it); name each "
                              "once")
        headers = {p: int(header and not is_parquet(p)) for p in paths}
        return cls.split({p: count_data_lines(p, bool(headers[p])) for p in paths}, fraction, headers)

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def end(self) -> tuple[str, int]:
        """(the last file holding rows before `stop`, its lines up to there, a header line
        included): where a reader of the files' rows before `stop` stops (a cluster's loader).

        >>> r = RowRange({"a.tsv": 0, "b.tsv": 80}, 0, 75, {"a.tsv": 0, "b.tsv": 1})
        >>> r.end(), RowRange(r.offsets, 0, 80, r.headers).end(), RowRange(r.offsets, 0, 90, r.headers).end()
        (('a.tsv', 75), ('a.tsv', 80), ('b.tsv', 11))
        """
        path = [p for p, first in self.offsets.items() if first < self.stop][-1]
        return path, self.stop - self.offsets[path] + self.headers[path]

    def index(self, path: str, line: int | np.ndarray) -> int | np.ndarray:
        """The stream position of `path`'s line (or Parquet row) number `line`, 1-based."""
        return self.offsets[path] + line - 1 - self.headers[path]

    def task_overlaps(self, task: BlockTask) -> bool:
        first = self.index(task.path, task.first_line + task.skip_rows)
        return first < self.stop and first + task.num_lines - task.skip_rows > self.start

    def cut(self, task: BlockTask, chunk, block: SparseBatch) -> SparseBatch:
        """The rows of `block` (parsed from `task`) inside the range."""
        lo, hi = self._bounds(task, chunk)
        return block if (lo, hi) == (0, block.num_rows) else block.slice(lo, hi, block.batch_id)

    def cut_stats(self, task: BlockTask, chunk: Chunk, stats: ParseStats) -> ParseStats:
        """`stats` of the block `task` (parsed into `chunk`) for its lines inside the range: the
        malformed ones of the other part are that part's. A data line is a row of `chunk` or
        malformed, so the bad lines inside are the lines inside less the rows inside.

        >>> r = RowRange({"a.tsv": 0}, 0, 3, {"a.tsv": 0})
        >>> task = BlockTask(None, "a.tsv", 1, b"", 5)
        >>> st = ParseStats(rows_ok=3, file="a.tsv")
        >>> st.add_bad(2, "empty line"); st.add_bad(5, "empty line")
        >>> part = r.cut_stats(task, Chunk({}, None, 3, lines=np.array([1, 3, 4])), st)
        >>> part.rows_ok, part.rows_bad, [b.line for b in part.first_bad]
        (2, 1, [2])
        """
        first = self.index(task.path, task.first_line + task.skip_rows)
        lines = task.num_lines - task.skip_rows
        if self.start <= first and first + lines <= self.stop:
            return stats
        lo, hi = self._bounds(task, chunk)
        inside = max(0, min(self.stop, first + lines) - max(self.start, first))
        clicks = int(np.count_nonzero(chunk.labels[lo:hi])) if chunk.labels is not None else 0
        part = ParseStats(rows_ok=hi - lo, rows_bad=inside - (hi - lo), file=stats.file, clicks=clicks)
        part.first_bad = [b for b in stats.first_bad if self.start <= self.index(task.path, b.line) < self.stop]
        return part

    def _bounds(self, task: BlockTask, chunk: Chunk) -> tuple[int, int]:
        """[lo, hi): the rows of `chunk` (parsed from `task`) inside the range."""
        if not chunk.num_rows:
            return 0, 0
        _, slots = task.row_slots(chunk)
        pos = self.index(task.path, task.first_line + task.skip_rows) + slots
        lo, hi = np.searchsorted(pos, [self.start, self.stop])
        return int(lo), int(hi)


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
                 batch_rows: int | None = None, workers: int = 2, slots: bool = False,
                 rows: RowRange | None = None):
        if slots and (batch_rows or rows):
            raise ValueError("slots come per block: no batch_rows or rows with them")
        self.paths, self.encoder, self.batch_rows, self.slots = list(paths), encoder, batch_rows, slots
        self.rows = rows  # only these rows of the files (a training or a validation part)
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
                        if not put_until_stopped(futures, pool.submit(self._process, task, f"b{i}"), stop):
                            return
                    put_until_stopped(futures, None, stop)
                except BaseException as e:  # raised in the consumer, in order
                    put_until_stopped(futures, e, stop)

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
        if self.rows is not None and not self.rows.task_overlaps(task):
            return [], ParseStats(file=task.path), None  # another part's block: not even parsed
        chunk, stats = task.run()
        slots = task.row_slots(chunk) if self.slots else None
        if self.rows is not None:  # the other part's malformed rows are not this part's
            stats = self.rows.cut_stats(task, chunk, stats)
        if not chunk.num_rows:
            return [], stats, slots
        block = self.encoder.encode(chunk, batch_id=batch_id)
        if self.rows is not None:
            block = self.rows.cut(task, chunk, block)
            if not block.num_rows:
                return [], stats, slots
        if not self.batch_rows:
            return [block], stats, slots
        batches = block.split(self.batch_rows)
        for b in batches:
            b.unique()
        return batches, stats, slots


def put_until_stopped(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless the consumer has stopped; False when it has."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
