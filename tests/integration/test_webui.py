"""The web UI: its routes on a real aiohttp server, and a real browser (headless
Chromium driven by Playwright) watching a job run on a real local cluster.

The browser test installs what it lacks: Debian's `chromium` (apt-get, as root) when
/usr/bin/chromium is absent; the `playwright` package comes with the dev extra. It never
downloads a browser of Playwright's own. Screenshots go to $MARIANA_TEST_ARTIFACTS or
<repo>/test-artifacts/ (git-ignored)."""
from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web

from mariana.services import webui
from mariana.services.coord_api import brief_summary
from mariana.sparse.synth import generate_criteo
from tests.conftest import ROOT
from tests.debian import debian_tool
from tests.integration.cluster import Cluster
from tests.integration.test_registration import ended, run, variant

CHROMIUM = Path("/usr/bin/chromium")
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
# LR on small batches: ~5,600 steps over 3 epochs of 120k rows, about 15-20 s on one worker
# and one shard: long enough to watch it run, short enough for the suite.
JOB = {"model": {"kind": "lr"}, "hashing": {"bits": 18}, "train": {"batch_size": 64, "epochs": 3},
       "data": {"block_bytes": 262144}}


# ---- routes ---------------------------------------------------------------------------------

@pytest.fixture
async def ui_server():
    """An aiohttp server with only the UI's routes, on a free loopback port: (host, port)."""
    app = web.Application()
    webui.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][:2]
    await runner.cleanup()


async def raw_get(addr: tuple, path: str) -> tuple[int, dict, bytes]:
    """GET with the path sent exactly as written (an HTTP client would normalize "..")."""
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: ui\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def test_ui_serves_its_files_without_caching(ui_server):
    code, headers, body = await raw_get(ui_server, "/ui/")
    assert code == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert headers["cache-control"] == "no-cache" and b'src="app.js"' in body
    assert "script-src" not in headers["content-security-policy"]  # default-src 'self': no inline code
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        code, headers, body = await raw_get(ui_server, f"/ui/{name}")
        assert code == 200 and headers["content-type"].startswith(kind), (name, headers)
        assert headers["cache-control"] == "no-cache"
        assert body == (webui.UI_DIR / name).read_bytes()


async def test_ui_root_redirects_to_the_page(ui_server):
    for path in ("/", "/ui"):
        code, headers, _ = await raw_get(ui_server, path)
        assert code == 302 and headers["location"] == "/ui/", (path, code, headers)


@pytest.mark.parametrize("path", [
    "/ui/../x", "/ui/../webui.py", "/ui/..%2fwebui.py", "/ui/%2e%2e/webui.py", "/ui/..%5cwebui.py",
    "/ui/webui.py", "/ui/nope.js", "/ui/app.js/x", "/ui/.", "/ui/..", "/ui//etc/passwd", "/x",
])
async def test_ui_serves_nothing_outside_its_directory(ui_server, path):
    code, _, body = await raw_get(ui_server, path)
    assert code == 404, (path, code, body[:200])


def test_the_ui_files_ship_with_the_package():
    """pyproject.toml's package-data lists them (an installed wheel has no source tree)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '[tool.setuptools.package-data]' in text and '"mariana.services" = ["ui/*"]' in text
    assert {"index.html", "app.js", "style.css"} <= set(webui.ui_files())


def test_the_page_builds_no_markup_from_strings():
    """Every string from the API becomes a text node: no innerHTML and friends in app.js."""
    js = (webui.UI_DIR / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink


# ---- a browser watching a job ---------------------------------------------------------------

@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium, installed with apt-get when it is missing (root only)."""
    return debian_tool(str(CHROMIUM), "chromium", timeout=240)


