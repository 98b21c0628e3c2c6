"""The pCTR endpoint: an aiohttp app over the data plane (serving/dataplane.py).

    POST /v1/predict     {"instances": [{"I1": 3, "C1": "68fd1e64", ...}, ...]} as JSON or msgpack
                         -> {"pctr": [...], "model_version": "v000003"} in the request's encoding;
                         a speech version takes a wav file instead (serving/speech.py)
    GET  /v1/model       the version in service: when and on what it was trained, its metrics
    GET  /healthz        the process is up;  GET /readyz: a model is loaded (else 503)
    GET  /metrics        Prometheus text, summed over the server's worker processes
    GET  /openapi.json   this API, for clients and fuzzers
    POST /v1/retrain     start `mariana retrain` (bearer token) -> 202 {"id": ...}
    GET  /v1/retrain/ID  its state and decision (bearer token)

Client mistakes are 4xx with a message naming them: 400 for a body that is not
JSON/msgpack or not {"instances": [objects]} or holds a value of the wrong type,
413 for a body or instance count over the limits, 401 for a missing or wrong
token; 503 while no model is loaded. Fields a model does not know are ignored
and counted. A 500 is a bug, logged with its trace.
"""
from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import logging
import os
import time

import aiohttp
from aiohttp import web

from mariana.services.runtime.auth import bearer_ok
from mariana.services.runtime.exporter import CONTENT_TYPE
from mariana.services.runtime.metrics import Metrics, merge, render
from mariana.services.runtime.report import dumps  # NaN (a metric of a version) as null
from mariana.serving import codec
from mariana.serving.config import ServeConfig, ready_path, snapshot_path, snapshot_worker
from mariana.serving.dataplane import Batcher, ModelHolder, error_answer
from mariana.serving.errors import ServeError
from mariana.serving.openapi import document, speech_document
from mariana.serving.retrain import VERDICTS, RetrainRunner
from mariana.serving.watch import VersionWatcher
from mariana.sparse.files import loads_json

log = logging.getLogger(__name__)
SNAPSHOT_SECONDS = 1.0
MEDIA = ("audio/", "image/", "video/")  # bodies no click model reads (a speech version's wav: its 400 said "not UTF-8")
RETRAIN_REAP_SECONDS = 1.0
HOLDER, BATCHER, WATCHER, METRICS, SETTINGS, RETRAIN, HOT = (web.AppKey(k, object) for k in (
    "holder", "batcher", "watcher", "metrics", "settings", "retrain", "hot"))


class _Hot:
    """What every prediction touches, bound once per app: the predict handler and the
    middleware read these attributes instead of `request.app[KEY]` (aiohttp's `request.app`
    and `Application.__getitem__` are Python calls: about ten a request), and update the
    metrics by label texts made once (`Metrics.key`)."""

    def __init__(self, serve, metrics: Metrics, holder: ModelHolder, settings: dict) -> None:
        self.serve, self.metrics, self.holder, self.settings = serve, metrics, holder, settings
        self.batcher: Batcher | None = None  # made at start-up (`_lifecycle`)
        self.in_flight = metrics.key()
        self.keys: dict[tuple[str, int], str] = {}  # (route, status) -> the requests_total series
        self.routes: dict[str, str] = {}             # route -> the request_seconds series

    def count(self, route: str, status: int, seconds: float) -> None:
        m = self.metrics
        key = self.keys.get((route, status))
        if key is None:  # a route and a code met for the first time (both come from few values)
            key = self.keys[route, status] = m.key(route=route, code=str(status))
            self.routes[route] = m.key(route=route)
        m.add("mariana_serve_requests_total", key)
        m.observe_at("mariana_serve_request_seconds", self.routes[route], seconds)


