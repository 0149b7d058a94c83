"""The dashboard's web app: one page (overview, conversation browser, versions) and a small JSON API.

Routes (every ``/api/*`` route except ``/api/config`` needs ``Authorization: Bearer <key>``
when ``proxy.api_keys`` is set, the same keys as the proxy):

- ``GET /``: the page (vendored front-end files under ``/static``; nothing from a CDN);
- ``GET /api/config``: ``{"auth": bool, "show_text": bool}`` (what the page needs to start);
- ``GET /api/overview``: counters, timelines, trainer steps, syncs, lag, dead letters;
- ``GET /api/versions``: live metrics per version and scope (:meth:`pipeline.rollout.live.LiveVersions.snapshot`;
  also in every overview, as ``versions``, so the versions page updates live);
- ``GET /api/sessions?q=&limit=``: recent sessions, optionally filtered by id;
- ``GET /api/sessions/{id}[?tenant=T]``: one session's turns, next states, samples and training outcome;
- ``POST /api/feedback``: a reviewer's thumb on a turn (``{"session_id", "turn_index", "score",
  "comment"}``), forwarded to the proxy's ``POST /v1/feedback`` with the request's own
  ``Authorization`` (the reviewer's key: the proxy checks it and its tenant, not this dashboard)
  and ``X-Tenant-Id``, ``source`` set to ``reviewer``; the proxy's answer is returned as it is.
  403 unless ``dashboard.review`` is on (the dashboard is read-only by default);
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
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pipeline.config import Config
from pipeline.engine_api.errors import EngineError
from pipeline.engine_api.transport import Transport
from pipeline.dashboard.sources import Scraper, TopicFollower
from pipeline.dashboard.state import DashboardState

STATIC = Path(__file__).resolve().parent / "static"


def _json(data, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), status_code=status,
                    media_type="application/json")


def _error(status: int, message: str, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind}}, status)


@dataclass
class Dashboard:
    """What the dashboard's routes share, kept as ``app.state.dashboard`` (read by the routes
    through the :func:`dashboard` dependency).

    Attributes:
        config: the pipeline config (``dashboard.start`` is reported with the reader's state).
        state: the state the routes read.
        follower: the topic reader (None: reported as not caught up, no error).
        scraper: the Prometheus scraper (None: no stages, live numbers or lag).
        keys: the API keys ``/api/*`` accepts (``proxy.api_keys``; empty: no key needed).
        push_s: ``dashboard.push_interval_s``: how often ``/api/stream`` looks for a change.
        refresh_s: the longest time between two ``/api/stream`` events (at least ``push_s``,
            else ``dashboard.scrape_interval_s``).
    """

    config: Config
    state: DashboardState
    follower: TopicFollower | None
    scraper: Scraper | None
    keys: list[bytes]
    push_s: float
    refresh_s: float
    proxy: Transport | None = None  # the proxy reviews go to (dashboard.review), opened on first use

    def proxy_transport(self) -> Transport:
        """The pool to the proxy reviews are posted to (``dashboard.proxy_url``)."""
        if self.proxy is None:
            pc = self.config.proxy
            self.proxy = Transport(self.config.dashboard.proxy_url or f"http://{pc.host}:{pc.port}", 30.0, 8)
        return self.proxy

    @classmethod
    def of(cls, config: Config, state: DashboardState, follower: TopicFollower | None,
           scraper: Scraper | None) -> "Dashboard":
        """The shared state of an app over ``state``, its keys and intervals read from ``config``."""
        push_s = config.dashboard.push_interval_s
        return cls(config, state, follower, scraper, [k.get_secret_value().encode() for k in config.proxy.api_keys],
                   push_s, max(push_s, config.dashboard.scrape_interval_s))

    def authorized(self, request: Request) -> bool:
        """True when no key is needed or ``request`` sends ``Authorization: Bearer <one of keys>``."""
        if not self.keys:
            return True
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode()
        return scheme.lower() == "bearer" and any(hmac.compare_digest(given, k) for k in self.keys)

    def overview(self) -> dict:
        """The ``/api/overview`` object: the state's overview plus scraper and reader info."""
        follower = self.follower
        extra = self.scraper.snapshot() if self.scraper is not None else {"stages": {}, "live": {}, "lag": []}
        extra["reader"] = {"caught_up": bool(follower and follower.caught_up),
                           "error": follower.error if follower else None, "start": self.config.dashboard.start}
        return self.state.overview(extra)


async def dashboard(request: Request) -> Dashboard:
    """The app's :class:`Dashboard` (a route dependency)."""
    return request.app.state.dashboard


router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    """The page."""
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/healthz")
async def healthz(d: Dashboard = Depends(dashboard)) -> Response:
    """Liveness, whether the topic reader has caught up and its error."""
    return _json({"ok": True, "caught_up": bool(d.follower and d.follower.caught_up),
                  "reader_error": d.follower.error if d.follower else None})


@router.get("/api/config")
async def api_config(d: Dashboard = Depends(dashboard)) -> Response:
    """What the page needs to start (no key needed)."""
    return _json({"auth": bool(d.keys), "show_text": d.state.text, "review": d.config.dashboard.review})


@router.post("/api/feedback")
async def api_feedback(request: Request, d: Dashboard = Depends(dashboard)) -> Response:
    """A reviewer's thumb, forwarded to the proxy (see the module docstring)."""
    if not d.config.dashboard.review:
        return _error(403, "reviews are off: this dashboard is read-only (start it with dashboard.review=true)",
                      "permission_error")
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        return _error(400, "the body is not JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object", "invalid_request_error")
    body["source"] = "reviewer"
    headers = {k: request.headers[k] for k in ("authorization", "x-tenant-id") if k in request.headers}
    try:
        status, data, _ = await d.proxy_transport().call("POST", "/v1/feedback", orjson.dumps(body), headers=headers)
    except EngineError as e:
        return _error(502, f"the proxy did not answer: {e}", "upstream_error")
    return Response(data, status_code=status, media_type="application/json")


@router.get("/api/overview")
async def api_overview(d: Dashboard = Depends(dashboard)) -> Response:
    """Counters, timelines, trainer steps, syncs, lag, dead letters."""
    return _json(d.overview())


@router.get("/api/versions")
async def api_versions(d: Dashboard = Depends(dashboard)) -> Response:
    """Live metrics per version, per scope (the full weights, then each tenant)."""
    with d.state.lock:
        return _json({"versions": d.state.live_versions.snapshot()})


@router.get("/api/sessions")
async def api_sessions(q: str = Query("", max_length=256), limit: int = Query(50, ge=1, le=1000),
                       d: Dashboard = Depends(dashboard)) -> Response:
    """Recent sessions (at most ``limit``), those whose id contains ``q`` when given."""
    return _json({"sessions": d.state.sessions_list(q, limit), "total": len(d.state.session_ids)})


@router.get("/api/sessions/{session_id:path}")
async def api_session(session_id: str, tenant: str | None = Query(None, min_length=1, max_length=256),
                      d: Dashboard = Depends(dashboard)) -> Response:
    """One session's turns, next states, samples and training outcome (404 when not read);
    ``?tenant=T`` names a tenant's session (two tenants' sessions may share an id)."""
    s = d.state.session(session_id, tenant)
    if s is None:
        of = f" of tenant {tenant!r}" if tenant is not None else ""
        return _error(404, f"no session {session_id!r}{of} in what the dashboard has read", "not_found")
    return _json(s)


@router.get("/api/stream")
async def api_stream(request: Request, d: Dashboard = Depends(dashboard)) -> StreamingResponse:
    """Server-sent ``overview`` events (:func:`_overview_events`) until the client leaves."""
    return StreamingResponse(_overview_events(request, d), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _overview_events(request: Request, d: Dashboard) -> AsyncIterator[bytes]:
    """An ``overview`` event after each change of the state (looked for every ``push_s``) and at
    least one per ``refresh_s``: the live Prometheus numbers change without records."""
    seen = -1
    since = 0.0  # seconds since the last event
    while not await request.is_disconnected():
        if d.state.version != seen or since >= d.refresh_s:
            seen = d.state.version
            since = 0.0
            data = await asyncio.to_thread(lambda: orjson.dumps(d.overview(), option=orjson.OPT_NON_STR_KEYS))
            yield b"event: overview\ndata: " + data + b"\n\n"
        await asyncio.sleep(d.push_s)
        since += d.push_s


async def _require_key(request: Request, call_next):
    """Middleware: 401 for an ``/api/*`` request (but ``/api/config``, and ``/api/feedback``, whose key the
    proxy checks) without an accepted key."""
    if (request.url.path.startswith("/api/") and request.url.path not in ("/api/config", "/api/feedback")
            and not request.app.state.dashboard.authorized(request)):
        return _error(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (one of proxy.api_keys)",
                      "authentication_error")
    return await call_next(request)


async def _bad_request(request: Request, exc: RequestValidationError) -> Response:
    """422 naming each invalid parameter."""
    where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
    return _error(422, f"bad request: {where}", "invalid_request_error")


async def _not_found(request: Request, exc) -> Response:
    """404 as a JSON error."""
    return _error(404, f"no route {request.url.path}", "not_found")


def create_app(config: Config, state: DashboardState, follower: TopicFollower | None = None,
               scraper: Scraper | None = None) -> FastAPI:
    """Build the FastAPI app over ``state`` (``follower``/``scraper`` add reader and Prometheus info)."""
    # the router's own routes, not app.include_router(router): FastAPI 0.165 includes a router as one
    # wrapper entry, and app.routes would not list them
    app = FastAPI(title="openclaw-pipeline dashboard", docs_url=None, redoc_url=None, openapi_url=None,
                  routes=router.routes)
    app.state.dashboard = Dashboard.of(config, state, follower, scraper)
    app.middleware("http")(_require_key)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_exception_handler(RequestValidationError, _bad_request)
    app.add_exception_handler(404, _not_found)

    async def close_proxy_pool() -> None:
        if app.state.dashboard.proxy is not None:
            await app.state.dashboard.proxy.close()

    app.router.on_shutdown.append(close_proxy_pool)
    return app
