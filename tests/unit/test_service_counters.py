"""Every counter a pipeline service increments is declared by its role (Service.COUNTERS), so
its /metrics series is 0 from the start: a series that first appears at its first event hides
that event from Prometheus' increase() (an exploratory run: the coordinator showed no counter
of its own after five jobs, a ps no checkpoints until its first one). And the loop services
run on (their HTTP ports)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from mariana.services.coordinator import Coordinator
from mariana.services.loader import Loader
from mariana.services.preprocess import Preprocess
from mariana.services.ps import ParamServer
from mariana.services.runtime.exporter import render_service
from mariana.services.runtime.lifecycle import Service
from mariana.services.worker import Worker

SERVICES = Path(__file__).resolve().parents[2] / "services"
ROLES = {"coordinator": Coordinator, "loader": Loader, "preprocess": Preprocess, "ps": ParamServer, "worker": Worker}
SHARED = ["transport.py", "runtime/memwatch.py", "sample_cache.py", "creative_cache.py"]  # counters passed in


def counted(path: Path) -> set[str]:
    return set(re.findall(r'counters\["([a-z_]+)"\] \+=', path.read_text()))


def test_each_role_declares_what_its_module_counts():
    for role, cls in ROLES.items():
        modules = [f"{role}.py"] + (["coord_api.py"] if role == "coordinator" else [])  # its HTTP API's
        missing = set().union(*(counted(SERVICES / m) for m in modules)) - set(cls.COUNTERS)
        assert not missing, (role, missing)
    shared = set().union(*(counted(SERVICES / name) for name in SHARED))
    assert shared <= set().union(*(cls.COUNTERS for cls in ROLES.values())), shared
    for cls in ROLES.values():  # every role talks over the transport and runs memwatch
        assert set(Service.COUNTERS) <= set(cls.COUNTERS) and len(set(cls.COUNTERS)) == len(cls.COUNTERS)


def test_a_service_that_has_counted_nothing_renders_its_counters_at_zero():
    counters = Counter(dict.fromkeys(ParamServer.COUNTERS, 0))
    text = render_service("ps", 0, counters, {"jobs": 0}, 1.0)
    assert 'mariana_ps_checkpoints_total{index="0",role="ps"} 0' in text
    assert 'mariana_ps_bad_messages_total{index="0",role="ps"} 0' in text


def test_services_run_on_the_loop_whose_accept_loop_is_mended(monkeypatch):
    """A metrics port or the coordinator's API out of descriptors retried accept() `backlog`
    times a pass (CPython gh-151615), as the model server did before it got MendedLoop."""
    import asyncio

    from mariana.services.runtime import lifecycle
    from mariana.services.runtime.accept_loop import MendedLoop

    seen = []

    async def fake_run(service):
        seen.append(type(asyncio.get_running_loop()))
        return 0

    monkeypatch.setattr(lifecycle, "_run", fake_run)
    monkeypatch.delenv("MARIANA_PROFILE", raising=False)
    assert lifecycle.run_service(object()) == 0 and seen == [MendedLoop]
