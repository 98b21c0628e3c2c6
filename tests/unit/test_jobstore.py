"""The coordinator's job store (SQLite): jobs, the journal, history; what a
restarted coordinator reads back."""
from __future__ import annotations

import os

import pytest

from mariana.services.jobstore import JobStore, JobStoreError


def test_jobs_journal_and_points_survive_reopening(tmp_path):
    with JobStore(str(tmp_path)) as s:
        s.save_job("j2", {"id": "j2", "state": "queued"}, submitted=2.0)
        s.save_job("j1", {"id": "j1", "state": "running"}, submitted=1.0)
        s.save_job("j1", {"id": "j1", "state": "done"}, submitted=1.0)  # an update, not a second job
        s.append("j1", "sent", {"chunk": {"id": "f0o0"}})
        s.append("j2", "start", {"t": 5.0})
        s.append("j1", "cached", {"chunk": "f0o0"})
        for t in (1.0, 2.0, 3.0):
            s.add_point("j1", {"t": t, "rows_total": int(t * 10)})
    with JobStore(str(tmp_path)) as s:
        assert [(j["id"], j["state"]) for j in s.load_jobs()] == [("j1", "done"), ("j2", "queued")]
        assert [k for k, _ in s.events("j1")] == ["sent", "cached"]
        assert [p["rows_total"] for p in s.points("j1", since=1.0)] == [20, 30]
        s.drop_events("j1")
        assert list(s.events("j1")) == [] and len(list(s.events("j2"))) == 1


def test_append_many_is_one_transaction_in_order(tmp_path):
    with JobStore(str(tmp_path)) as s:
        s.append("j1", "sent", {"n": 0})
        s.append_many("j1", "done", [{"n": 1}, {"n": 2}, {"n": 3}])
        s.append("j1", "epoch", {"n": 4})
        with pytest.raises(JobStoreError, match="NOT NULL"):  # a clear error; nothing written
            s.append_many(None, "done", [{"n": 5}])
    with JobStore(str(tmp_path)) as s:
        assert [(k, d["n"]) for k, d in s.events("j1")] == [("sent", 0), ("done", 1), ("done", 2), ("done", 3),
                                                            ("epoch", 4)]


def test_an_unusable_state_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(JobStoreError, match="cannot open the job store"):
        JobStore(str(blocker / "state"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(JobStoreError):
            JobStore(str(ro))
