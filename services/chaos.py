"""Chaos for a supervised local cluster: SIGKILL a randomly chosen process every few seconds.

A run is seeded (the same seed picks the same roles and pauses) and bounded (`max_kills`).
Each pause is drawn from `every` (seconds); then a role, dealt from a shuffled deck of
`roles` (so every role is hit once in each len(roles) kills), and one of its processes that
runs now (a process still being restarted is not a target; the role is then dealt again). The
supervisor (services/supervisor.py) starts each victim again; what the job must show is that
nothing was lost: rows applied == rows x epochs, the model as good as an undisturbed run's
(tests/integration/test_chaos.py, bench/chaos.py).

>>> c = Chaos("/nonexistent", seed=1, every=(2.0, 4.0))
>>> [round(c.pause(), 2) for _ in range(3)]
[2.27, 3.69, 3.53]
"""
from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

from mariana.services import launcher

log = logging.getLogger(__name__)

ROLES = ("worker", "ps", "preprocess", "loader", "coordinator", "redis")


@dataclass
class Kill:
    at: float       # unix time
    name: str       # e.g. "ps-1"
    pid: int


class Chaos:
    def __init__(self, root: str, seed: int, every: tuple[float, float] = (2.0, 5.0),
                 roles: tuple[str, ...] = ROLES, max_kills: int = 10) -> None:
        self.root, self.every, self.roles, self.max_kills = root, every, roles, max_kills
        self.rng = random.Random(seed)
        self.deck: list[str] = []
        self.kills: list[Kill] = []
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pause(self) -> float:
        return self.rng.uniform(*self.every)

    def kill_one(self) -> Kill | None:
        """SIGKILL one running process of a drawn role (its whole session: helpers too)."""
        state = launcher._load_state(self.root)
        if state is None:
            return None
        if not self.deck:
            self.deck = self.rng.sample(self.roles, len(self.roles))
        role = self.deck[-1]
        running = [r for r in launcher._records(state) if r["role"] == role and launcher._alive(r)]
        if not running:
            log.info("chaos: no %s runs now (being restarted): dealt again next time", role)
            return None
        self.deck.pop()
        rec = self.rng.choice(sorted(running, key=lambda r: r["name"]))
        try:
            os.killpg(rec["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return None
        deadline = time.monotonic() + 5.0
        while rec["pid"] in launcher._CHILDREN and launcher.reap(rec["pid"]) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # one `up` started in this process: reap it, or it stays a zombie of ours
        kill = Kill(time.time(), rec["name"], rec["pid"])
        self.kills.append(kill)
        log.warning("chaos: kill %d/%d: SIGKILL %s (pid %d)", len(self.kills), self.max_kills, rec["name"],
                    rec["pid"])
        return kill

    def run(self) -> list[Kill]:
        """Kill until `max_kills` or `stop`."""
        while len(self.kills) < self.max_kills and not self.stop.wait(self.pause()):
            self.kill_one()
        return self.kills

    def start(self) -> "Chaos":
        self._thread = threading.Thread(target=self.run, name="chaos", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> list[Kill]:
        self.stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.kills