@pytest.fixture
def artifacts() -> Path:
    path = Path(os.environ.get("MARIANA_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def http_code(url: str) -> int:
    try:
        with _HTTP.open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        with e:
            return e.code


def attr_int(locator, name: str) -> int:
    value = locator.get_attribute(name)
    return int(float(value)) if value else 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_browser_shows_a_running_job_progress_and_charts(chromium, artifacts, tmp_path):
    """The issue's demonstration: open the UI while a job runs; its progress advances,
    its charts grow, the services show alive; then the job's record once it is done."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
    data = tmp_path / "train.tsv"
    generate_criteo(data, 120_000, seed=21)
    with Cluster(tmp_path / "c") as c:
        job = c.submit([data], tmp_path / "model", [], JOB)
        summary = c.wait(job, 60, until=lambda s: s["state"] != "running" or s["progress"]["rows"] > 0)
        assert summary["state"] == "running", summary
        assert http_code(c.info["http"] + f"/v1/jobs/{job}/history") == 200
        # a worker started with another host's config: refused at its Hello, and listed with the services
        stray = run("worker", 1, variant(c, tmp_path / "stray.toml", **{"worker.count": 2, "worker.metrics_ports": []}),
                    tmp_path / "stray.log")
        assert ended(stray, tmp_path / "stray.log")[0] == 78
        errors: list[str] = []
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
                page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
                page.goto(c.info["http"] + "/")
                assert page.url == c.info["http"] + "/ui/"
                sync_api.expect(page.locator('[data-testid=refused-service][data-service="worker-1"]')).to_contain_text(
                    "refused worker-1: no worker #1 in the coordinator's config")
                watch_the_running_job(sync_api, page, job, artifacts)
                summary = c.wait(job, 120)
                assert summary["state"] == "done", f"{summary}\n{c.logs()}"
                see_the_job_done(sync_api, page, job, summary["record"], artifacts)
            except AssertionError as e:  # say what the page said, too
                page.screenshot(path=str(artifacts / "webui-failed.png"), full_page=True)
                raise AssertionError(f"{e}\nthe page's errors: {errors}\n"
                                     f"screenshot: {artifacts / 'webui-failed.png'}") from None
            finally:
                browser.close()
    assert not errors, errors


def watch_the_running_job(sync_api, page, job: str, artifacts: Path) -> None:
    expect = sync_api.expect
    row = page.locator(f'[data-testid=job-row][data-job="{job}"]')
    expect(row).to_have_attribute("aria-selected", "true")  # the running job is selected by default
    expect(row).to_have_attribute("data-state", "running")
    progress = row.locator("[data-testid=job-progress]")
    charts = ["chart-loss", "chart-auc", "chart-throughput"]
    expect(page.locator("[data-testid=chart-source]")).to_have_attribute("data-source", "history")
    page.wait_for_function("""(charts) => charts.every((c) =>
        +document.querySelector(`[data-testid=${c}]`).dataset.points >= 1)""", arg=charts, timeout=15_000)
    rows = attr_int(progress, "data-rows")
    points = {c: attr_int(page.locator(f"[data-testid={c}]"), "data-points") for c in charts}
    page.wait_for_function("""([job, rows, points]) => {
        const p = document.querySelector(`[data-testid=job-row][data-job="${job}"] [data-testid=job-progress]`);
        return +p.dataset.rows > rows && Object.entries(points).every(([c, n]) =>
            +document.querySelector(`[data-testid=${c}]`).dataset.points > n);
    }""", arg=[job, rows, points], timeout=15_000)
    assert attr_int(progress, "data-rows") > rows
    for c, n in points.items():
        assert attr_int(page.locator(f"[data-testid={c}]"), "data-points") > n, c
    worker = page.locator('[data-testid=service-row][data-service="worker-0"]')
    expect(worker).to_have_attribute("data-alive", "true")
    expect(worker.locator("[data-testid=service-host]")).to_have_text(platform.node())  # as it registered
    expect(page.locator('[data-testid=service-row][data-service="ps-0"]')).to_have_attribute("data-alive", "true")
    expect(page.locator("[data-testid=health]")).to_have_attribute("data-state", "ok")
    expect(page.locator("[data-testid=redis]")).to_have_attribute("data-up", "true")
    shot = artifacts / "webui-running.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot of the running job: {shot}")


def see_the_job_done(sync_api, page, job: str, record: dict, artifacts: Path) -> None:
    expect = sync_api.expect
    row = page.locator(f'[data-testid=job-row][data-job="{job}"]')
    expect(row).to_have_attribute("data-state", "done", timeout=10_000)
    expect(row.locator("[data-testid=job-progress]")).to_have_attribute("data-fraction", "1.0000")
    shown = page.locator("[data-testid=job-record]")
    expect(shown).to_be_visible()
    expect(shown.locator("[data-key=rows_applied] .v")).to_have_text(f"{record['rows_applied']:,}")
    expect(page.locator("[data-testid=job-error]")).to_be_hidden()
    expect(page.locator("[data-testid=job-epochs] tbody tr")).to_have_count(3)
    model = page.locator(f'[data-testid=model][data-dir="{record["model_dir"]}"]')
    expect(model.locator(f'[data-version="{record["model_version"]}"]')).to_contain_text("current", timeout=10_000)
    shot = artifacts / "webui-done.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot of the finished job: {shot}")


# ---- the page against an API that is hostile or incomplete ---------------------------------------

EVIL = "<img src=x onerror=window.pwned=1>"
FAKE_STATUS = {"services": {
    "worker-0": {"role": "worker", "index": 0, "pid": 41, "alive": False, "last_seen": time.time() - 30,
                 "status": {"rows": 10, EVIL: 1}},
    f"ps-0{EVIL}": {"role": "ps", "index": 0, "alive": True}},  # no pid, last_seen, status nor rate
    "counters": {}}
FAKE_JOB = {"id": f"j1{EVIL}", "state": "failed", "error": f"<script>window.pwned=2</script>{EVIL}",
            "submitted": 1.7e9, "started": 1.7e9, "ended": 0, "model": EVIL, "data": [EVIL],
            "progress": {"epoch": 1, "epochs": 2}}  # no rows, loss, rate, cache, record


@contextmanager
def ui_only_server():
    """The UI's routes alone on a real aiohttp server (its own loop, in a thread): its URL."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    webui.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, name="ui-server")
    thread.start()
    try:
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class FakeAPI:
    """/v1/status (its jobs included, as every coordinator has sent them) of an older
    coordinator (no history, no models): a running job whose rows grow at each request, and
    a failed one with hostile strings."""

    def __init__(self):
        self.calls = 0

    def running_job(self) -> dict:
        self.calls += 1
        return {"id": "j2-running", "state": "running", "error": "", "submitted": 1.8e9, "started": 1.8e9,
                "ended": 0, "model": "lr", "mode": "async", "data": ["/d.tsv"],
                "progress": {"epoch": 1, "epochs": 2, "rows": 1000 * self.calls, "rows_per_s": 900.0 + self.calls,
                             "loss": 0.5 - 0.001 * self.calls, "ready": 3, "leased": 1, "batches": 40,
                             "source_done": False}}

    def __call__(self, route) -> None:
        path = route.request.url.split("/v1/", 1)[1].split("?")[0]
        body = {"status": {**FAKE_STATUS, "jobs": [FAKE_JOB, self.running_job()]}}.get(path) \
            if path == "status" else None
        if body is None:  # history, models: an older coordinator
            route.fulfill(status=404, content_type="text/plain", body="404: Not Found")
        else:
            route.fulfill(status=200, content_type="application/json", body=json.dumps(body))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_page_writes_api_strings_as_text_and_copes_with_an_older_api(chromium):
    """Without history the charts fill from the running job's progress; hostile strings stay
    text; missing fields show a dash; a click selects a job (and shows its error)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
    expect = sync_api.expect
    with ui_only_server() as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/v1/**", FakeAPI())
            page.goto(url + "/ui/")
            running = page.locator('[data-testid=job-row][data-job="j2-running"]')
            expect(running).to_have_attribute("aria-selected", "true")  # the running job, though listed second
            expect(page.locator("[data-testid=job-row]").first).to_have_attribute("data-job", "j2-running")
            expect(page.locator("[data-testid=chart-source]")).to_have_attribute("data-source", "summary")
            page.wait_for_function("() => +document.querySelector('[data-testid=chart-loss]').dataset.points >= 3")
            expect(page.locator("[data-testid=chart-auc]")).to_have_attribute("data-points", "0")
            assert int(running.locator("[data-testid=job-progress]").get_attribute("data-rows")) >= 3000
            expect(running.locator("[data-testid=job-phase]")).to_have_count(0)  # no phase: nothing extra
            expect(page.locator("[data-testid=job-detail-phase]")).to_be_hidden()
            expect(page.locator("[data-testid=models]")).to_contain_text("404")

            failed = page.locator("[data-testid=job-row][data-state=failed]")
            expect(failed).to_have_attribute("data-job", FAKE_JOB["id"])
            failed.click()
            expect(failed).to_have_attribute("aria-selected", "true")
            expect(running).to_have_attribute("aria-selected", "false")
            assert page.url.endswith("#job=" + urllib.parse.quote(FAKE_JOB["id"], safe=""))
            expect(failed.locator("td").nth(2)).to_have_text(EVIL)  # the model, as text
            expect(failed.locator("[data-testid=job-rows]")).to_have_text("—")
            expect(failed.locator("[data-testid=job-cache]")).to_have_text("—")
            expect(page.locator("[data-testid=job-error]")).to_contain_text(FAKE_JOB["error"])
            expect(page.locator("[data-testid=chart-loss]")).to_have_attribute("data-points", "0")
            expect(page.locator("[data-testid=health]")).to_have_attribute("data-state", "degraded")
            expect(page.locator('[data-testid=service-row][data-service="worker-0"]')).to_have_attribute(
                "data-alive", "false")
            expect(page.locator(f'[data-testid=service-row][data-service="ps-0{EVIL}"]')).to_contain_text("—")
            page.wait_for_timeout(1500)  # a refresh or two more
            assert page.locator("img").count() == 0 and page.locator("script").count() == 1
            assert page.evaluate("window.pwned") is None
        finally:
            browser.close()
    assert not errors, errors


# ---- a finished job, a finishing one and model versions, at a laptop's width ---------------------

NOW = time.time()
DONE_ID, FINISHING_ID, NO_TEST_ID = "j20250312-101500-4f9c2a", "j20250312-113000-7d1e0b", "j20250312-090000-0a0a0a"
MODEL_DIR = "/srv/mariana/models/criteo-ctr-sparse-dnn"


def canned_history(started: float, seconds: int = 300) -> list[dict]:
    """A point every 2 s over 3 epochs: progressive AUC climbing to ~0.85 (above the test AUC)."""
    return [{"t": started + s, "epoch": 1 + min(2, 3 * s // seconds), "rows_total": 400 * s,
             "rows_per_s": 9000.0 + 600 * math.sin(s / 17), "loss": 0.56 - 0.1 * s / seconds,
             "auc": 0.70 + 0.15 * s / seconds} for s in range(2, seconds + 1, 2)]


def canned_epochs() -> list[dict]:
    """The history's epochs of a job with valid_data: the validation logloss is lowest after epoch 2."""
    return [{"epoch": e, "seconds": 99.0, "rows": 40_000, "loss": 0.47 - 0.01 * e, "auc": 0.8 + 0.02 * e,
             "valid": {"logloss": loss, "auc": auc, "calibration": 1.01, "ne": 0.83, "rows": 8_000}}
            for e, loss, auc in ((1, 0.4521, 0.8102), (2, 0.4471, 0.8201), (3, 0.4493, 0.8188))]


def canned_job(job_id: str, state: str, started: float, **fields) -> dict:
    return {"id": job_id, "state": state, "error": "", "submitted": started, "started": started,
            "ended": 0 if state == "running" else started + 300, "model": "sparse_dnn", "mode": "async",
            "data": ["/srv/data/train.tsv"], "restarts": 0,
            "progress": {"epoch": 3, "epochs": 3, "rows": 40_000, "rows_total": 120_000, "rows_per_s": 9000.0,
                         "loss": 0.46, "fraction": 1.0}, **fields}


def canned_reliability() -> list[dict]:
    """10 buckets of 2,000 test rows; the model over-predicts the top two (their intervals
    miss the diagonal), the other eight are within chance of it."""
    table = []
    for i in range(10):
        pred = 0.05 + 0.04 * i
        obs = pred * (0.7 if i >= 8 else 1.0) + (0.004 if i % 2 else -0.004)
        half = 1.96 * math.sqrt(obs * (1 - obs) / 2000)
        table.append({"score_min": round(pred - 0.015, 4), "score_max": round(pred + 0.015, 4), "rows": 2000,
                      "clicks": round(obs * 2000), "mean_pctr": round(pred, 4), "ctr": round(obs, 4),
                      "ctr_lo": round(obs - half, 4), "ctr_hi": round(obs + half, 4)})
    return table


def canned_record(auc: float | None, logloss: float | None, version: str) -> dict:
    return {"auc": auc, "logloss": logloss, "calibration": None if auc is None else 1.012,
            "ne": None if auc is None else 0.8312, "test_rows": 0 if auc is None else 20_000,
            "ece": None if auc is None else 0.0151, "reliability": None if auc is None else canned_reliability(),
            "train_rows": 40_000, "rows_applied": 120_000, "epochs": 3, "epoch_seconds": [99.1, 98.7, 100.2],
            "train_seconds": 298.0, "rows_per_s": 402.7, "train_loss": 0.4611, "model": "sparse_dnn",
            "model_dir": MODEL_DIR, "model_version": version, "promoted": True}


def canned_version(n: int, job: str, days_ago: float, auc: float | None) -> dict:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - days_ago * 86400))
    metrics = {"auc": None, "logloss": None, "calibration": None, "ne": None, "test_rows": 0} if auc is None \
        else {"auc": auc, "logloss": 0.4432 + (0.8201 - auc), "calibration": 1.012, "ne": 0.8312, "test_rows": 20_000}
    return {"version": f"v{n:06d}", "current": n == 3, "created": created, "model": "sparse_dnn",
            "metrics": metrics, "rows": 1_200_000, "job": job}


