"""The coordinator's durable job state: SQLite in `coordinator.state_dir`.

Three tables, written by the coordinator alone:

    jobs     id -> the job's request, spec, state, times and its last summary
    events   the ledger's journal of a running job (chunks sent and cached, steps
             done, epochs ended): replayed through `JobLedger.apply` after a restart,
             so a job goes on where it was; dropped when the job ends
    points   the job's history (rows, rows/s, loss, progressive AUC about once a
             second): the web UI's charts; kept

SQLite and not Redis: job history must outlive a restarted (or flushed) Redis, and
it is the coordinator's own state, kept on the coordinator's machine. Writes are
small and synchronous (WAL, synchronous=NORMAL: a commit costs tens of
microseconds and survives a killed process; only an OS crash may lose the last
ones), so the coordinator records an event before it acknowledges it.

>>> import tempfile
>>> with JobStore(tempfile.mkdtemp()) as s:
...     s.save_job("j1", {"state": "running"}, submitted=1.0)
...     s.append("j1", "done", {"step": "e1/f0o0:0"})
...     s.load_jobs()[0]["state"], list(s.events("j1"))
('running', [('done', {'step': 'e1/f0o0:0'})])
"""
from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator

from mariana.sparse.errors import MarianaError

FILE = "jobs.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, submitted REAL NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL,
                                   kind TEXT NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_job ON events (job, seq);
CREATE TABLE IF NOT EXISTS points (job TEXT NOT NULL, t REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS points_job ON points (job, t);
"""


class JobStoreError(MarianaError):
    """The state directory cannot be opened or written."""


class JobStore:
    def __init__(self, state_dir: str):
        self.path = os.path.join(state_dir, FILE)
        try:
            os.makedirs(state_dir, exist_ok=True)
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise JobStoreError(f"{self.path}: cannot open the job store: {e}") from None

    def __enter__(self) -> "JobStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    # ---- jobs ---------------------------------------------------------------------------

    def save_job(self, job: str, data: dict, submitted: float) -> None:
        self._write("INSERT INTO jobs (id, submitted, data) VALUES (?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET data = excluded.data", (job, submitted, json.dumps(data)))

    def load_jobs(self) -> list[dict]:
        """Every job's saved record, oldest first."""
        rows = self.db.execute("SELECT data FROM jobs ORDER BY submitted, id").fetchall()
        return [json.loads(r[0]) for r in rows]

    # ---- the journal of a running job ------------------------------------------------------

    def append(self, job: str, kind: str, data: dict) -> None:
        self._write("INSERT INTO events (job, kind, data) VALUES (?, ?, ?)", (job, kind, json.dumps(data)))

    def append_many(self, job: str, kind: str, events: list[dict]) -> None:
        """Several events of one kind in one transaction (one commit, not one each)."""
        rows = [(job, kind, json.dumps(d)) for d in events]
        try:
            with self.db:  # BEGIN ... COMMIT (or ROLLBACK)
                self.db.execute("BEGIN")
                self.db.executemany("INSERT INTO events (job, kind, data) VALUES (?, ?, ?)", rows)
        except sqlite3.Error as e:
            raise JobStoreError(f"{self.path}: {e}") from None

    def events(self, job: str) -> Iterator[tuple[str, dict]]:
        for kind, data in self.db.execute("SELECT kind, data FROM events WHERE job = ? ORDER BY seq", (job,)):
            yield kind, json.loads(data)

    def drop_events(self, job: str) -> None:
        self._write("DELETE FROM events WHERE job = ?", (job,))

    # ---- history -----------------------------------------------------------------------------

    def add_point(self, job: str, point: dict) -> None:
        self._write("INSERT INTO points (job, t, data) VALUES (?, ?, ?)", (job, point["t"], json.dumps(point)))

    def points(self, job: str, since: float = 0.0) -> list[dict]:
        rows = self.db.execute("SELECT data FROM points WHERE job = ? AND t > ? ORDER BY t", (job, since))
        return [json.loads(r[0]) for r in rows]

    def _write(self, sql: str, args: tuple) -> None:
        try:
            self.db.execute(sql, args)
        except sqlite3.Error as e:
            raise JobStoreError(f"{self.path}: {e}") from None
