"""What the coordinator keeps of a service: a Bye makes it down at once (`alive`), while a
running job still gives it the grace of a restart (`heard`)."""
from __future__ import annotations

import time

from mariana.services.coord_state import ServiceInfo


def test_a_service_that_said_bye_is_down_at_once_but_heard_within_a_jobs_grace():
    info = ServiceInfo("worker", 0, pid=123, boot=1.0)
    info.update({"steps": 5}, time.time())
    assert info.alive(10.0) and info.heard(10.0)
    info.stopped = True  # its Bye (services/coord_hello.py: bye)
    assert not info.alive(10.0)            # `mariana status`, the UI, mariana_service_up: down now
    assert info.heard(10.0)                 # a job waits the grace for its restart
    info.update({"steps": 6}, time.time())  # a heartbeat sent before the Bye, arriving after it
    assert info.stopped and not info.alive(10.0)
    info.last_seen -= 11.0
    assert not info.heard(10.0)             # silent past the grace: the job's stall begins


def test_the_job_list_without_a_limit_is_the_newest_page_and_says_the_total():
    """GET /v1/jobs without ?limit gave every job the coordinator ever ran (1.4 KB each, for
    good: 775 KB at 568 jobs); the newest JOBS_PAGE now, with `total` to page through the rest."""
    import asyncio
    import json
    from types import SimpleNamespace

    from aiohttp.test_utils import make_mocked_request

    from mariana.services.coord_api import JOBS_PAGE, CoordinatorAPI

    jobs = {f"j{i:04d}": SimpleNamespace(id=f"j{i:04d}", submitted=float(i), summary=lambda i=i: {"id": f"j{i:04d}"})
            for i in range(JOBS_PAGE + 30)}
    api = CoordinatorAPI(SimpleNamespace(jobs=jobs))

    def page(query: str) -> dict:
        return json.loads(asyncio.run(api.http_jobs(make_mocked_request("GET", "/v1/jobs" + query))).text)

    first = page("")
    assert len(first["jobs"]) == JOBS_PAGE and first["total"] == JOBS_PAGE + 30
    assert first["jobs"][0]["id"] == f"j{JOBS_PAGE + 29:04d}"  # newest first
    rest = page(f"?offset={JOBS_PAGE}")
    assert [j["id"] for j in rest["jobs"]] == [f"j{i:04d}" for i in range(29, -1, -1)]
    assert len(page("?limit=1000")["jobs"]) == JOBS_PAGE + 30