def create_app(cfg: ServeConfig, worker: int = 0, run_dir: str | None = None,
               config_path: str | None = None) -> web.Application:
    """The app of one worker process; `run_dir` is shared by the server's workers
    (their metrics snapshots); `config_path`, the server's resolved config, turns POST
    /v1/retrain on (the retrain runs with a copy of it under the model dir, which outlives
    the run dir: serving/retrain.py)."""
    s = cfg.serve
    settings = {"cfg": cfg, "worker": worker, "run_dir": run_dir, "name": f"serve-{worker}"}
    m = _metrics()
    hot = _Hot(s, m, ModelHolder(), settings)
    m.add("mariana_serve_in_flight", hot.in_flight, 0)  # there before the first request (an absent() alert)
    app = web.Application(client_max_size=s.max_body_bytes, middlewares=[_errors_and_metrics(hot)])
    app[SETTINGS], app[METRICS], app[HOLDER], app[HOT] = settings, m, hot.holder, hot
    app[RETRAIN] = RetrainRunner(cfg, config_path, on_end=lambda v: m.inc("mariana_serve_retrains_total", verdict=v))
    app.router.add_post("/v1/predict", _predict(hot), expect_handler=_expect)
    app.router.add_get("/v1/model", model_info)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/v1/retrain", retrain_start, expect_handler=_no_body_asked)
    app.router.add_get("/v1/retrain/{id}", retrain_status)
    settings["paths"] = frozenset(r.canonical for r in app.router.resources())
    app.cleanup_ctx.append(_lifecycle)
    return app


async def _lifecycle(app: web.Application):
    """Start-up in order, shut-down in reverse: batcher, first load, watcher, snapshots, retrains."""
    st, m = app[SETTINGS], app[METRICS]
    s = st["cfg"].serve
    where_keys = {where: m.key(where=where) for where in ("loop", "thread")}
    none = m.key()

    def on_batch(n: int, where: str) -> None:
        m.observe_at("mariana_serve_batch_requests", none, n)
        m.add("mariana_serve_batches_total", where_keys[where])

    batcher = app[BATCHER] = app[HOT].batcher = Batcher(s.batch_requests, s.max_instances, s.inline_bytes, on_batch)
    batcher.start()
    watcher = app[WATCHER] = VersionWatcher(s, app[HOLDER], st["name"], on_event=lambda k, i: _model_event(app, k, i))
    await watcher.check()  # what it cannot load it logs, and /readyz says 503 until there is a version
    watcher.start()
    if st["run_dir"]:
        _carry_over(app)
        # before the ready file says this worker is up: until then the other workers summed the dead
        # predecessor's snapshot as this one's, its gauges too (a version no worker served, in_flight)
        _write_snapshot(app)
    snapshots = asyncio.create_task(_write_snapshots(app)) if st["run_dir"] else None
    retrains = asyncio.create_task(_reap_retrains(app))
    yield
    retrains.cancel()
    await asyncio.gather(retrains, return_exceptions=True)
    app[RETRAIN].close()
    if snapshots:
        snapshots.cancel()
        await asyncio.gather(snapshots, return_exceptions=True)
    await watcher.close()
    await batcher.close()


# ---- endpoints ------------------------------------------------------------------------

