"""An HTTP/1.1 load generator for bench/serving.py: open loop (constant arrival
rate) or closed loop, on a pool of keep-alive connections, in its own process.

    .venv/bin/python bench/loadgen.py --port 8080 --bodies bodies.jsonl --rate 2000 --duration 10
    .venv/bin/python bench/loadgen.py --port 8080 --bodies batch.jsonl --closed 4 --duration 10

Open loop (`--rate R`): request i is due at start + i/R. At that moment it
goes out on a free connection (connections are used in turn, so all of them
carry load and SO_REUSEPORT's spread over the server's workers holds); if
none is free it waits in a queue, and the wait counts. Latency = from the
*scheduled* time to the last byte of the response, so a stalled server cannot
hide its queue (no coordinated omission). Also kept: from the send to the last
byte (`service`), and the generator's own lateness (`lag` = send - scheduled:
queueing for a connection, and this process waiting for a core).

Closed loop (`--closed K`): K connections, each sends its next request as soon
as its answer is complete; latency from send to answer.

Requests scheduled in the first `--warmup` seconds are sent but not counted.
One request at a time per connection (no pipelining). Each body (one line of
`--bodies`, sent as is) is wrapped into request bytes once, before the run.
Responses are parsed only as far as the status line, Content-Length (or
chunked), X-Model-Version (or the body's "model_version"), and a check that a
2xx body holds "pctr". Errors: non-2xx answers (by status), 2xx bodies without
"pctr", connections that failed or closed with a request in flight (not
retried), and in an open-loop run requests still unanswered when it stops
(`unfinished`: counted in the percentiles with the time they had waited).
An open-loop run stops early (`aborted`) once some request has waited
`--abort-after` seconds: the server is past its capacity. `ok_per_s` is the
achieved rate: good answers that arrived inside the measured window, per second.

The event loop is asyncio's over epoll, but it waits with select(2) on the
epoll fd: select's timeout has microsecond resolution where epoll_wait's is a
millisecond, so requests go out on time to within tens of microseconds on an
idle core instead of up to 1 ms late. GC is off during the run.

Prints one JSON object on stdout; progress lines (running p99) on stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import resource
import select
import selectors
import sys
import time
from array import array
from collections import deque

VERSION_HEADER = b"\r\nx-model-version:"
VERSION_KEY = b'"model_version":"'


def percentile(sorted_values, q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    n = len(sorted_values)
    if n == 0:
        return None
    return sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))]


def summary_ms(values) -> dict:
    v = sorted(values)
    out = {f"p{k}": percentile(v, q) for k, q in (("50", .50), ("90", .90), ("95", .95), ("99", .99),
                                                   ("99.9", .999))}
    out["max"] = v[-1] if v else None
    out["mean"] = sum(v) / len(v) if v else None
    return {k: (None if x is None else round(x * 1e3, 4)) for k, x in out.items()}


class Conn(asyncio.Protocol):
    """One keep-alive connection; `req` is the request in flight (scheduled, sent) or None."""

    def __init__(self, gen: "Generator"):
        self.gen = gen
        self.transport = None
        self.buf = bytearray()
        self.req = None
        self.need = -1          # bytes of the whole response once the head is read; -2: chunked
        self.head = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.gen.on_free(self)

    def send(self, request: bytes, scheduled: float, now: float) -> None:
        self.req = (scheduled, now)
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.need == -1:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head = head = bytes(buf[:end + 2]).lower()
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                self.need = end + 4 + int(head[i + 17:head.index(b"\r\n", i + 2)])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.need = -2
            else:  # no length: the body ends with the connection (not expected from these servers)
                self.need = -3
                return
        if self.need == -2:
            if not buf.endswith(b"0\r\n\r\n"):
                return
        elif self.need == -3 or len(buf) < self.need:
            return
        self._complete()

    def _complete(self) -> None:
        head, buf = self.head, self.buf
        status = int(head[9:12])
        version = None
        i = head.find(VERSION_HEADER)
        if i >= 0:
            version = head[i + len(VERSION_HEADER):head.index(b"\r\n", i + 2)].strip().decode()
        body_ok = True
        if 200 <= status < 300:
            body = buf[len(head) + 2:]
            body_ok = b'"pctr"' in body
            if version is None:
                j = body.find(VERSION_KEY)
                if j >= 0:
                    version = bytes(body[j + len(VERSION_KEY):body.index(b'"', j + len(VERSION_KEY))]).decode()
        req, self.req = self.req, None
        self.buf = bytearray()
        self.need = -1
        if b"\r\nconnection: close" in head:
            self.gen.record(req, status, version, body_ok)
            self.transport.close()  # connection_lost opens a new one
            return
        self.gen.record(req, status, version, body_ok)
        self.gen.on_free(self)

    def connection_lost(self, exc) -> None:
        if self.need == -3 and self.req is not None:  # a body delimited by the close
            self._complete()
        elif self.req is not None:
            self.gen.record(self.req, None, None, False, error="closed with a request in flight"
                            + (f" ({type(exc).__name__})" if exc else ""))
            self.req = None
        self.gen.on_lost(self)


class Generator:
    def __init__(self, args: argparse.Namespace, requests: list[bytes]):
        self.args, self.requests = args, requests
        self.loop = asyncio.get_running_loop()
        self.free: deque[Conn] = deque()
        self.conns: set[Conn] = set()
        self.queue: deque[float] = deque()      # scheduled times of due requests waiting for a connection
        self.next_i = 0
        self.sent = 0
        self.timer = None
        self.closed_loop = args.closed > 0
        self.rate = args.rate
        self.total = 0 if self.closed_loop else int(round(args.rate * (args.warmup + args.duration)))
        self.start = self.measure_from = self.end = 0.0
        self.running = False
        self.stopping = False
        self.aborted = False
        self.done = asyncio.Event()
        # measured requests (scheduled at or after measure_from)
        self.latency, self.service, self.lag, self.sched = array("d"), array("d"), array("d"), array("d")
        self.status: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        self.completed_all = 0
        self.ok_in_window = 0   # good answers that arrived inside the measured window: the achieved rate
        self.connect_failures = 0
        self.reconnects = 0
        self.progress_mark = 0

    # -- connections ------------------------------------------------------------------
    async def connect(self, n: int) -> None:
        results = await asyncio.gather(*(self._open() for _ in range(n)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if len(failed) == n:
            raise ConnectionError(f"could not connect to {self.args.host}:{self.args.port}: {failed[0]}")

    async def _open(self) -> None:
        try:
            await self.loop.create_connection(lambda: Conn(self), self.args.host, self.args.port)
        except OSError as e:
            self.connect_failures += 1
            self.errors[f"connect: {type(e).__name__}"] = self.errors.get(f"connect: {type(e).__name__}", 0) + 1
            raise

    def on_lost(self, conn: Conn) -> None:
        self.conns.discard(conn)
        try:
            self.free.remove(conn)
        except ValueError:
            pass
        if not self.stopping:
            self.reconnects += 1
            self.loop.call_later(0.05, lambda: self.loop.create_task(self._reopen()))

    async def _reopen(self) -> None:
        try:
            await self._open()
        except OSError:
            if not self.stopping:
                self.loop.call_later(0.2, lambda: self.loop.create_task(self._reopen()))

    def on_free(self, conn: Conn) -> None:
        self.conns.add(conn)
        if self.stopping:
            self._maybe_done()
            return
        if self.closed_loop and self.running:
            self._send(conn, self.loop.time())
            return
        self.free.append(conn)
        if self.queue:
            self.pump()
        elif self.next_i >= self.total and self.running:
            self._maybe_done()

    # -- open loop --------------------------------------------------------------------
    def sched_time(self, i: int) -> float:
        return self.start + i / self.rate

    def pump(self) -> None:
        now = self.loop.time()
        while self.next_i < self.total and self.sched_time(self.next_i) <= now:
            self.queue.append(self.sched_time(self.next_i))
            self.next_i += 1
        free, queue = self.free, self.queue
        while queue and free:
            self._send(free.popleft(), queue.popleft(), now)
        if self.next_i < self.total:
            if self.timer is None:
                self.timer = self.loop.call_at(self.sched_time(self.next_i), self._on_timer)
        elif not queue:
            self._maybe_done()

    def _on_timer(self) -> None:
        self.timer = None
        self.pump()

    def _send(self, conn: Conn, scheduled: float, now: float | None = None) -> None:
        now = self.loop.time() if now is None else now
        conn.send(self.requests[self.sent % len(self.requests)], scheduled, now)
        self.sent += 1

    # -- results ----------------------------------------------------------------------
    def record(self, req, status, version, body_ok: bool, error: str | None = None) -> None:
        now = self.loop.time()
        self.completed_all += 1
        scheduled, sent = req
        if not self.closed_loop and self.measure_from <= now <= self.end and scheduled < self.measure_from \
                and status is not None and 200 <= status < 300 and body_ok:
            self.ok_in_window += 1  # a warm-up request answered inside the window counts for the achieved rate
        if self.closed_loop:
            measured = self.measure_from <= sent and now <= self.end
            scheduled = sent
        else:
            measured = scheduled >= self.measure_from
        if not measured:
            return
        if status is not None:
            key = str(status)
            self.status[key] = self.status.get(key, 0) + 1
            if not 200 <= status < 300:
                error = f"HTTP {status}"
            elif not body_ok:
                error = "2xx without pctr"
        if error is not None:
            self.errors[error] = self.errors.get(error, 0) + 1
        else:
            if now <= self.end:
                self.ok_in_window += 1
            if version is not None:
                self.versions[version] = self.versions.get(version, 0) + 1
        self.latency.append(now - scheduled)
        self.service.append(now - sent)
        self.lag.append(sent - scheduled)
        self.sched.append(scheduled - self.measure_from)

    def in_flight(self) -> list[float]:
        return [c.req[0] for c in self.conns if c.req is not None]

    def _maybe_done(self) -> None:
        if not self.in_flight() and (self.closed_loop or self.stopping or
                                     (self.next_i >= self.total and not self.queue)):
            self.done.set()

    async def watch(self) -> None:
        """Progress lines, and the open-loop abort when some request has waited too long."""
        a = self.args
        last = self.loop.time()
        while not self.done.is_set():
            await asyncio.sleep(0.25)
            now = self.loop.time()
            if not self.closed_loop and not self.aborted and a.abort_after > 0:
                oldest = min(self.in_flight() + ([self.queue[0]] if self.queue else []), default=now)
                if now - oldest > a.abort_after:
                    self.aborted = True
                    self.total = self.next_i  # schedule nothing more
                    note(a, f"aborted at {now - self.start:.1f} s: a request has waited "
                            f"{now - oldest:.1f} s (overloaded)")
                    self.done.set()
                    return
            if a.progress > 0 and now - last >= a.progress:
                last = now
                window = sorted(self.latency[self.progress_mark:])
                self.progress_mark = len(self.latency)
                total_p99 = percentile(sorted(self.latency), .99)
                n_err = sum(self.errors.values())
                note(a, f"{now - self.start:5.1f} s: p99 {fmt_ms(percentile(window, .99))} last "
                        f"{a.progress:g} s, {fmt_ms(total_p99)} so far; {len(self.latency):,} answered"
                        f"{f', {n_err} ERRORS' if n_err else ''}")

    async def run(self) -> dict:
        a = self.args
        await self.connect(a.closed if self.closed_loop else a.connections)
        gc.collect()
        gc.disable()
        cpu0, t_wall0 = cpu_seconds(), time.perf_counter()
        self.start = self.loop.time() + 0.05
        self.measure_from = self.start + a.warmup
        self.end = self.measure_from + a.duration
        watcher = self.loop.create_task(self.watch())
        if self.closed_loop:
            await asyncio.sleep(self.start - self.loop.time())
            self.running = True
            for conn in list(self.free):
                self._send(conn, self.loop.time())
            self.free.clear()
            await asyncio.sleep(max(0.0, self.end - self.loop.time()))
            self.stopping = True
            self._maybe_done()
            try:
                await asyncio.wait_for(self.done.wait(), a.drain)
            except asyncio.TimeoutError:
                pass
        else:
            self.running = True
            self.loop.call_at(self.start, self.pump)
            try:
                await asyncio.wait_for(self.done.wait(), a.warmup + a.duration + 0.05 + a.drain)
            except asyncio.TimeoutError:
                pass
        stopped = self.loop.time()
        self.stopping = True
        if self.timer is not None:
            self.timer.cancel()
        watcher.cancel()
        unfinished = []
        if not self.closed_loop:  # waited on and never answered: counted with the time they waited
            unfinished = [s for s in self.in_flight() + list(self.queue) if s >= self.measure_from]
            for s in unfinished:
                self.latency.append(stopped - s)
                self.sched.append(s - self.measure_from)
        cpu1, wall = cpu_seconds(), time.perf_counter() - t_wall0
        for c in list(self.conns):
            c.req = None  # counted above as unfinished, not as a closed connection
            c.transport.close()
        gc.enable()
        return self.result(unfinished, stopped, cpu1 - cpu0, wall)

    def result(self, unfinished: list[float], stopped: float, cpu: float, wall: float) -> dict:
        a = self.args
        window = (min(stopped, self.end) - self.measure_from) if not self.closed_loop else a.duration
        answered = len(self.service)
        ok = sum(n for s, n in self.status.items() if s.startswith("2")) - self.errors.get("2xx without pctr", 0)
        errors = dict(self.errors)
        if unfinished:
            errors["unfinished"] = len(unfinished)
        return {
            "mode": "closed" if self.closed_loop else "open",
            "offered_rate": None if self.closed_loop else self.rate,
            "connections": a.closed if self.closed_loop else a.connections,
            "warmup_s": a.warmup, "duration_s": a.duration,
            "measured_s": round(window, 3),
            "scheduled": None if self.closed_loop else len(self.sched),
            "answered": answered, "ok": ok,
            "ok_per_s": round(self.ok_in_window / window, 1) if window > 0 else None,
            "status": self.status, "errors": errors, "error_count": sum(errors.values()),
            "aborted": self.aborted, "unfinished": len(unfinished),
            "latency_ms": summary_ms(self.latency),
            "service_ms": summary_ms(self.service),
            "lag_ms": summary_ms(self.lag),
            "versions": self.versions,
            "reconnects": self.reconnects, "connect_failures": self.connect_failures,
            "loadgen_cpu_s": round(cpu, 3), "loadgen_cpu_share": round(cpu / wall, 3) if wall > 0 else None,
            "per_second": per_second(self.sched, self.latency),
        }


class PreciseEpollSelector(selectors.EpollSelector):
    """epoll, waiting with select(2) on the epoll fd itself: a microsecond timeout where
    epoll_wait rounds up to the next millisecond (which would make requests leave up to
    1 ms late), for the cost of one cheap select on one fd per wait."""

    def select(self, timeout=None):
        if timeout is None or timeout > 0:
            try:
                select.select([self._selector.fileno()], [], [], timeout)
            except InterruptedError:
                pass
            timeout = 0
        return super().select(timeout)


def per_second(sched, latency) -> list[dict]:
    """Counted requests by the second they were scheduled in: count, p50, p99, max (ms)."""
    buckets: dict[int, list[float]] = {}
    for s, lat in zip(sched, latency):
        buckets.setdefault(int(s), []).append(lat)
    out = []
    for sec in sorted(buckets):
        v = sorted(buckets[sec])
        out.append({"s": sec, "n": len(v), "p50": round(percentile(v, .5) * 1e3, 3),
                    "p99": round(percentile(v, .99) * 1e3, 3), "max": round(v[-1] * 1e3, 3)})
    return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def note(args: argparse.Namespace, message: str) -> None:
    print(f"{args.label}: {message}" if args.label else message, file=sys.stderr, flush=True)


def build_requests(args: argparse.Namespace) -> list[bytes]:
    with open(args.bodies, "rb") as f:
        bodies = [line.rstrip(b"\n") for line in f if line.strip()]
    if not bodies:
        raise SystemExit(f"{args.bodies}: no request bodies")
    head = (f"POST {args.path} HTTP/1.1\r\nHost: {args.host}:{args.port}\r\n"
            f"Content-Type: {args.content_type}\r\nContent-Length: ").encode()
    return [head + str(len(b)).encode() + b"\r\n\r\n" + b for b in bodies]


async def main_async(args: argparse.Namespace) -> dict:
    gen = Generator(args, build_requests(args))
    return await gen.run()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default="/v1/predict")
    p.add_argument("--content-type", default="application/json")
    p.add_argument("--bodies", required=True, help="file of request bodies, one per line, sent in turn")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second")
    p.add_argument("--connections", type=int, default=64, help="open loop: keep-alive connections")
    p.add_argument("--closed", type=int, default=0, help="closed loop on this many connections (instead of --rate)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before the measured ones (not counted)")
    p.add_argument("--drain", type=float, default=2.0, help="seconds to wait for answers after the last send")
    p.add_argument("--abort-after", type=float, default=2.0,
                   help="open loop: stop once a request has waited this long (0: never)")
    p.add_argument("--progress", type=float, default=0.0, help="a progress line every this many seconds (0: none)")
    p.add_argument("--label", default="", help="prefix of the progress lines")
    p.add_argument("--selector", choices=("precise", "select", "epoll"), default="precise",
                   help="how the loop waits: epoll with a select(2) timeout (default), select(2) on every "
                        "socket, or plain epoll (its timeouts are rounded up to whole milliseconds)")
    args = p.parse_args(argv)
    if (args.rate > 0) == (args.closed > 0):
        p.error("give exactly one of --rate R (open loop) or --closed K")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selector = {"precise": PreciseEpollSelector, "select": selectors.SelectSelector,
                "epoll": selectors.EpollSelector}[args.selector]()
    loop = asyncio.SelectorEventLoop(selector)
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(main_async(args))
    except ConnectionError as e:
        print(json.dumps({"fatal": str(e)}))
        return 2
    finally:
        loop.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
