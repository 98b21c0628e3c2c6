"""`mariana train --mode cluster`: run one job on a cluster and return the
same record as local mode plus the pipeline counters.

Uses the cluster that is up in the cluster dir; when none is, starts one
(in a fresh temporary dir, so it never collides with a long-running one)
with the requested number of workers, shards and preprocess instances, and
stops it afterwards. The job is checked here first, with the same code the
coordinator uses, so bad input fails before any process starts.
"""
from __future__ import annotations

import contextlib
import http.client as http_client
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable, Iterator

from mariana.services.assemble import check_request
from mariana.services.runtime.config import ClusterConfig
from mariana.sparse.errors import MarianaError
from mariana.trainer.bundle import parse_init_from
from mariana.trainer.config import JobConfig
from mariana.trainer.job import absolute_paths, say_if_worse

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5
AWAY_SECONDS = 120.0  # how long `wait` polls a coordinator that does not answer before it gives up
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy for the cluster


class JobFailed(MarianaError):
    pass


class Unreachable(MarianaError):
    """The coordinator did not answer (down, or the wrong address). `refused`: the connection
    was refused, so a request never reached a coordinator (sending it again is safe)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class Refused(MarianaError):
    """The coordinator answered an HTTP error (`status`: 400, 404, 409, ...)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def cancel_job(info: dict, job: str) -> dict:
    """POST /v1/jobs/JOB/cancel: the job's summary after it; {"state": "writing"} when the
    coordinator refused because the job is writing its version (409: it ends done)."""
    try:
        return _request(info, "POST", f"/v1/jobs/{job}/cancel", {})
    except Refused as e:
        if e.status == 409:
            return {"state": "writing", "error": str(e)}
        raise


def run_cluster_job(config: JobConfig, data: list[str], test_data: list[str], out: str, cluster: ClusterConfig,
                    mode: str = "async", staleness: int | None = None,
                    on_progress: Callable[[dict], None] | None = None, asked: tuple[str, ...] = (),
                    promote: bool = True, valid_data: list[str] | None = None, init_from: str | None = None,
                    on_submit: Callable[[str, dict], None] | None = None) -> dict:
    """`asked`: the roles whose counts the user gave; a running cluster must have those.
    `on_submit(job, info)` hears the job's id once the coordinator has taken it, and the
    cluster's `cluster_session` info (a retrain keeps both).
    `promote=False` writes the version without moving CURRENT (a retrain's candidate).
    Relative paths (files, `out`, the config's path keys) are this process's: they go to
    the coordinator absolute, and it refuses relative ones. `valid_data` (or the tail of the
    data, `train.valid_fraction`) is scored after every epoch (and `train.epochs = "auto"`
    stops on it). `init_from` ('DIR' or 'DIR:vNNNNNN') warm-starts every shard from its
    slice of that version."""
    body = {"data": absolute_paths(data), "test_data": absolute_paths(test_data), "out": os.path.abspath(out),
            "config": config.resolve_paths().to_dict(), "mode": mode, "promote": promote,
            "valid_data": absolute_paths(valid_data or [])}
    if staleness is not None:
        body["staleness"] = staleness
    if init_from:
        body["init_from"] = absolute_init_from(init_from)
    # The coordinator checks it again (with its worker count); this fails before any process starts.
    check_request(body, cluster.worker.count)
    with cluster_session(cluster, asked) as info:
        job = submit(info, body)
        log.info("job %s submitted to %s", job, info["http"])
        if on_submit is not None:
            on_submit(job, info)
        record = wait(info, job, on_progress)
    _say_bad_rows(record)
    say_if_worse(record)  # (the coordinator's log said it too)
    return record


def _say_bad_rows(record: dict) -> None:
    """What local mode warns of, said here too: the malformed training rows the job skipped,
    the first ones named (the record carries them)."""
    if not record.get("bad_rows"):
        return
    from mariana.sparse.parse import describe_bad

    first = describe_bad(record.get("first_bad") or [], 3)
    log.warning("skipped %d malformed training rows per pass%s", record["bad_rows"], f" (first: {first})" if first
                else "")


def cancel_in(cluster: ClusterConfig, job: str) -> str:
    """Cancel `job` on the cluster up in `cluster`'s dir: its state after the request
    ("cancelled", "writing": too late, "done", ...); MarianaError when no cluster is up there
    or its coordinator does not answer."""
    from mariana.services import launcher

    info = launcher.cluster_info(cluster.cluster.path)
    if info is None:
        raise Unreachable(f"no cluster is up in {cluster.cluster.path}")
    return str(cancel_job(info, job).get("state"))