class CannedAPI:
    """/v1/status, /v1/jobs/{id}/history and /v1/models of a coordinator with three jobs: one
    done with a test set (test AUC 0.8201 below its progressive AUC's ~0.85), one done without,
    and one whose epochs are over but which is still running (`phase`)."""

    def __init__(self, total: int | None = None):
        self.total = total  # jobs_total, when the coordinator has more jobs than it lists
        self.asked: list[str] = []  # the query strings of /v1/status
        self.jobs = {
            FINISHING_ID: canned_job(FINISHING_ID, "running", NOW - 320, phase="evaluating on test.tsv",
                                     warnings=[SHARD_WARNING, EVIL]),
            DONE_ID: canned_job(DONE_ID, "done", NOW - 4000, phase=None,
                                record=canned_record(0.8201, 0.4432, "v000003")),
            NO_TEST_ID: canned_job(NO_TEST_ID, "done", NOW - 9000, record=canned_record(None, None, "v000002")),
        }
        self.versions = [canned_version(3, DONE_ID, 0.04, 0.8201), canned_version(2, NO_TEST_ID, 0.1, None),
                         canned_version(1, "j20250301-235959-c0ffee", 11, 0.8017)]
        self.model_dir, self.versions_total = MODEL_DIR, None  # versions_total: when the dir holds more

    def status(self, query: str = "") -> dict:
        """With brief=1, ended jobs' records but the newest's and the named job's cut short, as
        the coordinator's are."""
        services = {f"{role}-{i}": {"role": role, "index": i, "pid": 100 + i, "alive": True,
                                        "last_seen": time.time()}
                    for role in ("worker", "ps") for i in range(2)}
        more = {} if self.total is None else {"jobs_total": self.total}
        asked = urllib.parse.parse_qs(query)
        whole = {*asked.get("job", []), max(self.jobs.values(), key=lambda j: j["submitted"])["id"]}
        jobs = [brief_summary(j) if asked.get("brief") == ["1"] and j["id"] not in whole and j["state"] == "done"
                else j for j in self.jobs.values()]
        return {"services": services, "counters": {}, "jobs": jobs, **more}

    def models(self) -> dict:
        # a decisions.jsonl line as serving/retrain.py writes it (the page read other keys, so showed none)
        decision = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 3650)), "verdict": "promoted",
                    "new_version": "v000003", "served_version": "v000002",
                    "metrics": {"new": {"auc": 0.8201, "logloss": 0.4432}, "served": {"auc": 0.8017}},
                    "reason": "AUC 0.820100 >= served 0.801700 - tolerance 0"}
        promotion = {"time": NOW - 3640, "version": "v000003", "previous": "v000002", "reason": "retrain"}
        total = {} if self.versions_total is None else {"versions_total": self.versions_total}
        return {"models": [{"dir": self.model_dir, "current": "v000003", "versions": self.versions,
                            "decisions": [decision], "promotions": [promotion], **total}]}

    def __call__(self, route) -> None:
        path = urllib.parse.unquote(route.request.url.split("/v1/", 1)[1].split("?")[0])
        body = None
        if path == "status":
            self.asked.append(urllib.parse.urlsplit(route.request.url).query)
            body = self.status(self.asked[-1])
        elif path == "models":
            body = self.models()
        elif path.startswith("jobs/") and path.endswith("/history") and path[5:-8] in self.jobs:
            job = self.jobs[path[5:-8]]
            body = {"job": job["id"], "points": canned_history(job["started"]),
                    "epochs": canned_epochs() if job["id"] == DONE_ID else []}
        if body is None:
            route.fulfill(status=404, content_type="text/plain", body="404: Not Found")
        else:
            route.fulfill(status=200, content_type="application/json", body=json.dumps(body))


