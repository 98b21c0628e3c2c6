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
