"""The life of a service process: start, serve until SIGTERM, drain, persist,
close in reverse order, one summary line, exit 0.

    class ParamServer(Service):
        role = "ps"
        async def start(self): ...     # bind, connect, restore
        async def main(self): ...      # the work; returns when done or cancelled
        async def drain(self): ...     # stop taking work, finish what is in flight
        async def close(self): ...     # persist, close sockets

    sys.exit(run_service(ParamServer(cfg, index)))

Every service registers with the coordinator (`Hello`) and repeats it as a
heartbeat, so the coordinator knows who is alive and who restarted.
"""
from __future__ import annotations

import asyncio
import logging
import os
import platform
import signal
import time
from collections import Counter

import zmq.asyncio

from mariana.services.runtime import failpoints, memwatch, procs, sdnotify
from mariana.services.runtime.accept_loop import MendedLoop
from mariana.services.runtime.config import ClusterConfig, cluster_shape
from mariana.services.runtime.exporter import start_metrics
from mariana.services.transport import Client, PeerTimeout, RemoteError
from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)

DRAIN_SECONDS = 20.0
BYE_SECONDS = 0.5  # how long a stopping service waits for the coordinator to take its Bye
HOST = platform.node()  # how a service names its host to the coordinator


def _place() -> str:
    """Where a pid names one process: this kernel's boot and this pid namespace (two hosts
    may share a hostname; containers on one kernel do not share pids)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = HOST
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{boot}/{ns}"


PLACE = _place()


class ServiceRefused(MarianaError):
    """The coordinator will not take this service: it exits, saying why (no retry helps)."""


def _predecessor_gone(holder) -> bool:
    """Whether the process that holds our name ran where its pid is ours to look up (the same
    kernel boot and pid namespace), and is gone: we replace it."""
    return (isinstance(holder, dict) and holder.get("place") == PLACE and isinstance(holder.get("pid"), int)
            and holder["pid"] != os.getpid() and not procs.running(holder["pid"]))


class Service:
    role = "service"
    # What it counts, each 0 from the start (a series that appears at its first event hides
    # that event from `increase()`): the transport's and memwatch's; a role adds its own.
    COUNTERS: tuple[str, ...] = ("bad_messages", "errors", "rpc_timeouts", "late_replies", "unsent_replies",
                                 "handshake_failures", "memory_warnings")
    REDIS_COUNTERS = ("redis_refused", "redis_retries", "batches_transient")  # services.sample_cache
    CREATIVE_COUNTERS = ("creatives_embedded", "corrupt_images", "creative_cache_rebuilt")  # services.creative_cache

    def __init__(self, cfg: ClusterConfig, index: int = 0):
        self.cfg, self.index = cfg, index
        self.name = f"{self.role}-{index}"
        self.counters: Counter = Counter(dict.fromkeys(self.COUNTERS, 0))
        self.boot = time.time()
        self.ctx: zmq.asyncio.Context | None = None
        self.coordinator: Client | None = None
        self.stopping: asyncio.Event | None = None
        self._heartbeat: asyncio.Task | None = None
        self.background: set[asyncio.Task] = set()
        self.coordinator_boot: float | None = None  # when the coordinator we talk to started
        self.coordinator_takes_bye = False  # its Welcome says so
        self.shape = cluster_shape(cfg)  # what every Hello says of the settings a cluster shares
        self.refusal: ServiceRefused | None = None  # why the coordinator stopped taking it (exit 78)

    # ---- what a service fills in ----------------------------------------------------

    async def start(self) -> None:
        pass

    async def main(self) -> None:
        await self.stopping.wait()

    async def drain(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def status(self) -> dict:
        """Numbers sent with each heartbeat (shown by `mariana status`)."""
        return dict(self.counters)

    def heartbeat_status(self) -> dict:
        """`status()` and the resident set in bytes (a cluster job's peak_rss_mb is the largest
        one while it ran): what each heartbeat sends and /metrics shows."""
        return {**self.status(), "resident_memory_bytes": memwatch.rss_bytes()}

    # ---- shared plumbing ---------------------------------------------------------------

    def spawn(self, coro) -> asyncio.Task:
        """A background task, referenced until done (the loop keeps only weak references)."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def connect_coordinator(self, on_command=None) -> Client:
        self.coordinator = Client(self.ctx, self.cfg.coordinator.endpoint, self.counters,
                                  timeout=5.0, on_command=on_command,
                                  identity=f"{self.name}:{os.getpid()}".encode(), watch=True)  # until registered
        return self.coordinator

    async def register(self, attempts_seconds: float | None = None) -> None:
        """Hello to the coordinator, retried (it may start after us, or our predecessor's
        name may not have lapsed yet) up to the cluster's start time; then heartbeats. Fails
        startup if never answered, or at once if the coordinator refuses this service
        (services/coord_hello.py: not in its config, or a config that differs from its own)."""
        ep = self.cfg.coordinator.endpoint
        deadline = time.monotonic() + (attempts_seconds or self.cfg.cluster.start_seconds)
        first, said = {}, float("-inf")
        cache = getattr(self, "cache", None)  # the sample cache, for roles that have one
        while True:
            if cache is not None and not (first.get("redis") or {}).get("server"):
                first["redis"] = await cache.identity()  # asked again while its Redis does not answer
            try:
                await self.hello(**first)
                break
            except RemoteError as e:
                if e.code == "Refused":
                    raise ServiceRefused(f"{self.name}: the coordinator at {ep} refused it: {e.detail}") from None
                holder = e.fields.get("holder")
                if e.code == "NameTaken" and _predecessor_gone(holder) and first.get("replaces") != holder["pid"]:
                    first["replaces"] = holder["pid"]
                    continue
                if time.monotonic() > deadline:
                    raise ServiceRefused(f"{self.name}: the coordinator at {ep} did not take it: {e.detail}") \
                        from None
                if time.monotonic() - said > 10.0:  # asked again every second, said every 10
                    log.info("%s: not registered yet: %s", self.name, e.detail)
                    said = time.monotonic()
                await asyncio.sleep(1.0)
            except PeerTimeout as e:
                why = self.coordinator.trouble()
                if why and self.coordinator.watcher and self.coordinator.watcher.handshake_failed:  # no retry mends it
                    raise ServiceRefused(f"{self.name}: cannot talk to the coordinator at {ep}: {why}") from None
                if time.monotonic() > deadline:
                    raise PeerTimeout(f"{self.name}: coordinator at {ep} never answered: "
                                      f"{why or e}") from None
                log.info("%s: waiting for the coordinator at %s (%s)", self.name, ep, why or e)
        self._heartbeat = asyncio.create_task(self._beat(), name="heartbeat")

    async def hello(self, **first) -> None:
        # Every Hello names the host and the shared settings: a coordinator restarted with another
        # config refuses the heartbeats of services that ran with the old one (and shows the host)
        reply = await self.coordinator.call("Hello", role=self.role, index=self.index, pid=os.getpid(),
                                            boot=self.boot, host=HOST, place=PLACE, shape=self.shape,
                                            status=self.heartbeat_status(), timeout=2.0, **first)
        boot = reply.get("boot")
        if boot is not None and self.coordinator_boot is not None and boot != self.coordinator_boot:
            # The coordinator restarted: what was in flight to it is lost; send it again now
            # rather than when each request times out (a held Cached waits up to 10 minutes).
            n = self.coordinator.fail_pending("the coordinator restarted")
            log.info("%s: the coordinator restarted; %d requests in flight are sent again", self.name, n)
        self.coordinator_boot = boot if boot is not None else self.coordinator_boot
        self.coordinator_takes_bye = reply.get("bye") is True  # an older one counts it a bad message

    async def _beat(self) -> None:
        period, said = max(0.2, self.cfg.coordinator.heartbeat_seconds / 3), ""
        while True:
            await asyncio.sleep(period)
            why = self.coordinator.trouble()  # (reads the connection's events: none pile up)
            try:
                await self.hello()
                said = ""  # the next trouble is said again
                continue
            except RemoteError as e:
                if e.code == "NameTaken":  # another process took the name while this one was silent
                    self.refusal = ServiceRefused(f"{self.name}: the coordinator took another process under its "
                                                  f"name while this one was silent: {e.detail}; it stops")
                    self.stopping.set()
                    return
                why = f"the coordinator refuses its heartbeats: {e.detail}" if e.code == "Refused" else str(e)
            except PeerTimeout as e:  # a coordinator restarted with another curve_key fails every handshake
                why = self.coordinator.trouble() or why or str(e)
            if why != said:  # said once, not every beat
                log.warning("%s: heartbeat: %s", self.name, why)
                said = why

    def stop_heartbeat(self) -> None:
        if self._heartbeat:
            self._heartbeat.cancel()