@pytest.fixture
def canned_page(chromium, artifacts):
    """A factory of pages (viewport width, height) on the UI against CannedAPI; no page errors."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
    errors: list[str] = []
    with ui_only_server() as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])

        def open_page(width: int = 1280, height: int = 800, job: str | None = None, api: CannedAPI | None = None):
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.route("**/v1/**", api or CannedAPI())
            page.goto(url + "/ui/" + (f"#job={job}" if job else ""))
            return page

        try:
            yield sync_api.expect, open_page
        finally:
            browser.close()
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_survives_a_malformed_address_and_says_how_many_jobs_it_lists(canned_page):
    """`#job=%` threw in decodeURIComponent and the page never polled; with thousands of
    jobs the page asks for the newest 200 (and the one it follows) and says so."""
    expect, open_page = canned_page
    page = open_page(job="%E0%A4%A")
    expect(page.locator("[data-testid=job-row]")).to_have_count(3)
    expect(page.locator("[data-testid=jobs-more]")).to_be_hidden()
    api = CannedAPI(total=2014)
    page = open_page(job=DONE_ID, api=api)
    expect(page.locator("[data-testid=jobs-more]")).to_contain_text("The newest 3 of 2,014 jobs")
    expect(page.locator("[data-testid=stat-jobs]")).to_have_text("2,014")
    assert api.asked and api.asked[0] == f"jobs=200&brief=1&job={DONE_ID}", api.asked


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_shows_bidi_controls_as_code_points_counts_every_version_and_fits_a_phone(canned_page):
    """Found in a browser: a path holding U+202E (right-to-left override) read backwards; a dir
    of 210 versions said "Versions (50)" (/v1/models lists the newest 50); at 375 px the top bar
    was cut off and the page scrolled sideways."""
    expect, open_page = canned_page
    api = CannedAPI()
    api.jobs[DONE_ID]["progress"].update(ready=0, leased=8)  # an ended job's last counts: no queue to show
    page = open_page(1280, 800, job=DONE_ID, api=api)
    expect(page.locator("[data-testid=model] h3").first).to_have_text("Versions (3)")
    expect(page.locator("#job-facts div", has_text="Steps ready / leased").locator("dd")).to_have_text("—")
    api = CannedAPI()
    api.model_dir, api.versions_total = "/models/\u202etxt.exe/ctr", 210
    page = open_page(375, 800, api=api)
    expect(page.locator("[data-testid=model] .model-head .path")).to_have_text("/models/<U+202E>txt.exe/ctr")
    expect(page.locator("[data-testid=model] h3").first).to_have_text("Versions (the newest 3 of 210)")
    assert page.evaluate("document.documentElement.scrollWidth") <= 375


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_says_when_the_job_in_its_address_is_not_known(canned_page):
    """/ui/#job=ID of a job the coordinator does not know showed the newest job, saying nothing."""
    expect, open_page = canned_page
    page = open_page(job="j-no-such-job")
    expect(page.locator("#job-follow-hint")).to_have_text("no job j-no-such-job here; showing the running job")