def _predict(hot: _Hot):
    """POST /v1/predict's handler, bound to its app's `_Hot`."""
    s, holder, m = hot.serve, hot.holder, hot.metrics
    no_labels = m.key()

    async def predict(request: web.Request) -> web.Response:
        content_type = request.content_type
        fmt = codec.format_of(content_type)
        try:
            coding = request.headers.get("Transfer-Encoding")
            if coding is not None and coding.strip().lower() != "chunked":  # aiohttp de-chunks and drops the rest
                raise ServeError(400, f"Transfer-Encoding {coding[:60]!r} is not one this server reads (chunked only; "
                                      "a compressed body says so in Content-Encoding)", close=True)
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            if encoding not in _ENCODINGS:  # aiohttp read any other as none, and the answer said "not UTF-8"
                raise ServeError(415, f"Content-Encoding {encoding!r} is not one this server reads (gzip, deflate, "
                                      "x-gzip, or none)", close=True)
            length = request.content_length
            if length is not None and length > s.max_body_bytes:
                raise ServeError(413, f"a body of {length} bytes; at most {s.max_body_bytes} "
                                 "(serve.max_body_bytes): split the request", close=True)  # the body is left unread
            body = await _read(request, s)
            if encoding not in ("", "identity"):  # gzip (or its old name, x-gzip: RFC 9110 8.4.1.3), deflate
                body = _decompress(body, encoding, s.max_body_bytes)
            predictor = holder.current
            if predictor is None:
                raise ServeError(503, f"no model is loaded yet (nothing in service in {s.model_dir})")
        except ServeError as e:
            answer, close = error_answer(e, fmt, holder.version), e.close
        else:
            close = False
            if predictor.audio:
                return await _recognize(request.app, predictor, body, content_type)
            if content_type.startswith(MEDIA):  # a wav or an image for a click model: say what it takes
                answer = error_answer(ServeError(415, f"{predictor.version} is a click model: POST instances as "
                                                 f"JSON (or msgpack), not {content_type}"), fmt, predictor.version)
            else:
                answer = await hot.batcher.answer(predictor, body, fmt)
        m.add("mariana_serve_predictions_total", no_labels, answer.instances)
        if answer.unknown_fields:
            m.add("mariana_serve_unknown_fields_total", no_labels, answer.unknown_fields)
        if answer.unknown_creatives:
            m.add("mariana_serve_unknown_creatives_total", no_labels, answer.unknown_creatives)
        headers = {"X-Model-Version": answer.version} if answer.version else {}
        response = web.Response(body=answer.body, status=answer.status, content_type=answer.content_type,
                                headers=headers)
        if close:
            response.force_close()
        return response

    return predict


async def _recognize(app: web.Application, predictor, body: bytes, content_type: str) -> web.Response:
    """A speech version's answer (serving/speech.py), computed on a thread: the front-end's
    FFTs and the DNN take ~1.7 ms a second of audio (one thread, measured), too long for the
    event loop. A client's mistake raises ServeError (415, 400), which the middleware answers."""
    out = await asyncio.to_thread(predictor.answer, body, content_type)
    app[METRICS].inc("mariana_serve_predictions_total", 1)
    return web.json_response(out, headers={"X-Model-Version": predictor.version})


async def model_info(request: web.Request) -> web.Response:
    predictor = request.app[HOLDER].current
    if predictor is None:
        raise ServeError(503, "no model is loaded yet")
    return web.json_response(dumps=dumps, data={**predictor.info(), "worker": request.app[SETTINGS]["worker"]})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "worker": request.app[SETTINGS]["worker"], "pid": os.getpid()})


async def readyz(request: web.Request) -> web.Response:
    """Ready: this worker has a model. `workers` says how many of the server's worker
    processes listen yet (a load balancer needs one; a benchmark wants them all)."""
    st = request.app[SETTINGS]
    run_dir, n = st["run_dir"], st["cfg"].serve.worker_count
    listening = len(glob.glob(ready_path(run_dir, "*"))) if run_dir else 1
    workers = {"listening": listening, "of": n}
    version = request.app[HOLDER].version
    if version is None:
        return web.json_response({"ready": False, "error": "no model loaded", "workers": workers}, status=503)
    return web.json_response({"ready": True, "model_version": version, "worker": st["worker"], "workers": workers})


