"""Between the HTTP endpoints and the model: which version answers, and how
requests reach it without blocking the event loop.

- `ModelHolder` holds the version in service; a swap replaces the reference,
  so a request keeps the `Predictor` it started with until it is answered.
- `Batcher` answers the requests that queued up together, with one model call
  (decode, check, hash, one forward pass, encode), so under load each request
  pays a share of a call instead of a call of its own. A batch of small bodies
  (together at most `serve.inline_bytes`: about a millisecond of work) is
  answered on the event loop; a bigger one on the model thread, so the loop
  never stops for long (model versions load on a thread of their own). A small
  request that finds nothing queued, the first of its turn of the loop, is
  answered at once, with no hand-off.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from mariana.serving import codec
from mariana.serving.errors import ServeError
from mariana.serving.predictor import Predictor

log = logging.getLogger(__name__)


@dataclass
class Answer:
    status: int
    body: bytes
    content_type: str
    version: str
    instances: int = 0
    unknown_fields: int = 0
    error: str = ""
    unknown_creatives: int = 0
    scored: bool = True  # its instances reached the model call (False: its body did not decode)


class ModelHolder:
    def __init__(self) -> None:
        self.current: Predictor | None = None

    @property
    def version(self) -> str | None:
        return self.current.version if self.current else None

    def swap(self, new: Predictor) -> Predictor | None:
        old, self.current = self.current, new
        return old


@dataclass
class _Pending:
    predictor: Predictor
    body: bytes
    fmt: str
    future: asyncio.Future | None  # None: answered at once, not queued


class Batcher:
    def __init__(self, max_requests: int, max_instances: int, inline_bytes: int = 0,
                 on_batch: Callable[[int, str], None] = lambda n, where: None):
        self.max_requests, self.max_instances, self.on_batch = max_requests, max_instances, on_batch
        self.inline_bytes = inline_bytes
        self.pending: deque[_Pending] = deque()
        self.wake = asyncio.Event()
        # The model thread takes (batch, future) jobs and hands each future its answers
        # with one call_soon_threadsafe: no executor futures, locks or chaining per batch.
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._model_thread, name="mariana-predict", daemon=True)
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.alone = False  # a request was answered at once in this turn of the loop
        self.busy = False   # a batch is on the model thread

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread.start()
        self.task = asyncio.create_task(self._run(), name="batcher")

    async def answer(self, predictor: Predictor, body: bytes, fmt: str) -> Answer:
        if not (self.alone or self.pending or self.busy) and len(body) <= self.inline_bytes:
            # The first small request of this turn of the loop, nothing queued: answered here and
            # now, without the two turns of the loop a hand-off to the batcher's task costs
            # (at 2,000/s, most requests). Requests that come in the same turn queue behind it
            # and are answered together, so under load the batching is as before.
            self.alone = True
            self.loop.call_soon(self._next_turn)
            (answer,) = self._answer_here([_Pending(predictor, body, fmt, None)])
            if answer.scored:
                self.on_batch(1, "loop")
            return answer
        future = self.loop.create_future()
        self.pending.append(_Pending(predictor, body, fmt, future))
        self.wake.set()
        return await future

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.jobs.put(None)
        await asyncio.to_thread(self.thread.join)

    async def _run(self) -> None:
        while True:
            while not self.pending:
                self.wake.clear()
                await self.wake.wait()
            batch = self._take()
            where = "loop" if sum(len(p.body) for p in batch) <= self.inline_bytes else "thread"
            if where == "loop":
                # A few small bodies: about a millisecond at most, answered here. Handing them to
                # the model thread would cost more than that in latency (each hand-off waits for
                # the GIL, up to a switch interval), and save nothing in CPU.
                answers = self._answer_here(batch)
            else:
                done = self.loop.create_future()
                self.jobs.put((batch, done))
                self.busy = True
                try:
                    answers = await done  # one batch at a time: the next one gathers meanwhile
                finally:
                    self.busy = False
            for p, a in zip(batch, answers):
                if not p.future.done():  # the client may have gone
                    p.future.set_result(a)
            scored = sum(a.scored for a in answers)  # a body that did not decode reached no model call
            if scored:
                self.on_batch(scored, where)
            await asyncio.sleep(0)  # the loop reads and writes before the next batch

    def _next_turn(self) -> None:
        self.alone = False

    def _model_thread(self) -> None:
        while (job := self.jobs.get()) is not None:
            batch, done = job
            self.loop.call_soon_threadsafe(_resolve, done, self._answer_here(batch))

    def _answer_here(self, batch: list[_Pending]) -> list[Answer]:
        try:
            return answer_batch(batch[0].predictor, [(p.body, p.fmt) for p in batch], self.max_instances)
        except Exception as e:  # a bug: this batch's requests get a 500; the next batch is served
            log.exception("predicting a batch of %d requests failed", len(batch))
            err = ServeError(500, f"internal error (logged): {type(e).__name__}")
            return [error_answer(err, p.fmt, p.predictor.version) for p in batch]

    def _take(self) -> list[_Pending]:
        """The oldest request and those behind it for the same version, up to max_requests."""
        first = self.pending.popleft()
        batch = [first]
        while self.pending and self.pending[0].predictor is first.predictor and len(batch) < self.max_requests:
            batch.append(self.pending.popleft())
        return batch


def _resolve(future: asyncio.Future, answers: list[Answer]) -> None:
    if not future.done():
        future.set_result(answers)


def answer_batch(predictor: Predictor, items: list[tuple[bytes, str]], max_instances: int) -> list[Answer]:
    """Decode each body, score the good ones with one model call, encode each answer
    (runs on the batcher's thread)."""
    decoded = []
    for body, fmt in items:
        try:
            decoded.append((*codec.decode(body, fmt, max_instances), None))
        except ServeError as e:
            decoded.append((None, 0, e))
    # Requests of one instance (most, at a few thousand requests/s) in a small call: each scored
    # on its own with few or no numpy calls (`predict_lone`). For LR a call of several takes
    # the code a call of one takes, which keeps it warm: hey's bursts, a lone request then a
    # few queued behind it, cost more CPU a request when the few went through `predict_many`.
    # The DNN's rows share their matrix products in `predict_many` (4 rows: 27 us a row, 44 alone).
    lone = [predictor.predict_lone(d[0][0]) if d[2] is None and len(d[0]) == 1 else None
            for d in decoded] if len(decoded) <= predictor.lone_requests else [None] * len(decoded)
    rest = [d[0] for d, p in zip(decoded, lone) if d[2] is None and p is None]
    scored = iter(predictor.predict_many(rest) if rest else ())
    answers, nonfinite = [], 0
    for (instances, extra_keys, err), (_, fmt), p in zip(decoded, items, lone):
        unknown = extra_keys
        if err is None:
            p = next(scored) if p is None else p
            err, unknown = p.error, unknown + p.unknown_fields
        if err is None:
            pctr = p.pctr if isinstance(p.pctr, list) else p.pctr.tolist()
            if not all(map(math.isfinite, pctr)):  # never a NaN in a 200, in either encoding
                nonfinite += 1
                err = ServeError(500, "internal error (logged): the model gave a pCTR that is not a number")
        if err is not None:
            a = error_answer(err, fmt, predictor.version)
            a.unknown_fields, a.scored = unknown, instances is not None
            answers.append(a)
            continue
        body = codec.encode({"pctr": pctr, "model_version": predictor.version}, fmt)
        answers.append(Answer(200, body, fmt, predictor.version, len(instances), unknown,
                              unknown_creatives=p.unknown_creatives))
    if nonfinite:
        log.error("version %s gave a NaN or infinite pCTR to %d of %d requests; answered 500", predictor.version,
                  nonfinite, len(items))
    return answers


def error_answer(err: ServeError, fmt: str, version: str | None) -> Answer:
    return Answer(err.status, codec.encode({"error": err.message}, fmt), fmt, version or "", error=err.message)