async def cancel_and_wait(tasks, grace: float = 0.1) -> None:
    """Cancel `tasks` until every one has ended: again after `grace` seconds (time for the
    cleanup a cancelled task may do), then every 0.1 s. Once is not always enough: a
    cancellation that meets the result a task's `asyncio.wait_for` was waiting for can be
    lost (Python 3.11), and a task left running outlives the clients it uses, or holds up a
    close that waits for it. Their outcomes are retrieved (an error of one is no news at a
    stop).

    >>> async def stubborn():
    ...     try:
    ...         await asyncio.sleep(30)
    ...     except asyncio.CancelledError:
    ...         pass  # the first cancellation lost
    ...     await asyncio.sleep(30)
    >>> async def main():
    ...     t = asyncio.create_task(stubborn())
    ...     await asyncio.sleep(0)
    ...     await asyncio.wait_for(cancel_and_wait([t]), 5)
    ...     return t.cancelled()
    >>> asyncio.run(main())
    True
    """
    tasks = list(tasks)
    pending, wait = {t for t in tasks if not t.done()}, grace
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait)
        wait = 0.1
    for task in tasks:
        if not task.cancelled():
            task.exception()


async def _bye(service: Service) -> None:
    """Its last message: the coordinator shows it down now, not when its heartbeats are
    missed. Not for one the coordinator refused (it holds no name), nor waited on for long."""
    if service.coordinator_boot is None or service.refusal is not None or not service.coordinator_takes_bye:
        return
    try:
        await service.coordinator.call("Bye", role=service.role, index=service.index, pid=os.getpid(),
                                       boot=service.boot, timeout=BYE_SECONDS)
    except Exception as e:  # a coordinator down or older: it finds out from the missed heartbeats
        log.info("%s: the coordinator did not take its Bye: %s", service.name, e)