async def metrics(request: web.Request) -> web.Response:
    """Every worker's counts, summed. This worker writes its snapshot before reading
    the others': what a scrape reports is then on disk, so the next scrape, answered
    by whichever worker, never reports less (a drop would look like a counter reset).
    A worker that is down (the supervisor removed its ready file) adds its counts, which
    its successor goes on from, but not its gauges: it serves no version, has nothing in
    flight."""
    app = request.app
    m, st = app[METRICS], app[SETTINGS]
    states = [m.state()]
    if st["run_dir"]:
        own = _write_snapshot(app)
        for path in glob.glob(snapshot_path(st["run_dir"], "*")):
            if path != own:
                try:
                    with open(path) as f:
                        state = loads_json(f.read())
                except (OSError, ValueError):
                    continue  # being replaced right now: it is in the next scrape
                worker = snapshot_worker(path)
                if not os.path.exists(ready_path(st["run_dir"], worker)):
                    state = {k: v for k, v in state.items() if m.definitions.get(k, {}).get("type") != "gauge"}
                states.append(state)
    return web.Response(body=render(m.definitions, merge(states)).encode(),  # Prometheus' text format 0.0.4
                        headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"})


async def openapi(request: web.Request) -> web.Response:
    """This API, with the instance fields of the model this worker serves."""
    predictor = request.app[HOLDER].current
    if predictor is not None and predictor.audio:
        fe = predictor.recognizer.front_end
        return web.json_response(speech_document(fe.sample_rate, len(predictor.recognizer.manifest["classes"])))
    return web.json_response(document(predictor.schema if predictor is not None else None))


async def retrain_start(request: web.Request) -> web.Response:
    _authorize(request)
    if request.body_exists:  # it was ignored with a 202: the operator thought other data was used
        raise ServeError(400, "POST /v1/retrain takes no body: a retrain's data windows come from the server's "
                              "[retrain] config (data, train_files, eval_files)", close=True)
    run = request.app[RETRAIN].start()
    return web.json_response(dumps=dumps, data=run, status=202)


async def retrain_status(request: web.Request) -> web.Response:
    _authorize(request)
    return web.json_response(dumps=dumps, data=request.app[RETRAIN].status(request.match_info["id"]))


# ---- helpers ----------------------------------------------------------------------------

def _authorize(request: web.Request) -> None:
    """401 without credentials (or wrong ones), 403 for credentials the server cannot
    accept because its admin endpoints are off."""
    token = request.app[SETTINGS]["cfg"].serve.token
    got = request.headers.get("Authorization")
    if got is None:
        raise ServeError(401, "a bearer token is required (Authorization: Bearer <serve.token>)"
                         + ("" if token else "; the admin endpoints are off: set serve.token in the serve config"))
    if not token:
        raise ServeError(403, "admin endpoints are off: set serve.token in the serve config")
    if not bearer_ok(got, token):
        raise ServeError(401, "a valid bearer token is required (Authorization: Bearer <serve.token>)")


async def _expect(request: web.Request) -> None:
    """`Expect: 100-continue` (aiohttp's own handling, but): a body that its Content-Length
    puts over serve.max_body_bytes is not asked for. The 413 goes out at once, and the
    client does not send megabytes to have them refused."""
    t0 = time.perf_counter()
    s = request.app[SETTINGS]["cfg"].serve
    if request.content_length is not None and request.content_length > s.max_body_bytes:
        return None
    if request.version != aiohttp.HttpVersion11:  # HTTP/1.0 has no 100 Continue: the body just follows
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":  # answered before the middleware: counted here
        request.app[HOT].count("/v1/predict", 417, time.perf_counter() - t0)  # (both series, as the middleware does)
        version = request.app[HOLDER].version
        raise web.HTTPExpectationFailed(text=dumps({"error": f"Expect: {request.headers.get('Expect', '')} is not "
                                                             "one this server meets (only 100-continue)"}),
                                        content_type="application/json",
                                        headers={"X-Model-Version": version} if version else None)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer's own size starts after it, as in aiohttp's handler


async def _no_body_asked(request: web.Request) -> None:
    """POST /v1/retrain takes no body: `Expect: 100-continue` is never met with 100 Continue
    (aiohttp's default sent it before the token was looked at, inviting any client's
    megabytes). The handler answers at once: 401 without the token, 400 for a body."""
    return None


async def _read(request: web.Request, s) -> bytes:
    """The whole body, or ServeError: 413 over serve.max_body_bytes, 400 when it cannot be
    decoded (a Content-Encoding it is not in, a broken chunked stream), 408 when it does not
    all arrive in serve.body_seconds, 499 (nginx's "client closed request") when the client
    leaves meanwhile. Each closes the connection (after a 413 the rest of the body, never
    read, would be taken for the next request)."""
    try:
        if request.content.is_eof():  # the whole body came with the head: no timer, no task, no watch
            return await request.read()
        async with asyncio.timeout(s.body_seconds):
            return await _read_watched(request)
    except web.HTTPRequestEntityTooLarge:
        raise ServeError(413, f"the body is over {s.max_body_bytes} bytes (serve.max_body_bytes): "
                              "split the request", close=True) from None
    except web.RequestPayloadError as e:
        why = " ".join(str(getattr(e.__cause__, "message", None) or e).split())
        # The parser is done with this body (it feeds it no more): marked ended, so aiohttp does
        # not read it again after the answer, to log its error as an unhandled one.
        request.content.feed_eof()
        raise ServeError(400, f"the body cannot be read: {why}", close=True) from None
    except TimeoutError:
        raise ServeError(408, f"the body did not all arrive in {s.body_seconds:g}s (serve.body_seconds)",
                         close=True) from None
    except ConnectionError:
        raise ServeError(499, "the client closed the connection before its body arrived", close=True) from None


_ENCODINGS = ("", "identity", "gzip", "deflate", "x-gzip")


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip or deflate body, decoded up to `limit` bytes (413 past it); 400 when it is not
    in its Content-Encoding or ends early. Deflate is a zlib stream (RFC 9110 8.4.1.2), or a
    raw one, as some clients send it (aiohttp read both)."""
    import zlib

    name = "deflate" if encoding == "deflate" else "gzip"
    zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
    d = zlib.decompressobj(wbits=31 if name == "gzip" else zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise ServeError(400, f"the body cannot be read: not {name}, as its Content-Encoding says ({e})",
                         close=True) from None
    if len(out) > limit:
        raise ServeError(413, f"the body is over {limit} bytes (serve.max_body_bytes) once decompressed: "
                              "split the request")
    if not d.eof:
        raise ServeError(400, f"the body cannot be read: its {name} stream ends before it is complete", close=True)
    return out


async def _read_watched(request: web.Request) -> bytes:
    """request.read() of a body still arriving, ended with the parser's error when the rest of
    it is malformed (a broken chunked stream, a Content-Encoding it is not in): aiohttp queues
    that error as the connection's next message and never hands it to the body being read,
    which waited for serve.body_seconds and answered a false 408."""
    read = asyncio.ensure_future(request.read())
    try:
        while True:
            done, _ = await asyncio.wait([read], timeout=0.1)
            if done:
                return read.result()
            for message, _ in getattr(request.protocol, "_messages", ()):  # aiohttp's queue (3.9-3.14)
                if type(message).__name__ == "_ErrInfo" and not read.done() and not request.content.is_eof():
                    # (a body that ended meanwhile is whole: the error is a pipelined next request's)
                    request.content.feed_eof()  # done with: not read again after the answer
                    why = " ".join(str(getattr(message, "message", "") or "malformed").split())
                    raise ServeError(400, f"the body cannot be read: {why}", close=True)
    finally:
        if not read.done():
            read.cancel()


def _errors_and_metrics(hot: _Hot):
    """The middleware of every route: a client's mistake (ServeError, aiohttp's own 404/405)
    answered as JSON, a bug as a logged 500; each request counted by route and code, timed,
    and counted in flight while it runs."""
    m, settings = hot.metrics, hot.settings

    @web.middleware
    async def errors_and_metrics(request: web.Request, handler):
        t0 = time.perf_counter()
        resource = request.match_info.route.resource
        # a method an endpoint does not take (405) matches no route, but its path is one of ours
        route = resource.canonical if resource else request.path if request.path in settings["paths"] else "other"
        counted = route != "/metrics"  # a scrape would see itself, and leave itself in the snapshot it writes
        if counted:
            m.add("mariana_serve_in_flight", hot.in_flight, 1)
        try:
            response = await handler(request)
        except ServeError as e:
            challenge = {"WWW-Authenticate": 'Bearer realm="mariana"'} if e.status == 401 else None
            response = web.json_response({"error": e.message}, status=e.status, headers=challenge)
            if e.close:
                response.force_close()
        except web.HTTPException as e:  # aiohttp's own: no such route, method not allowed, ...
            response = web.json_response({"error": _http_error_text(request, e)}, status=e.status,
                                         headers={k: v for k, v in e.headers.items() if k == "Allow"})
            if route == "/v1/predict" and hot.holder.version:  # a GET there: every answer of it names one
                response.headers["X-Model-Version"] = hot.holder.version
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("%s: %s %s failed", settings["name"], request.method, request.path)
            response = web.json_response({"error": "internal error (logged)"}, status=500)
        finally:
            if counted:
                m.add("mariana_serve_in_flight", hot.in_flight, -1)
        if settings.get("draining"):  # stopping: a client's next request goes to another worker
            response.force_close()
        hot.count(route, response.status, time.perf_counter() - t0)
        return response

    return errors_and_metrics


def _http_error_text(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:  # a CONNECT names host:port, no path
        return f"no such endpoint: {request.path or request.raw_path or request.method} (see /openapi.json)"
    if e.status == 405:
        return f"{request.method} is not allowed on {request.path} (allowed: {e.headers.get('Allow', '')})"
    return e.reason or e.text or f"HTTP {e.status}"


def _metrics() -> Metrics:
    m = Metrics()
    m.counter("mariana_serve_requests_total", "HTTP requests answered, by route and status code.", start=())
    m.histogram("mariana_serve_request_seconds", "Time from request to answer, by route.",
                buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
    m.counter("mariana_serve_predictions_total", "Instances scored.")
    m.counter("mariana_serve_bad_http_total", "Requests aiohttp's parser refused before any route (a malformed "
              "head, chunked stream or Content-Encoding), each answered 400 by aiohttp.")
    m.counter("mariana_serve_unknown_fields_total", "Fields of instances that the model does not know (ignored; "
                                                    "counted in requests refused for another reason too).")
    m.counter("mariana_serve_creatives_added_total", "Creatives featurized after the version was trained, added "
                                                     "to its image table from the Redis creative cache.")
    m.counter("mariana_serve_unknown_creatives_total", "Instances naming a creative that the image model's table "
                                                       "lacks, or naming none (scored with the fallback: zero "
                                                       "features, flag 1).")
    m.counter("mariana_serve_bad_creatives_total", "Creative cache entries that hold no usable features (wrong "
                                                  "length, not finite, beyond 1e6): scored as unknown, said once.")
    m.histogram("mariana_serve_batch_requests", "Requests answered by one model call (a body that does not decode "
                                                "reaches none).",
                buckets=(1, 2, 4, 8, 16, 32, 64, 128))
    m.counter("mariana_serve_batches_total", "Model calls, by where they ran: the event loop (small batches) "
                                             "or the model thread.", start=({"where": "loop"}, {"where": "thread"}))
    m.gauge("mariana_serve_in_flight", "Requests being answered (scrapes of /metrics left out).")
    m.gauge("mariana_serve_model_info", "Worker processes serving each model version.")
    m.counter("mariana_serve_model_swaps_total", "Model versions swapped in for another (the first load is not one).")
    m.counter("mariana_serve_model_load_failures_total", "Model versions that could not be loaded, by each worker "
                                                         "(one bad version counts once per worker).")
    m.counter("mariana_serve_retrains_total", "Retrains started by POST /v1/retrain that ended, by verdict: "
                                              "promoted, refused, skipped (nothing new to learn) or failed (the reason "
                                              "is in the log).", start=tuple({"verdict": v} for v in VERDICTS))
    m.counter("mariana_serve_snapshot_failures_total", "Metrics snapshots this worker could not write (a full "
                                                       "TMPDIR): the sum the other workers answer is stale.")
    return m


def _model_event(app: web.Application, kind: str, info: dict) -> None:
    m = app[METRICS]
    if kind == "swapped":
        if info["previous"]:  # the first load is no swap
            m.remove("mariana_serve_model_info", version=info["previous"])
            m.inc("mariana_serve_model_swaps_total")
        m.set("mariana_serve_model_info", 1, version=info["version"])
    elif kind == "load_failed":
        m.inc("mariana_serve_model_load_failures_total")
    elif kind == "creatives_added":
        m.inc("mariana_serve_creatives_added_total", info["added"])
    elif kind == "creatives_bad":
        m.inc("mariana_serve_bad_creatives_total", info["bad"])


def _carry_over(app: web.Application) -> None:
    """A worker started again by the server's supervisor goes on from its predecessor's
    last snapshot: the server's counters would otherwise go down (/metrics sums the workers)."""
    st = app[SETTINGS]
    try:
        with open(snapshot_path(st["run_dir"], st["worker"])) as f:
            state = loads_json(f.read())
    except FileNotFoundError:
        return  # the first start of this worker
    except (OSError, ValueError) as e:
        log.warning("%s: the previous worker's metrics are unreadable (%s): its counters start at 0", st["name"], e)
        return
    if isinstance(state, dict):
        app[METRICS].carry_over(state)
        log.info("%s: counters go on from the previous worker's", st["name"])


