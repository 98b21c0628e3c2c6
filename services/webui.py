"""The web UI of jobs and models: static files in services/ui/, served by the coordinator.

No build step: index.html, app.js and style.css are read as they are. The page polls
the coordinator's JSON API (/v1/status, /v1/jobs, /v1/jobs/{id}/history, /v1/models)
about once a second and draws its charts itself (inline SVG), so it needs no network
beyond the coordinator.

    GET /            -> 302 /ui/
    GET /ui          -> 302 /ui/
    GET /ui/         -> index.html
    GET /ui/{file}   -> a file of services/ui/ (by exact name; anything else, 404)
"""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

UI_DIR = Path(__file__).resolve().with_name("ui")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
                 ".ico": "image/x-icon"}
# Every response revalidates (an upgraded coordinator serves its new page at once), and the
# page may run only its own script and style: no inline code, nothing from elsewhere.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


def add_routes(app: web.Application) -> None:
    """Register the UI's routes on an aiohttp app (the coordinator's)."""
    app.router.add_get("/", _to_ui)
    app.router.add_get("/ui", _to_ui)
    app.router.add_get("/ui/", _index)
    app.router.add_get("/ui/{file}", _asset)


def ui_files() -> dict[str, Path]:
    """The files the UI may serve, by name: what services/ui/ holds, nothing below it.

    >>> sorted(n for n in ui_files() if n.endswith((".html", ".js", ".css")))
    ['app.js', 'index.html', 'style.css']
    """
    return {p.name: p for p in UI_DIR.iterdir() if p.is_file() and p.suffix in CONTENT_TYPES}


async def _to_ui(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


async def _index(request: web.Request) -> web.StreamResponse:
    return _file("index.html")


async def _asset(request: web.Request) -> web.StreamResponse:
    return _file(request.match_info["file"])


def _file(name: str) -> web.StreamResponse:
    # By exact name from a listing, never a path joined from the request: "..", "%2f"
    # and friends are simply names that are not there.
    path = ui_files().get(name)
    if path is None:
        raise web.HTTPNotFound(text=f"no UI file {name!r}\n")
    return web.FileResponse(path, headers={**HEADERS, "Content-Type": CONTENT_TYPES[path.suffix]})
