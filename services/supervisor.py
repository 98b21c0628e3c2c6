"""The supervisor of a local cluster: what systemd's `Restart=on-failure` does in production,
for the processes `mariana up` started.

`up` starts Redis and the services, then this process (`mariana supervise --dir DIR`, its
log in <dir>/logs/supervisor.log). It watches every process recorded in <dir>/cluster.json;
one that exits while the cluster is up is started again with the same command line after a
backoff (RESTART_SECONDS, doubling while a process keeps dying young, up to
MAX_RESTART_SECONDS; reset once it has run STABLE_SECONDS), and cluster.json records its new
pid and its count of restarts (`mariana status` shows them; the coordinator counts a
service's registrations too, for the web UI). `mariana down` stops the supervisor first
(SIGTERM: it exits without touching the services), then the services.

A process the supervisor did not start (one `up` started) is watched through /proc: its exit
code is only known to its parent. The services it starts are its own children.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time

from mariana.services import launcher
from mariana.services.runtime import procs
from mariana.sparse.errors import MarianaError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
RESTART_SECONDS = 0.5        # the first restart of a process after this long
MAX_RESTART_SECONDS = 30.0   # the backoff doubles while it keeps dying young, up to this
STABLE_SECONDS = 30.0        # a process that ran this long starts over at RESTART_SECONDS


class Supervisor:
    def __init__(self, root: str) -> None:
        self.root = root
        self.stopping = threading.Event()
        self.due: dict[str, float] = {}      # name -> when to start it again (monotonic)
        self.delay: dict[str, float] = {}    # name -> its next backoff

    def state(self) -> dict:
        state = launcher._load_state(self.root)
        if state is None:
            raise launcher.ClusterNotUp(f"no cluster is up in {self.root}")
        return state

    def run(self) -> int:
        """Watch until SIGTERM/SIGINT/SIGHUP or until cluster.json is gone (`down` removed it)."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stopping.set())
        state = self.state()
        other = state.get("supervisor") or {}
        if other.get("pid") not in (None, os.getpid()) and launcher._alive(other):  # `down` stops only the one
            raise MarianaError(f"{self.root}: a supervisor already watches this cluster (pid "  # recorded
                               f"{other['pid']}); a second one would restart what `down` stops")
        state["supervisor"] = {"pid": os.getpid(), "start": procs.start_time(os.getpid())}
        unsaved = self.save(state, None)  # why cluster.json could not be written (said once; tried each tick)
        env = launcher._child_env()
        log.info("watching %d processes of %s", len(launcher._records(state)), self.root)
        why = "signalled"
        while not self.stopping.wait(POLL_SECONDS):
            on_disk = launcher._load_state(self.root)
            if on_disk is None:
                why = "cluster.json removed"
                break
            if unsaved is None:  # else what is on disk is older than what this process knows
                state = on_disk
            if self.owner_gone(state):  # everything stopped and cluster.json removed: nothing to save again
                log.info("stopped (its owner is gone)")
                return 0
            if state.get("restart", True) and self.tick(state, env) or unsaved is not None:
                unsaved = self.save(state, unsaved)
        if unsaved is not None and self.save(state, unsaved) is not None:
            self.stop_unrecorded(state)
        log.info("stopped (%s)", why)
        return 0

    def owner_gone(self, state: dict) -> bool:
        """A temporary cluster (`launcher.up(owner=...)`) whose owner has ended: stopped here, its
        dir left with its logs. Its owner stops it itself when it ends normally; killed, it
        cannot, and the cluster (its job, Redis, every service) would run on with nobody to
        use or stop it."""
        owner = state.get("owner")
        if not owner or launcher._alive(owner):
            return False
        log.warning("pid %d, which started this temporary cluster, is gone: stopping the cluster (its job with it)",
                    owner["pid"])
        summary = launcher._stop_all(state, timeout=10.0)
        launcher._remove_state(self.root)
        for name in os.listdir(self.root):  # a shard's checkpoints, Redis's dump, the job store: nobody's now
            if name != "logs":
                path = os.path.join(self.root, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        log.info("stopped %d processes, killed %d; its state removed, logs kept in %s", len(summary["stopped"]),
                 len(summary["killed"]), os.path.join(self.root, "logs"))
        return True

    def stop_unrecorded(self, state: dict) -> None:
        """The processes this supervisor started that cluster.json still does not name (it could
        not be written): `down`, which stops what the file names, would leave them running."""
        on_disk = launcher._load_state(self.root) or {}
        known = {r["pid"] for r in launcher._records(on_disk)} if on_disk else set()
        left = [r for r in launcher._records(state) if r["pid"] not in known and launcher._alive(r)]
        for rec in left:
            log.warning("stopping %s (pid %d): cluster.json does not name it", rec["name"], rec["pid"])
            launcher._CHILDREN[rec["pid"]].terminate()
        deadline = time.monotonic() + 10.0
        for rec in left:
            child = launcher._CHILDREN[rec["pid"]]
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def save(self, state: dict, unsaved: str | None) -> str | None:
        """Write cluster.json; on a full or read-only disk, say so once and go on restarting
        (the supervisor died there, and nothing was restarted any more). None once saved."""
        try:
            launcher._save_state(state)
        except OSError as e:
            why = f"{e.strerror or e}"
            if why != unsaved:
                log.error("cannot write %s (%s): restarts go on, but `status` and `down` see the pids saved "
                          "before until it can be written", launcher.STATE_FILE, why)
            return why
        if unsaved is not None:
            log.info("%s written again", launcher.STATE_FILE)
        return None

    def tick(self, state: dict, env: dict) -> bool:
        """Restart what is due; True when `state` changed."""
        changed = False
        now = time.monotonic()
        for rec in launcher._records(state):
            name = rec["name"]
            if launcher._alive(rec) or rec.get("refused"):
                continue
            if name not in self.due:
                code = launcher._exit_code(rec)
                if code == procs.EX_CONFIG:  # refused by the coordinator: a restart is refused again
                    rec.update(refused=True, exits=rec.get("exits", 0) + 1,
                               last_exit={"code": code, "at": time.time()})
                    log.error("%s (pid %d) exited %d: the coordinator refused it (its log says why); not "
                              "restarted", name, rec["pid"], code)
                    changed = True
                    continue
                ran = time.time() - rec.get("started_at", time.time())
                delay = RESTART_SECONDS if ran >= STABLE_SECONDS else self.delay.get(name, RESTART_SECONDS)
                self.delay[name] = min(2 * delay, MAX_RESTART_SECONDS)
                self.due[name] = now + delay
                rec["exits"] = rec.get("exits", 0) + 1
                rec["last_exit"] = {"code": code, "at": time.time(), "ran_seconds": round(ran, 1)}
                log.warning("%s (pid %d) exited (%s) after %.1fs; restart in %.1fs", name, rec["pid"],
                            _why(code), ran, delay)
                changed = True
            if now >= self.due[name] and not self.stopping.is_set():
                self.restart(rec, env)
                del self.due[name]
                changed = True
        return changed

    def restart(self, rec: dict, env: dict) -> None:
        if rec["role"] == "redis":
            os.makedirs(os.path.join(self.root, "redis"), exist_ok=True)
        proc = launcher._popen(rec["cmd"], rec["log"], None if rec["role"] == "redis" else env)
        rec.update(pid=proc.pid, start=procs.start_time(proc.pid), started_at=time.time(),
                   restarts=rec.get("restarts", 0) + 1)
        log.info("restarted %s: pid %d (restart %d)", rec["name"], proc.pid, rec["restarts"])


def _why(code: int | None) -> str:
    if code is None:
        return "exit code unknown: not started here"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"code {code}"