def test_browser_jobs_table_gives_an_ended_job_its_own_rows_per_second(canned_page):
    """The table showed a finished job's last epoch's pace (9,000 here) as its rows/s; its
    record's (every epoch: 402.7) is its own. A running job shows its epoch so far."""
    expect, open_page = canned_page
    page = open_page()
    expect(page.locator(f"[data-testid=job-row][data-job='{DONE_ID}'] [data-testid=job-rate]")).to_have_text("403")
    expect(page.locator(f"[data-testid=job-row][data-job='{FINISHING_ID}'] [data-testid=job-rate]")).to_have_text(
        "9,000")
    expect(page.locator(f"[data-testid=job-row][data-job='{DONE_ID}'] [data-testid=job-rows]")).to_have_text(
        "120,000")


def test_browser_labels_the_progressive_auc_and_shows_the_test_auc(canned_page, artifacts):
    """The AUC chart is of training rows scored before each update (it reads ~0.85 here), so it
    says so; a finished job's test AUC (0.8201) is in its caption and a dashed line on it."""
    expect, open_page = canned_page
    page = open_page(job=DONE_ID)
    expect(page.locator("[data-testid=job-detail]")).to_have_attribute("data-job", DONE_ID)
    title = page.locator("[data-testid=chart-auc-title]")
    expect(title).to_contain_text("Progressive AUC")
    expect(title).to_contain_text("training rows")
    assert "before the model trained" in title.get_attribute("title")
    expect(page.locator("[data-testid=chart-loss-title]")).to_contain_text("training rows")

    auc_test = page.locator("[data-testid=chart-auc-test]")
    expect(auc_test).to_have_text("test AUC 0.8201")
    expect(page.locator("[data-testid=chart-loss-test]")).to_have_text("test logloss 0.4432")
    chart = page.locator("[data-testid=chart-auc]")
    expect(chart).to_have_attribute("data-ref", "0.8201")
    expect(chart.locator(".ref line")).to_have_count(1)
    expect(chart.locator(".ref text")).to_have_text("test 0.8201")
    expect(page.locator("#now-auc")).to_have_text("0.8500")  # the progressive one, still shown
    record = page.locator("[data-testid=job-record]")
    expect(record.locator("[data-key=auc] .k")).to_have_text("Test AUC")
    expect(record.locator("[data-key=auc] .v")).to_have_text("0.8201")
    page.screenshot(path=str(artifacts / "webui-test-auc.png"), full_page=True)

    page.locator(f'[data-testid=job-row][data-job="{NO_TEST_ID}"]').click()  # done, without test data
    expect(auc_test).to_have_text("no test data")
    expect(chart).to_have_attribute("data-ref", "")
    expect(chart.locator(".ref line")).to_have_count(0)
    expect(record.locator("[data-key=auc] .v")).to_have_text("no test data")

    page.locator(f'[data-testid=job-row][data-job="{FINISHING_ID}"]').click()  # running: no test AUC yet
    expect(auc_test).to_have_text("")
    expect(page.locator("[data-testid=chart-auc]")).to_have_attribute("data-points", "150")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_shows_the_calibration_of_a_finished_job(canned_page, artifacts):
    """A finished job with test data: its reliability table as a chart beside the test AUC
    (observed vs predicted CTR, the diagonal, the buckets off it in red, ECE in the caption)
    and as a table in its record; a job without test data or still running says why not."""
    expect, open_page = canned_page
    page = open_page(job=DONE_ID)
    chart = page.locator("[data-testid=chart-reliability]")
    expect(chart).to_have_attribute("data-points", "10")
    expect(chart.locator(".bucket")).to_have_count(10)
    expect(chart.locator(".bucket.off")).to_have_count(2)  # the over-predicted top two
    expect(chart.locator(".bucket.off").first).to_have_attribute("data-pred", "0.37")
    expect(chart.locator(".diag")).to_have_count(1)
    expect(chart.locator(".bucket .whisker")).to_have_count(10)
    ece = page.locator("[data-testid=chart-reliability-ece]")
    expect(ece).to_have_text("ECE 0.0151")
    expect(page.locator("[data-testid=chart-reliability-test]")).to_have_text("20,000 test rows · 10 buckets")
    expect(page.locator("[data-testid=chart-reliability-title]")).to_contain_text("Calibration")
    chart.locator(".bucket").nth(9).hover()
    expect(ece).to_have_text("pCTR 0.41 → CTR 0.291")
    page.mouse.move(0, 0)
    expect(ece).to_have_text("ECE 0.0151")
    record = page.locator("[data-testid=job-record]")
    expect(record.locator("[data-key=ece] .v")).to_have_text("0.0151")
    table = record.locator("[data-testid=reliability-table]")
    expect(table).to_be_hidden()  # folded until asked for
    record.locator("details[data-name=reliability] summary").click()
    expect(table.locator("tbody tr")).to_have_count(10)
    expect(table.locator("tbody tr").first).to_contain_text("0.035–0.065")
    page.screenshot(path=str(artifacts / "webui-calibration.png"), full_page=True)

    page.locator(f'[data-testid=job-row][data-job="{NO_TEST_ID}"]').click()
    expect(chart).to_have_attribute("data-points", "0")
    expect(chart).to_contain_text("no test data")
    expect(ece).to_have_text("—")
    expect(record.locator("[data-key=ece] .v")).to_have_text("no test data")
    expect(record.locator("[data-testid=reliability-table]")).to_have_count(0)
    page.locator(f'[data-testid=job-row][data-job="{FINISHING_ID}"]').click()
    expect(chart).to_contain_text("once the job is done")
    # the poll now sends DONE_ID's record brief (no reliability table): picked again, it is fetched whole
    page.wait_for_timeout(1500)
    page.locator(f'[data-testid=job-row][data-job="{DONE_ID}"]').click()
    expect(chart).to_have_attribute("data-points", "10")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_charts_each_epochs_validation_logloss(canned_page, artifacts):
    """A job with valid_data: its validation logloss per epoch, the best epoch (the one an
    `epochs = "auto"` job publishes) in the caption and as a dashed line; others say why not."""
    expect, open_page = canned_page
    page = open_page(job=DONE_ID)
    chart = page.locator("[data-testid=chart-valid]")
    expect(chart).to_have_attribute("data-points", "3")
    expect(chart).to_have_attribute("data-ref", "0.4471")
    expect(chart.locator("svg > circle.dot")).to_have_count(4)  # one per epoch, and the last one's again
    best = page.locator("[data-testid=chart-valid-best]")
    expect(best).to_have_attribute("data-epoch", "2")
    expect(best).to_have_text("best: epoch 2, AUC 0.8201")
    expect(chart).to_contain_text("epoch 3")
    expect(page.locator("#now-valid")).to_have_text("0.4493")
    epochs = page.locator("[data-testid=job-epochs]")
    expect(epochs.locator("thead th")).to_have_count(8)
    expect(epochs.locator("tbody tr").nth(1)).to_contain_text("0.4471")
    page.screenshot(path=str(artifacts / "webui-validation.png"), full_page=True)
    page.locator(f'[data-testid=job-row][data-job="{NO_TEST_ID}"]').click()
    expect(chart).to_have_attribute("data-points", "0")
    expect(chart).to_contain_text("no validation data")
    expect(best).to_have_text("")
    page.locator(f'[data-testid=job-row][data-job="{FINISHING_ID}"]').click()
    expect(chart).to_contain_text("scored after each epoch")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_browser_shows_the_phase_of_a_job_past_its_epochs(canned_page):
    """A running job whose epochs are done says what it does now, in its row and its detail;
    jobs without a phase (null, or no field) show nothing extra."""
    expect, open_page = canned_page
    page = open_page()
    row = page.locator(f'[data-testid=job-row][data-job="{FINISHING_ID}"]')
    expect(row).to_have_attribute("aria-selected", "true")
    expect(row.locator(".state-cell [data-testid=job-phase]")).to_have_text("evaluating on test.tsv")
    expect(row.locator("[data-testid=job-progress]")).to_have_class("progress finishing")
    detail = page.locator("[data-testid=job-detail-phase]")
    expect(detail).to_be_visible()
    expect(detail).to_have_text("evaluating on test.tsv")
    expect(page.locator("[data-testid=job-phase]")).to_have_count(1)  # DONE_ID's null, NO_TEST_ID's absent
    page.locator(f'[data-testid=job-row][data-job="{DONE_ID}"]').click()
    expect(detail).to_be_hidden()


