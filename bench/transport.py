"""CPU per request/reply round trip of the services' ZeroMQ transport against its peers,
in one run: the cost every training step pays two or three times (docs/benchmarks.md).

    .venv/bin/python bench/transport.py                      # the docs/benchmarks.md numbers
    .venv/bin/python bench/transport.py --round-trips 5000 --repeat 5

Systems, each a client process and a server process on loopback TCP, one request in
flight, the same envelope (`services.protocol` encode/decode) on both sides:

- mariana: `services.transport` Client and Server (sockets read from the event loop's
  reader callback, non-blocking sends, a synchronous handler answering at once);
- pyzmq-asyncio: the usual pyzmq asyncio pattern (what services/transport.py did before
  commit ab1b2b0): `zmq.asyncio` sockets, a reader task resolving a future per request,
  `asyncio.wait_for` on the client, a task per request on the server;
- pyzmq-sync: blocking sockets without an event loop: the floor for Python over pyzmq.

Payloads: `small` (a header only) and `pull` (a PullRows of 18,000 int64 ids answered
with 18,000 float32 rows: the size of a 4096-row Criteo batch's pull). CPU is the
process's user + system time over the measured round trips (ZeroMQ's I/O thread
included), divided by their number; runs are interleaved and the table shows medians.
Writes bench-out/transport/results.json.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mariana.services import protocol  # noqa: E402
from mariana.services.launcher import free_port  # noqa: E402
from mariana.services.transport import Client, Server  # noqa: E402

SYSTEMS = ("mariana", "pyzmq-asyncio", "pyzmq-sync")
PAYLOADS = ("small", "pull")
IDS = np.arange(18_000, dtype=np.int64) * 7
ROWS = np.ones((18_000, 1), np.float32)
WARMUP = 200


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def request(payload: str, msg_id: int) -> list:
    if payload == "pull":
        return protocol.encode("PullRows", msg_id, {"ids": IDS}, job="j", dense=False)
    return protocol.encode("GetJob", msg_id, job="j")


def answer(msg: protocol.Message) -> list:
    return protocol.encode("Rows", msg.msg_id, {"linear": ROWS} if msg.arrays else None)


# ---- servers: answer until an EndJob, then print their CPU per round trip --------------------

def serve(system: str, endpoint: str, n: int) -> dict:
    if system == "pyzmq-sync":
        sock = zmq.Context().socket(zmq.ROUTER)
        sock.bind(endpoint)
        count, c0 = 0, None
        while True:
            frames = sock.recv_multipart(copy=False)
            msg = protocol.decode(frames[1:])
            sock.send_multipart([frames[0], *answer(msg)], copy=False)
            count += 1
            if count == WARMUP:
                c0 = cpu()
            if msg.type == "EndJob":
                return {"cpu_us": (cpu() - c0) / n * 1e6}
    return asyncio.run(_serve_async(system, endpoint, n))


async def _serve_async(system: str, endpoint: str, n: int) -> dict:
    ctx, done, state = zmq.asyncio.Context(), asyncio.Event(), {"count": 0, "c0": 0.0}

    def note(msg):
        state["count"] += 1
        if state["count"] == WARMUP:
            state["c0"] = cpu()
        if msg.type == "EndJob":
            state["c1"] = cpu()
            done.set()

    if system == "mariana":
        def handler(peer, msg):
            note(msg)
            return answer(msg)
        server = Server(ctx, endpoint, handler, Counter())
        await done.wait()
        server.close()
    else:  # pyzmq-asyncio: a reader loop, a task per request
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
        tasks = set()

        async def handle(peer, msg):
            note(msg)
            await sock.send_multipart([peer, *answer(msg)], copy=False)

        async def loop():
            while True:
                frames = await sock.recv_multipart(copy=False)
                t = asyncio.create_task(handle(frames[0].bytes, protocol.decode(frames[1:])))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        reader = asyncio.create_task(loop())
        await done.wait()
        await asyncio.sleep(0.05)  # the EndJob's reply goes out
        reader.cancel()
    return {"cpu_us": (state["c1"] - state["c0"]) / n * 1e6}


# ---- clients: n round trips after a warm-up ----------------------------------------------------

def client(system: str, endpoint: str, payload: str, n: int) -> dict:
    if system == "pyzmq-sync":
        sock = zmq.Context().socket(zmq.DEALER)
        sock.connect(endpoint)
        ids = itertools.count(1)

        def one():
            sock.send_multipart(request(payload, next(ids)), copy=False)
            protocol.decode(sock.recv_multipart(copy=False))

        for _ in range(WARMUP - 1):
            one()
        c0, t0 = cpu(), time.perf_counter()
        for _ in range(n):
            one()
        result = {"cpu_us": (cpu() - c0) / n * 1e6, "wall_us": (time.perf_counter() - t0) / n * 1e6}
        sock.send_multipart(protocol.encode("EndJob", 0, job="j"))
        sock.recv_multipart()
        return result
    return asyncio.run(_client_async(system, endpoint, payload, n))


async def _client_async(system: str, endpoint: str, payload: str, n: int) -> dict:
    ctx = zmq.asyncio.Context()
    if system == "mariana":
        c = Client(ctx, endpoint, Counter(), timeout=30.0)

        async def one():
            if payload == "pull":
                await c.call("PullRows", {"ids": IDS}, job="j", dense=False)
            else:
                await c.call("GetJob", job="j")
    else:  # pyzmq-asyncio: a reader task resolving futures, wait_for on each call
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        pending, ids = {}, itertools.count(1)

        async def reader():
            while True:
                msg = protocol.decode(await sock.recv_multipart(copy=False))
                fut = pending.pop(msg.msg_id, None)
                if fut is not None:
                    fut.set_result(msg)

        read_task = asyncio.create_task(reader())

        async def one():
            msg_id = next(ids)
            fut = asyncio.get_running_loop().create_future()
            pending[msg_id] = fut
            await sock.send_multipart(request(payload, msg_id), copy=False)
            await asyncio.wait_for(fut, 30.0)

    for _ in range(WARMUP - 1):
        await one()
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(n):
        await one()
    result = {"cpu_us": (cpu() - c0) / n * 1e6, "wall_us": (time.perf_counter() - t0) / n * 1e6}
    if system == "mariana":
        await c.call("EndJob", job="j")
        c.close()
    else:
        await sock.send_multipart(protocol.encode("EndJob", 0, job="j"))
        await asyncio.sleep(0.1)
        read_task.cancel()
    return result


# ---- the run -----------------------------------------------------------------------------------

def one_run(system: str, payload: str, n: int) -> dict:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    me = [sys.executable, __file__]
    server = subprocess.Popen(me + ["--serve", system, "--endpoint", endpoint, "--round-trips", str(n)],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    out = subprocess.run(me + ["--client", system, "--endpoint", endpoint, "--payload", payload,
                               "--round-trips", str(n)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        server.kill()
        raise SystemExit(f"{system} {payload} client failed:\n{out.stderr[-2000:]}")
    srv = json.loads(server.communicate(timeout=60)[0].strip().splitlines()[-1])
    cli = json.loads(out.stdout.strip().splitlines()[-1])
    return {"system": system, "payload": payload, "client_cpu_us": cli["cpu_us"], "server_cpu_us": srv["cpu_us"],
            "wall_us": cli["wall_us"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--round-trips", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--serve", choices=SYSTEMS)
    p.add_argument("--client", choices=SYSTEMS)
    p.add_argument("--endpoint")
    p.add_argument("--payload", choices=PAYLOADS, default="small")
    args = p.parse_args()
    if args.serve:
        print(json.dumps(serve(args.serve, args.endpoint, args.round_trips)))
        return 0
    if args.client:
        print(json.dumps(client(args.client, args.endpoint, args.payload, args.round_trips)))
        return 0
    runs = []
    for k in range(args.repeat):  # interleaved: the host's load drifts
        for payload in PAYLOADS:
            for system in SYSTEMS:
                runs.append(one_run(system, payload, args.round_trips))
                r = runs[-1]
                print(f"transport: run {k + 1} {system} {payload}: client {r['client_cpu_us']:.0f} us, "
                      f"server {r['server_cpu_us']:.0f} us CPU, {r['wall_us']:.0f} us wall per round trip",
                      file=sys.stderr, flush=True)
    med = {}
    for system in SYSTEMS:
        for payload in PAYLOADS:
            rs = [r for r in runs if (r["system"], r["payload"]) == (system, payload)]
            med[system, payload] = {k: statistics.median(r[k] for r in rs)
                                    for k in ("client_cpu_us", "server_cpu_us", "wall_us")}
    lines = [f"{args.round_trips:,} round trips per run, one in flight, medians of {args.repeat} interleaved runs "
             "(microseconds per round trip; CPU includes ZeroMQ's I/O thread)", "",
             "| system | payload | client CPU | server CPU | both | wall |", "|---|---|---:|---:|---:|---:|"]
    for payload in PAYLOADS:
        for system in SYSTEMS:
            m = med[system, payload]
            lines.append(f"| {system} | {payload} | {m['client_cpu_us']:.0f} | {m['server_cpu_us']:.0f} | "
                         f"{m['client_cpu_us'] + m['server_cpu_us']:.0f} | {m['wall_us']:.0f} |")
    lines.append("")
    for payload in PAYLOADS:
        a, b = med["mariana", payload], med["pyzmq-asyncio", payload]
        both = (a["client_cpu_us"] + a["server_cpu_us"]) / (b["client_cpu_us"] + b["server_cpu_us"])
        lines.append(f"- {payload}: mariana / pyzmq-asyncio CPU per round trip (both sides): **{both:.2f}**; "
                     f"wall {a['wall_us'] / b['wall_us']:.2f}")
    print("\n".join(lines))
    out = REPO / "bench-out" / "transport"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "runs": runs,
                                                  "medians": {f"{s} {p}": m for (s, p), m in med.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