async def _run(service: Service) -> int:
    loop = asyncio.get_running_loop()
    service.stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # one signal owner; SIGHUP stops too, cleanly
        loop.add_signal_handler(sig, service.stopping.set)
    service.ctx = zmq.asyncio.Context()
    t0 = time.monotonic()
    stop = asyncio.create_task(service.stopping.wait(), name="stop")
    metrics, watchdog, memory = None, None, None
    try:
        starting = asyncio.create_task(service.start(), name="start")
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # SIGTERM while still starting (e.g. waiting for the coordinator)
            _stopping(service)
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.info("%s: stopped while starting", service.name)
            return 0
        starting.result()
        metrics = await start_metrics(service)
        log.info("%s: started (pid %d)", service.name, os.getpid())
        if failpoints.ARMED:
            log.warning("%s: failpoints armed (%s): it ends itself at %s", service.name, failpoints.ENV,
                        ", ".join(sorted(failpoints.ARMED)))
        # systemd (Type=notify) counts the unit started now, and from now on restarts it
        # when the event loop stops pinging (WatchdogSec=): a blocked loop is a dead service.
        sdnotify.notify("READY=1", f"STATUS={service.name}: running")
        watchdog = _watchdog(service)
        c = service.cfg.cluster
        memory = asyncio.create_task(memwatch.watch(service.name, service.counters, c.memory_max_bytes,
                                                    c.memory_warn_fraction), name="memory")
        work = asyncio.create_task(service.main(), name="main")
        done, _ = await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if work in done and not service.stopping.is_set():  # (a main() that only waits for stop ends with it)
            stop.cancel()
            work.result()  # a crash of main() surfaces here
        else:
            log.info("%s: stopping: draining work in flight", service.name)
            _stopping(service)
            await _drain(service)
            work.cancel()
            await asyncio.wait({work}, timeout=DRAIN_SECONDS)  # its cleanup may call peers: bounded
    finally:
        stop.cancel()
        service.stop_heartbeat()
        if metrics is not None:  # reverse of start: it came up after start()
            await metrics.stop()
        try:
            await service.close()
        except Exception:  # close what was opened; a half-started service has less to close
            log.exception("%s: closing failed", service.name)
        if service.coordinator:
            await _bye(service)
            service.coordinator.close()
        service.ctx.destroy(linger=0)
        if watchdog is not None:  # fed through close (a ps checkpoint), which runs within TimeoutStopSec
            watchdog.cancel()
        if memory is not None:
            memory.cancel()
    log.info("%s: stopped after %.1fs (%s)", service.name, time.monotonic() - t0, _counts(service) or "no work")
    return 0


