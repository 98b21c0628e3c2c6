"""The coordinator's HTTP API: status, jobs, history, models, metrics, the web UI; submit and
cancel behind the token. Reads the coordinator's state; a job it accepts goes to the coordinator."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import Counter

from aiohttp import web
from redis.exceptions import NoPermissionError, RedisError

from mariana.services import launcher, webui
from mariana.services.coord_openapi import JOBS_PAGE, document
from mariana.services.coord_state import ENDED, JOB_COUNTERS, REDIS_STATS_SECONDS, JobRun, bad_request
from mariana.services.jobstore import JobStoreError
from mariana.services.runtime.auth import bearer_ok
from mariana.services.runtime.exporter import CONTENT_TYPE, render_service
from mariana.services.runtime.report import dumps
from mariana.services.sample_cache import refusal
from mariana.sparse.errors import ConfigError, MarianaError
from mariana.trainer import checkpoint

log = logging.getLogger(__name__)
respond = functools.partial(web.json_response, dumps=dumps)  # NaN (a diverged job's loss) as null
LOG_SECONDS = 10.0  # requests refused for their token: one line at most this often


ENDED_SHOWN_SECONDS = 600.0  # an ended job's final counts stay in /metrics this long: scrapes see its last values


class CoordinatorAPI:
    """The HTTP API (routes in `http_app`): reads the coordinator's state; submit and cancel
    need the token; a job it accepts is queued on the coordinator."""

    def __init__(self, coord):
        self.coord = coord
        self.said_unauthorized = -math.inf  # when a refused token was last logged (monotonic)

    def http_app(self) -> web.Application:
        loopback = self.coord.cfg.coordinator.http_host in LOOPBACK_HOSTS
        app = web.Application(client_max_size=1 << 20, middlewares=[loopback_host] * loopback + [store_errors])
        app.router.add_get("/healthz", lambda r: respond({"ok": True}))
        app.router.add_get("/v1/status", self.http_status)
        app.router.add_get("/v1/jobs", self.http_jobs)
        app.router.add_get("/v1/jobs/{id}", self.http_job)
        app.router.add_get("/v1/jobs/{id}/history", self.http_history)
        app.router.add_get("/v1/models", self.http_models)
        app.router.add_post("/v1/jobs", self.http_submit)
        app.router.add_post("/v1/jobs/{id}/cancel", self.http_cancel)
        app.router.add_get("/metrics", self.http_metrics)
        app.router.add_get("/openapi.json", self.http_openapi)
        webui.add_routes(app)  # GET / and /ui/: the web UI of jobs and models
        app.on_response_prepare.append(nosniff)
        return app

    def touch_self(self) -> None:
        """The coordinator sends itself no heartbeats: it is up while it answers."""
        self.coord.services[self.coord.name].last_seen = time.time()
        self.coord.services[self.coord.name].status = dict(self.coord.counters)

    def status_dict(self, jobs: list[dict] | None = None) -> dict:
        """`jobs`: the job summaries to show (default: every job)."""
        self.touch_self()
        within = self.coord.cfg.coordinator.heartbeat_seconds
        # the supervisor's counts, as `mariana status` shows them: the coordinator's own are of registrations
        # it saw, so never its own restarts, and none from before its last one (the web UI said 0 for 3)
        recorded = launcher.restarts(self.coord.cfg.cluster.path)
        return {"services": {n: {"role": s.role, "index": s.index, "pid": s.pid, "host": s.host,
                                 "alive": s.alive(within), "last_seen": s.last_seen, "status": s.status,
                                 "restarts": recorded.get(n, s.restarts),
                                 "rate": s.rate if s.alive(within) else None,
                                 "stopped": s.stopped}
                             for n, s in sorted(self.coord.services.items())},
                "jobs": self.job_summaries() if jobs is None else jobs,
                "jobs_total": len(self.coord.jobs), "counters": dict(self.coord.counters),
                "cluster_dir": self.coord.cfg.cluster.path,  # where its cluster.json is, if `mariana up` ran it
                "refused": {n: why for n, (_, why) in sorted(self.coord.refused.items())}}

    def newest_first(self) -> list[JobRun]:
        return sorted(self.coord.jobs.values(), key=lambda r: (r.submitted, r.id), reverse=True)

    def job_summaries(self) -> list[dict]:
        """Newest first."""
        return [r.summary() for r in self.newest_first()]

    async def http_status(self, request: web.Request) -> web.Response:
        """?jobs=N: the newest N jobs, with every queued or running one and ?job=ID's (the web
        UI's poll, every second: thousands of ended jobs need not travel each time).
        ?brief=1: the records of ended jobs but the newest and ?job=ID's hold only their single
        values (no reliability table, no per-epoch lists): what a list of jobs shows."""
        most = count_param(request, "jobs")
        brief = request.query.get("brief", "0")
        if brief not in ("0", "1"):
            return bad_request(f"brief must be 0 or 1, got {brief!r}")
        runs = self.newest_first()
        named = request.query.get("job")
        if most is not None:
            runs = [r for i, r in enumerate(runs) if i < most or r.id == named or r.state not in ENDED]
        whole = {named, runs[0].id if runs else None}
        jobs = [brief_summary(r.summary()) if brief == "1" and r.id not in whole and r.state in ENDED
                else r.summary() for r in runs]
        return respond({**self.status_dict(jobs), "redis": await self.redis_stats()})

    async def redis_stats(self) -> dict:
        """The sample cache's Redis as its INFO says: hit rate of reads, memory, keys.
        Asked at most every REDIS_STATS_SECONDS: each open web UI polls /v1/status every second."""
        at, stats = self.coord._redis_stats
        if time.monotonic() - at < REDIS_STATS_SECONDS:
            return stats
        stats = await self._read_redis_stats()
        self.coord._redis_stats = (time.monotonic(), stats)
        return stats

    async def _read_redis_stats(self) -> dict:
        try:
            info = await asyncio.wait_for(self.coord.cache.redis.info(), 1.0)
        except (asyncio.TimeoutError, OSError, RedisError) as e:
            if isinstance(e, NoPermissionError) and "'info'" in str(e):  # answering: jobs need no INFO
                return {"up": True, "error": f"no figures: {e}"}
            why = refusal(e, self.coord.cfg.redis.url)  # a wrong db, credentials, an ACL: jobs fail, not wait
            if why is not None:
                return {"up": False, "refused": True, "error": why}
            return {"up": False, "error": str(e) or type(e).__name__}
        hits, misses = info.get("keyspace_hits", 0), info.get("keyspace_misses", 0)
        return {"up": True, "hits": hits, "misses": misses,
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                "used_memory": info.get("used_memory"), "keys": sum(
                    v.get("keys", 0) for k, v in info.items() if k.startswith("db") and isinstance(v, dict))}

    async def http_jobs(self, request: web.Request) -> web.Response:
        """Newest first; ?limit=N&offset=K pages through them (JOBS_PAGE without a limit: the
        whole list grew by 1.4 KB a job, for good, 775 KB at 568 jobs)."""
        limit, offset = count_param(request, "limit"), count_param(request, "offset") or 0
        runs = self.newest_first()
        page = runs[offset:offset + (JOBS_PAGE if limit is None else limit)]
        return respond({"jobs": [r.summary() for r in page], "total": len(runs)})

    def job_or_404(self, request: web.Request) -> JobRun:
        run = self.coord.jobs.get(request.match_info["id"])
        if run is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no job {request.match_info['id']!r}"}),
                                   content_type="application/json")
        return run

    async def http_job(self, request: web.Request) -> web.Response:
        return respond(self.job_or_404(request).summary())

    async def http_history(self, request: web.Request) -> web.Response:
        run = self.job_or_404(request)
        try:
            since = float(request.query.get("since", 0))
            if not math.isfinite(since):
                raise ValueError
        except ValueError:
            return bad_request(f"since must be a number (unix seconds), got {request.query['since']!r}")
        return respond({"job": run.id, "points": self.coord.store.points(run.id, since),
                                  "epochs": run.epochs()})

    async def http_models(self, request: web.Request) -> web.Response:
        outs = (r.record.get("model_dir") or r.request.get("out") for r in self.coord.jobs.values())
        dirs = list(dict.fromkeys([*self.coord.cfg.coordinator.model_dirs, *outs]))
        models = await asyncio.to_thread(lambda: [checkpoint.overview(d) for d in dirs if d])
        return respond({"models": [m for m in models if m is not None]})

    def authorize(self, request: web.Request) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            # a page of another site: with no token, its form (or fetch, no-cors) submitted a job
            # that reads and writes paths of its choosing (an exploratory run); our clients send none
            self.coord.counters["http_unauthorized"] += 1
            log.warning("%s: %s %s from a page of another origin (%s): refused (403)", self.coord.name,
                        request.method, request.path, origin[:100])
            raise web.HTTPForbidden(text=json.dumps({"error": f"a request from a page of another origin "
                                                              f"({origin[:100]}) is refused"}),
                                    content_type="application/json")
        token = self.coord.cfg.coordinator.token
        if not token:
            return
        got = request.headers.get("Authorization", "")
        if not bearer_ok(got, token):
            self.coord.counters["http_unauthorized"] += 1  # said at most once per LOG_SECONDS, with the count
            if time.monotonic() - self.said_unauthorized >= LOG_SECONDS:
                seen, self.said_unauthorized = self.coord.counters["http_unauthorized"], time.monotonic()
                log.warning("%s: %s %s from %s without a valid bearer token: refused (401; %d since it started)",
                            self.coord.name, request.method, request.path, request.remote, seen)
            raise web.HTTPUnauthorized(text=json.dumps({"error": "a valid bearer token is required "
                                                         "(Authorization: Bearer <coordinator.token>)"}),
                                       content_type="application/json",
                                       headers={"WWW-Authenticate": 'Bearer realm="mariana"'})

    def refuse(self, message: str) -> web.Response:
        """A job request refused: 400, counted (jobs_refused) and logged with why."""
        self.coord.counters["jobs_refused"] += 1
        log.info("%s: a job request refused (400): %s", self.coord.name, message[:300])
        return bad_request(message)

    async def http_submit(self, request: web.Request) -> web.Response:
        self.authorize(request)
        try:
            body = _json_body(await request.read(), request.charset)
        except web.RequestPayloadError:  # a Content-Encoding the body is not in: was a 500
            encoding = request.headers.get("Content-Encoding", "")[:40]
            refused = self.refuse(f"the body cannot be read: it is not in the Content-Encoding it names ({encoding!r})")
            refused.force_close()  # the rest of its stream cannot be read either: the connection closes after
            request.content.feed_eof()  # it, undrained (aiohttp's drain raised the decoder's error: a traceback)
            return refused
        except ValueError as e:
            return self.refuse(str(e))
        checked = None
        try:
            # the files are probed on the loader's host (data_via_loader), or here off the loop
            checked = await self.coord.inputs.check(body) if self.coord.inputs.enabled else None
            run = await asyncio.to_thread(self.coord.book.new_job, body, checked)
        except ConfigError as e:
            return self.refuse(str(e))
        except MarianaError as e:
            if self.coord.inputs.enabled and checked is None:  # no loader to check the files: try later
                return respond({"error": str(e)}, status=503)
            return self.refuse(str(e))
        except OSError as e:
            return self.refuse(f"{e.filename}: {e.strerror}")
        self.coord.book.save(run)  # first: a job the store lacks would be lost at the next restart
        self.coord.jobs[run.id] = run
        self.coord.queue.put_nowait(run.id)
        log.info("%s: job %s submitted (%s, %d epochs)", self.coord.name, run.id, run.request["model"],
                 run.ledger.epochs)
        return respond({"job": run.id, "state": run.state}, status=201)

    async def http_cancel(self, request: web.Request) -> web.Response:
        self.authorize(request)
        run = self.coord.jobs.get(request.match_info["id"])
        if run is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "no such job"}), content_type="application/json")
        done = run.cancel()
        if done == "writing":
            log.info("%s: job %s: a cancel came while its version was being written; refused", self.coord.name,
                     run.id)
            return respond({"error": f"job {run.id} is writing its version ({run.phase}): too late to "
                                               "cancel; it ends done"}, status=409)
        if done == "cancelled":
            log.info("%s: job %s cancelled", self.coord.name, run.id)
            self.coord.book.ended(run)
            self.coord.pulse()
        return respond(run.summary())

    async def http_openapi(self, request: web.Request) -> web.Response:
        return respond(document(bool(self.coord.cfg.coordinator.token)))

    async def http_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.prometheus().encode(), headers={"Content-Type": CONTENT_TYPE})

    def prometheus(self) -> str:
        """Its own counters as every service renders them (role and index labels), then the
        cluster's: which services are up, jobs by state, the active job's progress, and the
        job counters of the active job and of jobs that ended in the last ENDED_SHOWN_SECONDS
        (their final values: a series that vanished at the end lost what came after the
        last scrape, and a short job's was never seen)."""
        own = render_service(self.coord.role, self.coord.index, self.coord.counters, {}, self.coord.boot)
        self.touch_self()
        lines = []
        within = self.coord.cfg.coordinator.heartbeat_seconds
        lines += ["# HELP mariana_service_up 1 while the service's heartbeats arrive, 0 once it is silent.",
                  "# TYPE mariana_service_up gauge"]
        for n, s in sorted(self.coord.services.items()):
            lines.append(f'mariana_service_up{{service="{_escaped(n)}",role="{_escaped(s.role)}"}} '
                         f"{int(s.alive(within))}")
        lines += ["# HELP mariana_jobs Jobs this coordinator holds, by state.", "# TYPE mariana_jobs gauge"]
        states = Counter(r.state for r in self.coord.jobs.values())
        for state in ("queued", "running", "done", "failed", "cancelled"):
            lines.append(f'mariana_jobs{{state="{state}"}} {states[state]}')
        run = self.coord.active()
        if run is not None:
            p, job = run.ledger.progress(), _escaped(run.id)
            lines += ["# HELP mariana_job_rows_per_second The running job's training rows per second.",
                      "# TYPE mariana_job_rows_per_second gauge",
                      f'mariana_job_rows_per_second{{job_id="{job}"}} {p["rows_per_s"]}',
                      "# HELP mariana_job_epoch The running job's epoch.",
                      "# TYPE mariana_job_epoch gauge", f'mariana_job_epoch{{job_id="{job}"}} {p["epoch"]}']
        now = time.time()
        shown = [(_escaped(r.id), r.job_counters()) for r in self.coord.jobs.values()
                 if r is run or r.state in ENDED and now - r.ended < ENDED_SHOWN_SECONDS]
        shown = [(job, counts) for job, counts in shown if counts]
        for key, text in JOB_COUNTERS.items() if shown else ():
            lines += [f"# HELP mariana_job_{key}_total {text}", f"# TYPE mariana_job_{key}_total counter"]
            lines += [f'mariana_job_{key}_total{{job_id="{job}"}} {counts.get(key, 0)}' for job, counts in shown]
        return own + "\n".join(lines) + "\n"


def _escaped(value: str) -> str:
    r"""A label value as the text format writes it (backslash, quote and newline escaped).

    >>> print(_escaped('a"b\\c\nd'))
    a\"b\\c\nd
    """
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def count_param(request: web.Request, name: str) -> int | None:
    """A query parameter that counts (an int >= 0), None when absent; 400 otherwise."""
    text = request.query.get(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"{name} must be a whole number >= 0 (at most "
                                                           f"9 digits), got {text[:40]!r}"}),
                                 content_type="application/json")
    return int(text)


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def host_name(host: str) -> str:
    """The name in a Host header, without its port.

    >>> host_name("127.0.0.1:5701"), host_name("[::1]:5701"), host_name("LocalHost")
    ('127.0.0.1', '::1', 'localhost')
    """
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    return name.lower()