SHARD_WARNING = ("ps-1: parameter-server shard 1 of 2: its tables take up to 26.0 GiB once written (hashing.bits "
                 "= 32: 2^32 rows each, 2,147,483,648 here), more than this machine's 23.4 GiB of memory: lower "
                 "hashing.bits or add shards, or expect swapping and the kernel's OOM killer")


def test_browser_shows_what_services_warned_of_about_a_job(canned_page):
    """A job's warnings (a shard's tables too big for its machine) show in its detail, each as
    text; a job without any (or an older coordinator's, without the field) shows no box."""
    expect, open_page = canned_page
    page = open_page()
    box = page.locator("[data-testid=job-warnings]")
    expect(box).to_be_visible()
    expect(box.locator("[data-testid=job-warning]")).to_have_text([f"Warning: {SHARD_WARNING}", f"Warning: {EVIL}"])
    assert page.evaluate("window.pwned") is None
    page.locator(f'[data-testid=job-row][data-job="{DONE_ID}"]').click()
    expect(box).to_be_hidden()


# every header cell's box, its scroll container's and the viewport's, in CSS pixels
HEADER_BOXES = """(table) => {
    const wrap = table.closest(".table-wrap");
    const box = (r) => ({left: r.left, right: r.right, top: r.top, bottom: r.bottom});
    return {wrap: {...box(wrap.getBoundingClientRect()), scroll: wrap.scrollWidth, client: wrap.clientWidth},
            view: {width: document.documentElement.clientWidth, height: window.innerHeight},
            heads: [...table.querySelectorAll("thead th")].map((th) => ({text: th.textContent,
                    ...box(th.getBoundingClientRect())}))};
}"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("width", [1280, 1024])
def test_browser_versions_table_shows_every_column_on_a_laptop(canned_page, artifacts, width):
    """No column of the model versions table (Job included) hides behind a horizontal scroll."""
    expect, open_page = canned_page
    page = open_page(width, 800)
    table = page.locator("[data-testid=model-versions]")
    expect(table.locator("tbody tr")).to_have_count(3)
    table.scroll_into_view_if_needed()
    boxes = table.evaluate(HEADER_BOXES)
    heads = [h["text"] for h in boxes["heads"]]
    assert {"Version", "Job", "Created"} <= set(heads), heads
    wrap, view = boxes["wrap"], boxes["view"]
    assert wrap["scroll"] <= wrap["client"], f"the table scrolls: {wrap}"
    for h in boxes["heads"]:
        assert wrap["left"] - 0.5 <= h["left"] and h["right"] <= wrap["right"] + 0.5, (h, wrap)
        assert 0 <= h["left"] and h["right"] <= view["width"], (h, view)
        assert 0 <= h["top"] and h["bottom"] <= view["height"], (h, view)
    decision = page.locator("[data-testid=decision]")
    expect(decision).to_contain_text("v000003 vs v000002")
    expect(decision).to_contain_text("AUC 0.8201 vs 0.8017")
    job = table.locator('[data-version="v000003"] [data-testid=version-job]')
    expect(job).to_have_attribute("title", DONE_ID)  # shown short, the full id on hover
    expect(job).to_have_text("…4f9c2a")
    page.screenshot(path=str(artifacts / f"webui-versions-{width}.png"))
    job.locator("a").click()  # selects that job
    expect(page.locator("[data-testid=job-detail]")).to_have_attribute("data-job", DONE_ID)