def stop_temporary(cluster_dir: str) -> None:
    """Stop a temporary cluster (`cluster_session`) whose owner was killed, if its supervisor
    has not already; its dir stays, with its logs."""
    from mariana.services import launcher

    try:
        launcher.down(cluster_dir, timeout=10.0)
    except launcher.ClusterNotUp:
        pass


def absolute_init_from(spec: str) -> str:
    """'models:v000003' -> '/abs/models:v000003': the coordinator refuses relative paths."""
    model_dir, version = parse_init_from(spec)
    return os.path.abspath(model_dir) + (f":{version}" if version else "")


@contextlib.contextmanager
def cluster_session(cluster: ClusterConfig, asked: tuple[str, ...] = ()) -> Iterator[dict]:
    """The cluster up in `cluster`'s dir (`launcher.cluster_info`), or one started here in
    a fresh temporary dir and stopped when the block ends (its dir removed, or kept with
    its logs when the block failed), or when this process is killed (its supervisor stops it:
    `launcher.up`'s owner); its info says `"temporary": True`. `asked`: the roles whose counts
    a running one must have."""
    from mariana.services import launcher

    info = launcher.cluster_info(cluster.cluster.path) or coordinator_back(cluster) or deployed(cluster)
    if info is not None:
        check_sizes(cluster, info, asked)
        yield info
        return
    if cluster.cluster.base_port and (held := held_ports(cluster)):
        # a cluster deployed on base_port whose coordinator is down: a temporary one took its
        # coordinator's ports, and its shard registered there (an exploratory run)
        raise Unreachable(f"no coordinator answers at {launcher.http_url(cluster)}, but ports of this config's "
                          f"cluster are taken ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}): a cluster "
                          f"deployed on cluster.base_port = {cluster.cluster.base_port} whose coordinator is down, "
                          "or another job's temporary cluster starting there; start its coordinator, or leave "
                          "base_port 0 for a temporary cluster on free ports")
    if not cluster.cluster.base_port and cluster.coordinator.endpoint:
        # endpoints written out name a deployed cluster: a temporary one on them would take its
        # ports, and its services, if the coordinator is only down for a moment
        raise Unreachable(f"no coordinator answers at {launcher.http_url(cluster)}: this config names the "
                          f"cluster's endpoints (coordinator.endpoint = {cluster.coordinator.endpoint}), as a "
                          "deployed cluster's does; start its coordinator, or give a config without endpoints for "
                          "a temporary cluster")
    cluster.cluster.dir = tempfile.mkdtemp(prefix="mariana-cluster-")
    log.info("no cluster is up: starting one (%d workers, %d ps, %d preprocess) in %s",
             cluster.worker.count, cluster.ps.count, cluster.preprocess.count, cluster.cluster.dir)
    try:
        launcher.up(cluster, owner=os.getpid())
    except MarianaError as e:
        if cluster.cluster.base_port and "in use" in str(e):  # two temporary clusters on the same fixed ports
            raise MarianaError(f"{e} (cluster.base_port = {cluster.cluster.base_port} gives a temporary cluster "
                               "fixed ports, so two jobs started at once without a cluster up collide: start one "
                               "with `mariana up` for them to share, or leave base_port 0 for free ports)") from None
        raise
    ok = False
    try:
        info = launcher.cluster_info(cluster.cluster.dir)
        if info is None:
            raise Unreachable(f"the coordinator of the cluster started in {cluster.cluster.dir} stopped as it started")
        yield {**info, "temporary": True}
        ok = True
    finally:
        launcher.down(cluster.cluster.dir)
        if ok:
            shutil.rmtree(cluster.cluster.dir, ignore_errors=True)
        else:
            log.warning("cluster logs kept in %s/logs", cluster.cluster.dir)


def coordinator_back(cluster: ClusterConfig) -> dict | None:
    """The cluster up in `cluster`'s dir whose coordinator is not running while its supervisor
    is (it starts it again: after deaths in a row, seconds later), once the coordinator runs
    again; None when no cluster is recorded there or its supervisor is gone. A job sent in
    that window ran on a temporary 1-worker cluster of its own, and said so only in a log line
    (an exploratory run)."""
    from mariana.services import launcher

    path = cluster.cluster.path
    if launcher.supervised(path) is None:
        return None
    log.warning("the cluster in %s is up, but its coordinator is not running: waiting up to %gs for its "
                "supervisor to start it again", path, AWAY_SECONDS)
    deadline = time.monotonic() + AWAY_SECONDS
    while time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
        info = launcher.cluster_info(path)
        if info is not None:
            return info
        if launcher.supervised(path) is None:
            raise Unreachable(f"the cluster in {path} stopped while its coordinator was down (`mariana down`, or "
                              "its supervisor died): `mariana up` it again")
    raise Unreachable(f"the coordinator of the cluster in {path} did not run again in {AWAY_SECONDS:g}s: see "
                      f"{path}/logs/coordinator-0.log")