def _write_snapshot(app: web.Application) -> str:
    """This worker's metrics to <run>/metrics-<i>.json (atomically); returns the path.
    A write that fails (a full TMPDIR, the run dir removed) is counted, and said once until
    one works again: meanwhile /metrics sums this worker's last snapshot, stale."""
    st = app[SETTINGS]
    path = snapshot_path(st["run_dir"], st["worker"])
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(app[METRICS].state(), f)
        os.replace(tmp, path)
    except OSError as e:
        _snapshot_failed(app, tmp, e)
    else:
        if st.get("snapshot_error"):
            log.warning("%s: its metrics snapshot is written again (%s): /metrics is up to date", st["name"], path)
            st["snapshot_error"] = None
    return path


def _snapshot_failed(app: web.Application, tmp: str, e: OSError) -> None:
    st = app[SETTINGS]
    with contextlib.suppress(OSError):
        os.unlink(tmp)  # a part written before the disk filled up
    app[METRICS].inc("mariana_serve_snapshot_failures_total")
    if not st.get("snapshot_error"):
        st["snapshot_error"] = str(e)
        log.warning("%s: cannot write its metrics snapshot: %s: %s; until it can, /metrics as answered by the "
                    "other workers holds this one's counts as they were: free space in %s (the server's TMPDIR)",
                    st["name"], e.filename or tmp, (e.strerror or str(e)).lower(), os.path.dirname(tmp))


async def _reap_retrains(app: web.Application) -> None:
    """A retrain this worker started is reaped (no zombie), logged and counted within a second
    of its end, whether or not anyone asks for its status. On a thread: a retrain that died
    has its cluster job cancelled over HTTP (up to 30 s), which must not hold the predictions."""
    while True:
        await asyncio.sleep(RETRAIN_REAP_SECONDS)
        if not app[RETRAIN].children:  # nearly always: no thread hop once a second in every worker
            continue
        try:
            await asyncio.to_thread(app[RETRAIN].reap)
        except Exception:  # a status file that cannot be read, say: the next look tries again
            log.exception("%s: cannot look at the retrains this worker started", app[SETTINGS]["name"])


async def _write_snapshots(app: web.Application) -> None:
    while True:
        await asyncio.sleep(SNAPSHOT_SECONDS)
        _write_snapshot(app)
