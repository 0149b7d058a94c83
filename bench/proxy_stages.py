"""What the proxy's own work per request costs, stage by stage (run in-process by bench/proxy.py).

    .venv/bin/python bench/proxy_stages.py          # prints the table alone

The HTTP run of ``bench/proxy.py`` gives the time the proxy adds in total; this splits the
proxy's share of it (what a naive forwarder does not do) into the stages of its hot path, each
run in this process on the bench's own workload (its multi-turn sessions, the stand-in engine's
answer and stream) with the proxy's own objects (:class:`pipeline.proxy.app.ProxyApp` without
its threads, :class:`pipeline.proxy.buffer.DiskBuffer` in a temporary folder):

- ``parse + validate``: JSON, session metadata, the chat fields, housekeeping recognition;
- ``session identity``: the session rules (:mod:`pipeline.proxy.identity`, prefix digests) and
  the turn index, then the previous turn's ``next_state`` built and published (admit);
- ``answer -> turn``: the engine's answer parsed, the ``turn`` built and published, the
  session's state updated, the answer stripped of the extras and re-serialised;
- ``stream relay``: one streamed answer's chunks through the recorder (per stream);
- ``event encode`` and ``disk commit``: msgpack of the request's events and their group commit to
  the disk buffer (one multi-row ``INSERT``). The response's last byte waits for the commit. The
  event loop does both itself when the publisher's writer thread holds nothing (the inline
  commit, the common case); with ``proxy.buffer_fsync``, or behind a backlog the writer thread
  still holds, the writer thread does them.

Numbers are CPU microseconds per request in a warm loop (caches hot): a floor, not what a
request costs when the process wakes up cold between requests, but the ratios between stages
hold. Each stage is timed with ``time.perf_counter`` per request; the median is printed.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

STAGES = ("parse + validate", "session identity", "answer -> turn", "stream relay", "event encode", "disk commit")


async def _engine_answer(reply: str, stream: bool) -> bytes:
    """The stand-in engine's answer (as bench/proxy.py's upstream sends it) to a chat request."""
    from pipeline.testing.servers import Reply, StandInEngine

    eng = StandInEngine(lambda req: Reply(content=reply), fixed=True, record=False, always_extras=True)
    body = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    out: list[bytes] = []

    async def receive():
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(3600)

    async def send(m):
        if m["type"] == "http.response.body":
            out.append(m.get("body", b""))

    await eng({"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []}, receive, send)
    return b"".join(out)


def _app():
    """A :class:`ProxyApp` for in-process calls: no broker, no threads, events in memory."""
    from pipeline.config import load_config
    from pipeline.proxy.app import ProxyApp

    config = load_config(None, topics={"prefix": "bench-"}).replace(proxy={"buffer_dir": None})
    return ProxyApp(config, follow_control=False)


def _one_request(app, body: bytes, headers: dict, answer: bytes, rid: str, t: dict) -> list:
    """Serve one request's hot path without I/O, adding each stage's seconds to ``t``; returns
    the events it published (for the commit's stages)."""
    from pipeline.proxy.app import _mark_housekeeping
    from pipeline.proxy.record import from_response, strip_response
    from pipeline.proxy.validate import SAMPLING_KEYS, check_request, json_body, session_meta

    c0 = time.perf_counter()
    req = json_body(body)
    meta = session_meta(headers, req, "main")
    check_request(req)
    _mark_housekeeping(meta, req["messages"])
    c1 = time.perf_counter()
    route, _ = app._route(req, meta, rid, 0, None)
    route.mt = app.sessions.begin(route.sid, req["messages"], fresh=route.fresh, tenant=None,
                                  continued=route.hit[1].request_of(route.sid) if route.hit else None)
    app._admit(route)
    c2 = time.perf_counter()
    resp = orjson.loads(answer)
    rec = from_response(resp)
    view = {"messages": req["messages"], "tools": None, "model": req.get("model"), "chat_options": {},
            "sampling": {k: req[k] for k in SAMPLING_KEYS if k in req}}
    app._record(rec, meta, route, route.mt.turn_index, view, None, {})
    if meta.done:  # X-Session-Done: session_end, published before the response completes
        app._end(route.sid, "header", None, meta.outcome)
    strip_response(resp, False, False, False, False)
    resp["id"] = "chatcmpl-" + rid
    orjson.dumps(resp)
    c3 = time.perf_counter()
    t["parse + validate"].append(c1 - c0)
    t["session identity"].append(c2 - c1)
    t["answer -> turn"].append(c3 - c2)
    published = []
    while app.publisher._pending:
        published.append(app.publisher._pending.popleft())
    while not app.publisher._inbox.empty():
        published.extend(app.publisher._inbox.get_nowait())
    return published


def _writer_stages(published: list, buf, t: dict) -> None:
    """The publisher's work for one request's events: encode, then one group commit."""
    from pipeline import events

    c0 = time.perf_counter()
    items = [(topic, key, events.encode(ev)) for topic, key, ev in published]
    c1 = time.perf_counter()
    buf.append(items)
    c2 = time.perf_counter()
    t["event encode"].append(c1 - c0)
    t["disk commit"].append(c2 - c1)


def _relay(chunks: list[bytes], t: dict) -> None:
    """One streamed answer's chunks through the recorder, as the relay does it."""
    from pipeline.proxy.adapters import shown
    from pipeline.proxy.record import StreamRecorder

    c0 = time.perf_counter()
    rec = StreamRecorder(False, False, False, "chatcmpl-bench")
    for data in chunks:
        b"data: " + rec.feed(shown(data)) + b"\n\n"
    rec.finish()
    t["stream relay"].append(time.perf_counter() - c0)


def measure(requests: int = 600, warmup: int = 100) -> dict[str, float]:
    """Microseconds per request of each stage (:data:`STAGES`), the median over ``requests`` of
    the bench's workload after ``warmup`` requests (a median: a request preempted by other work
    on the machine does not count)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from proxy import REPLY, Conversation  # bench/proxy.py's workload

    from pipeline.proxy.buffer import DiskBuffer

    answer = asyncio.run(_engine_answer(REPLY, False))
    sse = asyncio.run(_engine_answer(REPLY, True))
    chunks = [c[6:] for c in sse.split(b"\n\n") if c.startswith(b"data: {")]

    async def run() -> dict[str, float]:
        app = _app()
        t: dict[str, list] = {k: [] for k in STAGES}
        convs = [Conversation(w) for w in range(8)]
        with tempfile.TemporaryDirectory(prefix="bench-stages-") as folder:
            buf = DiskBuffer(folder)
            try:
                for i in range(warmup + requests):
                    if i == warmup:
                        t = {k: [] for k in STAGES}
                    conv = convs[i % len(convs)]
                    body, hdrs = conv.request(False)
                    headers = {k.lower().encode(): v.encode() for k, v in hdrs.items()}
                    published = _one_request(app, body, headers, answer, f"bench-{i:x}", t)
                    _writer_stages(published, buf, t)
                    _relay(chunks, t)
                    conv.advance()
            finally:
                buf.close()
        return {k: 1e6 * statistics.median(v) for k, v in t.items()}

    return asyncio.run(run())


def print_table(us: dict[str, float], file=None) -> None:
    """Print :func:`measure`'s result."""
    print("  the proxy's own work per request, by stage (CPU us, warm in-process loop; * the commit's stages, "
          "on the event loop unless the writer thread holds a backlog):", file=file)
    for k, v in us.items():
        star = "*" if k in ("event encode", "disk commit") else " "
        print(f"    {k:<18}{star} {v:7.1f}", file=file)
    loop = sum(v for k, v in us.items() if k != "stream relay")
    print(f"    {'event loop, unary':<18}  {loop:7.1f}   (parse + identity + answer -> turn + encode + commit)",
          file=file)


if __name__ == "__main__":
    print_table(measure())
