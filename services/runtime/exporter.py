"""Every service's Prometheus endpoint: GET /metrics on its own port renders
its `counters` (as `mariana_<role>_<name>_total` counters) and the other
numbers of its `heartbeat_status()` (as `mariana_<role>_<name>` gauges), labelled with
role and index, in the text format of services/runtime/metrics.py.

The lifecycle starts it after the service's start() and stops it before its
close(). The port comes from the cluster config (`ClusterConfig.metrics_port`);
the coordinator has none of its own: its HTTP API answers /metrics.

>>> print(render_service("worker", 1, {"steps": 3}, {"steps": 3, "busy": True, "jobs": ["j"]}, 1700000000.5),
...       end="")  # doctest: +NORMALIZE_WHITESPACE
# HELP mariana_worker_steps_total Count of steps since this worker started.
# TYPE mariana_worker_steps_total counter
mariana_worker_steps_total{index="1",role="worker"} 3
# HELP mariana_worker_busy The worker's busy, as its heartbeat reports it.
# TYPE mariana_worker_busy gauge
mariana_worker_busy{index="1",role="worker"} 1
# HELP mariana_service_start_time_seconds When the process started (Unix time).
# TYPE mariana_service_start_time_seconds gauge
mariana_service_start_time_seconds{index="1",role="worker"} 1700000000.5
"""
from __future__ import annotations

import logging
import re
from typing import Mapping

from aiohttp import web

from mariana.services.runtime.http_idle import IdleClosingRunner
from mariana.services.runtime.metrics import Metrics, render

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_service(role: str, index: int, counters: Mapping[str, float], status: Mapping[str, object],
                   boot: float) -> str:
    """The Prometheus text of one service; non-numeric status values (lists, names) are left out."""
    m, labels = Metrics(), {"role": role, "index": str(index)}
    for key, value in sorted(counters.items()):
        name = f"mariana_{role}_{_name(key)}_total"
        if name not in m.definitions:
            m.counter(name, f"Count of {key} since this {role} started.", start=())
            m.inc(name, value, **labels)
    for key, value in status.items():
        name = f"mariana_{role}_{_name(key)}"
        if key in counters or name in m.definitions or not _is_number(value):
            continue
        m.gauge(name, f"The {role}'s {key}, as its heartbeat reports it.")
        m.set(name, int(value) if isinstance(value, bool) else value, **labels)
    m.gauge("mariana_service_start_time_seconds", "When the process started (Unix time).")
    m.set("mariana_service_start_time_seconds", boot, **labels)
    return render(m.definitions, m.state())


def _name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and v == v  # bools count (as 0/1); NaN does not


class MetricsEndpoint:
    """An aiohttp server of GET /metrics for one service, on host:port."""

    def __init__(self, service, host: str, port: int) -> None:
        self.service, self.host, self.port = service, host, port
        self.runner: web.AppRunner | None = None

    async def start(self) -> "MetricsEndpoint":
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = IdleClosingRunner(app, access_log=None, handle_signals=False,
                                        keepalive_timeout=self.service.cfg.cluster.keepalive_seconds)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        return self

    async def handle(self, request: web.Request) -> web.Response:
        s = self.service
        text = render_service(s.role, s.index, s.counters, s.heartbeat_status(), s.boot)
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def start_metrics(service) -> MetricsEndpoint | None:
    """Serve the service's /metrics where the config says; None (with one log line) when
    it names no port. A port that cannot be bound fails startup, like any endpoint."""
    port = service.cfg.metrics_port(service.role, service.index)
    if port is None:  # the coordinator: its HTTP API answers /metrics
        return None
    if not port:
        log.info("%s: no metrics port configured (%s); running without /metrics", service.name,
                 "loader.metrics_port" if service.role == "loader" else f"{service.role}.metrics_ports")
        return None
    host = service.cfg.cluster.host
    endpoint = await MetricsEndpoint(service, host, port).start()
    log.info("%s: metrics at http://%s:%d/metrics", service.name, f"[{host}]" if ":" in host else host, port)
    return endpoint
