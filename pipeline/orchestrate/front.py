"""``pipeline front``: a small round-robin HTTP load balancer that streams (the Service in front of replicas).

What a Kubernetes Service or an HAProxy ``balance roundrobin`` backend does for the scaled-out
single-machine topology of ``pipeline up --replicas``: every request goes to the next backend in
turn, among those that are healthy. HTTP handling (parsing, keep-alive, chunked streaming) is
aiohttp's, on both sides; this module only chooses a backend and copies bytes.

- **Streaming.** The response is forwarded as it arrives (server-sent events chunk by chunk);
  ``Content-Length`` is kept when the backend sent one. Hop-by-hop headers are dropped. Each
  response carries ``X-Upstream: <backend URL>`` so a client (and ``bench/chaos.py``) can tell
  which replica answered, also on the front's own 502.
- **Failover.** A backend whose connection is refused (its process is down) is skipped and the
  same request goes to the next one: it never reached the refused backend, so this is always
  safe. With ``retry="connect"`` every request opens its own connection (no pooled connection
  to a dead backend whose reset would be ambiguous). With ``retry="any"`` a request whose backend failed *before its response started* (reset,
  timeout) is also tried on the next one — for backends where a repeat has no side effect (an
  inference engine: generation records nothing). The default, ``retry="connect"``, answers such a
  request 502: a proxy that died mid-request may already have recorded the turn, and a silent
  repeat would record it twice. A response that broke after it started is cut (the client sees a
  broken stream, as with any load balancer).
- **Health.** A refused backend is out of rotation for ``down_s`` seconds (passive), and every
  ``health_interval_s`` each backend's health URL (``<url><health_path>``, or its own) is probed
  (active): non-2xx or no answer takes it out, 2xx puts it back. When no backend is healthy every
  one is tried in turn (fail open).

``GET /_front/status`` answers the backends, their health and request counts (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

HELP = "round-robin HTTP load balancer (streams) in front of proxy or engine replicas"

#: headers of one connection, never forwarded (RFC 9110 7.6.1) plus those aiohttp sets itself
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"))
STATUS_PATH = "/_front/status"


def end_to_end(headers) -> list[tuple[str, str]]:
    """``headers`` without hop-by-hop ones (:data:`HOP_BY_HOP` and those named in ``Connection``)."""
    named = {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in named]


@dataclass
class Backend:
    """One upstream replica.

    Attributes:
        url: base URL, e.g. ``http://127.0.0.1:8001``.
        health_url: probed every ``health_interval_s`` (None: no active check).
        healthy: last verdict (active probe or a refused connection).
        down_until: monotonic time before which a refused backend is skipped.
    """

    url: str
    health_url: str | None = None
    healthy: bool = True
    down_until: float = 0.0
    requests: int = 0
    failures: int = 0
    refused: int = 0
    last_error: str = ""

    def usable(self, now: float) -> bool:
        """In rotation: healthy and not recently refused."""
        return self.healthy and now >= self.down_until


@dataclass
class Front:
    """The balancer (an aiohttp application; see the module docstring).

    Args:
        backends: the replicas, in rotation order.
        retry: ``connect`` (only refused connections move on) or ``any`` (also failures before the
            response started).
        down_s: seconds a refused backend is skipped.
        health_interval_s: active probe period (0: no active probes).
        timeout_s: longest silence while waiting for or reading a backend's response.
    Raises:
        ValueError: no backends, or an unknown ``retry``.
    """

    backends: list[Backend]
    retry: str = "connect"
    down_s: float = 2.0
    health_interval_s: float = 1.0
    timeout_s: float = 600.0
    _rr: itertools.count = field(default_factory=itertools.count)
    _session: aiohttp.ClientSession | None = None
    _tasks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("front: at least one --backend is needed")
        if self.retry not in ("connect", "any"):
            raise ValueError(f"front: retry must be 'connect' or 'any', got {self.retry!r}")

    # ---- choice ------------------------------------------------------------------------------
    def order(self, now: float | None = None) -> list[Backend]:
        """Backends to try for the next request: the usable ones from the next in turn, then the rest."""
        now = time.monotonic() if now is None else now
        n = len(self.backends)
        start = next(self._rr) % n
        ring = [self.backends[(start + i) % n] for i in range(n)]
        return [b for b in ring if b.usable(now)] + [b for b in ring if not b.usable(now)]

    # ---- aiohttp app -------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application (catch-all route plus ``/_front/status``)."""
        app = web.Application(client_max_size=256 << 20)
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app) -> None:
        # retry="connect" (proxies): a fresh connection per request, so a backend that died shows as
        # a refused connection (safe to fail over) rather than a reset of a pooled one (ambiguous:
        # answered 502). A loopback connect costs tens of microseconds.
        conn = aiohttp.TCPConnector(limit=0, force_close=True) if self.retry == "connect" else \
            aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
        self._session = aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                              skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
        if self.health_interval_s > 0 and any(b.health_url for b in self.backends):
            self._tasks.append(asyncio.ensure_future(self._probe_loop()))

    async def _cleanup(self, _app) -> None:
        for t in self._tasks:
            t.cancel()
        if self._session is not None:
            await self._session.close()

    async def _probe_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(0.5, min(5.0, self.health_interval_s * 2)))
        while True:
            for b in self.backends:
                if not b.health_url:
                    continue
                try:
                    async with self._session.get(b.health_url, timeout=timeout) as r:
                        ok = 200 <= r.status < 300
                        await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    ok = False
                if ok != b.healthy:
                    log.info("front: %s is %s", b.url, "healthy" if ok else "unhealthy")
                b.healthy = ok
            await asyncio.sleep(self.health_interval_s)

    async def _status(self, _request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({"retry": self.retry, "backends": [
            {"url": b.url, "health_url": b.health_url, "healthy": b.healthy, "in_rotation": b.usable(now),
             "requests": b.requests, "failures": b.failures, "refused": b.refused, "last_error": b.last_error}
            for b in self.backends]})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = end_to_end(request.headers)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.timeout_s)
        tried: list[str] = []
        last = "no backend"
        for b in self.order():
            tried.append(b.url)
            try:
                upstream = await self._session.request(request.method, b.url + request.rel_url.raw_path_qs,
                                                       headers=headers, data=body or None, timeout=timeout,
                                                       allow_redirects=False)
            except aiohttp.ClientConnectorError as e:  # never reached the backend: always safe to move on
                b.refused += 1
                b.down_until = time.monotonic() + self.down_s
                last = b.last_error = f"{type(e).__name__}: {e}"
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                b.failures += 1
                last = b.last_error = f"{type(e).__name__}: {e}"
                if self.retry == "any":
                    b.down_until = time.monotonic() + self.down_s
                    continue
                return self._error(502, f"backend {b.url} failed before answering: {last}", b.url)
            b.requests += 1
            try:
                return await self._relay(request, upstream, b)
            finally:
                upstream.release()
        return self._error(502, f"no backend answered (tried {', '.join(tried)}): {last}",
                           tried[-1] if tried else "")

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, b: Backend) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in end_to_end(upstream.headers):
            resp.headers.add(k, v)
        resp.headers["X-Upstream"] = b.url
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length
        await resp.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            b.failures += 1
            b.last_error = f"{type(e).__name__} mid-response: {e}"
            log.warning("front: response from %s broke mid-stream: %s", b.url, e)
            if request.transport is not None:  # the client sees a cut, not a complete-looking response
                request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    @staticmethod
    def _error(status: int, message: str, upstream: str) -> web.Response:
        return web.json_response({"error": {"message": f"front: {message}", "type": "server_error",
                                            "code": "upstream_unavailable"}},
                                 status=status, headers={"X-Upstream": upstream})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", required=True, metavar="URL[=HEALTH_URL]",
                        help="a replica's base URL, optionally '=<its health URL>' (repeat for each replica)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, required=True, help="listen port")
    parser.add_argument("--health-path", default=None,
                        help="probe <backend URL><path> every --health-interval seconds (e.g. /healthz)")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between active probes")
    parser.add_argument("--retry", choices=["connect", "any"], default="connect",
                        help="connect: move on only when a backend refuses the connection (safe for anything); "
                             "any: also when it failed before answering (only for side-effect-free backends)")
    parser.add_argument("--down", type=float, default=2.0, help="seconds a refused backend is skipped")


def parse_backends(specs: list[str], health_path: str | None = None) -> list[Backend]:
    """``URL`` or ``URL=HEALTH_URL`` strings -> :class:`Backend` s (``health_path`` fills the rest)."""
    out = []
    for spec in specs:
        url, _, health = spec.partition("=")
        url = url.rstrip("/")
        out.append(Backend(url, health or (url + health_path if health_path else None)))
    return out


def run(args, config) -> int:
    front = Front(parse_backends(args.backend, args.health_path), retry=args.retry, down_s=args.down,
                  health_interval_s=args.health_interval)
    print(f"front: http://{args.host}:{args.port} -> {', '.join(b.url for b in front.backends)} "
          f"(round robin, retry={args.retry})", flush=True)
    web.run_app(front.app(), host=args.host, port=args.port, print=None, access_log=None, handle_signals=True)
    return 0