def _stopping(service: Service) -> None:
    sdnotify.notify("STOPPING=1", f"STATUS={service.name}: stopping")


def _watchdog(service: Service) -> asyncio.Task | None:
    """WATCHDOG=1 from the event loop while systemd asks for it, with the counters as STATUS."""
    period = sdnotify.watchdog_period()
    if period is None:
        return None

    def status() -> str:  # what `systemctl status` shows
        return f"{service.name}: " + (_counts(service) or "running")

    return asyncio.create_task(sdnotify.watchdog(period, status), name="watchdog")


def _counts(service: Service) -> str:
    """'rows=10, steps=2': the counters that counted something."""
    return ", ".join(f"{k}={v}" for k, v in sorted(service.counters.items()) if v)


async def _drain(service: Service) -> None:
    try:
        await asyncio.wait_for(service.drain(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        log.warning("%s: drain took longer than %.0fs; closing anyway", service.name, DRAIN_SECONDS)


def run_service(service: Service) -> int:
    """Run until SIGTERM/SIGINT; 0 on a clean stop, 1 when startup or the work failed,
    procs.EX_CONFIG (78) when the coordinator refused the service (`Service.register`).

    With MARIANA_PROFILE=DIR set, a cProfile of the whole run goes to DIR/<name>.prof.
    """
    from mariana.sparse.errors import MarianaError

    try:
        if os.environ.get("MARIANA_PROFILE"):
            return _profiled(service, os.environ["MARIANA_PROFILE"])
        with asyncio.Runner(loop_factory=MendedLoop) as runner:  # metrics ports, the coordinator's API
            code = runner.run(_run(service))
        if getattr(service, "refusal", None) is not None:
            raise service.refusal
        return code
    except ServiceRefused as e:  # a restart would be refused again: systemd's units do not restart on 78
        log.error("%s", e)
        return procs.EX_CONFIG
    except (MarianaError, OSError, zmq.ZMQError) as e:  # e.g. an endpoint already in use
        log.error("%s: %s", service.name, e)
        return 1


def _profiled(service: Service, out_dir: str) -> int:
    import cProfile

    prof = cProfile.Profile()
    try:
        with asyncio.Runner(loop_factory=MendedLoop) as runner:
            return prof.runcall(runner.run, _run(service))
    finally:
        os.makedirs(out_dir, exist_ok=True)
        prof.dump_stats(os.path.join(out_dir, f"{service.name}.prof"))
