"""`mariana status`'s services table (services/cli.py)."""
from __future__ import annotations

import time

from mariana.services.cli import _job_row, _service_rows


def test_a_process_that_exited_is_not_alive_whatever_the_coordinator_last_heard():
    """The coordinator marks a service dead only once its heartbeats stop for a while; the
    launcher sees the exit at once. The table said "ALIVE yes" beside "PID 5 (exited)"."""
    now = time.time()
    st = {"processes": {"worker-0": {"pid": 5, "running": False, "role": "worker", "index": 0, "restarts": 0},
                        "ps-0": {"pid": 6, "running": True, "role": "ps", "index": 0, "restarts": 0}}}
    coord = {"services": {"worker-0": {"alive": True, "last_seen": now, "role": "worker", "index": 0},
                          "ps-0": {"alive": True, "last_seen": now, "role": "ps", "index": 0},
                          "preprocess-0": {"alive": False, "last_seen": now - 60, "role": "preprocess", "index": 0,
                                           "pid": 77, "host": "node-3"}}}
    rows = {r[0]: r for r in _service_rows(st, coord)}
    assert rows["worker-0"][3:6] == ("no", "-", "5 (exited)")
    assert rows["ps-0"][3:6] == ("yes", "-", "6")
    # started elsewhere: the coordinator's word, and the pid and host it registered with ("-" before)
    assert rows["preprocess-0"][3:6] == ("no", "node-3", 77)


def test_an_ended_jobs_row_gives_its_own_rows_and_pace_not_its_last_epochs():
    """A 2-epoch job showed ROWS 100,000 and ROWS/S 359,712 (its last epoch's); its record said
    200,000 rows at 132,100 rows/s. A running job shows its epoch's pace so far."""
    progress = {"epoch": 2, "epochs": 2, "rows": 100_000, "rows_total": 200_000, "rows_per_s": 359_712.0,
                "loss": 0.45, "fraction": 1.0}
    done = {"id": "j1", "state": "done", "model": "lr", "progress": progress, "record": {"rows_per_s": 132_100.4}}
    running = {**done, "id": "j2", "state": "running", "record": {}}
    assert _job_row(done)[5:7] == ("200,000", "132,100")
    assert _job_row(running)[5:7] == ("200,000", "359,712")
