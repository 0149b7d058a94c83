"""The dashboard's web app: one page (overview + conversation browser) and a small JSON API.

Routes (every ``/api/*`` route except ``/api/config`` needs ``Authorization: Bearer <key>``
when ``proxy.api_keys`` is set, the same keys as the proxy):

- ``GET /``: the page (vendored front-end files under ``/static``; nothing from a CDN);
- ``GET /api/config``: ``{"auth": bool, "show_text": bool}`` (what the page needs to start);
- ``GET /api/overview``: counters, timelines, trainer steps, syncs, lag, dead letters;
- ``GET /api/sessions?q=&limit=``: recent sessions, optionally filtered by id;
- ``GET /api/sessions/{id}``: one session's turns, next states, samples and training outcome;
- ``GET /api/stream``: server-sent events: an ``overview`` event after each change of the
  topics' state (at most one per ``dashboard.push_interval_s``), and at least one per
  ``dashboard.scrape_interval_s`` for the live Prometheus numbers;
- ``GET /healthz``: liveness and whether the topic reader has caught up.

Conversation text leaves this process only when the dashboard was started with
``--show-text`` (``dashboard.show_text``); the state never stores it otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pipeline.config import Config
from pipeline.dashboard.sources import Scraper, TopicFollower
from pipeline.dashboard.state import DashboardState

STATIC = Path(__file__).resolve().parent / "static"


def _json(data, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), status_code=status,
                    media_type="application/json")


def _error(status: int, message: str, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind}}, status)


def create_app(config: Config, state: DashboardState, follower: TopicFollower | None = None,
               scraper: Scraper | None = None) -> FastAPI:
    """Build the FastAPI app over ``state`` (``follower``/``scraper`` add reader and Prometheus info)."""
    app = FastAPI(title="openclaw-pipeline dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    keys = [k.get_secret_value().encode() for k in config.proxy.api_keys]
    push_s = config.dashboard.push_interval_s
    refresh_s = max(push_s, config.dashboard.scrape_interval_s)

    def authorized(request: Request) -> bool:
        if not keys:
            return True
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode()
        return scheme.lower() == "bearer" and any(hmac.compare_digest(given, k) for k in keys)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path.startswith("/api/") and request.url.path != "/api/config" and not authorized(request):
            return _error(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (one of proxy.api_keys)",
                          "authentication_error")
        return await call_next(request)

    def overview() -> dict:
        extra = scraper.snapshot() if scraper is not None else {"stages": {}, "live": {}, "lag": []}
        extra["reader"] = {"caught_up": bool(follower and follower.caught_up),
                           "error": follower.error if follower else None, "start": config.dashboard.start}
        return state.overview(extra)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"ok": True, "caught_up": bool(follower and follower.caught_up),
                      "reader_error": follower.error if follower else None})

    @app.get("/api/config")
    async def api_config() -> Response:
        return _json({"auth": bool(keys), "show_text": state.text})

    @app.get("/api/overview")
    async def api_overview() -> Response:
        return _json(overview())

    @app.get("/api/sessions")
    async def api_sessions(q: str = Query("", max_length=256), limit: int = Query(50, ge=1, le=1000)) -> Response:
        return _json({"sessions": state.sessions_list(q, limit), "total": len(state.session_ids)})

    @app.get("/api/sessions/{session_id:path}")
    async def api_session(session_id: str) -> Response:
        s = state.session(session_id)
        if s is None:
            return _error(404, f"no session {session_id!r} in what the dashboard has read", "not_found")
        return _json(s)

    @app.get("/api/stream")
    async def api_stream(request: Request) -> StreamingResponse:
        async def events():
            seen = -1
            since = 0.0  # seconds since the last event: live Prometheus numbers change without records
            while not await request.is_disconnected():
                if state.version != seen or since >= refresh_s:
                    seen = state.version
                    since = 0.0
                    data = await asyncio.to_thread(lambda: orjson.dumps(overview(), option=orjson.OPT_NON_STR_KEYS))
                    yield b"event: overview\ndata: " + data + b"\n\n"
                await asyncio.sleep(push_s)
                since += push_s

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _error(422, f"bad request: {where}", "invalid_request_error")

    @app.exception_handler(404)
    async def not_found(request: Request, exc) -> Response:
        return _error(404, f"no route {request.url.path}", "not_found")

    return app

