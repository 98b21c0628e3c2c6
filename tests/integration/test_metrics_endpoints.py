"""Every service of a real local cluster answers GET /metrics on the port the
resolved config gives it (the coordinator on its HTTP API), in the Prometheus
text format, with the counters its heartbeat reports, labelled role and index."""
from __future__ import annotations

import re
import urllib.request

import pytest

from mariana.sparse.synth import generate_criteo
from tests.debian import debian_tool, promtool_check
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow

SAMPLE = re.compile(r'^([a-z_:][a-z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|[+-]Inf|NaN)$', re.I)
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def scrape(port: int, promtool: str | None = None) -> tuple[int, str, dict[str, float]]:
    """(status, content type, {series: value}); every line must be a comment or a sample,
    and with `promtool`, the page must pass `promtool check metrics`."""
    with DIRECT.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
        status, ctype = r.status, r.headers["Content-Type"]
    if promtool:
        promtool_check(promtool, text)
    series = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_:][a-z0-9_:]* ", line, re.I), line
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        series[(m.group(1) + (m.group(2) or ""))] = float(m.group(3))
    return status, ctype, series


@pytest.mark.timeout(180)
def test_every_service_serves_its_counters_as_prometheus_text(tmp_path):
    promtool = debian_tool("promtool", "prometheus")  # Prometheus' linter reads every page
    data = tmp_path / "train.tsv"
    generate_criteo(data, 5_000, seed=5)
    with Cluster(tmp_path / "c", workers=2, ps=1, preprocess=1) as c:
        job = c.submit([data], tmp_path / "m", config={"hashing": {"bits": 16}, "train": {"batch_size": 512}})
        summary = c.wait(job)
        assert summary["state"] == "done", c.logs()

        def reported_numbers() -> dict | None:  # a job of 5,000 rows can end before a service's next heartbeat
            services = c.status()["services"]
            return services if all(any(isinstance(v, (int, float)) for v in s["status"].values())
                                   for name, s in services.items() if not name.startswith("coordinator")) else None

        services = c.wait_for(reported_numbers, 10.0)  # what each one last reported in its heartbeat
        status, ctype, coord = scrape(c.cfg.coordinator.http_port, promtool)
        assert status == 200 and ctype == "text/plain; version=0.0.4; charset=utf-8"
        # an ended job's counters stay, at their final values (they vanished with the job: a short job's
        # were never scraped, and a longer one's lost what came after the last scrape)
        for key in ("cache_hits", "cache_misses", "batches_reissued", "batches_replayed"):
            assert f'mariana_job_{key}_total{{job_id="{job}"}}' in coord, (key, sorted(coord))
        assert coord[f'mariana_job_cache_misses_total{{job_id="{job}"}}'] == summary["cache"]["misses"]
        assert coord['mariana_service_up{service="worker-1",role="worker"}'] == 1
        own = '{index="0",role="coordinator"}'  # its own numbers carry the labels every service's do
        assert coord[f"mariana_service_start_time_seconds{own}"] > 0
        mine = [k for k in coord if k.startswith("mariana_coordinator_")]
        assert all(k.endswith(own) for k in mine), mine
        for role in ("loader", "preprocess", "worker", "ps"):
            for index in range(c.cfg.count(role)):
                name, port = f"{role}-{index}", c.cfg.metrics_port(role, index)
                assert port, f"{name}: the resolved config gives it no metrics port"
                status, ctype, series = scrape(port, promtool)
                assert status == 200 and ctype == "text/plain; version=0.0.4; charset=utf-8", (name, ctype)
                labels = f'{{index="{index}",role="{role}"}}'
                assert series[f"mariana_service_start_time_seconds{labels}"] > 0
                reported = {k: v for k, v in services[name]["status"].items() if isinstance(v, (int, float))}
                assert reported, f"{name}: no numbers in its heartbeat"
                for key, value in reported.items():  # a counter, or a gauge (busy, jobs)
                    counter, gauge = f"mariana_{role}_{key}_total{labels}", f"mariana_{role}_{key}{labels}"
                    assert counter in series or gauge in series, (name, key, sorted(series))
                    assert series.get(counter, value) >= value, (name, key)  # scraped after the heartbeat
        assert series_of(c, "worker", "steps") > 0 and series_of(c, "ps", "steps_applied") > 0
        assert series_of(c, "loader", "chunks_sent") > 0 and series_of(c, "preprocess", "batches") > 0
        # what nothing happened to is 0, not absent: increase() sees the first event
        assert coord[f"mariana_coordinator_bad_messages_total{own}"] == 0
        assert scrape(c.cfg.metrics_port("ps", 0))[2]['mariana_ps_checkpoint_failures_total{index="0",role="ps"}'] == 0
        # a loader done with a job no longer says it reads it (it listed every job it ever read)
        assert c.wait_for(lambda: c.status()["services"]["loader-0"]["status"]["reading"] == [] or None, 10.0)
        # each heartbeat says its RSS (a gauge here); a job's peak_rss_mb is the largest one while it ran
        assert all(s["status"]["resident_memory_bytes"] > 0 for n, s in services.items()
                   if not n.startswith("coordinator"))
        assert series_of(c, "ps", "resident_memory_bytes", total=False) > 0 and summary["record"]["peak_rss_mb"] > 0


def series_of(c: Cluster, role: str, counter: str, total: bool = True) -> float:
    """A counter (or, `total=False`, a gauge) summed over a role's instances, as scraped."""
    suffix, summed = "_total" if total else "", 0.0
    for index in range(c.cfg.count(role)):
        summed += scrape(c.cfg.metrics_port(role, index))[2].get(
            f'mariana_{role}_{counter}{suffix}{{index="{index}",role="{role}"}}', 0.0)
    return summed
