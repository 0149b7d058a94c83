"""Test and bench helpers: serve an ASGI app on a free port, and a scripted stand-in engine.

:class:`ScriptedUpstream` is **not** a model: it is a stand-in OpenAI-compatible server that
answers every chat completion instantly from a script (content, reasoning, tool calls), with
deterministic token ids and log-probs, in the shapes of our engine (``token_ids``,
``prompt_token_ids``, ``logprobs.content``, ``metadata.weight_version``; streamed chunks with
tool-call deltas by index and a usage chunk when asked). Tests use it to check exactly what the
proxy forwards and records; ``bench/proxy.py`` uses it as the fast upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import orjson


@contextlib.contextmanager
def serve_app(app, host: str = "127.0.0.1", *, loop: str = "auto", http: str = "auto",
              start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a daemon thread on a free port; yield its base URL.

    Raises:
        RuntimeError: the server did not start (the lifespan start-up failed or timed out).
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    cfg = uvicorn.Config(app, log_level="warning", access_log=False, loop=loop, http=http, lifespan="auto",
                         timeout_graceful_shutdown=5)
    server = uvicorn.Server(cfg)
    errors: list[BaseException] = []

    def _run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=_run, name=f"asgi-{port}", daemon=True)
    t.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if errors or not t.is_alive():
            raise RuntimeError(f"server failed to start: {errors[:1]}")
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start in time")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        t.join(20)
        sock.close()


@dataclass
class Reply:
    """One scripted answer.

    Attributes:
        content: assistant text (split into one token per character group when streamed).
        tool_calls: ``[(name, arguments_json), ...]``.
        reasoning: reasoning text, or None.
        finish_reason: default ``tool_calls`` when there are tool calls, else ``stop``.
        status: HTTP status to answer with instead (an error body is sent).
        break_after: streaming only: drop the connection after this many chunks.
        delay_s: wait this long before answering (tests of time-outs).
        cut: streaming only: end the response cleanly after the content, without a finish
            chunk or ``[DONE]`` (an engine that closed the stream early).
    """

    content: str = "ok"
    tool_calls: list = field(default_factory=list)
    reasoning: str | None = None
    finish_reason: str | None = None
    status: int = 200
    break_after: int | None = None
    delay_s: float = 0.0
    cut: bool = False


def _tokens(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or []


class ScriptedUpstream:
    """Stand-in engine (see the module docstring). ASGI app; not thread-safe beyond one loop.

    Args:
        script: a function ``request_dict -> Reply`` (default: always ``Reply()``).
        weight_version: reported in ``metadata.weight_version``.
        token_interval_s: streaming: pause between chunks (0 = as fast as possible).
        fixed: cache the answer bytes by (stream, include_usage) — for benchmarks, where the
            script and the prompt do not change.
        always_extras: answer as if ``logprobs`` and ``return_token_ids`` were asked (benchmarks:
            every client gets the same bytes).

    Attributes:
        requests: every chat request body received (parsed).
        answers: for each request, ``{"prompt_token_ids", "token_ids", "logprobs", "reply"}``.
    """

    def __init__(self, script: Callable[[dict], Reply] | None = None, weight_version: str = "0",
                 token_interval_s: float = 0.0, fixed: bool = False, record: bool = True,
                 always_extras: bool = False) -> None:
        self.script = script or (lambda req: Reply())
        self.weight_version = weight_version
        self.token_interval_s = token_interval_s
        self.fixed = fixed
        self.record = record
        self.always_extras = always_extras
        self.requests: list[dict] = []
        self.answers: list[dict] = []
        self.disconnects = 0  # streams cut short because the client hung up
        self._cache: dict = {}

    # ---- deterministic ids -------------------------------------------------------------------
    @staticmethod
    def prompt_ids(req: dict) -> list[int]:
        """Stand-in prompt token ids: a function of the message texts."""
        text = orjson.dumps(req.get("messages"))
        return [b % 251 + 3 for b in text[:400]]

    @staticmethod
    def pieces(reply: Reply) -> list[tuple[str, str, Any]]:
        """(kind, text, extra) per sampled token: kind in reasoning/content/tool."""
        out: list[tuple[str, str, Any]] = []
        for t in _tokens(reply.reasoning or ""):
            out.append(("reasoning", t, None))
        for t in _tokens(reply.content or ""):
            out.append(("content", t, None))
        for k, (name, args) in enumerate(reply.tool_calls):
            out.append(("tool_head", name, k))
            for t in _tokens(args, 5):
                out.append(("tool_args", t, k))
        if not out:
            out.append(("content", "", None))
        return out

    def _answer(self, req: dict) -> tuple[Reply, list[int], list[int], list[float], list]:
        reply = self.script(req)
        pieces = self.pieces(reply)
        n = len(pieces)
        pids = self.prompt_ids(req)
        seed = sum(pids) % 1000
        ids = [(seed * 31 + 7 * i) % 49000 + 100 for i in range(n)]
        lps = [-round(0.01 * ((seed + 13 * i) % 300) + 0.001, 4) for i in range(n)]
        return reply, pids, ids, lps, pieces

    # ---- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif m["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/chat/completions" and scope["method"] == "POST":
            await self._chat(orjson.loads(body), send, receive)
        elif path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [{"id": "scripted", "object": "model",
                                                                "owned_by": "stand-in"}]})
        elif path == "/health":
            await _json(send, 200, {})
        elif path in ("/server_info", "/model_info"):
            await _json(send, 200, {"chat_stream_token_ids": True, "weight_version": self.weight_version})
        else:
            await _json(send, 404, {"object": "error", "message": f"no route {path}", "code": 404})

    async def _chat(self, req: dict, send, receive=None) -> None:
        if self.always_extras:
            req = dict(req, logprobs=True, return_token_ids=True)
        stream = bool(req.get("stream"))
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        if self.fixed and (stream, usage) in self._cache:
            if self.record:
                self.requests.append(req)
            await self._send_cached(self._cache[(stream, usage)], stream, send, receive)
            return
        reply, pids, ids, lps, pieces = self._answer(req)
        if self.record:
            self.requests.append(req)
            self.answers.append({"prompt_token_ids": pids, "token_ids": ids, "logprobs": lps, "reply": reply})
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.status != 200:
            await _json(send, reply.status, {"object": "error", "message": f"scripted failure {reply.status}",
                                             "type": "Bad Request" if reply.status < 500 else "server_error",
                                             "code": reply.status})
            return
        if stream:
            chunks = self._chunks(req, reply, pids, ids, lps, pieces, usage)
            if self.fixed:
                self._cache[(stream, usage)] = chunks
            await self._send_stream(chunks, reply.break_after, send, receive)
        else:
            data = orjson.dumps(self._full(req, reply, pids, ids, lps))
            if self.fixed:
                self._cache[(stream, usage)] = data
            await _raw(send, 200, data)

    async def _send_cached(self, cached, stream: bool, send, receive) -> None:
        if stream:
            await self._send_stream(cached, None, send, receive)
        else:
            await _raw(send, 200, cached)

    def _finish(self, reply: Reply) -> str:
        return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")

    def _full(self, req: dict, reply: Reply, pids, ids, lps) -> dict:
        want_ids = bool(req.get("return_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                        "tool_calls": [{"id": f"call_{k}", "index": k, "type": "function",
                                        "function": {"name": n, "arguments": a}}
                                       for k, (n, a) in enumerate(reply.tool_calls)] or None},
            "logprobs": ({"content": [{"token": f"t{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                      for i, lp in zip(ids, lps)]} if req.get("logprobs") else None),
            "finish_reason": self._finish(reply), "matched_stop": None}
        if want_ids or req.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = pids
        if want_ids:
            choice["token_ids"] = ids
        return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
                "model": req.get("model") or "scripted", "choices": [choice],
                "usage": {"prompt_tokens": len(pids), "completion_tokens": len(ids), "total_tokens": len(pids) + len(ids)},
                "metadata": {"weight_version": self.weight_version}}

    def _chunks(self, req: dict, reply: Reply, pids, ids, lps, pieces, usage: bool) -> list[bytes]:
        want_ids = bool(req.get("return_token_ids"))
        want_lp = bool(req.get("logprobs"))
        model = req.get("model") or "scripted"
        base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}

        def chunk(delta: dict, **extra) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                      "finish_reason": extra.pop("finish_reason", None)}
            if "token_ids" in extra:
                choice["token_ids"] = extra.pop("token_ids")
            return b"data: " + orjson.dumps(dict(base, choices=[choice], **extra)) + b"\n\n"

        first: dict[str, Any] = {"metadata": {"weight_version": self.weight_version}}
        if want_ids:
            first["prompt_token_ids"] = pids
        out = [chunk({"role": "assistant", "content": ""}, **first)]
        for i, (kind, text, k) in enumerate(pieces):
            extra: dict[str, Any] = {}
            if want_ids:
                extra["token_ids"] = [ids[i]]
            if want_lp:
                extra["logprobs"] = {"content": [{"token": f"t{ids[i]}", "logprob": lps[i], "bytes": None,
                                                  "top_logprobs": []}]}
            if kind == "reasoning":
                delta = {"reasoning_content": text}
            elif kind == "content":
                delta = {"content": text} if text else {}
            elif kind == "tool_head":
                delta = {"tool_calls": [{"index": k, "id": f"call_{k}", "type": "function",
                                         "function": {"name": text, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": k, "function": {"arguments": text}}]}
            out.append(chunk(delta, **extra))
        if reply.cut:
            return out
        out.append(chunk({}, finish_reason=self._finish(reply), metadata={"weight_version": self.weight_version}))
        if usage:
            out.append(b"data: " + orjson.dumps(dict(base, choices=[], usage={
                "prompt_tokens": len(pids), "completion_tokens": len(ids),
                "total_tokens": len(pids) + len(ids)})) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    async def _send_stream(self, chunks: list[bytes], break_after: int | None, send, receive) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        gone = asyncio.Event()
        watcher = None
        if self.token_interval_s and receive is not None:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()
            watcher = asyncio.ensure_future(watch())
        try:
            for i, c in enumerate(chunks):
                if break_after is not None and i >= break_after:
                    raise RuntimeError("scripted stream break")  # uvicorn drops the connection
                if gone.is_set():  # the client (the proxy) hung up: stop generating, like an engine aborts
                    self.disconnects += 1
                    return
                await send({"type": "http.response.body", "body": c, "more_body": True})
                if self.token_interval_s:
                    await asyncio.sleep(self.token_interval_s)
            await send({"type": "http.response.body", "body": b""})
        finally:
            if watcher is not None:
                watcher.cancel()


async def _raw(send, status: int, data: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _json(send, status: int, obj: Any) -> None:
    await _raw(send, status, orjson.dumps(obj))


def read_events(config, timeout_s: float = 10.0, want: int | None = None, topic: str = "turns",
                idle_s: float = 1.0) -> list:
    """Read decoded events from a topic (all partitions, from the beginning) until ``want`` arrived
    or nothing new came for ``idle_s`` / ``timeout_s`` passed. Returns ``[(partition, offset, key, event)]``."""
    from kafka import KafkaConsumer, TopicPartition

    from pipeline import events
    from pipeline.bus.settings import consumer_kwargs

    name = config.topics.name(topic)
    c = KafkaConsumer(**consumer_kwargs(config, None))
    try:
        parts = c.partitions_for_topic(name) or {0}
        tps = [TopicPartition(name, p) for p in sorted(parts)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out = []
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline:
            batch = c.poll(timeout_ms=200)
            for recs in batch.values():
                for r in recs:
                    out.append((r.partition, r.offset, r.key.decode() if r.key else None, events.decode(r.value)))
                    last = time.monotonic()
            if want is not None and len(out) >= want:
                break
            if want is None and out and time.monotonic() - last > idle_s:
                break
        return out
    finally:
        c.close()


@contextlib.contextmanager
def running_proxy(config, engine_url: str, *, follow_control: bool = False, publisher=None,
                  **proxy_settings: Any) -> Iterator[tuple[str, Any]]:
    """Serve a :class:`pipeline.proxy.app.ProxyApp` for ``engine_url``; yield ``(base_url, app)``.

    ``proxy_settings`` override fields of ``config.proxy`` (on a copy), e.g. ``api_keys=["k"]``.
    Without ``buffer_dir`` the proxy gets a fresh temporary buffer folder (removed afterwards).
    """
    import shutil
    import tempfile

    from pipeline.proxy.app import ProxyApp

    tmp = None
    if "buffer_dir" not in proxy_settings and publisher is None:  # each proxy its own durable buffer
        tmp = tempfile.mkdtemp(prefix="proxy-buffer-")
        proxy_settings = {"buffer_dir": tmp, **proxy_settings}
    cfg = config.replace(proxy=proxy_settings)
    try:
        app = ProxyApp(cfg, engine_url=engine_url, publisher=publisher, follow_control=follow_control)
        with serve_app(app) as url:
            yield url, app
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