def held_ports(cluster: ClusterConfig) -> list[str]:
    """The ports of the config's services (all but the coordinator's) that something on
    `cluster.host` accepts connections at: "ps.endpoints[0] (5710)", ..."""
    import socket

    from mariana.services.runtime.config import endpoint_host

    host = cluster.cluster.host or "127.0.0.1"
    wanted = [(key, endpoint_host(ep, key), int(ep.rpartition(":")[2])) for key, ep in cluster.zmq_endpoints()
              if key != "coordinator.endpoint"]
    wanted += [("loader.metrics_port", host, cluster.loader.metrics_port)] if cluster.loader.metrics_port else []
    for role in ("ps", "preprocess", "worker"):
        wanted += [(f"{role}.metrics_ports[{i}]", host, p) for i, p in enumerate(getattr(cluster, role).metrics_ports)]
    held = []
    for key, where, port in wanted:
        try:
            with socket.create_connection(("127.0.0.1" if where in ("0.0.0.0", "") else where, port), timeout=0.3):
                held.append(f"{key} ({port})")
        except OSError:
            pass
    return held


def deployed(cluster: ClusterConfig) -> dict | None:
    """The cluster whose coordinator answers at the config's fixed HTTP port, where no
    cluster.json says one is up: one deployed host by host, or by systemd (docs/operations.md).
    A temporary cluster on those fixed ports would fail to bind them, and its other services
    would knock at that coordinator under the same names. None when the port is 0 (a
    temporary cluster picks free ports) or nothing answers there as a coordinator."""
    from mariana.services import launcher

    if not cluster.coordinator.http_port:
        return None
    http = launcher.http_url(cluster)
    try:
        status = launcher.fetch_status(http)
    except (OSError, ValueError, http_client.HTTPException):
        return None
    if not isinstance(status, dict) or not isinstance(status.get("services"), dict):
        return None
    up_there = launcher.cluster_info(status["cluster_dir"]) if isinstance(status.get("cluster_dir"), str) else None
    if up_there is not None and up_there.get("http") == http:
        if up_there.get("owner"):  # another job's temporary cluster: it stops when that job ends
            raise MarianaError(f"the coordinator at {http} is the temporary cluster of another job (pid "
                               f"{up_there['owner']['pid']}, in {up_there['dir']}), on the fixed ports of "
                               f"cluster.base_port = {cluster.cluster.base_port}: start a cluster with `mariana up` "
                               "for jobs to share, or leave base_port 0 for free ports")
        return up_there  # `mariana up` in another dir than this config's cluster.dir
    log.info("using the cluster whose coordinator answers at %s (%d services; started without `mariana up` here)",
             http, len(status["services"]))
    return {"http": http, "token": cluster.coordinator.token, "dir": None, "config": None,
            "services": status["services"]}


def check_sizes(wanted: ClusterConfig, info: dict, asked: tuple[str, ...]) -> None:
    """A running cluster is used as it is: asked-for sizes that differ are an error, not a surprise."""
    from mariana.services.runtime.config import load_cluster_config

    if info.get("config"):
        running = load_cluster_config(info["config"], env={})
        have, where, stop = {r: getattr(running, r).count for r in asked}, f"up in {info['dir']}", "`mariana down`"
    else:  # deployed: what registered with its coordinator
        have = {r: sum(s.get("role") == r for s in info["services"].values()) for r in asked}
        where, stop = f"at {info['http']}", "stop it"
    for role in asked:
        if getattr(wanted, role).count != have[role]:
            has = f"{role}.count = {have[role]}" if info.get("config") else f"{have[role]} {role} registered"
            raise MarianaError(f"the cluster {where} has {has}; asked for {getattr(wanted, role).count} "
                               f"(drop the flag, or {stop} first)")


def submit(info: dict, body: dict) -> str:
    """The id the coordinator gave the job. A refused connection (a coordinator restarting,
    between its process start and its listening) is tried again for up to AWAY_SECONDS, as
    `wait` does: the job never reached it, so it is not sent twice (it failed at once)."""
    since = None
    while True:
        try:
            return _request(info, "POST", "/v1/jobs", body)["job"]
        except Unreachable as e:
            if not e.refused or _taken_down(info):
                raise
            now = time.monotonic()
            if since is None:
                since = now
                log.warning("%s; trying again for up to %gs (a coordinator restarting)", e, AWAY_SECONDS)
            if now - since > AWAY_SECONDS:
                raise Unreachable(f"{e} for {AWAY_SECONDS:g}s") from None
            _moved(info)
            time.sleep(POLL_SECONDS)


