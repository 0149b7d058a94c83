"""The round-robin front (``pipeline front``): rotation, streaming, failover, health, retry rules.

Real HTTP on both sides: the front is served by aiohttp on a free port, the backends are small
uvicorn-served ASGI stand-ins (each says who it is) on free ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import httpx
import pytest
from aiohttp import web

from pipeline.orchestrate.front import Backend, Front, parse_backends
from pipeline.testing.servers import StandInServer, serve_app
from pipeline.testing.waiting import wait_for


class Dropper:
    """A backend that reads each request and closes the connection without answering (a process
    dying mid-request); counts the requests it swallowed."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            if data:
                self.requests += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


class StandIn(StandInServer):
    """A backend stand-in: ``/who`` answers its name; ``/stream`` sends one chunk, waits for
    :attr:`go`, sends a second; ``/healthz`` answers :attr:`health`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.go = threading.Event()
        self.health = 200
        self.seen_headers: list[dict] = []

    async def handle(self, scope, body: bytes, send, receive) -> None:
        path = scope["path"]
        self.seen_headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"connection", b"keep-alive")]})
            await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
            await asyncio.get_running_loop().run_in_executor(None, self.go.wait, 30)
            await send({"type": "http.response.body", "body": b"data: second\n\n"})
            return
        status = self.health if path == "/healthz" else 200
        data = self.name.encode() + b":" + body
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(data)).encode()),
                                (b"x-backend", self.name.encode())]})
        await send({"type": "http.response.body", "body": data})


@contextlib.contextmanager
def running_front(front: Front):
    """Serve ``front`` with aiohttp in a thread; yield its base URL."""
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    runner = web.AppRunner(front.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.SockSite(runner, sock)
    loop.run_until_complete(site.start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


@pytest.fixture
def two():
    a, b = StandIn("a"), StandIn("b")
    with serve_app(a) as ua, serve_app(b) as ub:
        yield (a, ua), (b, ub)


def test_requests_rotate_over_the_backends_and_carry_body_and_upstream(two):
    (_, ua), (_, ub) = two
    with running_front(Front([Backend(ua), Backend(ub)], health_interval_s=0)) as url:
        rs = [httpx.post(f"{url}/who", content=f"req{i}".encode(), timeout=10) for i in range(4)]
    assert [r.text for r in rs] == ["a:req0", "b:req1", "a:req2", "b:req3"]
    assert [r.headers["x-upstream"] for r in rs] == [ua, ub, ua, ub]
    assert rs[0].headers["content-length"] == str(len("a:req0")) and rs[0].headers["x-backend"] == "a"


def test_a_stream_is_forwarded_chunk_by_chunk(two):
    (a, ua), _ = two
    with running_front(Front([Backend(ua)], health_interval_s=0)) as url:
        with httpx.stream("GET", f"{url}/stream", timeout=30) as r:
            it = r.iter_raw()
            first = next(it)
            assert first.startswith(b"data: first"), first  # arrived while the backend still waits
            assert not a.go.is_set()
            a.go.set()
            rest = b"".join(it)
    assert b"data: second" in first + rest


def test_a_refused_backend_is_skipped_without_failing_a_request(two):
    (_, ua), _ = two
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused
    try:
        front = Front([Backend(dead), Backend(ua)], health_interval_s=0, down_s=60)
        with running_front(front) as url:
            rs = [httpx.get(f"{url}/who", timeout=10) for _ in range(4)]
            status = httpx.get(f"{url}/_front/status", timeout=10).json()
    finally:
        s.close()
    assert [r.status_code for r in rs] == [200] * 4 and {r.headers["x-upstream"] for r in rs} == {ua}
    dead_status = status["backends"][0]
    assert dead_status["refused"] == 1 and not dead_status["in_rotation"], "refused once, then out of rotation"


def test_all_backends_down_gives_a_clear_502():
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    try:
        with running_front(Front([Backend(u) for u in urls], health_interval_s=0)) as url:
            r = httpx.get(f"{url}/who", timeout=10)
    finally:
        for s in socks:
            s.close()
    assert r.status_code == 502 and "no backend answered" in r.json()["error"]["message"]


def test_failure_after_the_request_was_sent_is_not_repeated_by_default(two):
    # a proxy that died mid-request may have recorded the turn: retrying would record it twice
    (b, ub), _ = two
    d = Dropper()
    try:
        with running_front(Front([Backend(d.url), Backend(ub)], health_interval_s=0)) as url:
            r = httpx.post(f"{url}/who", content=b"x", timeout=10)
    finally:
        d.close()
    assert r.status_code == 502 and r.headers["x-upstream"] == d.url and "failed before answering" in r.text
    assert d.requests == 1 and len(b.seen_headers) == 0, "sent once, to one backend"


def test_retry_any_moves_a_failed_request_to_the_next_backend(two):
    # for side-effect-free backends (engines): the request goes on to the next backend
    (b, ub), _ = two
    d = Dropper()
    try:
        with running_front(Front([Backend(d.url), Backend(ub)], retry="any", health_interval_s=0)) as url:
            r = httpx.post(f"{url}/who", content=b"x", timeout=10)
    finally:
        d.close()
    assert r.status_code == 200 and r.text == "a:x" and r.headers["x-upstream"] == ub
    assert d.requests == 1 and len(b.seen_headers) == 1


def test_unhealthy_backend_leaves_the_rotation_and_comes_back(two):
    (a, ua), (b, ub) = two
    front = Front(parse_backends([ua, ub], "/healthz"), health_interval_s=0.05)
    with running_front(front) as url:
        b.health = 503
        wait_for(lambda: not front.backends[1].healthy)
        assert {httpx.get(f"{url}/who", timeout=10).text[0] for _ in range(4)} == {"a"}
        b.health = 200
        wait_for(lambda: front.backends[1].healthy)
        assert {httpx.get(f"{url}/who", timeout=10).text[0] for _ in range(4)} == {"a", "b"}


def test_hop_by_hop_headers_are_not_forwarded(two):
    (a, ua), _ = two
    with running_front(Front([Backend(ua)], health_interval_s=0)) as url:
        httpx.get(f"{url}/who", headers={"X-Session-Id": "s1", "Connection": "keep-alive, x-secret-hop",
                                         "Keep-Alive": "timeout=5"}, timeout=10)
    h = a.seen_headers[-1]
    assert h["x-session-id"] == "s1" and "keep-alive" not in h and h.get("connection", "") != "keep-alive, x-secret-hop"