async def nosniff(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer says its Content-Type is the one to go by (the UI's files said so, the API's
    JSON did not)."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")


@web.middleware
async def loopback_host(request: web.Request, handler):
    """A coordinator that listens on loopback answers only requests that name a loopback host:
    a web page whose name was re-pointed at 127.0.0.1 (DNS rebinding) read the whole API, its
    Host header its own name. 421, naming what to use."""
    if host_name(request.host) not in LOOPBACK_HOSTS:
        return respond({"error": f"Host {request.host[:100]!r} is not this coordinator's: it listens on loopback; "
                                 "ask http://127.0.0.1:<port> (or localhost)"}, status=421)
    return await handler(request)


@web.middleware
async def store_errors(request: web.Request, handler):
    """The state dir full or unwritable (JobStoreError) is the coordinator's trouble, said as
    such: a 503 naming it, not a 500. A job it could not save was not queued."""
    try:
        return await handler(request)
    except JobStoreError as e:
        log.error("%s %s: %s", request.method, request.path, e)
        return respond({"error": f"the coordinator cannot save its state: {e}"}, status=503)


def brief_summary(summary: dict) -> dict:
    """A job summary whose record keeps only single values (what a list of jobs shows).

    >>> brief_summary({"id": "j1", "record": {"auc": 0.78, "model_version": "v000002", "reliability": [{}],
    ...                                       "epoch_seconds": [1.5], "valid": {"best_epoch": 1}}})
    {'id': 'j1', 'record': {'auc': 0.78, 'model_version': 'v000002'}, 'brief': True}
    """
    if "record" not in summary:
        return summary
    record = {k: v for k, v in summary["record"].items() if not isinstance(v, (list, dict))}
    return {**summary, "record": record, "brief": True}


def _json_body(raw: bytes, charset: str | None) -> object:
    """A request body as JSON; ValueError saying what is wrong with it (a charset no codec
    has, bytes not in it, text that is no JSON: the first was a 500, the last said only
    "must be a JSON object").

    >>> _json_body(b'{"data": [1', None)
    Traceback (most recent call last):
    ...
    ValueError: the body is not valid JSON: Expecting ',' delimiter: line 1 column 12 (char 11)
    >>> _json_body(b'{}', "foo")
    Traceback (most recent call last):
    ...
    ValueError: the body's charset 'foo' is not one this server knows: send UTF-8 JSON
    """
    try:
        text = raw.decode(charset or "utf-8")
    except LookupError:
        raise ValueError(f"the body's charset {charset[:40]!r} is not one this server knows: send UTF-8 JSON") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"the body is not {charset or 'UTF-8'} text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("the body is not valid JSON: it nests too deeply") from None