def wait(info: dict, job: str, on_progress: Callable[[dict], None] | None) -> dict:
    """The job's record once it is done; `on_progress` hears its progress (with "phase":
    what it waits for, "waiting for ps-0: ...", or does after its epochs; or None) about once
    a second. The job's warnings (a shard's tables too big for its machine) are logged as
    they appear."""
    last, away = 0.0, None  # away: since when the coordinator has not answered
    said: set[str] = set()  # the job's warnings shown so far
    try:
        while True:
            try:
                summary = _request(info, "GET", f"/v1/jobs/{job}")
            except Unreachable as e:  # restarting (the supervisor's ~1 s, a journal to replay), or down
                if _moved(info):  # `down` then `up`: the new coordinator listens on other ports
                    continue
                if _taken_down(info):  # no restart to wait for
                    raise Unreachable(f"{e}: the cluster in {info['dir']} was stopped (`mariana down`); job {job} "
                                      "goes on when it is up again (`mariana up`; its record: `mariana status`)") \
                        from None
                now = time.monotonic()
                if away is None:
                    away = now
                    log.warning("%s; waiting up to %gs for it (a restarted coordinator goes on with job %s)",
                                e, AWAY_SECONDS, job)
                if now - away > AWAY_SECONDS and info.get("temporary"):
                    raise Unreachable(f"{e} for {AWAY_SECONDS:g}s; job {job} ends with the temporary cluster "
                                      f"this command started for it, stopped now") from None
                if now - away > AWAY_SECONDS:
                    raise Unreachable(f"{e} for {AWAY_SECONDS:g}s; job {job} goes on when the cluster is up "
                                      f"again (`mariana up`; its record: `mariana status`)") from None
                time.sleep(POLL_SECONDS)
                continue
            if away is not None:
                log.info("the coordinator answers again after %.1fs", time.monotonic() - away)
                away = None
            for text in summary.get("warnings") or []:  # before a failure they may explain
                if text not in said:
                    said.add(text)
                    log.warning("job %s: %s", job, text)
            if summary["state"] == "done":
                return summary["record"]
            if summary["state"] in ("failed", "cancelled"):
                raise JobFailed(f"job {job} {summary['state']}: {summary['error']}")
            if on_progress and time.monotonic() - last >= 1.0:
                on_progress({**summary["progress"], "phase": summary.get("phase")})
                last = time.monotonic()
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        if cancel_job(info, job)["state"] == "writing":
            log.warning("job %s was writing its version when interrupted: too late to cancel; it ends done", job)
        raise


def _taken_down(info: dict) -> bool:
    """Whether the cluster `mariana up` started in `info`'s dir was stopped by `mariana down`
    (its cluster.json is gone): a client waited two minutes for a coordinator nobody restarts."""
    if info.get("temporary") or not info.get("dir"):
        return False
    from mariana.services import launcher

    try:
        return not launcher.recorded(info["dir"])
    except MarianaError:  # a cluster.json being written
        return False


def _moved(info: dict) -> bool:
    """Whether the cluster in `info`'s dir is up again at another address (a `down` and an `up`
    pick new ports unless the config fixes them): `info` updated to it. A job waited for went on
    there (its journal), and its client gave up after two minutes on the old port."""
    if info.get("temporary") or not info.get("dir"):
        return False
    from mariana.services import launcher

    try:
        now = launcher.cluster_info(info["dir"])
    except MarianaError:  # a cluster.json being written: the next poll reads it
        return False
    if now is None or (now["http"], now.get("token")) == (info["http"], info.get("token")):
        return False
    log.info("the cluster in %s is up again, its coordinator at %s (was %s)", info["dir"], now["http"], info["http"])
    info.update(http=now["http"], token=now.get("token"))
    return True


def _request(info: dict, method: str, path: str, body: dict | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if info.get("token"):
        headers["Authorization"] = f"Bearer {info['token']}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(info["http"] + path, data=data, method=method, headers=headers)
    try:
        with _DIRECT.open(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except (json.JSONDecodeError, AttributeError):
            pass
        raise Refused(f"coordinator at {info['http']}: {e.code}: {detail}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        refused = isinstance(getattr(e, "reason", e), ConnectionRefusedError)
        raise Unreachable(f"coordinator at {info['http']} unreachable: {e}", refused) from None
